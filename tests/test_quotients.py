"""Clipping factors of many norms (``backend.QUOTIENT_MIN`` or more) are plain quotients
``c / n`` where every one is normal, behind one conditional; the exact split of
``clip.clip_factor`` only where one is not. Expected values are float64 NumPy: a float64
quotient of two float32 values rounded to float32 is the correctly rounded quotient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import ON_XLA_CPU, xla_cpu_only

import jaxclip
from jaxclip._norms import arith, backend, clip

TINY = float(np.finfo(np.float32).tiny)
#: XLA:GPU divides float32 with ``div.full.f32`` (up to 2 ulp off; openxla/xla#37181), so
#: off CPU a factor is within 2 ulp of the correctly rounded quotient.
ULPS = 0 if ON_XLA_CPU else 2
MAX = float(np.finfo(np.float32).max)


@jax.jit
def _factor(frac: jax.Array, exp: jax.Array, c: jax.Array) -> clip.Factor:
    return clip.clip_factor(arith.Norm(frac, exp), c)


def _norms(n: int, seed: int = 0) -> np.ndarray:
    """Norms from 1e-30 to 1e30, about half of them above 1."""
    rng = np.random.default_rng(seed)
    return (10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)


def _check(norms: np.ndarray, exps: np.ndarray, c: float) -> None:
    """Each factor against float64: kept where the norm is at most ``c``, else f0 * f1 is
    ``c / norm`` (correctly rounded where it is normal, within an ulp beyond)."""
    keep, f0, f1 = (np.asarray(v) for v in _factor(norms, exps.astype(np.float32), np.float32(c)))
    value = norms.astype(np.float64) * 2.0 ** exps.astype(np.float64)
    np.testing.assert_array_equal(keep, value <= c)
    np.testing.assert_array_equal(f1 == 0, keep)
    q = np.float64(np.float32(c)) / value[~keep]
    got = f0[~keep].astype(np.float64) * f1[~keep].astype(np.float64)
    normal = q >= TINY
    if ULPS:
        np.testing.assert_allclose(got[normal], q[normal], rtol=ULPS * 2.0**-23, atol=0)
    else:
        np.testing.assert_array_equal(got[normal], q[normal].astype(np.float32))
    np.testing.assert_allclose(got[~normal], q[~normal], rtol=2.0**-23, atol=0)
    assert np.all(np.isfinite(f0) & np.isfinite(f1))


@pytest.mark.parametrize("c", [1.0, 3e-20, 7e25])
def test_plain_quotients_are_correctly_rounded(c):
    n = _norms(backend.QUOTIENT_MIN + 13)
    _check(n, np.zeros_like(n), c)


@pytest.mark.parametrize(
    "case", ["subnormal quotient", "norm beyond the range", "zero clip norm", "small vector"]
)
def test_a_norm_the_quotient_cannot_serve_takes_the_exact_split(case):
    n = _norms(backend.QUOTIENT_MIN * 2, seed=1)
    e = np.zeros_like(n)
    c = 1.0
    if case == "subnormal quotient":
        n[77] = 3e38  # 1 / 3e38 is below float32's normal range
    elif case == "norm beyond the range":
        n[5], e[5] = 0.75, 200.0  # 0.75 * 2**200
    elif case == "zero clip norm":
        c = 0.0
    else:
        n = n[: backend.QUOTIENT_MIN - 1]
        n[3] = 3e38
        e = e[: backend.QUOTIENT_MIN - 1]
    if c == 0.0:
        keep, f0, f1 = (np.asarray(v) for v in _factor(n, e, np.float32(0.0)))
        assert not keep.any() and np.all(f0 * f1 == 0)  # every update scaled to 0
    else:
        _check(n, e, c)


def test_nan_and_inf_norms_in_a_large_vector():
    n = _norms(backend.QUOTIENT_MIN, seed=2)
    n[10], n[20] = np.nan, np.inf
    keep, f0, f1 = (np.asarray(v) for v in _factor(n, np.zeros_like(n), np.float32(1.0)))
    assert not keep[10] and np.isnan(f0[10] * f1[10])  # NaN for NaN
    assert not keep[20] and f0[20] * f1[20] == 0  # 0 for an inf norm
    rest = np.ones(n.size, bool)
    rest[[10, 20]] = False
    _check(n[rest], np.zeros(rest.sum(), np.float32), 1.0)


def _conditionals(shape: tuple[int, ...]) -> int:
    f = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)[0])
    return f.lower(jnp.ones(shape)).compile().as_text().count(" conditional(")


@xla_cpu_only  # quotients first on CPU only (backend.quotient_first)
def test_one_conditional_more_from_quotient_min_norms():
    assert backend.QUOTIENT_MIN == 4096
    # Rows of 24 float32: a leaf of its own (above the bucket limits).
    assert _conditionals((4096, 24)) == _conditionals((4095, 24)) + 1


def test_no_conditional_with_the_single_pass(monkeypatch):
    monkeypatch.setattr(backend, "ONE_PASS", True)
    jax.clear_caches()
    try:
        assert _conditionals((4096, 24)) == 0
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_clipping_through_the_quotients_against_float64():
    # 8192 rows of 3 (a conv kernel clipped over its last axis): each row's factor from
    # the quotient, under jit, vmap and grad.
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(8192, 3)) * 10.0 ** rng.uniform(-3, 3, (8192, 1))).astype(np.float32)
    clipped, norms = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1))(x)
    n = np.asarray(norms, np.float64)
    want = np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=-1))
    np.testing.assert_allclose(n, want, rtol=2.0**-22)
    q = (1.0 / n).astype(np.float32).astype(np.float64)[:, None]
    expect = np.where(n[:, None] <= 1.0, x, (x * q).astype(np.float32))
    two = jax.vmap(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)[0])(np.stack([x, x]))
    for got in (clipped, two[1]):
        if ULPS:  # the factor's ulps and the product's rounding
            np.testing.assert_allclose(np.asarray(got), expect, rtol=(ULPS + 1) * 2.0**-23)
        else:
            np.testing.assert_array_equal(np.asarray(got), expect)
    g = jax.grad(lambda t: jnp.sum(jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)[0]))(x)
    assert np.all(np.isfinite(np.asarray(g)))


def test_agc_limits_per_unit_through_the_quotients():
    # A (4, 6000) kernel: 6000 units (columns), each with its own limit from the params.
    rng = np.random.default_rng(4)
    p = (rng.normal(size=(4, 6000)) * 10.0 ** rng.uniform(-2, 2, (1, 6000))).astype(np.float32)
    g = (rng.normal(size=(4, 6000)) * 10.0 ** rng.uniform(-4, 2, (1, 6000))).astype(np.float32)
    tx = jaxclip.adaptive_clip(0.05)
    out, _ = jax.jit(tx.update)({"w": g}, tx.init({"w": p}), {"w": p})
    gn = np.sqrt(np.sum(np.square(g.astype(np.float64)), axis=0))
    limit = 0.05 * np.maximum(np.sqrt(np.sum(np.square(p.astype(np.float64)), axis=0)), 1e-3)
    want = g * np.where(gn <= limit, 1.0, limit / gn)
    assert 0 < np.sum(gn > limit) < 6000  # some units clipped, some not
    np.testing.assert_allclose(np.asarray(out["w"], np.float64), want, rtol=4 * 2.0**-23)


@xla_cpu_only  # quotients first on CPU only (backend.quotient_first)
def test_ordinary_norms_take_the_quotients():
    # The quotients' mark: a kept norm's f0 is c itself (the split's is c's mantissa
    # scaled by another power of two). Norms at exactly c (kept) and at 2**126, whose
    # quotient 2**-126 is float32's smallest normal, still take them.
    n = _norms(backend.QUOTIENT_MIN, seed=5)
    n[0], n[1] = 1.0, 2.0**126
    keep, f0, f1 = (np.asarray(v) for v in _factor(n, np.zeros_like(n), np.float32(1.0)))
    assert keep[0] and not keep[1] and f0[1] == TINY and f1[1] == 1.0
    np.testing.assert_array_equal(f0[keep], 1.0)
    # One norm the quotient cannot serve sends them all to the split.
    n[2] = 3e38
    keep, f0, _ = (np.asarray(v) for v in _factor(n, np.zeros_like(n), np.float32(1.0)))
    assert not np.all(f0[keep] == 1.0)
