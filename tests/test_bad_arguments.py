"""A sweep of bad arguments over every public factory and function.

Each argument of each callable in ``jaxclip.__all__`` is given values that are wrong for
it (wrong type, NaN, inf, negative, zero, an integer beyond int64, a string, None, each only
where it is wrong for that argument), and must be rejected by jaxclip itself: a ValueError
or TypeError whose message says ``jaxclip``, names the argument and says what to pass. A
transformation is built and, where a check can only happen on the tree, initialised on a
small tree; nothing is compiled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
import pytest

import jaxclip

NAN, INF, BIG = math.nan, math.inf, 2**70
TREE = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
PER_EXAMPLE = {"w": jnp.ones((4, 2, 3)), "b": jnp.ones((4, 3))}  # a batch of 4

# Bad values by kind of argument.
NOT_A_NUMBER = ["abc", None, [1.0, 2.0], object(), True, 1 + 2j]
START = [*NOT_A_NUMBER, NAN, -1.0, -INF, BIG]  # >= 0, inf allowed (an adaptive start)
THRESHOLD = [*START, 0.0, 0]  # > 0, inf allowed
NONNEG_FINITE = [*NOT_A_NUMBER, NAN, INF, -INF, -1.0, BIG]  # >= 0 and finite
POS_FINITE = [*NONNEG_FINITE, 0.0]
NORM_TYPE = ["abc", None, object(), True, NAN, -1.0, 0.0, -INF]
COUNT = ["abc", None, 1.5, NAN, INF, 0, -1, True, BIG, object()]  # buffer sizes: ints >= 1
FLAG = ["abc", None, 1.5, NAN, 2, object()]  # bools
NEED_CLIP = ["abc", 1.5, NAN, 3, {"w": "yes", "b": True}]
GROUP = ["abc", 1.5, 3, object()]
AXES = ["abc", 1.5, NAN, INF, BIG, [0, "a"], (0, 0), object()]
CHOICE = ["abc", None, 1.5, 3]
NAMES = [1.5, None, 3, object()]


def tx(factory: Callable[..., Any], tree: Any = TREE) -> Callable[..., Any]:
    """Builds the transformation and initialises it (checks that need the tree run there)."""

    def build(*args: Any, **kwargs: Any) -> Any:
        t = factory(*args, **kwargs)
        assert isinstance(t, optax.GradientTransformation)
        t.init(tree)
        return t

    return build


# name -> (call(**kwargs), good keyword arguments, {argument: bad values})
CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], dict[str, list[Any]]]] = {
    "clip_by_value": (
        tx(jaxclip.clip_by_value),
        {"max": 1.0},
        {
            # (an array bound is checked against each leaf in update, naming the leaf)
            "max": ["abc", None, object(), True, 1 + 2j, NAN, -1.0, 0.0, -INF, BIG],
            "need_clip": NEED_CLIP,
        },
    ),
    "clip_tree_by_value": (
        jaxclip.clip_tree_by_value,
        {"tree": TREE, "max": 1.0, "min": -1.0},
        {
            "max": ["abc", None, object(), True, NAN, BIG, -2.0],
            "min": ["abc", object(), True, NAN, BIG, 2.0],
            "need_clip": NEED_CLIP,
            "tree": ["abc", object()],
        },
    ),
    "clip_by_norm": (
        tx(jaxclip.clip_by_norm),
        {"clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "axes": AXES,
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "error_if_nonfinite": FLAG,
        },
    ),
    "clip_tree_by_norm": (
        jaxclip.clip_tree_by_norm,
        {"tree": TREE, "clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "axes": AXES,
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "error_if_nonfinite": FLAG,
            "tree": ["abc", object()],
        },
    ),
    "clip_by_global_norm": (
        tx(jaxclip.clip_by_global_norm),
        {"clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "group": GROUP,
            "error_if_nonfinite": FLAG,
        },
    ),
    "clip_tree_by_global_norm": (
        jaxclip.clip_tree_by_global_norm,
        {"tree": TREE, "clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "group": GROUP,
            "use_norm": ["abc", object(), True, -1.0, -INF, BIG],
            "error_if_nonfinite": FLAG,
            "tree": ["abc", object()],
        },
    ),
    "global_norm": (
        jaxclip.global_norm,
        {"tree": TREE},
        {"norm_type": NORM_TYPE, "need_clip": NEED_CLIP, "tree": ["abc", object()]},
    ),
    "adaptive_clip": (
        tx(jaxclip.adaptive_clip),
        {"clipping": 0.01},
        {
            "clipping": THRESHOLD,
            "eps": POS_FINITE,
            "axes": AXES,
            "need_clip": NEED_CLIP,
        },
    ),
    "clip_tree_adaptive": (
        jaxclip.clip_tree_adaptive,
        {"tree": TREE, "params": TREE, "clipping": 0.01},
        {
            "clipping": THRESHOLD,
            "eps": POS_FINITE,
            "axes": AXES,
            "need_clip": NEED_CLIP,
            "tree": ["abc", object()],
            "params": ["abc", object()],
        },
    ),
    "auto_clip": (
        tx(jaxclip.auto_clip),
        {},
        {
            "percentile": [*NOT_A_NUMBER, NAN, INF, -1.0, 0.0, 101.0, BIG],
            "clip_percentile": [*NOT_A_NUMBER[:1], NAN, 0.0, 101.0],
            "window": COUNT,
            "history_size": [c for c in COUNT if c is not None],
            "need_clip": NEED_CLIP,
        },
    ),
    "quantile_clip": (
        tx(jaxclip.quantile_clip),
        {},
        {
            "quantile": [*NOT_A_NUMBER, NAN, INF, -0.5, 1.5, BIG],
            "history_length": COUNT,
            "global_threshold": FLAG,
            "need_clip": NEED_CLIP,
        },
    ),
    "standard_clip": (
        tx(jaxclip.standard_clip),
        {},
        {
            "deviations": NONNEG_FINITE,
            "history_length": COUNT,
            "global_threshold": FLAG,
            "need_clip": NEED_CLIP,
        },
    ),
    "zclip": (
        tx(jaxclip.zclip),
        {},
        {
            "alpha": [*NOT_A_NUMBER, NAN, INF, -0.5, 1.0, BIG],
            "z_thresh": THRESHOLD,
            "max_grad_norm": [c for c in THRESHOLD if c is not None],
            "max_norm": [c for c in THRESHOLD if c is not None],
            "eps": NONNEG_FINITE,
            "warmup_steps": COUNT,
            "mode": CHOICE,
            "clip_option": CHOICE,
            "clip_factor": THRESHOLD,  # inf: never clip spikes, as z_thresh=inf
            "skip_update_on_spike": FLAG,
            "need_clip": NEED_CLIP,
        },
    ),
    "skip_large_updates": (
        tx(jaxclip.skip_large_updates),
        {"inner": optax.sgd(0.1)},
        {
            "inner": ["abc", None, 1.5, optax.sgd],
            "threshold": THRESHOLD,
            "max_consecutive_errors": ["abc", 1.5, NAN, INF, -1, True, BIG],
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
        },
    ),
    "clip_per_example": (
        tx(jaxclip.clip_per_example),
        {"clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "reduce": CHOICE[:1] + CHOICE[2:],
            "noise_multiplier": NONNEG_FINITE,
            "seed": ["abc", None, 1.5, NAN, INF, BIG, -(2**70), True, object(), jnp.ones(3)],
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "group": GROUP,
            "batch_size": [c for c in COUNT if c is not None],
        },
    ),
    "clip_tree_per_example": (
        jaxclip.clip_tree_per_example,
        {"grads": PER_EXAMPLE, "clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "group": GROUP,
            "reduce": CHOICE[:1] + CHOICE[2:],
            "grads": ["abc", object()],
        },
    ),
    "clipped_grad": (
        lambda **kw: jaxclip.clipped_grad(lambda p, x: jnp.sum(p * x), **kw),
        {"clip_norm": 1.0},
        {
            "clip_norm": THRESHOLD,
            "microbatch_size": [c for c in COUNT if c is not None],
            "has_aux": FLAG,
            "keep_batch_dim": FLAG,
            "reduce": CHOICE,
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
            "group": GROUP,
            "return_norms": FLAG,
            "return_values": FLAG,
        },
    ),
    "adaptive_clip_per_example": (
        tx(jaxclip.adaptive_clip_per_example),
        {"initial_clip_norm": 1.0},
        {
            "initial_clip_norm": START,
            "target_unclipped_quantile": [*NOT_A_NUMBER, NAN, INF, -0.5, 1.5, BIG],
            "learning_rate": NONNEG_FINITE,
            "noise_multiplier": NONNEG_FINITE,
            "geometric_update": FLAG,
            "reduce": CHOICE[:1] + CHOICE[2:],
            "seed": ["abc", None, 1.5, NAN, INF, BIG, True, object()],
            "norm_type": NORM_TYPE,
            "need_clip": NEED_CLIP,
        },
    ),
    "adaptive_clip_noise_multiplier": (
        jaxclip.adaptive_clip_noise_multiplier,
        {"noise_multiplier": 1.0, "clipped_count_stddev": 10.0},
        {"noise_multiplier": POS_FINITE, "clipped_count_stddev": POS_FINITE},
    ),
    "by_name": (jaxclip.by_name, {}, {"names": NAMES}),
    "exclude_names": (jaxclip.exclude_names, {}, {"names": NAMES}),
    "by_path": (jaxclip.by_path, {}, {"patterns": NAMES}),
    "exclude_paths": (jaxclip.exclude_paths, {}, {"patterns": NAMES}),
    "min_rank": (jaxclip.min_rank, {}, {"rank": ["abc", None, 1.5, NAN, INF, -1, True]}),
    "Selector": (
        jaxclip.Selector,
        {"fn": lambda path, leaf: True},
        {"fn": ["abc", None, 1.5], "description": [1.5, object()]},
    ),
}

# Not swept: the states (NamedTuple records that jaxclip builds, not user input),
# NonFiniteNormError (an exception type), exclude_biases_and_norms (no arguments) and
# clip_stats (any pytree is an optimizer state; one without a jaxclip mode reports {}).
NOT_SWEPT = {
    "clip_stats",
    "AutoClipState",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipPerExampleState",
    "AdaptiveClipPerExampleState",
    "ClippedGradAux",
    "HistoryClipState",
    "SkipLargeUpdatesState",
    "ZClipState",
    "NonFiniteNormError",
    "exclude_biases_and_norms",
}
VARARGS = {"names", "patterns"}


def test_every_public_callable_is_swept():
    public = {n for n in jaxclip.__all__ if callable(getattr(jaxclip, n))}
    assert public == set(CASES) | NOT_SWEPT, (
        f"sweep these too: {sorted(public - set(CASES) - NOT_SWEPT)}; "
        f"gone: {sorted(set(CASES) - public)}"
    )


PARAMS = [
    pytest.param(name, arg, bad, id=f"{name}-{arg}-{i}")
    for name, (_, _, bad_values) in CASES.items()
    for arg, values in bad_values.items()
    for i, bad in enumerate(values)
]

# What a message must say besides the argument: what to do.
FIX = re.compile(
    r"\b(pass|use|must|give|wrap|call|needs?|keep|set|move|exclude|name each)\b|e\.g\.", re.I
)


@pytest.mark.parametrize("name, arg, bad", PARAMS)
def test_bad_argument_is_a_jaxclip_error(name: str, arg: str, bad: Any):
    call, good, _ = CASES[name]
    if arg in VARARGS:
        args, kwargs = ("bias", bad), {}
    else:
        args, kwargs = (), {**good, arg: bad}
    with pytest.raises((ValueError, TypeError)) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "jaxclip" in message, f"not a jaxclip error: {message}"
    # A bad tree is named by its leaf's path; a bad *name by the helper it was given to.
    named = {"tree": "leaf", "grads": "leaf", "params": "params", "names": name, "patterns": name}
    assert named.get(arg, arg) in message, (
        f"{name}({arg}={bad!r}): the message does not name {arg!r}: {message}"
    )
    assert FIX.search(message), f"{name}({arg}={bad!r}): the message says no fix: {message}"
