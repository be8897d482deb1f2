"""Small leaves clipped per slice share buckets: each leaf's slices over its trailing or
leading axes become rows of one matrix with the slices of the same length of other small
leaves (``units.SLICES``), so a transformer's biases and small kernels compile to a few
reductions and conditionals, not one of each per leaf. Expected values are the float64
formulas of ``reference.py``, eagerly, under ``jit``, ``vmap`` and ``grad``, and inside
``shard_map``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from _helpers import xla_cpu_only
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip._norms import slices, units

F32_TINY = float(np.finfo(np.float32).tiny)


def _tree(dtype=np.float32, big: float = 1e30) -> dict[str, np.ndarray]:
    """Small leaves whose slices over the last axis have 16 elements (those over the
    first vary), each with slices the rare path must read again: zero, tiny (squares
    that underflow), huge (squares that overflow float32), and one NaN."""
    rng = np.random.default_rng(7)
    tree = {
        "k": rng.normal(size=(8, 16)),
        "huge": rng.normal(size=(4, 16)) * big,
        "bias": rng.normal(size=(16,)),
        "cube": rng.normal(size=(2, 3, 16)),
        "tall": rng.normal(size=(16, 4)) * 3.0,
        "zero": np.zeros((5, 16)),
        "tiny": rng.normal(size=(3, 16)) * 1e-25,
        "mixed": rng.normal(size=(6, 16)),
        "nan": rng.normal(size=(3, 16)),
    }
    tree["mixed"][1] = 0.0
    tree["mixed"][4] *= 1e-24
    tree["mixed"][5, 3] = 2e-30
    tree["nan"][1, 5] = np.nan
    return {k: v.astype(dtype) for k, v in tree.items()}


def _single(x: np.ndarray) -> float:
    return float(np.asarray(x).reshape(()))


def _norm(v: np.ndarray, p: float, a: tuple[int, ...]) -> np.ndarray:
    """The float64 norms over ``a`` (keepdims): NaN where a slice holds one."""
    return np.where(np.isnan(v).any(axis=a, keepdims=True), np.nan, ref.norm([v], p, a))


def _clipped(v: np.ndarray, c: float, p: float, a: tuple[int, ...]) -> np.ndarray:
    """:func:`reference.clip_each`, every element of a NaN slice NaN (as torch's)."""
    return np.where(np.isnan(_norm(v, p, a)), np.nan, ref.clip_each(v, c, p, a))


def test_plan_buckets_small_leaves_by_slice_length():
    leaves = [
        jnp.ones((8, 16)),  # 0: trailing, slices of 16
        jnp.ones((4, 16)),  # 1: trailing, 16
        jnp.ones((16,)),  # 2: all its axes: a whole leaf, a row of the rows bucket
        jnp.ones((2, 3, 16)),  # 3: trailing, 16
        jnp.ones((16, 4)),  # 4: leading, 16 (transposed into rows)
        jnp.ones((units.SLICE_BUCKET_MAX_BYTES // 64 + 1, 16)),  # 5: one row too large
        jnp.ones((5, 7)),  # 6: slices of 7: alone in its bucket, so a unit of its own
        jnp.ones((3, 16, 2)),  # 7: a middle axis
        jnp.ones((2, 16), jnp.bfloat16),  # 8: another dtype
        jnp.ones((2, 16), jnp.bfloat16),  # 9
        jnp.ones((units.SLICE_BUCKET_MAX_BYTES // 64, 16)),  # 10: as large as may be
    ]
    axes = [(1,), (1,), (0,), (2,), (0,), (1,), (1,), (1,), (1,), (1,), (1,)]
    plan = units.plan(leaves, axes, [()] * len(leaves), bucket=True, rows=True)
    kinds = {u.members: u.width for u in plan}
    assert kinds == {
        (5,): units.ALONE,
        (6,): units.ALONE,
        (7,): units.ALONE,
        (0, 1, 3, 4, 10): units.SLICES,
        (2,): 16,
        (8, 9): units.SLICES,
    }, kinds
    leaves[4] = jnp.arange(64.0).reshape(16, 4)
    built, unit_axes, bucketed = units.build(leaves, axes, plan)
    at = next(i for i, u in enumerate(plan) if u.members == (0, 1, 3, 4, 10))
    assert built[at].shape == (8 + 4 + 6 + 4 + 256, 16) and unit_axes[at] == (1,)
    np.testing.assert_array_equal(built[at][18:22], leaves[4].T)  # its columns, as rows
    # A bucket of slices says how many rows each of its leaves has.
    kinds = {u.members: b for u, b in zip(plan, bucketed)}
    assert kinds[(0, 1, 3, 4, 10)] == (8, 4, 6, 4, 256)
    assert kinds[(2,)] is True and kinds[(5,)] is False
    where = units.places(leaves, axes, plan)
    assert [(w.row, w.rows, w.shape) for w in (where[0], where[1], where[3], where[4])] == [
        (0, 8, (8, 1)),
        (8, 4, (4, 1)),
        (12, 6, (2, 3, 1)),
        (18, 4, (1, 4)),
    ]
    # Without bucketing (or for a joint norm) every leaf with axes stays alone.
    assert all(u.width == units.ALONE for u in units.plan(leaves, axes, [()] * 11, False, True))


def test_plan_with_a_partner_lays_both_trees_out_alike():
    # AGC's bfloat16 gradients of float32 params (and float16 ones of bfloat16): planned
    # with its partner, each tree gets the units the other gets. A leaf buckets only where
    # both dtypes' copies are small, and only with leaves whose partners share a dtype.
    n = units.BUCKET_MAX_BYTES // 4 + 1  # fits in a bucket in 16 bits, not in 32
    shapes = [(3, 5), (n,), (4, 4), (16,), (6, 16), (2, 16), (9,)]
    grads = [jnp.ones(s, jnp.bfloat16) for s in shapes]
    grads[6] = jnp.ones(shapes[6], jnp.float16)
    params = [jnp.ones(s, jnp.float32) for s in shapes]
    params[3] = jnp.ones(shapes[3], jnp.bfloat16)  # a bfloat16 param among float32 ones
    params[6] = jnp.ones(shapes[6], jnp.bfloat16)
    axes = [None, None, None, None, (1,), (1,), None]
    none = [()] * len(shapes)
    mine = units.plan(grads, axes, none, True, True, partner=(params, none))
    theirs = units.plan(params, axes, none, True, True, partner=(grads, none))
    assert mine == theirs
    assert {u.members: u.width for u in mine} == {
        (1,): units.ALONE,  # 8 KiB past the bucket in float32
        (0, 2): 16,  # bfloat16 beside float32 params
        (3,): 16,  # bfloat16 beside a bfloat16 param: a bucket of its own
        (4, 5): units.SLICES,
        (6,): 16,
    }
    assert units.places(grads, axes, mine) == units.places(params, axes, theirs)
    # Alone, the gradients bucket the large leaf, and leaf 3 with leaves 0 and 2.
    alone = {u.members: u.width for u in units.plan(grads, axes, none, True, True)}
    assert alone[(1,)] == 1 << n.bit_length() and alone[(0, 2, 3)] == 16


def test_plan_keeps_each_one_byte_dtype_in_buckets_of_its_own():
    # Seven float8 dtypes (and float4) share NumPy's type string '<V1': a bucket is a
    # concatenation, so each dtype needs its own, planned alone or with a partner.
    dtypes = [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e3m4, jnp.float8_e5m2fnuz]
    leaves = [jnp.ones((4, 4), d) for d in dtypes]
    none = [()] * len(leaves)
    axes = [None] * len(leaves)
    for partner in (None, ([jnp.ones((4, 4))] * len(leaves), none)):
        got = units.plan(leaves, axes, none, True, True, partner=partner)
        assert sorted(u.members for u in got) == [(0,), (1,), (2,), (3,)], got
    x = jnp.asarray(np.linspace(-2, 2, 16).reshape(4, 4))
    tree = {str(np.dtype(d)): x.astype(d) for d in dtypes}
    clipped, norms = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0))(tree)
    for k, v in tree.items():
        n = np.linalg.norm(ref.f64(v))
        np.testing.assert_allclose(float(norms[k]), n, rtol=1e-6, err_msg=k)
        assert clipped[k].dtype == v.dtype


@pytest.mark.parametrize("p", [2.0, 3.0, math.inf])
@pytest.mark.parametrize("axes", [-1, 0])
def test_bucketed_slices_are_exact(axes, p):
    tree = _tree()
    fn = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=axes, norm_type=p))
    clipped, norms = fn(tree)
    for k, v in tree.items():
        a = (v.ndim - 1,) if axes == -1 else (0,)
        want = _norm(v, p, a)
        got = np.asarray(norms[k], np.float64)
        np.testing.assert_allclose(got, np.squeeze(want, a), rtol=4 * 2.0**-23, err_msg=k)
        np.testing.assert_allclose(
            ref.f64(clipped[k]), _clipped(v, 1.0, p, a), rtol=4 * 2.0**-23, atol=0, err_msg=k
        )
    # The NaN stays in its own slice: the other rows of the bucket are numbers.
    assert np.isnan(np.asarray(norms["nan"])).sum() == 1


def test_bucketed_slices_eagerly_and_in_the_transform_state():
    tree = _tree()
    clipped, norms = jaxclip.clip_tree_by_norm(tree, 1.0, axes=-1)
    for k, v in tree.items():
        a = (v.ndim - 1,)
        np.testing.assert_allclose(ref.f64(clipped[k]), _clipped(v, 1.0, 2.0, a), rtol=4 * 2.0**-23)
        np.testing.assert_allclose(
            np.asarray(norms[k], np.float64),
            np.squeeze(_norm(v, 2.0, (v.ndim - 1,)), -1),
            rtol=4 * 2.0**-23,
            err_msg=k,
        )
    # The transform's state keeps each leaf's largest slice norm, exact for a leaf all
    # of whose squares underflow while the other leaves of its bucket are ordinary (no
    # overflow, which would have the bucket read again anyway).
    del tree["nan"], tree["huge"]
    tx = jaxclip.clip_by_norm(1.0, axes=-1)
    for update in (tx.update, jax.jit(tx.update)):
        _, state = update(tree, tx.init(tree))
        assert isinstance(state, jaxclip.ClipByNormState)
        for k, v in tree.items():
            want = float(np.max(ref.norm([v], 2.0, (v.ndim - 1,))))
            np.testing.assert_allclose(_single(state.norms[k]), want, rtol=4 * 2.0**-23, err_msg=k)
    assert _single(state.norms["tiny"]) > 1e-25


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("axes", [-1, 0])
def test_bucketed_16bit_slices(dtype, axes):
    tree = _tree(dtype, big=1e3)
    del tree["nan"], tree["tiny"], tree["mixed"]  # below float16's range
    clipped, norms = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=axes))(tree)
    for k, v in tree.items():
        a = (v.ndim - 1,) if axes == -1 else (0,)
        want = ref.norm([v], 2.0, a)  # of the 16-bit values, exactly
        np.testing.assert_allclose(
            np.asarray(norms[k], np.float64), np.squeeze(want, a), rtol=4 * 2.0**-23, err_msg=k
        )
        assert clipped[k].dtype == dtype
        eps = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(
            ref.f64(clipped[k]), ref.clip_each(v, 1.0, 2.0, a), rtol=eps, atol=0, err_msg=k
        )


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_bucketed_slices_under_grad_and_vmap():
    rng = np.random.default_rng(3)
    tree = {f"w{i}": rng.normal(size=(3 + i, 16)).astype(np.float32) for i in range(5)}
    tree["b"] = rng.normal(size=(16,)).astype(np.float32) * 0.01
    tree["t"] = rng.normal(size=(16, 2)).astype(np.float32)

    def loss(t):
        out, _ = jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)
        return sum(jnp.sum(v * jnp.arange(v.size).reshape(v.shape)) for v in out.values())

    grads = jax.jit(jax.grad(loss))(tree)
    for k, v in tree.items():  # each leaf alone: the same derivative, by the formula
        x, w = ref.f64(v), np.arange(v.size, dtype=np.float64).reshape(v.shape)
        n = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
        want = np.where(n <= 1, w, (w - x * np.sum(w * x, -1, keepdims=True) / n**2) / n)
        np.testing.assert_allclose(ref.f64(grads[k]), want, rtol=2e-5, atol=1e-6, err_msg=k)

    batch = {k: np.stack([v, 2 * v, 0 * v]) for k, v in tree.items()}
    got = jax.jit(jax.vmap(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)))(batch)
    for i in range(3):
        for k in tree:
            v = batch[k][i]
            np.testing.assert_allclose(
                ref.f64(got[0][k][i]), ref.clip_each(v, 1.0, 2.0, (v.ndim - 1,)), rtol=1e-6
            )
            n = np.squeeze(ref.norm([v], 2.0, (v.ndim - 1,)), -1)
            np.testing.assert_allclose(ref.f64(got[1][k][i]), n, rtol=1e-6, atol=0)


def _count(fn, tree, op: str) -> int:
    return jax.jit(fn).lower(tree).compile().as_text().count(op)


@pytest.mark.parametrize("axes", [-1, 0])
def test_conditionals_and_reductions_do_not_grow_with_small_leaves(axes):
    def tree(n: int) -> dict[str, jax.Array]:
        return {f"w{i}": jnp.ones((4 + i % 5, 32)).T if axes == 0 else jnp.ones((4 + i, 32))
                for i in range(n)}  # fmt: skip

    small, large = tree(6), tree(18)
    fn = lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=axes)  # noqa: E731
    for op in (" conditional(", " reduce("):
        assert _count(fn, large, op) == _count(fn, small, op), op


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_slices_that_vary_differently_inside_shard_map_are_not_bucketed_together():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(4)
    # Rows of 16 everywhere: "split" varies over "model" (its rows are split), "rep"
    # over no axis, "also" over "model" like "split".
    tree = {k: rng.normal(size=(8, 16)).astype(np.float32) for k in ("split", "rep", "also")}
    specs = {"split": P("model"), "rep": P(), "also": P("model")}

    def body(g):  # every slice whole on each device: nothing to combine
        return jaxclip.clip_tree_by_norm(g, 1.0, axes=-1, axis_name=())

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(specs, specs)))
    placed = {k: jax.device_put(v, jax.NamedSharding(mesh, specs[k])) for k, v in tree.items()}
    clipped, norms = f(placed)
    for k, v in tree.items():
        np.testing.assert_allclose(ref.f64(clipped[k]), ref.clip_each(v, 1.0, 2.0, (1,)), rtol=1e-6)
        np.testing.assert_allclose(
            ref.f64(norms[k]), np.squeeze(ref.norm([v], 2.0, (1,)), 1), rtol=1e-6
        )


@xla_cpu_only  # the rare path's second read; GPU/TPU take the single pass
def test_a_zero_row_costs_its_bucket_no_second_read(monkeypatch):
    # The transform's state needs each leaf's largest slice norm exact: a leaf with a
    # zero row among ordinary ones has it from its plain sums, so its bucket is not read
    # again; a leaf all of whose rows are zero or tiny is.
    reads = []
    original = slices._shifted_by_sum.__wrapped__

    def counted(p, a, b, c):
        branch = original(p, a, b, c)

        def read(x, f):
            jax.debug.callback(lambda: reads.append(x.shape))
            return branch(x, f)

        return read

    monkeypatch.setattr(slices, "_shifted_by_sum", counted)
    rng = np.random.default_rng(5)
    tree = {f"w{i}": rng.normal(size=(3 + i, 24)).astype(np.float32) for i in range(4)}
    tree["w2"][1] = 0.0
    tx = jaxclip.clip_by_norm(1.0, axes=-1)
    update = jax.jit(tx.update)
    for case in ("zero row", "zero leaf", "tiny leaf"):
        if case == "zero leaf":
            tree["w1"] = np.zeros_like(tree["w1"])
        if case == "tiny leaf":
            tree["w1"] = np.full_like(tree["w1"], 1e-30)
        reads.clear()
        _, state = update(tree, tx.init(tree))
        jax.effects_barrier()
        assert isinstance(state, jaxclip.ClipByNormState)
        assert reads == ([] if case == "zero row" else [(3 + 4 + 5 + 6, 24)]), case
        for k, v in tree.items():
            want = float(np.max(ref.norm([v], 2.0, (1,))))
            np.testing.assert_allclose(_single(state.norms[k]), want, rtol=4 * 2.0**-23, err_msg=k)
    # Under vmap, per example: the tiny leaf of the first, the ordinary one of the second.
    other = dict(tree, w1=rng.normal(size=(4, 24)).astype(np.float32))
    batch = {k: np.stack([tree[k], other[k]]) for k in tree}
    _, states = jax.jit(jax.vmap(tx.update))(batch, jax.vmap(tx.init)(batch))
    for i, t in enumerate((tree, other)):
        for k, v in t.items():
            want = float(np.max(ref.norm([v], 2.0, (1,))))
            np.testing.assert_allclose(float(states.norms[k][i]), want, rtol=4 * 2.0**-23)
