"""Bad input is a clear error naming the leaf path and what to change."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

GRADS = {"encoder": [{"kernel": jnp.ones((2, 3))}], "bias": jnp.ones(3)}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: jaxclip.clip_by_global_norm(0.0), r"clip_norm=0.0 must be > 0"),
        (lambda: jaxclip.clip_by_global_norm(-1.0), r"must be > 0"),
        (lambda: jaxclip.clip_by_global_norm(float("nan")), r"must be > 0"),
        (lambda: jaxclip.clip_by_norm(jnp.array(-2.0)), r"must be > 0"),
        (lambda: jaxclip.clip_by_value(max=-1.0, min=1.0), r"min=1.0 > max=-1.0"),
        (lambda: jaxclip.clip_by_value(max=0.0), r"max must be > 0"),
        (lambda: jaxclip.clip_by_value(max=-1.0), r"max must be > 0"),
        (
            lambda: jaxclip.clip_by_global_norm(1.0, norm_type=0.0),
            r"norm_type=0.0 is not a valid norm",
        ),
        (lambda: jaxclip.clip_by_global_norm(1.0, norm_type=-2), r"not a valid norm"),
        (lambda: jaxclip.clip_by_norm(1.0, norm_type=float("nan")), r"not a valid norm"),
        # Below 2**-10 (the smallest p accepted): an OverflowError from the exact powers'
        # masks under 2**-20, and an 8% error at 1e-6, where the norms were still finite.
        (lambda: jaxclip.clip_by_global_norm(1.0, norm_type=1e-10), r"below 2\*\*-10"),
        (lambda: jaxclip.global_norm([1.0], norm_type=2.0**-10 * 0.999), r"below 2\*\*-10"),
        (lambda: jaxclip.global_norm([1.0], norm_type=True), r"norm_type=True is a bool"),
        (
            lambda: jaxclip.clip_tree_by_global_norm([jnp.ones(2)], 1.0, use_norm=-4.0),
            r"use_norm=-4.0 is negative",
        ),
        (lambda: jaxclip.clip_by_norm(1.0, norm_type="fro"), r"not a number"),
        (lambda: jaxclip.clip_by_norm(1.0, axes=[1, 1]), r"names an axis twice"),
        (lambda: jaxclip.clip_by_norm(1.0, axes=[0.5]), r"int or a sequence of ints"),
    ],
)
def test_construction_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_smallest_norm_type_is_accepted():
    """p = 2**-10 itself is a norm: rows of one nonzero element have that element's
    magnitude as their p-norm (float64: |x|), within the 1/p-amplified rounding."""
    x = jnp.array([[5.0, 0.0], [0.0, -3.0]])
    _, norms = jaxclip.clip_tree_by_norm(x, 1.0, axes=1, norm_type=2.0**-10)
    np.testing.assert_allclose(np.asarray(norms, np.float64), [5.0, 3.0], rtol=1e-3)


def test_mask_missing_a_leaf_names_it():
    tx = jaxclip.clip_by_global_norm(1.0, need_clip={"encoder": [{"weight": True}], "bias": True})
    with pytest.raises(ValueError, match=r"no entry for the gradient leaf at 'encoder/0/kernel'"):
        tx.update(GRADS, tx.init(GRADS))


def test_mask_with_extra_entry_names_it():
    mask = {"encoder": [{"kernel": True}], "bias": True, "head": False}
    with pytest.raises(ValueError, match=r"entry at 'head' but the gradients have no leaf there"):
        jaxclip.clip_tree_by_value(GRADS, 1.0, need_clip=mask)


def test_mask_with_non_bool_entry_names_it():
    with pytest.raises(TypeError, match=r"need_clip at 'bias' is 1 of type int"):
        jaxclip.clip_tree_by_norm(GRADS, 1.0, need_clip={"encoder": True, "bias": 1})


def test_callable_returning_non_bool_names_path():
    with pytest.raises(TypeError, match=r"need_clip\('bias', leaf\) returned 'yes'"):
        jaxclip.global_norm(GRADS, need_clip=lambda path, leaf: "yes")


def test_axes_out_of_range_names_leaf():
    tx = jaxclip.clip_by_norm(1.0, axes=1)
    with pytest.raises(
        ValueError, match=r"out of range for the leaf at 'bias', which has shape \(3,\)"
    ):
        jax.jit(tx.update)(GRADS, tx.init(GRADS))


def test_integer_leaf_selected_names_path():
    grads = {"w": jnp.ones(2), "step": jnp.array(3, jnp.int32)}
    with pytest.raises(TypeError, match=r"leaf at 'step' has dtype int32 and is selected"):
        jaxclip.clip_tree_by_global_norm(grads, 1.0, need_clip=lambda p, x: True)
    with pytest.raises(TypeError, match=r"leaf at 'flag' has dtype bool"):
        jaxclip.clip_tree_by_value({"flag": jnp.array(True)}, 1.0, need_clip=True)
    # need_clip=None selects floating-point leaves only: the integer leaf passes through.
    out, _ = jaxclip.clip_tree_by_global_norm(grads, 1.0)
    assert out["step"] is grads["step"]


def test_complex_leaf_in_value_clipping():
    with pytest.raises(TypeError, match=r"leaf at 'z' is complex"):
        jaxclip.clip_tree_by_value({"z": jnp.ones(2, jnp.complex64)}, 1.0)


def test_non_array_leaf_names_path():
    with pytest.raises(TypeError, match=r"leaf at 'name' is a str"):
        jaxclip.global_norm({"name": "kernel", "w": np.ones(2)})
    # A leaf with a dtype and no values (jax.eval_shape's) was a bare TypeError from float().
    shape = jax.ShapeDtypeStruct((2,), jnp.float32)
    for clip in (jaxclip.clip_tree_by_global_norm, jaxclip.clip_tree_by_value):
        with pytest.raises(TypeError, match=r"leaf at 'enc/s' is a ShapeDtypeStruct"):
            clip({"enc": {"w": jnp.ones(3), "s": shape}}, 1.0)

    class Converts:  # a dtype and values NumPy can take (xarray, pandas, CPU tensors)
        dtype = np.dtype(np.float32)

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return np.full(4, 3.0, np.float32)

    np.testing.assert_allclose(jaxclip.global_norm({"w": Converts()}), 6.0)  # sqrt(4 * 9)


# ---------------------------------------------------------------------------------------
# error_if_nonfinite: one exception type to catch, eagerly and under jit, with one message.

BAD = {"enc": {"w": jnp.array([1.0, jnp.inf])}, "b": jnp.array([1.0])}
NONFINITE = {
    "global": (
        lambda: jaxclip.clip_by_global_norm(1.0, error_if_nonfinite=True),
        "jaxclip: the global norm is non-finite (inf): the gradients hold inf or NaN, or "
        "their norm exceeds float32's range (3.4e+38).",
    ),
    "per-leaf": (
        lambda: jaxclip.clip_by_norm(1.0, error_if_nonfinite=True),
        "jaxclip: the norm of the leaf at 'enc/w' is non-finite (inf)",
    ),
    "group": (
        lambda: jaxclip.clip_by_global_norm(
            1.0, error_if_nonfinite=True, group=lambda path, leaf: path.split("/")[0]
        ),
        "jaxclip: the global norm of group 'enc' is non-finite (inf)",
    ),
}


@pytest.mark.parametrize("mode", NONFINITE)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_error_if_nonfinite_is_one_exception_eager_jit_and_chain(mode):
    make, message = NONFINITE[mode]
    tx = make()
    chain = optax.chain(make(), optax.sgd(0.1))
    runs = {
        "eager": lambda: tx.update(BAD, tx.init(BAD)),
        "jit": lambda: jax.jit(tx.update)(BAD, tx.init(BAD)),
    }
    if mode == "global":
        runs["chain in jit"] = lambda: jax.jit(chain.update)(BAD, chain.init(BAD), BAD)
    for how, run in runs.items():
        with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)) as info:
            jax.block_until_ready(run())
        if how == "eager":  # the jaxclip type itself, also PyTorch's FloatingPointError
            assert type(info.value) is jaxclip.NonFiniteNormError
            assert isinstance(info.value, FloatingPointError)
            assert str(info.value).startswith(message)
        else:  # JAX wraps what a host callback raises; the jaxclip type is named in it
            assert f"NonFiniteNormError: {message}" in str(info.value)


def test_a_failing_need_clip_rule_names_the_leaf():
    tree = {"enc": {"w": jnp.ones(2)}}
    with pytest.raises(TypeError) as info:
        jaxclip.clip_tree_by_global_norm(tree, 1.0, need_clip=lambda path: True)
    assert "raised by need_clip('enc/w', leaf)" in "".join(info.value.__notes__)


def test_skip_large_updates_refuses_an_optimizer_factory():
    # optax.adam is the factory; its first update would fail far from the cause.
    with pytest.raises(TypeError, match=r"inner=adam is not an optax.GradientTransformation"):
        jaxclip.skip_large_updates(optax.adam, 10.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inner=int is not"):
        jaxclip.skip_large_updates(3, 10.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "group, match",
    [
        # A layer index for some leaves and a name for others: JAX cannot sort the labels.
        (
            lambda path, leaf: 0 if path == "bias" else "enc",
            r"one kind that sorts.*group\('bias', leaf\) returned 0 but .* returned 'enc'",
        ),
        (lambda path, leaf: [path], r"group\('bias', leaf\) returned \['bias'\], which is not"),
        # NaN is not equal to itself: every leaf was a group of its own that no lookup
        # found, and clip_tree_by_global_norm returned the tree unclipped with norms 0.
        (
            lambda path, leaf: float("nan"),
            r"group\('bias', leaf\) returned nan, which is not equal",
        ),
        # A composite label holding NaN: a new tuple per leaf, no two equal (each leaf a
        # group of its own, clipped alone, silently).
        (
            lambda path, leaf: ("g", float("nan")),
            r"group\('bias', leaf\) returned \('g', nan\), which is not equal",
        ),
    ],
)
def test_group_labels_that_cannot_key_a_state_name_the_leaves(group, match):
    transforms = [
        jaxclip.clip_by_global_norm(1.0, group=group),
        jaxclip.clip_per_example(1.0, group=group),
    ]
    per_example = jax.tree.map(lambda x: jnp.ones((2, *x.shape)), GRADS)
    for tx in transforms:
        with pytest.raises(TypeError, match=match):
            tx.init(GRADS)
        with pytest.raises(TypeError, match=match):
            jax.jit(tx.init)(GRADS)
        with pytest.raises(TypeError, match=match):
            jaxclip.clip_tree_by_global_norm(GRADS, 1.0, group=group)
        with pytest.raises(TypeError, match=match):
            jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1.0, group=group))(per_example)


def test_an_optax_style_mask_function_is_told_how_need_clip_is_called():
    """optax masks are functions of the whole params tree; jaxclip's rule is per leaf."""
    mask_fn = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    with pytest.raises(TypeError, match=r"need_clip takes one argument.*need_clip=mask_fn"):
        jaxclip.clip_tree_by_global_norm(GRADS, 1.0, need_clip=mask_fn)
    # The fix it names works.
    clipped, _ = jaxclip.clip_tree_by_global_norm(GRADS, 1.0, need_clip=mask_fn(GRADS))
    assert clipped["bias"] is GRADS["bias"]
