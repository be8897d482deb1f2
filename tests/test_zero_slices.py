"""Zero and tiny slices (unused embedding rows, frozen leaves): the clipping factors need
no exact norm of a slice too small to reach the clip norm, so such slices cost no second
pass (issue 12), while every norm that is reported stays exact. Expected values are the
float64 formulas of ``reference.py``, in every execution mode."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from _helpers import xla_cpu_only
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip._norms import arith, leafwise

F32_TINY = float(np.finfo(np.float32).tiny)
LO = F32_TINY * 2.0**64  # below this a float32 power sum is not exact as it stands


def _rows(dtype, big: float = 1e30) -> np.ndarray:
    """16 rows of 40: all zero; squares that underflow (1e-25); one tiny element;
    a plain sum of squares of about 2 LO (just in range); huge; ordinary."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 40))
    x[0] = 0.0
    x[1] *= 1e-25
    x[2] = 0.0
    x[2, 7] = -3e-30
    x[3] = np.sqrt(2 * LO / 40) * np.sign(x[3])
    x[4] *= big
    x[5] = 0.0
    return np.asarray(x.astype(dtype))


def _cs(p: float) -> list[float]:
    """Clip norms far above the floor bound, just below it (the exact path), and below the
    tiny rows' norms (so those are clipped)."""
    bound = arith.floor_bound(np.dtype(np.float32), p)
    return [1.0, 0.5 * bound, 1e-27] if p != math.inf else [1.0, 1e-27]


def _check(out, norms, x, c: float, p: float, dtype) -> None:
    # A fractional p magnifies the sum's rounding by 1/p (docs/guides/numerics.md, the error bound).
    grow = max(1.0, 1 / p)
    want = ref.clip_each(x, c, p, (1,))
    eps = float(jnp.finfo(dtype).eps)
    # Outputs below the smallest normal may be flushed to 0 (XLA:CPU), or round to 0.
    tiny = max(F32_TINY, float(jnp.finfo(dtype).tiny))
    np.testing.assert_allclose(ref.f64(out), want, rtol=4 * eps * grow, atol=tiny)
    if norms is not None:
        n = ref.norm([x], p, (1,))[:, 0]
        np.testing.assert_allclose(ref.f64(norms), n, rtol=4 * 2.0**-23 * grow, atol=0)


@functools.cache
def _jitted(p: float, clipped_only: bool):
    def f(g, c):
        out, norms = jaxclip.clip_tree_by_norm(g, c, axes=1, norm_type=p)
        return out if clipped_only else (out, norms)

    return jax.jit(f)


@pytest.mark.parametrize(
    "p, dtype",
    [(2.0, jnp.float32), (3.0, jnp.bfloat16)]  # the default run; the rest run slow
    + [
        pytest.param(p, dtype, marks=pytest.mark.slow)
        for p, dtype in [
            (0.5, jnp.float32),
            (1.0, jnp.float32),
            (3.0, jnp.float32),
            (math.inf, jnp.float32),
            (2.0, jnp.bfloat16),
            (2.0, jnp.float16),
        ]
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_zero_and_tiny_rows_match_float64_in_every_mode(p, dtype):
    big = 1e3 if dtype == jnp.float16 else 1e30
    x = _rows(dtype, big)
    for c in _cs(p):
        cj = jnp.asarray(c, jnp.float32)
        _check(*jaxclip.clip_tree_by_norm(jnp.asarray(x), c, axes=1, norm_type=p), x, c, p, dtype)
        out, norms = _jitted(p, False)(x, cj)
        _check(out, norms, x, c, p, dtype)
        # Norms unused: the factors alone, bit for bit the same clipped values.
        np.testing.assert_array_equal(_jitted(p, True)(x, cj), out)
        # vmap over the rows: each example's norm over its one axis.
        row = jax.vmap(lambda g, c=c: jaxclip.clip_tree_by_norm(g, c, norm_type=p))(x)
        _check(*row, x, c, p, dtype)


def test_batched_clip_norms_under_vmap_take_the_exact_path_where_one_is_small():
    x = _rows(np.float32)
    cs = np.full(16, 1.0, np.float32)
    cs[1] = 1e-27  # the underflowing row itself is clipped
    out, norms = jax.jit(jax.vmap(lambda g, c: jaxclip.clip_tree_by_norm(g, c)))(x, cs)
    n = ref.norm([x], 2.0, (1,))
    np.testing.assert_allclose(ref.f64(out), ref.f64(x) * ref.scale(n, cs[:, None]), rtol=4e-7)
    np.testing.assert_allclose(ref.f64(norms), n[:, 0], rtol=4e-7)
    assert 0 < float(jnp.max(jnp.abs(out[1]))) < 1e-27


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_gradient_through_zero_and_tiny_rows():
    x = _rows(np.float32)
    w = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)

    def loss(g, c):
        return jnp.sum(jaxclip.clip_tree_by_norm(g, c, axes=1)[0] * w)

    for c in (1.0, 1e-27):
        d = jax.jit(jax.grad(loss))(x, c)
        n = ref.norm([x], 2.0, (1,))
        xs, ws = ref.f64(x), ref.f64(w)
        # d(x c/n) . w = (c/n) (w - x (x.w)/n^2) where clipped, w where kept.
        safe = np.where(n > 0, n, 1)
        clipped = (c / safe) * (ws - xs * np.sum(xs * ws, 1, keepdims=True) / safe**2)
        want = np.where(n > c, clipped, ws)
        assert np.all(np.isfinite(np.asarray(d)))
        np.testing.assert_allclose(ref.f64(d), want, rtol=2e-5, atol=1e-30 / c)


def test_scan_matches_the_plain_call():
    x = _rows(np.float32)

    def step(carry, g):
        return carry, jaxclip.clip_tree_by_norm(g, 1.0, axes=1)[0]

    _, ys = jax.jit(lambda xs: jax.lax.scan(step, 0, xs))(jnp.stack([x, -x]))
    _check(ys[0], None, x, 1.0, 2.0, jnp.float32)
    _check(ys[1], None, -x, 1.0, 2.0, jnp.float32)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_transform_state_keeps_each_leafs_exact_largest_norm():
    x = _rows(np.float32)
    tiny = np.full((6, 5), 1e-25, np.float32)
    tiny[2, 3] = 2e-25  # its largest row is exact, not 0
    tree = {
        "mixed": x,  # large rows beside the small ones
        "tiny": tiny,
        "zero": np.zeros((7, 3), np.float32),
        "near": np.concatenate([tiny, np.full((1, 5), np.sqrt(2 * LO / 5), np.float32)]),
    }
    tx = jaxclip.clip_by_norm(1.0, axes=1)
    for update in (tx.update, jax.jit(tx.update)):
        updates, state = update(tree, tx.init(tree))
        assert isinstance(state, jaxclip.ClipByNormState)
        for k, v in tree.items():
            want = np.max(ref.norm([v], 2.0, (1,)))
            np.testing.assert_allclose(float(state.norms[k]), want, rtol=4 * 2.0**-23, err_msg=k)
            _check(updates[k], None, v, 1.0, 2.0, jnp.float32)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_transform_state_of_bucketed_small_leaves_is_exact():
    rng = np.random.default_rng(2)
    tree = {f"w{i}": rng.normal(size=(3, 4)).astype(np.float32) for i in range(40)}
    tree["w3"] = np.zeros((3, 4), np.float32)
    tree["w5"] = np.full((3, 4), 1e-25, np.float32)
    tree["w8"] = np.full((3, 4), -4e-30, np.float32)
    for p in (2.0, 3.0):
        tx = jaxclip.clip_by_norm(1.0, norm_type=p)
        _, state = jax.jit(tx.update)(tree, tx.init(tree))
        assert isinstance(state, jaxclip.ClipByNormState)
        for k, v in tree.items():
            np.testing.assert_allclose(
                float(state.norms[k]), ref.norm([v], p), rtol=4 * 2.0**-23, err_msg=k
            )


def test_agc_with_zero_and_tiny_rows_in_grads_and_params():
    x = _rows(np.float32)
    params = np.random.default_rng(3).normal(size=x.shape).astype(np.float32) * 0.1
    params[1:3] = 0.0
    params[6] *= 1e-25
    for eps in (1e-3, 1e-36):
        out = jax.jit(lambda g, q, e=eps: jaxclip.clip_tree_adaptive(g, q, 0.01, eps=e, axes=1))(
            x, params
        )
        limit = 0.01 * np.maximum(ref.norm([params], 2.0, (1,)), eps)
        want = ref.f64(x) * ref.scale(ref.norm([x], 2.0, (1,)), limit)
        np.testing.assert_allclose(ref.f64(out), want, rtol=4 * 2.0**-23, atol=F32_TINY)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_zero_rows_of_a_sharded_leaf():
    x = np.concatenate([_rows(np.float32)] * 4)  # 64 rows, 8 per device
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    for c in (1.0, 1e-27):
        out, norms = _jitted(2.0, False)(xs, jnp.asarray(c, jnp.float32))
        _check(out, norms, x, c, 2.0, jnp.float32)


@xla_cpu_only  # the rare path's floor; GPU/TPU take the single pass (backend.one_pass)
def test_floored_norms_skip_the_small_slices_and_the_reported_ones_do_not():
    """The mechanism: with a floor above the bound, a row whose squares underflowed has
    floored norm 0 (its data were not read again); below it, its exact norm."""
    x = jnp.asarray(_rows(np.float32, big=1.0))  # an overflowed row would be read again
    exact = ref.norm([x], 2.0, (1,))[:, 0]
    for floor, skipped in ((1.0, True), (1e-12, False)):
        (floored, reported), _ = leafwise._unit_norms(
            [x], 2.0, ((1,),), True, None, None, False, jnp.float32(floor), "exact"
        )
        np.testing.assert_allclose(ref.f64(reported[0].value)[:, 0], exact, rtol=4e-7)
        got = ref.f64(floored[0].value)[:, 0]
        small = [1, 2]  # rows whose plain sums underflowed
        np.testing.assert_array_equal(got[small] == 0, skipped)
        big = [i for i in range(16) if i not in small]
        np.testing.assert_allclose(got[big], exact[big], rtol=4e-7)


@pytest.mark.parametrize(
    "report",
    [pytest.param("exact", marks=pytest.mark.slow), "largest"],  # suite budget
)
@xla_cpu_only  # XLA:GPU keeps no conditional; GPU/TPU take the single pass
def test_one_rare_branch_per_unit_serves_clipping_and_the_norms(report):
    """The clipped leaves and the reported norms share one rare pass: a conditional per
    unit (the leaf alone here) and a few for the call (one of them the opaque offsets
    of the units' settled flags); a second rare pass for the reported norms would double
    the per-unit ones."""
    xs = [np.ones((8 + i, 40 - i), np.float32) for i in range(3)]
    kw = {"axes": ((1,),) * len(xs), "report": report}
    both = jax.jit(lambda g: leafwise.clip_slices(g, 2.0, clip_norm=1.0, **kw))
    count = both.lower(xs).compile().as_text().count("conditional(")
    assert len(xs) < count <= len(xs) + 5, count


def test_transform_state_under_vmap_is_each_examples_largest_norm():
    """The vmap rule's batch axis is one more kept axis: each example is a leaf of its own
    there (one example's large row does not make another's tiny rows 0)."""
    g = np.zeros((2, 4, 8), np.float32)
    g[0, 0] = 1.0
    g[1] = 1e-20
    tiny = np.full((2, 4, 8), 1e-20, np.float32)  # no example has a large slice
    tiny[1, 1:] = 0.0
    cases = [(1, g), (None, np.concatenate([g] * 1024, axis=2)), (1, tiny)]  # unbucketed
    for axes, x in cases:
        tx = jaxclip.clip_by_norm(1.0, axes=axes)
        got = jax.jit(jax.vmap(lambda v, tx=tx: tx.update(v, tx.init(v))[1].norms))(x)
        want = [np.max(ref.norm([v], 2.0, (1,) if axes else None)) for v in x]
        np.testing.assert_allclose(ref.f64(got), want, rtol=4 * 2.0**-23)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_transform_on_sharded_leaves_explicit_axes_and_shard_map():
    x = np.full((64, 128), 1e-20, np.float32)
    x[0] = 1.0
    tx = jaxclip.clip_by_norm(1.0, axes=1)
    for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        mesh = jax.make_mesh((8,), ("d",), axis_types=(kind,))
        xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
        state = jax.jit(lambda g: tx.update(g, tx.init(g))[1])(xs)
        np.testing.assert_allclose(float(state.norms), np.sqrt(128.0), rtol=4e-7)
    # Inside shard_map, rows split (each device's rows whole): the state is the leaf's
    # largest norm on every device (a pmax over the axis that splits the kept rows).
    local = jaxclip.clip_by_norm(1.0, axes=1, axis_name=())
    f = jax.shard_map(
        lambda g: local.update(g, local.init(g))[1].norms[None],
        mesh=jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,)),
        in_specs=P("d", None),
        out_specs=P("d"),
    )
    want = [np.max(ref.norm([x], 2.0, (1,)))] * 8
    np.testing.assert_allclose(ref.f64(jax.jit(f)(x)), want, rtol=4e-7)
