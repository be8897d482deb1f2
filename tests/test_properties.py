"""Hypothesis properties against float64 NumPy, over dtypes, magnitudes, shapes, norm types.

Shapes come from a fixed set and every jitted function is built once per
(mode, p), so examples reuse compiled executables instead of compiling each time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import given
from hypothesis import strategies as st

import jaxclip

SHAPES = [(5,), (3, 4), (2, 1, 3)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
PS = [2.0, 1.0, 3.0, 0.5, math.inf]
F32_ULPS = 8 * 2.0**-24  # the norm's own error: a few float32 ulps
RANGE = {jnp.float32: 30, jnp.bfloat16: 30, jnp.float16: 3}  # decimal exponents each can hold


@functools.cache
def _global(p: float):
    return jax.jit(lambda g, c: jaxclip.clip_tree_by_global_norm(g, c, norm_type=p))


@functools.cache
def _each(p: float):
    return jax.jit(lambda g, c: jaxclip.clip_tree_by_norm(g, c, norm_type=p, axes=-1))


@st.composite
def trees(draw):
    dtype = draw(st.sampled_from(DTYPES))
    exp = draw(st.integers(-RANGE[dtype], RANGE[dtype]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    leaves = [
        jnp.asarray(rng.normal(size=s) * 10.0**exp, dtype)
        for s in draw(st.permutations(SHAPES))[:2]
    ]
    p = draw(st.sampled_from(PS))
    ratio = draw(st.sampled_from([0.01, 0.5, 0.999, 2.0]))  # threshold / norm
    return leaves, p, ratio, dtype


def _threshold(leaves, p, ratio) -> float:
    n = ref.norm(leaves, p)
    return max(n * ratio, 1e-37)


@pytest.mark.slow  # suite budget: the differential harness covers it in the default step
@given(trees())
def test_global_norm_matches_float64(case):
    leaves, p, ratio, dtype = case
    c = _threshold(leaves, p, ratio)
    out, n = _global(p)(leaves, c)
    np.testing.assert_allclose(n, ref.norm(leaves, p), rtol=4e-6)
    expected, _ = ref.clip_global(leaves, c, p)
    eps = float(jnp.finfo(dtype).eps)
    for o, e in zip(out, expected):
        assert o.dtype == dtype
        # One rounding into the leaf dtype (subnormal f16 results have absolute error).
        np.testing.assert_allclose(
            ref.f64(o), e, rtol=eps + F32_ULPS, atol=float(jnp.finfo(dtype).smallest_subnormal)
        )
    # Clipped: the norm is at most the threshold, up to rounding.
    assert ref.norm(out, p) <= c * (1 + 4 * eps * (len(out) + 1))
    if ref.norm(leaves, p) <= c:  # below the threshold: bit-identical
        for o, x in zip(out, leaves):
            assert np.asarray(o).tobytes() == np.asarray(x).tobytes()


@pytest.mark.slow  # suite budget: the differential harness covers it in the default step
@given(trees())
def test_clip_by_norm_rows_match_float64_and_keep_direction(case):
    leaves, p, ratio, dtype = case
    x = leaves[0]
    c = _threshold([x], p, ratio)
    (out,), (norms,) = _each(p)([x], c)
    expected_norms = ref.norm([x], p, axes=(x.ndim - 1,))
    np.testing.assert_allclose(ref.f64(norms), np.squeeze(expected_norms, -1), rtol=4e-6)
    eps = float(jnp.finfo(dtype).eps)
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    np.testing.assert_allclose(
        ref.f64(out), ref.clip_each(x, c, p, axes=(x.ndim - 1,)), rtol=eps + F32_ULPS, atol=tiny
    )
    # Direction kept: out = s * x with 0 < s <= 1 per row (compare signs and ratios).
    xo, xi = ref.f64(out), ref.f64(x)
    assert np.all(np.sign(xo) * np.sign(xi) >= 0)
    assert np.all(np.abs(xo) <= np.abs(xi))


@pytest.mark.slow  # 6 s: the default step's budget
@given(trees())
def test_clipping_twice_equals_once(case):
    leaves, p, ratio, dtype = case
    c = _threshold(leaves, p, ratio)
    once, _ = _global(p)(leaves, c)
    twice, _ = _global(p)(once, c)
    eps = float(jnp.finfo(dtype).eps)
    for a, b in zip(once, twice):
        # The second clip rescales by at most the norm's own error (a few f32 ulps).
        np.testing.assert_allclose(
            ref.f64(b),
            ref.f64(a),
            rtol=4 * eps + F32_ULPS,
            atol=float(jnp.finfo(dtype).smallest_subnormal),
        )


@pytest.mark.slow  # suite margin (test_clipping checks pass-through by default)
@given(
    st.lists(st.booleans(), min_size=3, max_size=3), st.sampled_from(["value", "norm", "global"])
)
def test_unselected_leaves_are_the_same_objects(mask, mode):
    grads = {"a": jnp.array([3.0, -4.0]), "b": jnp.array([[5.0, 12.0]]), "c": jnp.array(7.0)}
    need_clip = dict(zip("abc", mask))
    fn = {
        "value": lambda: jaxclip.clip_tree_by_value(grads, 1.0, need_clip=need_clip),
        "norm": lambda: jaxclip.clip_tree_by_norm(grads, 1.0, need_clip=need_clip)[0],
        "global": lambda: jaxclip.clip_tree_by_global_norm(grads, 1.0, need_clip=need_clip)[0],
    }[mode]
    out = fn()
    for k, selected in need_clip.items():
        assert (out[k] is grads[k]) == (not selected)
    if mode == "global":
        chosen = [grads[k] for k in "abc" if need_clip[k]]
        n = jaxclip.global_norm(grads, need_clip=need_clip)
        np.testing.assert_allclose(n, ref.norm(chosen, 2.0), rtol=2e-6)
