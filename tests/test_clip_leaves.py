"""``_norms.clip_leaves``: each whole leaf clipped to its own limit (the per-leaf
history clippers ``quantile_clip`` and ``standard_clip``), its limits laid out as the
units' norms so that a thousand leaves are one set of factor kernels. Expected values
are float64 NumPy norms and the clipping formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxclip
from jaxclip import _norms


def _leaves(dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    shapes = [(4, 8), (300, 300), (16,), (2, 3, 5), (64, 64), (7,), (1,), (128, 130)]
    xs = [rng.normal(size=s).astype(np.float32) for s in shapes]
    xs[2][:] = 0.0  # norm 0
    xs[3] *= np.float32(1e-30)  # sums below the exact range: the rare pass
    xs[5] *= np.float32(1e25)  # sums overflow float32
    return [x.astype(dtype) for x in xs]


# Per leaf: clipped hard, kept, clipped (its norm is 0: kept), tiny limit, inf, 0, ...
LIMITS = np.array([0.5, 1e6, 1.0, 1e-31, np.inf, 0.0, 0.3, 2.0], np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_each_leaf_at_its_own_limit_as_float64(dtype):
    xs = _leaves(dtype)
    run = jax.jit(lambda xs, lims: _norms.clip_leaves(xs, lims, jnp.float32))
    out, norms = run([jnp.asarray(x) for x in xs], jnp.asarray(LIMITS))
    want_n = np.array([ref.norm([x], 2.0) for x in xs])
    # float32 norms of bfloat16 data: the float32 sum's rounding only.
    np.testing.assert_allclose(np.asarray(norms, np.float64), want_n, rtol=3e-7)
    assert norms.dtype == jnp.float32
    for x, y, n, c in zip(xs, out, want_n, LIMITS):
        want = ref.f64(x) * ref.scale(n, np.float64(c))
        got = ref.f64(y)
        if np.dtype(dtype) == np.float32:
            np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)
        else:  # one rounding into bfloat16
            np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=0)
        if n <= c:
            np.testing.assert_array_equal(np.asarray(y), x)  # kept bit for bit


def test_no_leaves_and_a_traced_vmap_of_limits():
    out, norms = _norms.clip_leaves([], jnp.zeros((0,)), jnp.float32)
    assert out == [] and norms.shape == (0,)
    xs = [jnp.asarray(x) for x in _leaves(np.float32)[:3]]
    lims = jnp.asarray([[0.5, 1e6, 1.0], [2.0, 3.0, 1.0]], jnp.float32)
    outs, norms = jax.vmap(lambda c: _norms.clip_leaves(xs, c, jnp.float32))(lims)
    for b in range(2):
        for x, y, c in zip(xs, outs, lims[b]):
            n = ref.norm([x], 2.0)
            want = ref.f64(x) * ref.scale(n, np.float64(c))
            np.testing.assert_allclose(ref.f64(y[b]), want, rtol=3e-7, atol=0)


def test_derivative_of_a_clipped_and_a_kept_leaf():
    # d(x t / |x|) v = (t / n) (v - x (x.v) / n^2) where clipped; v where kept.
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(5, 6)).astype(np.float32), rng.normal(size=(7,)).astype(np.float32)]
    vs = [rng.normal(size=x.shape).astype(np.float32) for x in xs]
    lims = jnp.asarray([0.5, 100.0], jnp.float32)

    def f(xs):
        return _norms.clip_leaves(xs, lims, jnp.float32)[0]

    _, tangents = jax.jvp(f, ([jnp.asarray(x) for x in xs],), ([jnp.asarray(v) for v in vs],))
    x, v = ref.f64(xs[0]), ref.f64(vs[0])
    n = np.sqrt(np.sum(x * x))
    want = 0.5 / n * (v - x * np.sum(x * v) / n**2)
    np.testing.assert_allclose(ref.f64(tangents[0]), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(tangents[1]), vs[1])


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_history_clippers_compile_one_set_of_factor_kernels_for_many_leaves():
    # 60 small leaves: quantile_clip (standard_clip shares its step) compiles about as
    # many kernels as the whole-leaf clip_by_norm transform (two per leaf more, 308 for
    # 150 leaves, when the norms were split per leaf and stacked again).
    g = {f"p{i:03d}": jnp.ones((8 + i % 40,), jnp.float32) for i in range(60)}

    def fusions(tx) -> int:
        state = tx.init(g)
        return jax.jit(tx.update).lower(g, state).compile().as_text().count(" fusion(")

    base, history = fusions(jaxclip.clip_by_norm(1.0)), fusions(jaxclip.quantile_clip(0.5))
    assert history <= base + 40, (history, base)
