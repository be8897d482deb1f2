"""The numerics core's parts against float64 formulas, fast enough to run first.

Each test sweeps one part of ``jaxclip._norms`` over the values where its constants and
comparisons matter (the exact range's ends, the dtype's range, zeros, NaN, inf), with
few compiles: one jitted program per norm type covers every layout. ``tests/mutation.py``
runs this file first; a change to a constant or a comparison of the core fails here.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxclip
from jaxclip import _norms
from jaxclip._norms import arith, clip, rare

F32 = np.finfo(np.float32)
P_ALL = (2.0, 1.0, 3.0, 0.5, 1.5, math.inf, 100.0)


def _rows() -> np.ndarray:
    """Rows of 64 float32 values, one magnitude class each: where the plain sum of powers
    is exact, overflows, underflows in part or in all, is zero, or mixes extremes."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 2.0, (10, 64)).astype(np.float32)
    scales = [1.0, 0.0, 1e-20, 1e-30, 1e30, 1.5e38, 1e-19, 3e-38, 1e15, 1e-3]
    x = base * np.array(scales, np.float32)[:, None]
    x[6, 0] = 1.2e-19  # the rest 1e-19 * U(0.5, 2): squares below float32's normal range
    x[5, 1:] = 1.0  # one near 3e38, the rest 1: the sum of squares overflows
    x[8, ::2] *= -1
    return x


ROWS = _rows()


def _check(got: jax.Array | float, want: np.ndarray | float, rtol: float, what: str) -> None:
    np.testing.assert_allclose(ref.f64(got), want, rtol=rtol, atol=0, err_msg=what)


# ----------------------------------------------------------------------------------------
# Exact arithmetic.


def test_frexp_ldexp_pow2_are_exact():
    v = np.array([0.0, 1.0, 0.75, 3.0, 1e-30, F32.tiny, 3e38, F32.max, 6e-39], np.float32)
    f, e = arith.frexp(jnp.asarray(v))
    wf, we = np.frexp(v.astype(np.float64))
    sub = v < F32.tiny  # flushed subnormals (XLA:CPU) count as 0
    np.testing.assert_array_equal(np.where(sub & (np.asarray(f) == 0), 0, wf), f)
    np.testing.assert_array_equal(np.where(sub & (np.asarray(f) == 0), 0, we), e)
    special = np.array([np.inf, np.nan], np.float32)
    fs, es = arith.frexp(jnp.asarray(special))
    np.testing.assert_array_equal(fs, special)
    np.testing.assert_array_equal(es, [0, 0])
    for k in (-126, -100, -1, 0, 1, 64, 127):
        assert float(arith.pow2(jnp.float32(k), np.float32)) == 2.0**k, k
    assert float(arith.pow2(jnp.float32(-200), np.float32)) == 2.0**-126  # clamped
    assert float(arith.pow2(jnp.float32(300), np.float32)) == 2.0**127
    for x, k in ((0.75, 250), (1.5, -260), (3.0, 100), (0.5, -149), (1.0, 0)):
        want = np.float64(x) * 2.0**k
        want = np.float32(want) if abs(want) <= F32.max else np.float32(np.inf)
        got = arith.ldexp(jnp.float32(x), jnp.float32(k))
        assert np.float32(got) == want or (want < F32.tiny and float(got) == 0.0), (x, k)
        got = arith.ldexp(jnp.float32(x), jnp.float32(k), divide_last=True)
        assert np.float32(got) == want or (want < F32.tiny and float(got) == 0.0), (x, k)


def test_norm_value_and_from_root():
    for frac, exp in ((0.75, 0.0), (0.75, 200.0), (0.6, -200.0), (1.5, 100.0), (0.0, 5.0)):
        want = frac * 2.0**exp
        want = want if want <= float(F32.max) else math.inf  # float: no cast to float32
        got = float(arith.Norm(jnp.float32(frac), jnp.float32(exp)).value)
        assert got == pytest.approx(want, rel=1e-7, abs=0) or (want < F32.tiny and got < 1e-37)
    g = F32.maxexp // 2
    # (Below the normal range the value is flushed to 0 where the backend flushes.)
    for r, e in ((1.5, 0), (1.5, 300), (0.0, 10), (3.0e38, 1)):
        n = arith.from_root(jnp.float32(r), e)
        frac, exp = float(n.frac), float(n.exp)
        assert frac * 2.0**exp == pytest.approx(r * 2.0**e, rel=1e-7), (r, e)
        value = r * 2.0**e
        if value == 0 or float(F32.tiny) <= value <= float(F32.max):
            assert exp == 0, (r, e)
        elif value > float(F32.max):
            assert 2.0 ** (g - 1) <= frac < 2.0**g, (r, e)
        else:
            assert 2.0 ** (-g - 1) <= frac < 2.0**-g, (r, e)
    assert float(arith.from_root(jnp.float32(np.inf), 0).value) == np.inf


def test_narrow_norm_keeps_the_value_and_a_norm_of_its_dtype_as_it_is():
    for v in (3.0, 3e38, 1e-30):  # canonical: a normal value keeps exp 0, as it is
        got = arith.narrow_norm(arith.Norm(jnp.float32(v), jnp.float32(0.0)), np.float32)
        assert (float(got.frac), float(got.exp)) == (float(np.float32(v)), 0.0), v
    with jax.enable_x64(True):
        for v, e in ((6e38, 0.0), (3.0, 0.0), (1e-300, 0.0), (0.0, 0.0), (np.inf, 0.0), (5.0, 7.0)):
            n = arith.narrow_norm(arith.Norm(jnp.float64(v), jnp.float64(e)), np.float32)
            assert n.frac.dtype == np.float32 and n.exp.dtype == np.float32
            if v in (0.0, np.inf):
                assert (float(n.frac), float(n.exp)) == (v, e)
            else:  # the value, to float32's precision, at any exponent; the frac keeps
                # up to half of float32's exponent range (limits and tangents formed
                # from it stay finite), the rest goes to exp
                assert 2.0**-65 <= float(n.frac) < 2.0**64
                assert float(n.exp) == e or abs(math.log2(float(n.frac))) > 63
                got = math.log2(float(n.frac)) + float(n.exp)
                assert got == pytest.approx(math.log2(v) + e, abs=1e-6), (v, e)


def test_exact_range_and_floor_bound():
    lo = float(F32.tiny) * 2.0**64
    assert arith.exact_lo(np.float32) == lo
    s = np.array([lo, np.nextafter(np.float32(lo), 0), 1.0, F32.max, np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(
        arith.in_exact_range(jnp.asarray(s), np.float32), [True, False, True, True, False, False]
    )
    for p in (2.0, 1.0, 0.5, 3.0):
        assert arith.floor_bound(np.float32, p) == max((4 * lo) ** (1 / p), float(F32.tiny))
    assert arith.floor_bound(np.float32, 200.0) == (4 * lo) ** (1 / 200)


@pytest.mark.parametrize("terms", [2.0**47, 1.0])
def test_always_exact_holds_where_no_term_leaves_the_range(terms, monkeypatch):
    """A dtype's plain power sums need no rare path where the smallest term (its smallest
    subnormal to the p) is a normal float32 and ``MAX_TERMS`` of the largest stay below
    2**127 (float32's overflow threshold halved: room for rounding). Evaluated here as
    float64 powers; with one term, the smallest term decides for float16 above p = 5.25
    (2**-126 at 5.25 itself: float32's smallest normal)."""
    monkeypatch.setattr(arith, "MAX_TERMS", terms)
    dtypes = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2]
    ps = [0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 5.01, 5.2, 5.25, 5.3, 6.0, 8.0, 9.0, 9.2, 16.0, math.inf]
    for dtype in dtypes:
        info = jnp.finfo(dtype)
        for p in ps:
            with np.errstate(over="ignore", under="ignore"):
                small = np.float64(info.smallest_subnormal) ** p
                large = np.float64(info.max) ** p * terms
            narrow = info.bits < 32 and math.isfinite(p)
            want = narrow and small >= F32.tiny and large < 2.0**127
            assert arith.always_exact(dtype, p) == want, (dtype, p)
    assert not arith.always_exact(jnp.complex64, 2.0)
    assert not arith.always_exact(jnp.float64, 2.0)


def test_powers_and_roots_match_float64():
    a = np.array([0.0, 1e-30, 3e-8, 0.7, 1.0, 2.5, 1e5, 3e20, np.inf, np.nan], np.float32)
    for p in (1.0, 2.0, 3.0, 0.5, 1.5, 0.3, 7.5, 100.0):
        for split in (False, True):
            got = ref.f64(arith.power(jnp.asarray(a), p, split))
            with np.errstate(over="ignore", under="ignore"):
                want = ref.f64(a) ** p
            want = np.where(want > F32.max, np.inf, want)
            fine = (want >= F32.tiny) | ~np.isfinite(want) | (want == 0)
            # pow rounds p ln a first (split=False serves data near 1 only)
            rtol = 3e-7 if split or p == int(p) or p == 0.5 else 2e-6
            np.testing.assert_allclose(got[fine], want[fine], rtol=rtol, err_msg=f"{p} {split}")
            assert np.all(got[~fine] <= 2 * F32.tiny), (p, split)
    for c in (Fraction(1, 3), Fraction(2, 1), Fraction(10, 7)):
        hi, mid, lo = arith.split_exact(c, np.float32)
        assert abs(Fraction(hi) + Fraction(mid) + Fraction(lo) - c) < Fraction(1, 2**45)
        assert Fraction(hi).denominator <= 2**12 * max(1, Fraction(hi).denominator >> 12)
        assert math.frexp(hi)[0] * 2**12 == round(math.frexp(hi)[0] * 2**12)
    s = np.array([0.0, 1e-37, 0.3, 1.0, 7.0, 3e38, np.inf, np.nan], np.float32)
    for p in (1.0, 2.0, 3.0, 4.0, 0.5, 1.5, 100.0):
        with np.errstate(over="ignore"):
            want = ref.f64(s) ** (1 / p)
        if p == int(p):  # root serves integer p (root_norm splits the others exactly)
            np.testing.assert_allclose(ref.f64(arith.root(jnp.asarray(s), p)), want, rtol=4e-7)
        n = arith.root_norm(jnp.asarray(s), p, 3.0)
        got = ref.f64(n.frac) * 2.0 ** ref.f64(n.exp)
        # (below the normal range flushed to 0 where the backend flushes)
        np.testing.assert_allclose(got, want * 8.0, rtol=4e-7, atol=F32.tiny, err_msg=str(p))
        n = arith.in_range_norm(jnp.asarray(s[1:6]), p)
        got = ref.f64(n.frac) * 2.0 ** ref.f64(n.exp)
        np.testing.assert_allclose(got, want[1:6], rtol=4e-7, atol=F32.tiny, err_msg=str(p))
    m = jnp.asarray([0.0, 2.0, np.inf, np.nan], jnp.float32)
    n = arith.special(m, arith.Norm(jnp.full(4, 5.0), jnp.ones(4)))
    np.testing.assert_array_equal(n.frac, [0.0, 5.0, np.inf, np.nan])
    np.testing.assert_array_equal(n.exp, [0.0, 1.0, 0.0, 0.0])
    assert arith.acc_dtype(jnp.bfloat16) == np.float32
    assert arith.acc_dtype(np.float64) == arith.acc_dtype(np.complex128) == np.float64
    f32, f64 = np.ones(2, np.float32), np.ones(2, np.float64)
    assert arith.result_dtype([f32, f64]) == arith.result_dtype([f64]) == np.float64
    assert arith.result_dtype([f32, np.ones(2, jnp.bfloat16)]) == np.float32


def test_rare_shifts_make_every_term_exact():
    info = F32
    for s in (np.inf, 1e-45, 1e-38, 1e-30, 0.0):
        e = float(rare.sum_shift(jnp.float32(s), False))
        if s == np.inf:  # every element <= max: 2**40 shifted squares stay finite
            assert e == (info.maxexp + rare.SQUARES_LOG2 + 2) // 2
            assert (2.0**info.maxexp * 2.0**-e) ** 2 * 2.0**rare.SQUARES_LOG2 <= info.max
        else:  # the largest possible element, sqrt(max(s, tiny)), lifted below the top
            top = math.sqrt(max(s, float(info.tiny))) * 2.0**-e
            assert 2.0 ** ((info.maxexp - rare.SQUARES_LOG2 - 3) / 2) <= top, s
            assert top <= 2.0 ** ((info.maxexp - rare.SQUARES_LOG2 - 1) / 2), s
    assert float(rare.sum_shift(jnp.float32(1.0), True)) == 0
    e, mant = rare.max_shift(jnp.float32(3.0), 2.0)
    assert float(e) == 2 and mant is None
    e, mant = rare.max_shift(jnp.float32(3.0), 100.0)
    assert float(e) == 2 and mant is not None and float(mant) == 0.75
    f = rare.shift_factors(jnp.float32(200.0), None, np.float32, False)
    assert float(f[0]) * float(f[1]) == 2.0**-200
    (g,) = rare.shift_factors(jnp.float32(-60.0), None, np.float32, True)
    assert float(g) == 2.0**60


# ----------------------------------------------------------------------------------------
# Norms: every layout of one array per norm type, in one program.


@functools.partial(jax.jit, static_argnums=2)
def _all_norms(x: jax.Array, small: list[jax.Array], p: float) -> dict:
    return {
        "rows": _norms.slice_norms([x], p, ((1,),))[0].value,
        "cols": _norms.slice_norms([x], p, ((0,),))[0].value,
        "whole": _norms.slice_norms([x, *small], p, (None,) * (1 + len(small))),
        "global": _norms.global_norm([x, *small], p),
        "per_example": _norms.per_example_norm_parts([x], p).value,
        "few_rows": _norms.per_example_norm_parts([x[-8:]], p).value,
        "clipped": _norms.clip_slices([x], p, ((1,),), 1e-3)[1][0],
    }


@functools.partial(jax.jit, static_argnums=1)
def _per_example(leaves: list[jax.Array], p: float) -> jax.Array:
    return _norms.per_example_norm_parts(leaves, p).value


def _small_examples(scales: list[float], shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Per-example leaves of ``shapes`` cycling through three dtypes, each example scaled
    by its entry of ``scales`` (float16 ones only within 1e-3..1e3, else 0: its range)."""
    rng = np.random.default_rng(5)
    dtypes = [np.float32, jnp.bfloat16, np.float16]
    out = []
    for i, s in enumerate(shapes):
        d = dtypes[i % 3]
        k = np.array(scales)
        if d == np.float16:
            k = np.where((k >= 1e-3) & (k <= 1e3), k, 0.0)
        x = rng.normal(size=(len(scales), *s)) * k.reshape((-1,) + (1,) * len(s))
        out.append(np.asarray(x, d))
    return out


@pytest.mark.parametrize("p", [2.0, 3.0])
def test_per_example_rare_paths_of_many_small_leaves_match_float64(p):
    """Per-example norms out of the exact range (all-zero, 1e-30, 1e25 examples), read
    again one example's rows at a time (one out of range) or over the batch (most),
    with the small leaves of each dtype concatenated per example on the rare path: each
    example's norm is its own, whatever its neighbours in a bucket. Thirty small leaves
    (buckets of ten), and two beside a leaf whose rows are too long to copy (a bucket of
    two small float32 ones)."""
    many = [(3,), (7,), (4, 5), (16,), (2, 3, 2)] * 6
    pair = [(5,), (17000,), (1,), (2, 2), (3,)]
    for shapes in (many, pair):
        for scales in (
            [1.0] * 5 + [1e-30] + [1.0] * 2,  # one example: its rows
            [0.0, 1e-30, 1.0, 1e25, 1e-25, 0.0, 1e30, 3e-3],  # most: the whole batch
        ):
            leaves = _small_examples(scales, shapes)
            got = _per_example([jnp.asarray(x) for x in leaves], p)
            want = [ref.norm([x[b] for x in leaves], p) for b in range(len(scales))]
            _check(got, want, 3e-6, f"scales {scales}")


# Suite budget: p = 1.5 and 100 run in the slow step (0.5 and 3 keep fractional and odd
# powers in the default one; CI runs both).
_SLOW_P = (1.5, 100.0)


@pytest.mark.parametrize(
    "p", [pytest.param(p, marks=pytest.mark.slow) if p in _SLOW_P else p for p in P_ALL]
)
def test_every_layout_matches_float64(p):
    x = ROWS
    small = [np.float32(3.0) * np.ones(5, np.float32), np.zeros(3, np.float32)]
    small.append((ROWS[4, :7] if p != 100.0 else ROWS[2, :7]).copy())
    got = _all_norms(jnp.asarray(x), [jnp.asarray(s) for s in small], p)
    rtol = 3e-6 if p < 1 else 2e-6
    want_rows = ref.norm([x], p, (1,))[:, 0]
    _check(got["rows"][:, 0], want_rows, rtol, f"rows p={p}")
    _check(got["per_example"], want_rows, rtol, f"per-example p={p}")
    _check(got["few_rows"], want_rows[-8:], rtol, f"per-example, few out of range p={p}")
    _check(got["clipped"], want_rows, rtol, f"clip_slices' reported norms p={p}")
    _check(got["cols"][0], ref.norm([x], p, (0,))[0], rtol, f"cols p={p}")
    leaves = [x, *small]
    whole = [n.value.reshape(()) for n in got["whole"]]
    _check(np.array(whole), [ref.norm([v], p) for v in leaves], rtol, f"whole p={p}")
    want = ref.norm(leaves, p)
    _check(got["global"], min(want, np.inf) if want <= F32.max else np.inf, rtol, f"global {p}")


def test_the_2_norm_below_the_trigger_is_exact():
    """A 2-norm whose plain sum of squares lost its terms to underflow: one 1.2e-19 and
    999 of 1e-20 is 3.38e-19; the plain sum alone gives 1.2e-19."""
    x = np.full(1000, 1e-20, np.float32)
    x[0] = 1.2e-19
    want = ref.norm([x], 2.0)
    assert want == pytest.approx(3.38e-19, rel=1e-3)
    _check(jaxclip.global_norm({"w": x}), want, 1e-5, "global_norm")
    _check(jaxclip.clip_tree_by_norm({"w": x}, 1.0)[1]["w"], want, 1e-5, "clip_tree_by_norm")
    rows = np.stack([x, x * 1e10, x])
    _check(
        jaxclip.clip_tree_by_norm({"w": rows}, 1.0, axes=1)[1]["w"],
        ref.norm([rows], 2.0, (1,))[:, 0],
        1e-5,
        "rows",
    )
    _check(
        jaxclip.clip_tree_per_example({"w": rows}, 1.0)[1],
        ref.norm([rows], 2.0, (1,))[:, 0],
        1e-5,
        "per example",
    )
    _check(jaxclip.clip_tree_by_global_norm([x], 1e-30)[1], want, 1e-5, "clip_tree_by_global_norm")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_leaves(dtype):
    fi = jnp.finfo(dtype)
    x = np.array([[1.0, 2.0, -3.0] * 40, [float(fi.max)] * 120, [float(fi.tiny)] * 120], np.float32)
    x = np.asarray(jnp.asarray(x, dtype))
    for p in (2.0, 1.0, 3.0, math.inf):
        n = _norms.slice_norms([jnp.asarray(x)], p, ((1,),))[0]
        rows = ref.f64(n.frac) * 2.0 ** ref.f64(n.exp)
        _check(rows[:, 0], ref.norm([x], p, (1,))[:, 0], 2e-6, f"{dtype} p={p}")
        n = _norms.global_norm_parts([jnp.asarray(x)], p)  # beyond float32 for bf16
        _check(ref.f64(n.frac) * 2.0 ** ref.f64(n.exp), ref.norm([x], p), 2e-6, f"{dtype} {p}")


def test_complex_leaves_beyond_float32():
    z = np.array([2.5e38 + 2.5e38j, 1 + 1j, 3e-30j], np.complex64)
    for p in (2.0, 3.0, 0.5, math.inf):
        want = ref.norm([z], p)
        got = _norms.global_norm_parts([jnp.asarray(z)], p)
        _check(ref.f64(got.frac) * 2.0 ** ref.f64(got.exp), want, 2e-6, f"complex p={p}")
    # Beside a real leaf whose largest value is above the complex one's largest part
    # (3.2e38 > 2.5e38) but below its modulus: the real leaf's half is its max halved.
    r = np.array([3.2e38, -1.0], np.float32)
    got = _norms.global_norm_parts([jnp.asarray(z), jnp.asarray(r)], math.inf)
    want = ref.norm([z, r], math.inf)
    _check(ref.f64(got.frac) * 2.0 ** ref.f64(got.exp), want, 2e-6, "complex and real p=inf")


def test_empty_leaves_in_the_rare_path():
    """Empty leaves and empty slices beside leaves whose sums leave the exact range: the
    maxima that shift the second read (p != 2) are 0 for them, of the reduced shape."""
    big = np.array([3e30, -2.0], np.float32)  # sums overflow for p >= 2, underflow never
    for p in (3.0, math.inf):  # the rare path's maxima, and the maxima themselves
        got = _norms.global_norm_parts([jnp.zeros((0, 3)), jnp.asarray(big)], p)
        _check(ref.f64(got.frac) * 2.0 ** ref.f64(got.exp), ref.norm([big], p), 2e-6, f"p={p}")
        # All-zero and empty slices: plain sums of 0 take the rare path.
        for shape, axes, kept in (((0, 4), (0,), (1, 4)), ((4, 0), (1,), (4, 1))):
            n = _norms.slice_norms([jnp.zeros(shape), jnp.asarray(big)], p, (axes, None))
            assert n[0].value.shape == kept, (p, shape)
            np.testing.assert_array_equal(n[0].value, np.zeros(kept))
            _check(float(n[1].value.reshape(())), ref.norm([big], p), 2e-6, f"beside p={p}")


def test_nonfinite_and_zero():
    for p in P_ALL:
        for bad, want in ((np.nan, np.nan), (np.inf, np.inf)):
            x = jnp.asarray([1.0, bad, 2.0], jnp.float32)
            got = float(_norms.global_norm([x], p))
            assert (math.isnan(got) and math.isnan(want)) or got == want, (p, bad)
            got = float(_norms.slice_norms([x], p, (None,))[0].value.reshape(()))
            assert (math.isnan(got) and math.isnan(want)) or got == want, (p, bad)
        assert float(_norms.global_norm([jnp.zeros(3)], p)) == 0.0  # the program above
        assert float(_norms.global_norm([], p)) == 0.0


# ----------------------------------------------------------------------------------------
# Clipping factors.


def test_clip_factor_is_c_over_n_rounded_once():
    x = np.array([1.0, -3.0, 1e-37, 7.0], np.float32)
    for n, c in ((5.0, 1.0), (3.0, 3.0), (np.nextafter(np.float32(3.0), 4), 3.0), (1e30, 1e-30)):
        out = clip.clip_joint([jnp.asarray(x)], jnp.float32(n), c)[0]
        if n <= c:
            np.testing.assert_array_equal(out, x)  # kept, bit for bit
        else:
            want = ref.f64(x) * (np.float64(np.float32(c)) / np.float64(np.float32(n)))
            np.testing.assert_allclose(ref.f64(out), want, rtol=1.2e-7, atol=1e-45)
    huge = arith.Norm(jnp.float32(0.75), jnp.float32(200.0))  # 0.75 * 2**200
    out = clip.clip_joint([jnp.asarray(x)], huge, 1e30)[0]
    want = ref.f64(x) * 1e30 / (0.75 * 2.0**200)
    np.testing.assert_allclose(
        ref.f64(out), np.where(np.abs(want) < 4 * F32.tiny, 0, want), rtol=2e-7, atol=1e-44
    )
    for n, c, want in (
        (np.inf, 1.0, 0.0),
        (np.nan, 1.0, np.nan),
        (5.0, 0.0, 0.0),
        (5.0, -1.0, 0.0),
    ):
        out = clip.clip_joint([jnp.asarray(x)], jnp.float32(n), c)[0]
        np.testing.assert_array_equal(out, ref.f64(x) * want if not np.isnan(want) else np.nan)
    f = clip.clip_factor(jnp.float32(4.0), 1.0)
    assert not bool(f.keep) and float(f.f0) * float(f.f1) == 0.25
    assert bool(clip.clip_factor(jnp.float32(1.0), 1.0).keep)
    assert bool(clip.clip_factor(jnp.float32(0.0), 0.0).keep)


# ----------------------------------------------------------------------------------------
# Floors: small slices need no exact norm for clipping.


def test_floored_factors_and_reported_norms():
    x = jnp.asarray(ROWS)
    exact = ref.norm([ROWS], 2.0, (1,))[:, 0]
    for c in (1.0, 1e-25, 1e-36):
        for report in ("exact", "largest"):
            out, norms = _norms.clip_slices([x], 2.0, ((1,),), c, report=report)
            want = ref.clip_each(ROWS, c, 2.0, (1,))
            # (outputs below float32's normal range are flushed to 0 on XLA:CPU)
            np.testing.assert_allclose(
                ref.f64(out[0]), want, rtol=3e-7, atol=F32.tiny, err_msg=f"{c}"
            )
            if report == "exact":
                _check(norms[0], exact, 2e-6, f"reported c={c}")
            else:
                assert float(jnp.max(norms[0])) == pytest.approx(exact.max(), rel=2e-6)
    # A leaf whose every slice is small: its largest norm is still exact.
    tiny = jnp.asarray(ROWS[2:4])
    _, norms = _norms.clip_slices([tiny], 2.0, ((1,),), 1.0, report="largest")
    assert float(jnp.max(norms[0])) == pytest.approx(
        ref.norm([ROWS[2:4]], 2.0, (1,)).max(), rel=2e-6
    )


# ----------------------------------------------------------------------------------------
# Derivatives and batching.


def test_derivatives_match_the_formula():
    for scale in (1.0, 1e-30, 1e30):
        x = np.array([3.0, -4.0, 0.0, 12.0], np.float32) * np.float32(scale)
        for p in (2.0, 3.0, 1.0, math.inf):
            g = jax.grad(lambda v, p=p, k=scale: _norms.global_norm([v], p) / k)(jnp.asarray(x))
            a = ref.f64(x)
            n = ref.norm([x], p)
            if p == math.inf:
                want = np.where(np.abs(a) == n, np.sign(a), 0.0)
            else:
                want = np.sign(a) * (np.abs(a) / n) ** (p - 1)
            np.testing.assert_allclose(
                ref.f64(g) * scale,
                want * scale / scale,
                rtol=2e-6,
                atol=1e-7,
                err_msg=f"{p} {scale}",
            )
    # d/dx of x * c / n at n > c: c/n (I - u u^T) for the 2-norm, u = x / n.
    x = np.array([3.0, 4.0], np.float32)
    jac = jax.jacobian(lambda v: clip.clip_joint([v], _norms.global_norm_parts([v], 2.0), 1.0)[0])(
        jnp.asarray(x)
    )
    u = ref.f64(x) / 5.0
    np.testing.assert_allclose(
        ref.f64(jac), (np.eye(2) - np.outer(u, u)) / 5.0, rtol=2e-6, atol=1e-7
    )

    def dc(c: float) -> float:
        return float(
            jax.grad(lambda c: clip.clip_joint([jnp.asarray(x)], jnp.float32(5.0), c)[0].sum())(c)
        )

    assert dc(1.0) == pytest.approx(7.0 / 5.0, rel=1e-6)  # sum(x) / n
    # A clip norm of 0 scales by c / n from the right (optax's formula there); below 0 it is
    # held at 0 ("updates of norm 0"), a constant in c.
    assert dc(0.0) == pytest.approx(7.0 / 5.0, rel=1e-6)
    assert dc(-1.0) == 0.0


def test_vmap_matches_each_example():
    x = jnp.asarray(ROWS)
    for p in (2.0, 3.0):
        got = jax.vmap(lambda r, p=p: _norms.global_norm([r], p))(x)
        _check(got, ref.norm([ROWS], p, (1,))[:, 0], 3e-6, f"vmap global p={p}")
        got = jax.vmap(lambda r, p=p: _norms.slice_norms([r], p, (None,))[0].value)(x)
        _check(got.reshape(-1), ref.norm([ROWS], p, (1,))[:, 0], 3e-6, f"vmap slices p={p}")
    # With a floor (the clip norm), batched too: the batching rule takes its smallest value.
    clip = jax.vmap(lambda r, c: _norms.clip_slices([r], 2.0, (None,), c)[1][0])
    got = clip(x, jnp.full(len(ROWS), 1e-3, jnp.float32))
    _check(got, ref.norm([ROWS], 2.0, (1,))[:, 0], 3e-6, "vmap clip_slices, batched floor")


# ----------------------------------------------------------------------------------------
# Backend measures whose wrong choice changes values: long sequential sums, lost NaN.


def test_long_fused_sums_stay_accurate():
    """XLA's fused reduce (float16 leaves) adds sequentially: one pass over 2**21 terms
    would be ~n/2 ulps off; in blocks the error is that of a short sum."""
    x = np.full(2**21, 0.1, np.float16)
    want = ref.norm([x], 2.0)
    _check(_norms.global_norm([jnp.asarray(x)], 2.0), want, 1e-5, "global, float16")
    n = _norms.slice_norms([jnp.asarray(x.reshape(2, -1))], 2.0, ((1,),))[0].value
    _check(n[:, 0], ref.norm([x.reshape(2, -1)], 2.0, (1,))[:, 0], 1e-5, "rows, float16")


def test_inf_norms_keep_nan_in_long_leaves():
    """XLA:CPU's library max of many elements can drop a NaN: maxima take the fused one."""
    x = np.linspace(-1.0, 1.0, 5000, dtype=np.float32)
    x[1234] = np.nan
    for fn in (
        lambda v: _norms.global_norm([v], math.inf),
        lambda v: _norms.slice_norms([v], math.inf, (None,))[0].value,
        lambda v: jaxclip.clip_tree_by_norm(v, 0.5, norm_type=math.inf)[1],
    ):
        assert np.isnan(np.asarray(fn(jnp.asarray(x)))).all()


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_fused_sums_over_axes_that_are_not_adjacent():
    """Slices over axes that are not adjacent (0, 2 and 3; 0 and 2) of a float16 leaf
    (the fused reduce, one run of adjacent axes at a time), and adjacent ones."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 3, 6, 8)).astype(np.float16)
    every = ((0, 2, 3), (0, 2), (1,), (0, 1))
    for p in (2.0, 3.0):  # one program per p: a leaf per choice of axes
        norms = _norms.slice_norms([jnp.asarray(x)] * len(every), p, every)
        for axes, n in zip(every, norms):
            _check(n.value, ref.norm([x], p, axes), 2e-6, f"axes {axes} p={p}")


def test_backend_choices_follow_their_rules():
    """The kernel choices are speed and memory measures (values agree either way), so
    their rules are checked as stated: the rare path's library reduce for 32-bit rows
    of at least LIBRARY_ROW_MIN trailing elements or a whole leaf; one row at a time for
    at most one example in ROWS_APART_OF, or up to row bytes / ROW_BYTES_ALONE of the
    batch, at most three quarters."""
    from jaxclip._norms import backend

    f32 = jnp.ones((8, 64), jnp.float32)
    assert not backend.rare_native(f32, False, 2.0, (1,))  # trailing rows of 64: library
    assert not backend.rare_native(f32, False, 2.0, None)  # whole: library
    assert backend.rare_native(f32, False, 2.0, (0,))  # leading axis: fused
    assert backend.rare_native(jnp.ones((8, 63)), False, 2.0, (1,))  # short rows: fused
    assert backend.rare_native(f32, True, 2.0, (1,))  # a bucket: fused
    assert backend.rare_native(f32, False, 3.0, (1,))  # not a 2-norm: fused
    assert backend.rare_native(f32.astype(jnp.bfloat16), False, 2.0, (1,))  # 16-bit: fused
    assert backend.native(f32, math.inf) and not backend.native(f32, 2.0)
    bf16 = f32.astype(jnp.bfloat16)
    assert not backend.native(bf16, 2.0) and not backend.native(bf16, 3.0)  # its convert fuses
    assert backend.native(bf16, 1.5) and backend.native(f32.astype(jnp.float16), 2.0)
    row = backend.ROW_BYTES_ALONE

    def limit(batch: int, row_bytes: int) -> int:
        return backend.rows_apart_limit([jnp.zeros((batch, row_bytes // 4))], batch)

    assert limit(4, 400) == 1
    assert limit(64, 400) == 64 // backend.ROWS_APART_OF == 8
    assert limit(64, row // 4) == 16
    assert limit(64, 4 * row) == 48
    assert backend.rows_apart([f32], [()], (8,)) and not backend.rows_apart([f32], [("x",)], (8,))
    assert not backend.rows_apart([f32], [()], (1,))


def test_agc_limits_below_the_floor_bound_are_exact():
    """AGC's floor (clipping * eps) is at most every limit: a gradient row of norm 3e-10
    against zero params (limit clipping * eps = 1e-10, below the floor bound) is clipped."""
    g = {"w": jnp.full((2, 9), 1e-10, jnp.float32)}
    p = {"w": jnp.zeros((2, 9), jnp.float32)}
    out = jaxclip.clip_tree_adaptive(g, p, clipping=1e-3, eps=1e-7, axes=1)
    np.testing.assert_allclose(ref.f64(out["w"]), 1e-10 / 3.0, rtol=2e-6)


def test_blue_single_pass_at_every_magnitude():
    """Blue's pass (GPU/TPU), forced here: its thresholds keep every square normal."""
    from jaxclip._norms import backend

    x = np.array([[1e-30, 2e-30], [1.0, 2.0], [5e9, 6e9], [1e30, 2e30], [3e38, 2e38]])
    x = x.astype(np.float32)
    backend.ONE_PASS = True
    jax.clear_caches()
    try:
        rows = _norms.slice_norms([jnp.asarray(x)], 2.0, ((1,),))[0]
        total = _norms.global_norm_parts([jnp.asarray(x[:4])], 2.0)
    finally:
        backend.ONE_PASS = None
        jax.clear_caches()
    got = ref.f64(rows.frac) * 2.0 ** ref.f64(rows.exp)
    _check(got[:, 0], ref.norm([x], 2.0, (1,))[:, 0], 2e-7, "rows")
    _check(ref.f64(total.frac) * 2.0 ** ref.f64(total.exp), ref.norm([x[:4]], 2.0), 2e-7, "all")


def test_max_keeping_nan_orders_nan_above_inf_in_every_width():
    """The largest of non-negative values, NaN if one is (of either sign bit: x86's
    default NaN is negative), at 5000 elements (XLA:CPU's library max), per row too."""
    kernel = jax.jit(_norms.max_keeping_nan, static_argnums=1)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        info = jnp.finfo(dtype)
        x = np.zeros((4, 5000), np.float32)
        x[0, 17] = float(info.max)
        x[1, 4000] = np.inf
        x[1, 10] = float(info.tiny)
        x[2, 2500] = 3.0
        x[3, :] = 1.5
        v = jnp.asarray(x, dtype)
        rows = np.asarray(kernel(v, (1,)), np.float32)[:, 0]
        np.testing.assert_array_equal(rows, [float(info.max), np.inf, 3.0, 1.5])
        assert float(kernel(v, None)) == np.inf
        for nan in (np.nan, -np.nan):
            y = v.at[2, 4999].set(nan)
            assert np.isnan(float(kernel(y, None)))
            rows = np.asarray(kernel(y, (1,)), np.float32)[:, 0]
            np.testing.assert_array_equal(np.isnan(rows), [False, False, True, False])
        assert float(kernel(jnp.zeros((0,), dtype), None)) == 0.0
    with jax.enable_x64(True):  # 64-bit norms (float64 leaves) as 64-bit integers
        y = np.full(5000, 1e300)
        y[3] = np.finfo(np.float64).max
        assert float(kernel(jnp.asarray(y), None)) == np.finfo(np.float64).max
        y[4000] = -np.nan
        assert np.isnan(float(kernel(jnp.asarray(y), None)))
