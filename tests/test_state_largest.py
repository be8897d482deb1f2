"""The ``clip_by_norm`` transform's state: each leaf's largest slice norm, taken as one
segment maximum over the stacked per-slice norms (``stacking.largest``), not one
reduction per leaf. Expected values are float64 NumPy maxima of the float64 norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxclip
from jaxclip._norms import stacking

RTOL = 4 * 2.0**-23


def _largest(vectors: list[np.ndarray], parts: list[stacking.Piece]) -> list[float]:
    """``stacking.largest`` under jit, each piece's part picked with a static slice."""

    def fn(vs):
        picked = [vs[g][at : at + size] for g, at, size, _, _ in parts]
        return stacking.largest(vs, parts, picked)

    return [float(v) for v in jax.jit(fn)([jnp.asarray(v) for v in vectors])]


def test_largest_per_piece_keeps_nan_and_inf_and_gives_0_for_no_elements():
    a = np.array([1.0, 3.0, 2.0, 0.0, 5.0, np.nan, 4.0, 0.5, np.inf, 7.0, 6.0], np.float32)
    b = np.array([2.5, 0.25], np.float32)
    c = np.array([9.0], np.float32)
    # (group, offset, size, shape, sliced): pieces of 3, 0, 1, 2 (NaN), 3 (inf, at the
    # end) elements in one group, a whole vector, and a vector of one.
    parts = [
        (0, 0, 3, (3,), True),
        (0, 3, 0, (0,), True),
        (0, 4, 1, (1,), True),
        (0, 5, 2, (2,), True),
        (0, 8, 3, (3,), True),
        (1, 0, 2, (2,), False),
        (2, 0, 1, (1,), False),
    ]
    got = _largest([a, b, c], parts)
    assert got[:3] == [3.0, 0.0, 5.0]
    assert np.isnan(got[3])
    assert got[4:] == [np.inf, 2.5, 9.0]


def test_largest_of_parts_reduced_alone_among_segments():
    # Parts above SEGMENT_MAX_SIZE are reduced alone, beside a segment maximum of the
    # others (which skips them); the largest value is at either end of a part, or NaN;
    # the parts are listed out of the order of their offsets.
    big = stacking.SEGMENT_MAX_SIZE + 1
    rng = np.random.default_rng(3)
    v = rng.random(3 * big + 14).astype(np.float32)
    v[big - 1] = 7.0  # the last element of the first big part
    v[big] = 9.0  # the first of the small part after it
    v[big + 10 + 5] = np.nan  # inside the second big part
    v[2 * big + 10] = 50.0  # the first of the third big part, above every small part's
    v[3 * big + 9] = 8.0  # its last
    v[3 * big + 12] = 6.0  # in the last small part, after the big ones
    parts = [
        (0, 3 * big + 10, 4, (4,), True),
        (0, big, 10, (10,), True),
        (0, 0, big, (big,), True),
        (0, big + 10, big, (big,), True),
        (0, 2 * big + 10, big, (big,), True),
    ]
    got = _largest([v], parts)
    assert got[0] == 6.0 and got[1] == 9.0 and got[2] == 7.0
    assert np.isnan(got[3]) and got[4] == 50.0


def test_largest_of_one_piece_per_group_and_of_uncovered_elements():
    # Element 2 belongs to no piece (dropped); the second piece covers the last element.
    v = np.array([1.0, 2.0, 100.0, 3.0, 8.0], np.float32)
    parts = [(0, 0, 2, (2,), True), (0, 3, 2, (2,), True)]
    assert _largest([v], parts) == [2.0, 8.0]
    # float16 and bfloat16 bits order as their values do.
    for dtype in (np.float16, jnp.bfloat16):
        w = np.array([3.0, 0.0, 65504.0 if dtype == np.float16 else 1e38, 2.0], dtype)
        got = _largest([w], [(0, 0, 2, (2,), True), (0, 2, 2, (2,), True)])
        assert got == [3.0, float(w[2])]


def _tree() -> dict[str, np.ndarray]:
    """Leaves alone (above the bucket limits), small ones that share buckets, each with
    its largest slice at a different place; magnitudes from tiny to near float32's top."""
    rng = np.random.default_rng(11)
    tree = {
        "w1": rng.normal(size=(256, 96)),
        "w2": rng.normal(size=(96, 256)) * 1e30,
        "w3": rng.normal(size=(128, 64)) * 1e-20,
        "b1": rng.normal(size=(96,)),
        "b2": rng.normal(size=(8, 16)),
        "b3": rng.normal(size=(4, 16)) * 1e-24,
        "z": np.zeros((6, 16)),
    }
    tree["w1"][17] *= 50.0  # one large row
    tree["b2"][3] = 0.0
    return {k: v.astype(np.float32) for k, v in tree.items()}


@pytest.mark.parametrize("axes", [-1, 0, None])
@pytest.mark.parametrize("p", [2.0, 3.0, float("inf")])
def test_transform_state_is_each_leafs_largest_float64_norm(axes, p):
    tree = _tree()
    tx = jaxclip.clip_by_norm(1.0, axes=axes, norm_type=p)
    _, state = jax.jit(tx.update)(tree, tx.init(tree))
    for k, v in tree.items():
        a = tuple(range(v.ndim)) if axes is None else ((v.ndim - 1,) if axes == -1 else (0,))
        want = float(np.max(ref.norm([v], p, a)))
        got = float(np.asarray(state.norms[k]))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=0, err_msg=f"{k} {axes} {p}")


def test_a_nan_or_inf_slice_makes_only_its_leafs_state_nan_or_inf():
    tree = _tree()
    del tree["w2"]  # its squares overflow: the state's inf would come from it too
    tree["b2"][5, 2] = np.nan
    tree["w1"][3, 4] = np.inf
    tx = jaxclip.clip_by_norm(1.0, axes=-1)
    for update in (tx.update, jax.jit(tx.update)):
        _, state = update(tree, tx.init(tree))
        got = {k: float(np.asarray(v)) for k, v in state.norms.items()}
        assert np.isnan(got.pop("b2")) and got.pop("w1") == np.inf
        for k, v in got.items():
            want = float(np.max(ref.norm([tree[k]], 2.0, (tree[k].ndim - 1,))))
            np.testing.assert_allclose(v, want, rtol=RTOL, err_msg=k)


def test_transform_state_under_vmap_is_per_example():
    tree = _tree()
    two = {k: np.stack([v, 2 * v]) for k, v in tree.items()}
    tx = jaxclip.clip_by_norm(1e-3, axes=0)
    _, state = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))))(two)
    for k, v in tree.items():
        want = float(np.max(ref.norm([v], 2.0, (0,))))
        np.testing.assert_allclose(np.asarray(state.norms[k]), [want, 2 * want], rtol=RTOL)


def _reductions(fn, tree) -> int:
    return jax.jit(fn).lower(tree).compile().as_text().count(" reduce(")


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_the_state_costs_no_reduction_per_leaf():
    # Leaves of distinct shapes, each a unit of its own: the transform's reductions grow
    # with them exactly as the functional form's do (whose norms are per slice).
    def tree(n: int) -> dict[str, jax.Array]:
        return {f"w{i}": jnp.ones((64 + 8 * i, 96)) for i in range(n)}

    tx = jaxclip.clip_by_norm(1.0, axes=-1)

    def transform(g):
        return tx.update(g, tx.init(g))

    def functional(g):
        return jaxclip.clip_tree_by_norm(g, 1.0, axes=-1)

    small, large = tree(2), tree(6)
    grown = _reductions(transform, large) - _reductions(transform, small)
    assert grown == _reductions(functional, large) - _reductions(functional, small)


def test_float64_state_under_x64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        tree = {"w": rng.normal(size=(40, 16)) * 1e-170, "b": rng.normal(size=(3, 16))}
        tree["w"][7] *= 1e150  # the others' squares underflow float64
        tx = jaxclip.clip_by_norm(1.0, axes=-1)
        _, state = jax.jit(tx.update)(tree, tx.init(tree))
        for k, v in tree.items():
            assert state.norms[k].dtype == jnp.float32  # the state's dtype, as ever
            want = np.float32(np.max(ref.norm([v], 2.0, (1,))))
            assert np.asarray(state.norms[k]) == want, k


@pytest.mark.parametrize(("rows", "scatters"), [((1024, 1025), 1), ((1025, 1026), 0), ((8, 9), 1)])
def test_parts_of_more_than_segment_max_size_norms_are_reduced_alone(rows, scatters):
    assert stacking.SEGMENT_MAX_SIZE == 1024
    # Rows of 600 float32: each leaf a unit of its own, above the bucket limits.
    tree = {f"w{i}": jnp.ones((r, 600)) for i, r in enumerate(rows)}
    tx = jaxclip.clip_by_norm(1.0, axes=-1)
    text = jax.jit(tx.update).lower(tree, tx.init(tree)).compile().as_text()
    # The largest norms' segment maxima (the rare path's settled codes take their own).
    lines = [t for t in text.splitlines() if " scatter(" in t and "_layout_norms" not in t]
    assert len(lines) == scatters


def test_float64_norms_beyond_float32_are_checked_before_the_states_float32():
    # error_if_nonfinite reads the norms in the leaf's precision: a float64 norm of 2e200
    # is finite (the state, float32, holds inf).
    with jax.enable_x64(True):
        g = {"w": jnp.full((4, 3), 1e200, jnp.float64)}
        tx = jaxclip.clip_by_norm(1.0, axes=1, error_if_nonfinite=True)
        clipped, state = jax.jit(tx.update)(g, tx.init(g))
        np.testing.assert_allclose(np.linalg.norm(np.asarray(clipped["w"]), axis=1), 1.0)
        assert state.norms["w"].dtype == jnp.float32 and np.isinf(np.asarray(state.norms["w"]))


def test_the_state_carries_no_derivative():
    # Leaves of one slice, of several, of more than SEGMENT_MAX_SIZE, and a whole leaf.
    tree = {
        "one": jnp.array([[3.0, 4.0]]),
        "two": jnp.array([[3.0, 4.0], [1.0, 0.0]]),
        "big": jnp.ones((1100, 2)),
        "whole": jnp.array([3.0, 4.0]),
    }
    for axes in (-1, None):
        tx = jaxclip.clip_by_norm(1.0, axes=axes)
        state = tx.init(tree)
        ones = jax.tree.map(jnp.ones_like, tree)
        _, tangents = jax.jvp(
            lambda u, tx=tx, state=state: tx.update(u, state)[1].norms, (tree,), (ones,)
        )
        for k, t in tangents.items():
            assert float(t) == 0.0, (axes, k)


@pytest.mark.parametrize("axes", [-1, 0, None])
def test_a_tiny_leaf_among_stacked_leaves_keeps_its_exact_largest_norm(axes):
    # Twelve small leaves stacked into one group, one of them all 1e-30 (its squares
    # underflow to 0) and one all zero, beside normal ones: the tiny leaf's state is its
    # float64 largest norm, not 0 (its unit is read again though the others are in range).
    rng = np.random.default_rng(11)
    tree = {f"w{i:02d}": rng.normal(size=(6, 5)).astype(np.float32) for i in range(12)}
    tree["w03"] = (tree["w03"] * 1e-30).astype(np.float32)
    tree["w07"] = np.zeros((6, 5), np.float32)
    tx = jaxclip.clip_by_norm(1.0, axes=axes)
    _, state = jax.jit(tx.update)(tree, tx.init(tree))
    for k, x in tree.items():
        a = tuple(range(x.ndim)) if axes is None else axes
        want = np.max(np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=a)))
        np.testing.assert_allclose(float(state.norms[k]), want, rtol=RTOL, err_msg=k)
