"""Every jaxclip transformation through the same checks: one registry, as optax's
``alias_test.py``. A new mode, or a new configuration of one, gets every check by adding
one line to ``TRANSFORMS``.

Each entry is run two ways, and every check reads one of the two runs:

1. ``jax.jit(tx.update, donate_argnums=(1,))`` over steps 1 and 2 and a step whose gradient
   has a NaN, from ``tx.init``, next to the same steps without jit. Checks: jit and eager
   agree (updates and states); one trace for the three steps (no recompile on the second
   call); ``init``'s state has the structure, shapes, dtypes (and weak types) of
   ``update``'s, also after the NaN step; the donated states' leaves are distinct buffers
   and steps 1 and 2 run with them donated.
2. ``jax.lax.scan`` over ``optax.MultiSteps(optax.inject_hyperparams(factory)(hp=schedule),
   every_k_schedule=2)``, jitted, called on four chunks of two steps. Checks: the state
   carries through the scan and keeps its structure between calls, with one trace for the
   four calls (the scheduled value changes without recompiling); MultiSteps emits zeros on
   the first step of each pair and, on the second, the transform's update of the pair's
   mean gradient, computed eagerly by the transform built with that step's concrete
   hyperparameter value (so a traced hyperparameter behaves as the concrete one); the
   scheduled values are the schedule's. Entries whose factory has no entry in
   ``HYPERPARAMETER`` (the optax chain) run ``MultiSteps(tx)``.

Scan, MultiSteps and inject_hyperparams share one compiled program because compiles
dominate the run time (about a second each on a CPU); for the same reason every jitted
function is built once per entry (``functools.cache``) and the trees are tiny. Expected
values are invariants (jit == eager, traced hyperparameter == concrete one, MultiSteps ==
the transform of the mean gradient); the formulas are checked in test_clipping.py and
test_adaptive.py.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref

import jaxclip
from jaxclip._registry import MODES

P = functools.partial


class Case(NamedTuple):
    id: str
    make: Callable[[], optax.GradientTransformation]  # a partial of the factory: injectable
    tree: str  # "f32" or "bf16"
    needs_params: bool  # the jitted update gets params (else None)


def _no_bias(path: str, leaf: Any) -> bool:
    return not path.endswith("bias")


def _top_level(path: str, leaf: Any) -> str:
    return path.split("/")[0]


def _columns(path: str, leaf: Any) -> bool:  # the leaves (3,)-shaped bounds broadcast to
    return leaf.shape[-1:] == (3,)


def _matrices(path: str, leaf: Any) -> bool:  # the leaves axes=1 exists for (None in the state)
    return leaf.ndim == 2


def _chain_adamw() -> optax.GradientTransformation:
    return optax.chain(jaxclip.clip_by_global_norm(1.0), optax.adamw(1e-3))


_HI, _LO = np.array([0.5, 1.0, 2.0], np.float32), np.array([-1.0, -0.25, -2.0], np.float32)
GLOBAL = jaxclip.clip_by_global_norm

TRANSFORMS = [
    Case("value", P(jaxclip.clip_by_value, 1.0), "f32", False),
    Case("value_arrays", P(jaxclip.clip_by_value, _HI, _LO, need_clip=_columns), "f32", False),
    Case("norm", P(jaxclip.clip_by_norm, 1.0), "f32", False),
    Case("norm_axes1", P(jaxclip.clip_by_norm, 1.0, axes=1, need_clip=_matrices), "f32", False),
    Case("norm_inf", P(jaxclip.clip_by_norm, 1.0, norm_type=math.inf), "f32", False),
    Case("global", P(GLOBAL, 1.0), "f32", False),
    Case("global_bf16", P(GLOBAL, 1.0), "bf16", False),
    Case("global_p1.5", P(GLOBAL, 1.0, norm_type=1.5), "f32", False),
    Case("global_group", P(GLOBAL, 1.0, group=_top_level), "f32", False),
    Case("global_need_clip", P(GLOBAL, 1.0, need_clip=_no_bias), "f32", False),
    Case("adaptive_clip", P(jaxclip.adaptive_clip, 0.1), "f32", True),
    Case("auto_clip", P(jaxclip.auto_clip, 10.0, window=8), "f32", False),
    Case("quantile_clip", P(jaxclip.quantile_clip, 0.5, 8), "f32", False),  # per leaf
    Case("standard_clip", P(jaxclip.standard_clip, 2.0, 8, global_threshold=True), "f32", False),
    Case("zclip", P(jaxclip.zclip, warmup_steps=3), "f32", False),
    Case("zclip_max_norm", P(jaxclip.zclip, warmup_steps=3, max_norm=5.0), "f32", False),
    Case("skip_large_updates", P(jaxclip.skip_large_updates, optax.adam(1e-3), 10.0), "f32", False),
    Case("chain_adamw", _chain_adamw, "f32", True),
]

# The hyperparameter optax.inject_hyperparams schedules, per factory (the others are static).
HYPERPARAMETER = {m.name: m.scheduled for m in MODES}


def _schedule(value: Any) -> Callable[[Any], Any]:
    return lambda count: value / (1.0 + count)  # value, value/2, value/3, ...: stays in range


CASES = {c.id: c for c in TRANSFORMS}
assert len(CASES) == len(TRANSFORMS), "registry ids must be unique"
each_transform = pytest.mark.parametrize("case", TRANSFORMS, ids=list(CASES))

# ----------------------------------------------------------------------------------------
# Trees: a (4, 3) kernel, a (3,) bias and a nested list leaf ("head/0"), in float32 or
# bfloat16. A gradient is the base tree times a scale (the base's norm is 3.9), so the
# larger scales are clipped, or skipped.

_BASE = {
    "kernel": np.linspace(-1.5, 1.25, 12).reshape(4, 3),
    "bias": np.array([0.5, -2.0, 1.0]),
    "head": [np.array([0.75, -0.25])],
}
_DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16}

JIT_STEPS = (1.0, 4.0, "nan")  # run 1; "nan": scale 1 with one NaN in the kernel
CHUNKS = ((1.0, 4.0), (0.25, 16.0), (4.0, 16.0), (64.0, 64.0))  # run 2: MultiSteps' pairs


@functools.cache
def _grads(kind: str, step: Any) -> dict:
    base = _BASE
    if step == "nan":
        base = {
            **base,
            "kernel": np.where(np.arange(12).reshape(4, 3) == 4, np.nan, base["kernel"]),
        }
        step = 1.0
    return jax.tree.map(lambda x: jnp.asarray(x * step, _DTYPE[kind]), base)


@functools.cache
def _param_tree(kind: str) -> dict:
    # Non-zero units, and a zero bias (where AGC's eps applies).
    params = {
        "kernel": np.linspace(0.1, 1.2, 12).reshape(4, 3),
        "bias": np.zeros(3),
        "head": [np.array([-0.5, 1.5])],
    }
    return jax.tree.map(lambda x: jnp.asarray(x, _DTYPE[kind]), params)


# ----------------------------------------------------------------------------------------
# Helpers

TRACES: collections.Counter = collections.Counter()


def _counted(key: tuple, fn: Callable) -> Callable:
    """``fn``, counting its traces in ``TRACES[key]`` (jit traces once per signature)."""

    def traced(*args):
        TRACES[key] += 1
        return fn(*args)

    return traced


def _spec(tree: Any) -> tuple:
    """The tree structure and, per leaf path, (shape, dtype, weak_type)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef, {
        jax.tree_util.keystr(p): (jnp.shape(x), jnp.result_type(x), jax.typeof(x).weak_type)
        for p, x in leaves
    }


def _assert_same_spec(actual: tuple, expected: tuple, what: str) -> None:
    (adef, aleaves), (edef, eleaves) = actual, expected
    assert adef == edef, f"{what}: tree structure {adef} != {edef}"
    for path, e in eleaves.items():
        assert aleaves[path] == e, (
            f"{what} at {path}: (shape, dtype, weak_type) {aleaves[path]} != {e}"
        )


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    """The same structure; floats allclose (NaN where NaN), anything else equal."""
    a_leaves, adef = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, edef = jax.tree.flatten(expected)
    assert adef == edef, f"{what}: tree structure {adef} != {edef}"
    for (path, a), e in zip(a_leaves, e_leaves):
        where = f"{what} at {jax.tree_util.keystr(path)}"
        a, e = np.asarray(a), np.asarray(e)
        assert (a.shape, a.dtype) == (e.shape, e.dtype), (
            f"{where}: {(a.shape, a.dtype)} != {(e.shape, e.dtype)}"
        )
        if jnp.issubdtype(a.dtype, jnp.inexact):
            rtol, atol = (
                (2 * float(jnp.finfo(a.dtype).eps), 1e-3) if a.dtype.itemsize < 4 else (1e-5, 1e-7)
            )
            np.testing.assert_allclose(
                ref.f64(a), ref.f64(e), rtol=rtol, atol=atol, equal_nan=True, err_msg=where
            )
        else:
            np.testing.assert_array_equal(a, e, err_msg=where)


@functools.cache
def _tx(case_id: str) -> optax.GradientTransformation:
    return CASES[case_id].make()


def _update_params(case: Case) -> Any:
    return _param_tree(case.tree) if case.needs_params else None


def _injectable(case: Case) -> tuple[Callable, dict[str, Any], str] | None:
    """(factory, the arguments the entry gives it, the hyperparameter to schedule), or None."""
    make = case.make
    if not isinstance(make, functools.partial) or make.func.__name__ not in HYPERPARAMETER:
        return None
    signature = inspect.signature(make.func)
    given = dict(signature.bind(*make.args, **make.keywords).arguments)
    hp = HYPERPARAMETER[make.func.__name__]
    given.setdefault(hp, signature.parameters[hp].default)
    return make.func, given, hp


# ----------------------------------------------------------------------------------------
# Run 1: jax.jit(tx.update, donate_argnums=(1,)), and the same steps eagerly


class JitRun(NamedTuple):
    specs: list  # of the state: init, then after each step
    distinct: list  # per step: the donated state's leaves are distinct buffers
    updates: list
    states: list  # host copies (the device ones are donated at the next step)
    traces: int
    cache_size: int | None


@functools.cache
def _jit_run(case_id: str) -> JitRun:
    case, tx = CASES[case_id], _tx(case_id)
    key = ("update", case_id)
    TRACES[key] = 0  # (a run that raised is run again by the next check that reads it)
    update = jax.jit(_counted(key, tx.update), donate_argnums=(1,))
    state = tx.init(_param_tree(case.tree))
    run = JitRun([_spec(state)], [], [], [], 0, None)
    for step in JIT_STEPS:
        leaves = jax.tree.leaves(state)
        run.distinct.append(len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves))
        updates, state = update(_grads(case.tree, step), state, _update_params(case))
        run.updates.append(updates)
        run.states.append(jax.device_get(state))
        run.specs.append(_spec(state))
    cache_size = getattr(update, "_cache_size", None)  # private; the trace count is the check
    return run._replace(traces=TRACES[key], cache_size=cache_size() if cache_size else None)


@functools.cache
def _eager_run(case_id: str) -> list:
    """[(None, init state)] + [(updates, state)] per step of JIT_STEPS, without jit."""
    case, tx = CASES[case_id], _tx(case_id)
    out = [(None, tx.init(_param_tree(case.tree)))]
    for step in JIT_STEPS:
        out.append(tx.update(_grads(case.tree, step), out[-1][1], _update_params(case)))
    return out


@each_transform
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_jit_matches_eager(case):
    run, eager = _jit_run(case.id), _eager_run(case.id)
    for i, step in enumerate(JIT_STEPS):
        _assert_close(run.updates[i], eager[i + 1][0], f"updates of step {i + 1} (x{step})")
        _assert_close(run.states[i], eager[i + 1][1], f"state after step {i + 1} (x{step})")


@each_transform
def test_second_call_does_not_recompile(case):
    run = _jit_run(case.id)
    assert run.traces == 1, (
        f"jit(update) traced {run.traces} times for {len(JIT_STEPS)} calls of one signature"
    )
    if run.cache_size is not None:
        assert run.cache_size == 1


@each_transform
def test_init_state_matches_update_state(case):
    run, eager = _jit_run(case.id), _eager_run(case.id)
    for i, step in enumerate(JIT_STEPS):
        _assert_same_spec(
            run.specs[i + 1], run.specs[0], f"jitted: state after step {i + 1} (x{step}) vs init"
        )
        _assert_same_spec(
            _spec(eager[i + 1][1]),
            _spec(eager[0][1]),
            f"eager: state after step {i + 1} (x{step}) vs init",
        )


@each_transform
def test_donated_state(case):
    run = _jit_run(case.id)
    # Steps 1 and 2 ran with the state donated (and agree with eager: test_jit_matches_eager).
    # Donating a state is only valid when no buffer stands in two of its leaves.
    assert run.distinct[:2] == [True, True], (
        "one buffer is in two leaves of the state passed to update"
    )


# ----------------------------------------------------------------------------------------
# Run 2: lax.scan over MultiSteps(inject_hyperparams(factory)(hp=schedule), 2)


class ScanRun(NamedTuple):
    hp: str | None
    specs: list  # of the MultiSteps state: init, then after each chunk
    updates: list  # per step
    used: list  # the scheduled value at each emit (None without inject)
    expected: list  # per emit: (updates, state) of the transform built with that value, eagerly
    inner_states: list  # per emit: the transform's state inside MultiSteps (and inject)
    traces: int


@functools.cache
def _scan_run(case_id: str) -> ScanRun:
    case = CASES[case_id]
    params = _param_tree(case.tree)  # always: a training loop passes them (and optax takes
    injectable = _injectable(case)  # the hyperparameters' dtype from them)
    if injectable:
        factory, given, hp = injectable
        static = tuple(name for name in inspect.signature(factory).parameters if name != hp)
        inner = optax.inject_hyperparams(factory, static_args=static)(
            **{**given, hp: _schedule(given[hp])}
        )
    else:
        hp, inner = None, _tx(case_id)
    ms = optax.MultiSteps(inner, every_k_schedule=2)

    def chunk(state, grads, params):
        def body(s, g):
            updates, s = ms.update(g, s, params)
            return s, updates

        return jax.lax.scan(body, state, grads)

    key = ("scan", case_id)
    TRACES[key] = 0
    run_chunk = jax.jit(_counted(key, chunk))
    state = ms.init(params)
    run = ScanRun(hp, [_spec(state)], [], [], [], [], 0)
    ref_state = _tx(case_id).init(params)
    for pair in CHUNKS:
        grads = jax.tree.map(
            lambda *xs: np.stack(xs), *[jax.device_get(_grads(case.tree, s)) for s in pair]
        )
        state, updates = run_chunk(state, grads, params)
        run.specs.append(_spec(state))
        updates = jax.device_get(updates)  # sliced on the host: no compile per slice
        run.updates.extend(jax.tree.map(operator.itemgetter(i), updates) for i in range(len(pair)))
        inner_state = state.inner_opt_state
        if hp is None:
            tx = _tx(case_id)
        else:
            used = inner_state.hyperparams[hp]
            run.used.append(used)
            inner_state = inner_state.inner_state
            # The same value, concrete; a Python number where a scalar (as the entry's own).
            tx = factory(**{**given, hp: float(used) if np.ndim(used) == 0 else np.asarray(used)})
        run.inner_states.append(inner_state)
        expected = tx.update(_grads(case.tree, sum(pair) / len(pair)), ref_state, params)
        run.expected.append(expected)
        ref_state = expected[1]
    return run._replace(traces=TRACES[key])


@each_transform
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_state_carries_through_scan(case):
    run = _scan_run(case.id)
    for i, spec in enumerate(run.specs[1:]):
        _assert_same_spec(spec, run.specs[0], f"MultiSteps state after chunk {i + 1} vs init")
    assert run.traces == 1, f"the scan was traced {run.traces} times for {len(CHUNKS)} calls"


@each_transform
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_multisteps_emits_the_update_of_the_mean_gradient(case):
    run = _scan_run(case.id)
    for i, pair in enumerate(CHUNKS):
        first, second = run.updates[2 * i : 2 * i + 2]
        assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(first)), (
            f"step {2 * i + 1} should emit zeros"
        )
        what = f"emit {i + 1} (the mean of x{pair[0]} and x{pair[1]})"
        _assert_close(second, run.expected[i][0], f"updates of {what}")
        _assert_close(run.inner_states[i], run.expected[i][1], f"state after {what}")


@each_transform
def test_inject_hyperparams_schedule(case):
    run = _scan_run(case.id)
    if run.hp is None:
        pytest.skip("no hyperparameter to schedule (not a jaxclip factory)")
    value = _injectable(case)[1][run.hp]
    narrow = case.tree == "bf16"  # optax stores the hyperparameters in the params' dtype
    for count, used in enumerate(run.used):
        np.testing.assert_allclose(
            ref.f64(used), ref.f64(value) / (1 + count), rtol=1e-2 if narrow else 1e-6
        )
    assert len({float(np.max(ref.f64(u))) for u in run.used}) == len(CHUNKS)  # it changes,
    assert run.traces == 1  # without a recompile,
    for i, used in enumerate(run.used):  # and a traced value acts as the concrete one
        _assert_close(
            run.updates[2 * i + 1], run.expected[i][0], f"updates of emit {i + 1} ({run.hp}={used})"
        )


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_the_registry_holds_every_public_transformation():
    """A public factory that returns a GradientTransformation and has no registry entry
    would escape every check here; each entry's example builds, with the state type and
    the logged fields it names."""
    factories = set()
    for name in dir(jaxclip):
        fn = getattr(jaxclip, name)
        hint = getattr(fn, "__annotations__", {}).get("return") if callable(fn) else None
        hint = None if isinstance(fn, type) else hint
        if hint is not None and "GradientTransformation" in str(hint):
            factories.add(name)
    assert factories == {m.name for m in MODES}
    grads = {"w": jnp.ones((2, 3))}
    for m in MODES:
        assert m.scheduled in inspect.signature(m.factory).parameters, m.name
        g = jax.tree.map(lambda x: x[None], grads) if m.batched else grads
        tx = m.build()
        state = tx.init(grads)
        _, state = tx.update(g, state, grads)
        assert type(state) is m.state, m.name
        assert set(m.logged) <= set(getattr(state, "_fields", ())), m.name
        held = {f for f in m.logged if getattr(state, f) is not None}  # per-example norms: opt-in
        assert held <= {k.split("/")[0] for k in jaxclip.clip_stats(state)}, m.name


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_every_mode_takes_inject_hyperparams_without_static_args_under_jit():
    """As users write it: ``optax.inject_hyperparams(factory)(...)`` makes every numeric
    argument an array, defaults included (only the sizes of states are ``static_args``);
    under ``jit`` each update equals the plain transformation's, eagerly."""
    grads = {"w": jnp.asarray(np.arange(6.0).reshape(2, 3), jnp.float32)}
    for m in MODES:
        g = jax.tree.map(lambda x: jnp.stack([x, 2 * x, 0.5 * x]), grads) if m.batched else grads
        kw = dict(m.example)
        value = kw.get(m.scheduled, inspect.signature(m.factory).parameters[m.scheduled].default)
        sizes = tuple(k for k, v in kw.items() if isinstance(v, int) and not isinstance(v, bool))
        injected = optax.inject_hyperparams(m.factory, static_args=sizes)(
            **{**kw, m.scheduled: lambda count, v=value: v}
        )
        plain = m.build()
        want = plain.update(g, plain.init(grads), grads)[0]
        got = jax.jit(injected.update)(g, injected.init(grads), grads)[0]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=m.name)
