"""Numerics: low precision, overflow, underflow, non-finite values, derivatives, memory."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from _helpers import ON_XLA_CPU, xla_cpu_only

import jaxclip

P_ALL = [1.0, 2.0, 3.0, 0.5, math.inf]

# The regression table of the numerics issue: optax 0.2.8 returns zeros or unclipped values.
TABLE = [
    ("bf16-3e19", jnp.bfloat16, 3e19, 4, 1.0),
    ("f16-100", jnp.float16, 100.0, 9, 1.0),
    ("f32-1e20", jnp.float32, 1e20, 4, 1.0),
    ("f32-1e-25", jnp.float32, 1e-25, 4, 1e-26),
]


@functools.cache
def _jitted(mode: str, p: float, c: float):
    fns = {
        "global": lambda g: jaxclip.clip_tree_by_global_norm(g, c, norm_type=p),
        "norm": lambda g: jaxclip.clip_tree_by_norm(g, c, norm_type=p),
        "norm_axes": lambda g: jaxclip.clip_tree_by_norm(g, c, norm_type=p, axes=-1),
    }
    return jax.jit(fns[mode])


P_QUICK = [2.0, 0.5, math.inf]  # the default, a fractional p, the max; P_ALL runs slow


@pytest.mark.parametrize(
    "jit, ps",
    [
        pytest.param(True, P_QUICK, id="jit"),
        pytest.param(False, [2.0], id="eager"),  # the default norm only (compiles dominate)
        pytest.param(True, P_ALL, id="jit-every-p", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "mode", ["global", "norm", pytest.param("norm_axes", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("name, dtype, value, n, c", TABLE, ids=[t[0] for t in TABLE])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_regression_table(name, dtype, value, n, c, mode, jit, ps):
    g = jnp.full((n,), value, dtype)
    for p in ps:
        f = _jitted(mode, p, c) if jit else _jitted(mode, p, c).__wrapped__
        out, norm = f(g)
        expected_norm = ref.norm([g], p)
        np.testing.assert_allclose(ref.f64(norm).max(), expected_norm, rtol=4e-6)
        expected = ref.f64(jnp.asarray(ref.f64(g) * ref.scale(expected_norm, c), dtype))
        np.testing.assert_allclose(ref.f64(out), expected, rtol=float(jnp.finfo(dtype).eps))
        assert out.dtype == dtype
    if mode == "global":
        np.testing.assert_allclose(jaxclip.global_norm(g), ref.norm([g], 2.0), rtol=4e-6)
    # The exact values the issue names, for p = 2.
    out, _ = _jitted(mode, 2.0, c)(g)
    want = {"bf16-3e19": 0.5, "f16-100": 1 / 3, "f32-1e20": 0.5, "f32-1e-25": 5e-27}[name]
    np.testing.assert_allclose(ref.f64(out), want, rtol=float(jnp.finfo(dtype).eps))


@pytest.mark.parametrize("name, dtype, value, n, c", TABLE, ids=[t[0] for t in TABLE])
def test_naive_norm_fails_on_table(name, dtype, value, n, c):
    """The rows are real regressions: the naive sqrt(sum(x*x)) in the leaf dtype is wrong."""
    g = jnp.full((n,), value, dtype)
    naive = float(jnp.sqrt(jnp.sum(g * g)))
    assert not np.isclose(naive, ref.norm([g], 2.0), rtol=1e-3, atol=0.0)


@pytest.mark.parametrize("mode", ["global", "norm"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_grad_at_zero_is_identity(mode):
    w = jnp.arange(1.0, 5.0)

    def loss(g):
        out, _ = _jitted(mode, 2.0, 1.0).__wrapped__(g)
        return jnp.sum(out * w)

    grad = jax.grad(loss)(jnp.zeros(4))
    np.testing.assert_array_equal(grad, w)
    tangent = jnp.array([1.0, -2.0, 0.5, 3.0])
    _, jvp = jax.jvp(
        lambda g: _jitted(mode, 2.0, 1.0).__wrapped__(g)[0], (jnp.zeros(4),), (tangent,)
    )
    np.testing.assert_array_equal(jvp, tangent)


@pytest.mark.parametrize(
    "mode, p",  # one case in the default run (suite budget), every case in the slow step
    [
        (m, p) if (m, p) == ("global", 2.0) else pytest.param(m, p, marks=pytest.mark.slow)
        for p in (2.0, 1.0, 3.0, 0.5)
        for m in ("global", "norm")
    ],
)
def test_derivatives_match_finite_differences(mode, p):
    with jax.enable_x64(True):
        g0 = jnp.array([0.3, -1.2, 2.0, 0.7], jnp.float64)  # norm well above the threshold
        f = jax.jit(lambda g: _jitted(mode, p, 1.0).__wrapped__(g)[0])
        w = jnp.array([1.0, 2.0, -1.0, 0.5], jnp.float64)
        grad = jax.jit(jax.grad(lambda g: jnp.sum(f(g) * w)))(g0)
        assert np.all(np.isfinite(grad))
        h = 1e-6
        for i in range(4):
            e = jnp.zeros(4, jnp.float64).at[i].set(h)
            fd = (jnp.sum(f(g0 + e) * w) - jnp.sum(f(g0 - e) * w)) / (2 * h)
            np.testing.assert_allclose(grad[i], fd, rtol=1e-6, atol=1e-9)
        t = jnp.array([0.1, 0.2, -0.3, 0.4], jnp.float64)
        _, jvp = jax.jvp(f, (g0,), (t,))
        fd = (f(g0 + h * t) - f(g0 - h * t)) / (2 * h)
        np.testing.assert_allclose(jvp, fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "value, n",
    [
        (3e37, 100),
        pytest.param(1e37, 300, marks=pytest.mark.slow),
        pytest.param(2.0**-70, 64, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_norm_gradient_at_norms_beyond_2_pow_126(value, n):
    """d||x||/dx = x / ||x|| where the norm is a normal number above 2**126 (XLA:CPU divides
    by a broadcast scalar through its reciprocal, which is 0 there) or tiny."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(value * rng.uniform(0.5, 1.0, n), jnp.float32)
    x2 = x.reshape(4, -1)
    want = ref.f64(x) / np.sqrt(np.sum(ref.f64(x) ** 2))
    rows = ref.f64(x2) / np.sqrt(np.sum(ref.f64(x2) ** 2, axis=1, keepdims=True))
    row_norms = lambda g: jnp.sum(jaxclip.clip_tree_by_norm(g, math.inf, axes=1)[1])  # noqa: E731
    for grad in (jax.grad(jaxclip.global_norm), jax.jit(jax.grad(jaxclip.global_norm))):
        np.testing.assert_allclose(ref.f64(grad(x)), want, rtol=2e-6)
    np.testing.assert_allclose(ref.f64(jax.jit(jax.grad(row_norms))(x2)), rows, rtol=2e-6)


@pytest.mark.parametrize(
    "ps, modes",
    [
        pytest.param((2.0,), ("global",), id="quick"),
        pytest.param((3.0,), ("norm",), id="more", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_second_derivatives_match_the_formulas(ps, modes):
    """Hessians through the norm and the clipping (the norm is not a constant in its own
    derivative): H||x||_p = (p-1)/n (diag r^(p-2) - r^(p-1) r^(p-1)^T), r = |x|/n, and for
    f = c w.x / n: c (3 (w.x) x x^T / n^5 - (w x^T + x w^T + (w.x) I) / n^3)."""
    x, w = np.array([3.0, 4.0]), np.array([1.0, -2.0])
    for p in ps:
        n = np.sum(np.abs(x) ** p) ** (1 / p)
        r = np.abs(x) / n
        want = (p - 1) / n * (np.diag(r ** (p - 2)) - np.outer(r ** (p - 1), r ** (p - 1)))
        got = jax.hessian(lambda g, p=p: jaxclip.global_norm(g, norm_type=p))(jnp.asarray(x))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    c, n, wx = 1.0, 5.0, w @ x
    want = c * (3 * wx * np.outer(x, x) / n**5 - (np.outer(w, x) + np.outer(x, w)) / n**3)
    want -= c * wx * np.eye(2) / n**3
    for mode in modes:
        loss = lambda g, m=mode: jnp.sum(_jitted(m, 2.0, c).__wrapped__(g)[0] * w)  # noqa: E731
        np.testing.assert_allclose(jax.hessian(loss)(jnp.asarray(x)), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
    "modes",
    [
        pytest.param(("global",), id="quick"),
        pytest.param(("norm", "rows", "example"), id="more", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_derivatives_where_the_float32_norm_overflows(modes):
    """Four values of 3e38 (norm 6e38): the Jacobian of the clipped update is
    (c/n)(I - x x^T/n^2) in forward and reverse mode, and d||x||/dx = x/n, although the
    chain rule through the factor would form sum(x) (inf) and dn/n (subnormal)."""
    x = jnp.full((4,), 3e38, jnp.float32)
    x64, c = ref.f64(x), 1e30
    n = np.sqrt(np.sum(x64**2))
    want = (c / n) * (np.eye(4) - np.outer(x64, x64) / n**2)
    fns = {
        "global": lambda g: jaxclip.clip_tree_by_global_norm(g, c)[0],
        "norm": lambda g: jaxclip.clip_tree_by_norm(g, c)[0],
        "rows": lambda g: jaxclip.clip_tree_by_norm(g[None], c, axes=1)[0][0],
        "example": lambda g: jaxclip.clip_tree_per_example(g[None], c, reduce=None)[0][0],
    }
    for name in modes:
        f = fns[name]
        for jac in (jax.jacrev, jax.jacfwd):
            np.testing.assert_allclose(ref.f64(jac(f)(x)), want, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(ref.f64(jax.grad(jaxclip.global_norm)(x)), x64 / n, rtol=1e-6)
    _, tangent = jax.jvp(jaxclip.global_norm, (x,), (jnp.ones(4),))
    np.testing.assert_allclose(float(tangent), np.sum(x64) / n, rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: jaxclip.clip_by_global_norm(jnp.inf), id="global"),
        # no history yet: the threshold is inf
        pytest.param(lambda: jaxclip.quantile_clip(global_threshold=True), id="quantile"),
        pytest.param(lambda: jaxclip.clip_by_norm(jnp.inf), id="norm", marks=pytest.mark.slow),
        pytest.param(jaxclip.standard_clip, id="standard", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_gradient_through_an_infinite_threshold_is_the_identity(make):
    """An infinite clip norm keeps every update: the gradient is exactly 1 (f0 = inf,
    f1 = 0 never meet in the transpose)."""
    g, tx = jnp.array([1.0, 2.0, 2.0]), make()
    grad = jax.grad(lambda u: jnp.sum(tx.update(u, tx.init(u))[0]))(g)
    np.testing.assert_array_equal(grad, np.ones(3))


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_inf_norm_keeps_nan_in_large_leaves(dtype):
    """XLA:CPU's library max of 4096 or more values loses a NaN (-inf, or a wrong max);
    p = inf must still return NaN, and the right maximum without one."""
    inf = math.inf
    x = jnp.asarray(np.arange(5000.0), dtype)
    bad = x.at[-1].set(jnp.nan)
    rows = jnp.ones((3, 5000), dtype).at[1, -1].set(jnp.nan)
    assert float(jaxclip.global_norm(x, norm_type=inf)) == float(x[-1])
    assert np.isnan(jaxclip.global_norm(bad, norm_type=inf))
    row_norms = jaxclip.clip_tree_by_norm(rows, 1.0, axes=1, norm_type=inf)[1]
    np.testing.assert_array_equal(np.isnan(row_norms), [False, True, False])
    example_norms = jaxclip.clip_tree_per_example(rows, 1.0, norm_type=inf)[1]
    np.testing.assert_array_equal(np.isnan(example_norms), [False, True, False])
    tx = jaxclip.clip_by_norm(1.0, axes=0)  # the state's largest of 5000 column norms
    assert np.isnan(tx.update({"w": rows}, tx.init({"w": rows}))[1].norms["w"])


@pytest.mark.parametrize(
    "sizes, ps",
    [
        pytest.param((64,), (127.0, 0.05), id="quick"),
        pytest.param((2, 5000), (100.0, 1000.0, 1e6, 1e30, 0.2), id="more", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_extreme_norm_types(sizes, ps):
    """p far above 64 (where the largest scaled term, in [0.5, 1)^p, would underflow) and
    p far below 1 (f**(1/p) would): ||x||_p = m (sum (|x|/m)^p)^(1/p) in float64, inf
    where it exceeds float32; the update is clipped by it."""
    rng = np.random.default_rng(7)
    f = jax.jit(
        lambda g, p: (
            jaxclip.global_norm(g, p),
            jaxclip.clip_tree_by_norm(g[None], 1.0, axes=1, norm_type=p)[1][0],
            jaxclip.clip_tree_per_example(g[None], 1.0, norm_type=p)[1][0],
        ),
        static_argnums=1,
    )
    for x in (1e-20 * rng.normal(size=n) if n > 2 else np.array([3.0, 4.0]) for n in sizes):
        g = jnp.asarray(x, jnp.float32)
        a = np.abs(ref.f64(g))
        m = a.max()
        for p in ps:
            want = m * np.sum((a / m) ** p) ** (1 / p) if p > 1 else np.sum(a**p) ** (1 / p)
            want = np.float64(np.float32(want)) if want < 3e38 else np.inf
            rtol = 4e-6 if p > 1 else 2e-5  # a sum's rounding, magnified by 1/p
            for got in f(g, p):
                np.testing.assert_allclose(ref.f64(got), want, rtol=rtol, err_msg=f"p={p}")
    out, norm = jaxclip.clip_tree_by_global_norm(jnp.array([3.0, 4.0]), 1.0, norm_type=127.0)
    # 4 (1 + 0.75**127)**(1/127) rounds to 4.0; XLA:GPU's exp2 and log2 may be an ulp off.
    np.testing.assert_allclose(float(norm), 4.0, rtol=0 if jax.default_backend() == "cpu" else 3e-7)
    np.testing.assert_allclose(out, [0.75, 1.0], rtol=1e-6)
    assert float(jaxclip.global_norm(jnp.array([3.0, 4.0]), 0.001)) == math.inf  # 3.7e301


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_derivatives_through_bfloat16_buckets():
    """Small bfloat16 leaves are concatenated as 16-bit words; the derivative still flows:
    d||x||/dx = x/n, and the per-leaf clip's Jacobian is (c/n)(I - x x^T/n^2)."""
    x = jnp.asarray([3.0, 4.0, 0.0, 12.0], jnp.bfloat16)
    grad = jax.grad(lambda v: jaxclip.global_norm([v[:2], v[2:]]).astype(jnp.float32))(x)
    np.testing.assert_allclose(ref.f64(grad), [3 / 13, 4 / 13, 0, 12 / 13], rtol=2**-8)
    v, v64 = x[:2], np.array([3.0, 4.0])
    clip = lambda g: jaxclip.clip_tree_by_norm([g], 1.0)[0][0].astype(jnp.float32)  # noqa: E731
    want = 0.2 * (np.eye(2) - np.outer(v64, v64) / 25)
    np.testing.assert_allclose(ref.f64(jax.jacrev(clip)(v)), want, rtol=2**-7, atol=1e-3)


def test_nonfinite_propagates_as_in_pytorch():
    g = [jnp.array([1.0, jnp.inf]), jnp.array([2.0])]
    out, n = jaxclip.clip_tree_by_global_norm(g, 1.0)
    assert float(n) == math.inf
    np.testing.assert_array_equal(out[1], [0.0])  # scale 0, as torch: 1 / (inf + 1e-6)
    assert np.isnan(out[0][1])
    out, n = jaxclip.clip_tree_by_global_norm([jnp.array([1.0, jnp.nan])], 1.0)
    assert np.isnan(n) and np.all(np.isnan(out[0]))
    out, norms = jaxclip.clip_tree_by_norm(
        {"a": jnp.array([jnp.nan, 1.0]), "b": jnp.array([3.0, 4.0])}, 1.0
    )
    assert np.all(np.isnan(out["a"])) and np.isnan(norms["a"])
    np.testing.assert_allclose(out["b"], [0.6, 0.8], rtol=1e-6)


def test_error_if_nonfinite_eager_and_jit():
    bad = {"enc": {"w": jnp.array([1.0, jnp.nan])}, "b": jnp.array([1.0])}
    with pytest.raises(FloatingPointError, match="global norm is non-finite"):
        jaxclip.clip_tree_by_global_norm(bad, 1.0, error_if_nonfinite=True)
    tx = jaxclip.clip_by_global_norm(1.0, error_if_nonfinite=True)
    with pytest.raises(Exception, match="global norm is non-finite"):
        jax.block_until_ready(jax.jit(tx.update)(bad, tx.init(bad)))
    tx = jaxclip.clip_by_norm(1.0, error_if_nonfinite=True)
    with pytest.raises(Exception, match="norm of the leaf at 'enc/w' is non-finite"):
        jax.block_until_ready(jax.jit(tx.update)(bad, tx.init(bad)))
    good = {"enc": {"w": jnp.array([3.0, 4.0])}, "b": jnp.array([1.0])}
    out, _ = jax.jit(tx.update)(good, tx.init(good))
    np.testing.assert_allclose(out["enc"]["w"], [0.6, 0.8], rtol=1e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_complex_leaves_use_modulus():
    z = jnp.array([3 + 4j, 0 + 0j, 1e20 + 1e20j], jnp.complex64)
    for p in P_ALL:
        n = jaxclip.global_norm([z], p)
        np.testing.assert_allclose(n, ref.norm([z], p), rtol=4e-6)
    out, _ = jaxclip.clip_tree_by_global_norm([z], 1.0)
    np.testing.assert_allclose(ref.f64(out[0]), ref.f64(z) / ref.norm([z], 2.0), rtol=2e-6)
    assert out[0].dtype == jnp.complex64


@xla_cpu_only
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("mode", ["global", "norm", "norm_axes", "global_inf", "global_p3"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_no_upcast_copy_in_temporaries(mode, dtype):
    g = {"a": jnp.ones((512, 512), dtype), "b": jnp.ones((256, 512), dtype)}
    f = {
        "global": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0),
        "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0),
        "norm_axes": lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=1),
        "global_inf": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=math.inf),
        "global_p3": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=3.0),
    }[mode]
    temp = jax.jit(f).lower(g).compile().memory_analysis().temp_size_in_bytes
    nbytes = sum(x.nbytes for x in jax.tree.leaves(g))
    # A widened copy of either leaf would be >= 33% of the gradient bytes. Per-slice norms
    # are O(slices): a few float32 vectors (norm, exponent, factor) per slice are allowed.
    slices = 768 if mode == "norm_axes" else 0
    assert temp <= 0.02 * nbytes + 32 * slices, (temp, nbytes)


@pytest.mark.parametrize("p", [3.0, 4.0, 5.0])
def test_integer_p_norms_stay_within_a_few_ulps_at_any_magnitude(p):
    # pow(s, 1/p) with an inexact 1/p loses ~ln(s) * 2^-25 (15 ulps near 1e38) without the
    # exact power-of-two split in _norms.root.
    rng = np.random.default_rng(7)
    norm = jax.jit(lambda x: jaxclip.global_norm([x], p))
    worst = 0.0
    for e in [-12, 0, 6, 12, 20, 25]:
        for _ in range(5):
            x = jnp.asarray(rng.normal(size=50) * 10.0**e, jnp.float32)
            worst = max(worst, abs(float(norm(x)) / ref.norm([x], p) - 1))
    assert worst <= 4 * 2.0**-24, worst / 2.0**-24


# Magnitude classes of the rare 2-norm path's three accumulators (float32: squared as
# they are within [2**-63, 2**48], scaled down above, up below), mixed inside one leaf.
BLUE_MIXES = {
    "big+medium": [(2.0**49, 3), (2.0**47, 70_000)],  # the medium sum dominates
    "big-only-near-max": [(3.0e38, 5)],
    "medium-tiny+small": [(2.0**-63, 1), (2.0**-64, 70_000)],  # the small sum dominates
    "small-only": [(1e-30, 1000), (1e-35, 1000)],
    "all-three": [(1e30, 2), (1.0, 50_000), (1e-25, 10)],
    "small-subnormal-squares": [(2.0**-75, 300), (2.0**-70, 1)],
}


@functools.cache
def _blue_fns():
    return jax.jit(
        lambda xs: (
            jaxclip.global_norm(xs),
            jaxclip.clip_tree_by_norm(xs, 1.0)[1],
            jaxclip.clip_tree_by_norm([x.reshape(2, -1) for x in xs], 1.0, axes=1)[1],
        )
    )


@pytest.mark.parametrize(
    "mix",  # two mixes in the default run (suite budget), every mix in the slow step
    [
        m if m in ("all-three", "small-only") else pytest.param(m, marks=pytest.mark.slow)
        for m in BLUE_MIXES
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_three_accumulator_rare_path_is_exact(mix):
    rng = np.random.default_rng(1)
    parts = [m * rng.uniform(0.5, 1.0, n) * rng.choice([-1.0, 1.0], n) for m, n in BLUE_MIXES[mix]]
    flat = np.concatenate(parts).astype(np.float32)
    flat = np.concatenate([flat, np.zeros(len(flat) % 2, np.float32)])
    rng.shuffle(flat)
    leaves = [flat, flat[::-1].copy()]  # one global norm over two leaves, two per-leaf norms
    g, per_leaf, rows = _blue_fns()([jnp.asarray(x) for x in leaves])
    want = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in leaves))
    _assert_value(g, want)
    for x, n, r in zip(leaves, per_leaf, rows):
        x64 = x.astype(np.float64)
        _assert_value(n, np.linalg.norm(x64))
        _assert_value(r, np.linalg.norm(x64.reshape(2, -1), axis=1))


def _assert_value(got, want) -> None:
    """A norm's value within 4 float32 ulps of float64 (a float32 sum's rounding), inf
    where it exceeds float32's range."""
    want = np.asarray(want, np.float64)
    expected = np.where(want > np.finfo(np.float32).max, np.inf, want)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=4.8e-7)


def test_whole_large_float16_leaves_are_summed_in_rows_exactly():
    """A whole float16 leaf is summed a few rows at a time (backend._looped_sum, rows of
    a divisor of its size: 1024, and 64 for 1000x1000; under 1 MiB chunks of whole rows,
    backend._looped_rows, their sums added in blocks); a size with no divisor of 64 or
    more, or too few rows, keeps the fused reduce. NaN and inf carry."""
    rng = np.random.default_rng(1)
    f = jax.jit(lambda t: jaxclip.global_norm(t))
    shapes = [(1024, 1024), (1000, 1000), (3, 3, 300, 517), (128, 512), (600, 64), (8, 512)]
    for shape in shapes:
        x = rng.lognormal(0.0, 2.0, shape).astype(np.float16)
        want = np.sqrt(np.sum(np.square(x.astype(np.float64))))
        np.testing.assert_allclose(float(f(x)), want, rtol=1e-5)
        loops = "while(" in f.lower(x).compile().as_text()
        # The loop is XLA:CPU's measure; other backends reduce at once (test_gpu_lowering).
        assert loops == (ON_XLA_CPU and shape not in [(3, 3, 300, 517), (8, 512)]), shape
    x = np.ones((1024, 1024), np.float16)
    x[700, 5] = np.inf
    assert float(f(x)) == np.inf
    x[1000, 1000] = np.nan
    assert np.isnan(float(f(x)))


@pytest.mark.parametrize(
    ("shape", "axes"), [((262144, 4), 0), ((2148, 1024), 0), ((3, 3, 300, 512), (0, 1, 2))]
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_sums_over_leading_axes_of_large_float16_leaves_are_accurate(shape, axes):
    # Leaves of 1 MiB and more are summed over leading axes a few rows at a time
    # (backend._looped_sum): blocks of 256 rows, and a tail.
    x = jnp.asarray(np.random.default_rng(0).lognormal(0.0, 2.0, shape), jnp.float16)
    got = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=axes)[1])(x)
    want = np.sqrt(np.sum(np.square(np.asarray(x, np.float64)), axis=axes))
    np.testing.assert_allclose(ref.f64(got), want, rtol=1e-5)


_NARROW_CASES = [
    (jnp.float16, 2.0),
    (jnp.float16, 1.0),
    (jnp.float16, 4.0),
    (jnp.float8_e4m3fn, 2.0),
    (jnp.float8_e5m2, 3.0),
]


@functools.cache
def _narrow_norms(p: float):
    """Global, per-row and per-example norms of one tree, one program per p."""

    def norms(t):
        g = jaxclip.global_norm(t, norm_type=p)
        rows = jaxclip.clip_tree_by_norm(t, 1.0, axes=-1, norm_type=p)[1]
        per_example = jaxclip.clip_tree_per_example(t, 1.0, norm_type=p)[1]
        return g, rows, per_example

    return jax.jit(norms)


def _extremes(dtype) -> np.ndarray:
    """Rows of a dtype's extremes: its smallest magnitude, its largest value, zeros,
    and magnitudes spread over its whole range, both signs."""
    info = jnp.finfo(dtype)
    # bfloat16 subnormals are float32 subnormals, which XLA:CPU flushes (they count 0).
    tiny = float(info.tiny if dtype == jnp.bfloat16 else info.smallest_subnormal)
    big = float(info.max)
    rng = np.random.default_rng(0)
    spread = np.exp2(rng.uniform(np.log2(tiny), np.log2(big), (5, 300)))
    rows = [np.full(300, tiny), np.full(300, big), np.zeros(300), np.full(300, -tiny)]
    x = np.concatenate([np.stack(rows), spread * rng.choice([-1, 1], spread.shape)])
    return np.asarray(jnp.asarray(x, dtype))  # rounded to the dtype


@pytest.mark.parametrize(("dtype", "p"), _NARROW_CASES, ids=str)
def test_narrow_dtypes_are_exact_with_no_rare_path(dtype, p):
    """float16 and float8 terms |x|**p (moderate p) are normal float32 numbers whose sums
    cannot overflow, whatever the data: their norms take no conditional (no rare
    branch to compile) and are exact at the dtype's extremes, subnormals included."""
    x = _extremes(dtype)
    fn = _narrow_norms(p)
    assert "conditional(" not in fn.lower({"w": x}).compile().as_text()
    g, rows, per_example = fn({"w": x})
    x64 = np.abs(x.astype(np.float64))
    want_rows = np.sum(x64**p, axis=-1) ** (1 / p)
    np.testing.assert_allclose(ref.f64(rows["w"]), want_rows, rtol=2e-6)
    np.testing.assert_allclose(ref.f64(per_example), want_rows, rtol=2e-6)
    np.testing.assert_allclose(float(g), np.sum(x64**p) ** (1 / p), rtol=2e-6)


@pytest.mark.parametrize(("dtype", "p"), [(jnp.bfloat16, 2.0), (jnp.float16, 6.0)], ids=str)
def test_wider_terms_keep_the_rare_path(dtype, p):
    """bfloat16 squares (float32's exponent range, doubled) and float16's sixth powers
    (2**-144 for its smallest subnormal) leave float32's range: the rare path stays, and
    gives the exact norm of rows whose plain sums underflow or overflow."""
    x = _extremes(dtype)
    fn = _narrow_norms(p)
    assert "conditional(" in fn.lower({"w": x}).compile().as_text()
    _, rows, per_example = fn({"w": x})
    x64 = np.abs(x.astype(np.float64))
    m = np.max(x64, axis=-1, keepdims=True)
    want_rows = m[:, 0] * np.sum((x64 / np.where(m > 0, m, 1)) ** p, axis=-1) ** (1 / p)
    want_rows = np.where(want_rows > np.finfo(np.float32).max, np.inf, want_rows)
    np.testing.assert_allclose(ref.f64(rows["w"]), want_rows, rtol=2e-6)
    np.testing.assert_allclose(ref.f64(per_example), want_rows, rtol=2e-6)


@pytest.mark.parametrize(
    ("shape", "axes", "chunk"),
    [
        ((3, 3, 96, 100), -1, 128),  # 6 chunks of 128 rows of 100, and a tail of 96
        ((256, 100), 1, 128),  # exactly two chunks
        ((40, 65536), 1, 1),  # the longest rows it takes, one a chunk
        ((257, 3, 7, 64), (2, 3), 32),
        ((3, 65537), 1, None),  # rows too long: the fused reduce
        ((8, 8, 8), 2, None),  # too few rows for two chunks
    ],
)
def test_float16_row_sums_over_trailing_axes_are_accurate(shape, axes, chunk):
    """Sums over trailing axes of float16 leaves read chunks of whole rows (about 16384
    elements) in a loop (backend._looped_rows): exact against float64, from subnormal
    to largest magnitudes, NaN and inf carried to their rows only."""
    rng = np.random.default_rng(5)
    x = np.exp2(rng.uniform(-24, 15.9, shape)) * rng.choice([-1, 1], shape)
    x = x.astype(np.float16)
    flat = x.reshape(-1, x.shape[-1])
    flat[1, 3], flat[-1, 0] = np.nan, np.inf
    f = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=axes)[1])
    text = f.lower(x).compile().as_text()
    length = math.prod(shape[d] for d in np.atleast_1d(axes))
    slices = set(re.findall(r"= (f16\[[\d,]+\])\S* dynamic-slice", text))
    chunked = chunk is not None and ON_XLA_CPU  # XLA:CPU's measure (test_gpu_lowering)
    assert slices == ({f"f16[{chunk},{length}]"} if chunked else set()), slices
    want = np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=axes))
    np.testing.assert_allclose(ref.f64(f(x)), want, rtol=2e-6)


@pytest.mark.parametrize(
    ("shape", "axes", "chunk"),
    [
        ((512, 128), 0, "f16[128,128]"),
        ((2048, 2048), 0, "f16[16,2048]"),  # 1/64 of the leaf a chunk, above 16384
        ((3, 65536), 0, None),  # fewer than 32 rows: one fused block
        ((128, 128), 0, "f16[64,128]"),  # a small leaf of 32 rows or more: two chunks
        ((33, 256), 0, "f16[16,256]"),
        ((32, 256), 0, None),  # up to 32 rows: the rows' sum (backend.SHORT_LEADING)
        ((4, 64, 32), 1, "f16[4,32,32]"),  # middle axes
    ],
)
def test_float16_sums_over_leading_axes_of_small_leaves_loop(shape, axes, chunk):
    """A float16 leaf is summed over its leading axis a chunk of rows at a time
    (backend._looped_sum): about 16384 elements, or 1/64 of a larger leaf; exact against
    float64, NaN and inf carried to their columns only."""
    x = np.random.default_rng(4).lognormal(0.0, 2.0, shape).astype(np.float16)
    x[1, 3], x[2, 5] = np.nan, np.inf
    f = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=axes)[1])
    text = f.lower(x).compile().as_text()
    slices = set(re.findall(r"= (f16\[[\d,]+\])\S* dynamic-slice", text))
    chunked = chunk is not None and ON_XLA_CPU  # XLA:CPU's measure (test_gpu_lowering)
    assert slices == ({chunk} if chunked else set()), slices
    want = np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=axes))
    np.testing.assert_allclose(ref.f64(f(x)), want, rtol=2e-6)


def test_float16_long_rows_keep_terms_below_half_an_ulp():
    """A row's terms are summed in blocks (backend._row_sums): in one reduction XLA adds a
    row in a few sequential lanes, and 32767 terms of 2**-24 next to a 1 were lost from
    one lane (a 3-norm 4e-5 low). Rows, per-example rows, and a whole leaf."""
    x = np.full((4, 32768), 2.0**-8, np.float16)
    x[:, 0] = 1.0
    want = np.sum(np.abs(x.astype(np.float64)) ** 3, axis=-1) ** (1 / 3)

    def norms(t):
        rows = jaxclip.clip_tree_by_norm(t, 1e4, axes=-1, norm_type=3.0)[1]
        return rows, jaxclip.clip_tree_per_example(t, 1e4, norm_type=3.0)[1]

    for got in jax.jit(norms)(x):
        np.testing.assert_allclose(ref.f64(got), want, rtol=1e-6)


def test_float16_size_zero_leaves_with_axes():
    """A float16 leaf whose reduced trailing axis is empty (rows of no elements) has norms
    0 of its kept shape; one whose kept axes are empty has no norms."""
    f = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1))
    for shape in [(7, 0), (2, 3, 0), (0, 7)]:
        x = jnp.zeros(shape, jnp.float16)
        out, norms = f(x)
        assert out.shape == shape and out.dtype == jnp.float16
        np.testing.assert_array_equal(norms, np.zeros(shape[:-1], np.float32))


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((64, 0), 0), ((300, 0), 0), ((4, 4, 4, 0), (0, 1, 2)), ((0, 64, 3), 1), ((2, 64, 0), 1)],
)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn])
def test_empty_low_precision_leaves_over_32_rows_or_more(shape, axes, dtype):
    """A leaf with an empty kept (or leading) dimension: empty norms and an empty clipped
    leaf, not a division by its zero row size (the loop over chunks of rows)."""
    g = {"w": jnp.zeros(shape, dtype)}
    clipped, norms = jaxclip.clip_tree_by_norm(g, 1.0, axes=axes)
    a = (axes,) if isinstance(axes, int) else axes
    assert clipped["w"].shape == shape
    assert norms["w"].shape == tuple(d for i, d in enumerate(shape) if i not in a)
    tx = jaxclip.clip_by_norm(1.0, axes=axes)
    _, state = jax.jit(tx.update)(g, tx.init(g))
    assert float(state.norms["w"]) == 0.0


@functools.cache
def _clip_rows(p: float):
    return jax.jit(lambda x, c: jaxclip.clip_tree_by_norm(x, c, axes=1, norm_type=p)[0])


@functools.cache
def _clip_global(p: float):
    return jax.jit(lambda x, c: jaxclip.clip_tree_by_global_norm(x, c, norm_type=p)[0])


@pytest.mark.parametrize(
    "p, rows, c",
    [
        (2.0, [[60000.0]], 1e-7),  # one element: 1e-7 -> 2 steps of 5.96e-8 (1.19e-7)
        (2.0, [[60000.0]], 5e-8),  # below the smallest subnormal: 0, not 5.96e-8
        (2.0, [[60000.0]], 1e-6),
        (2.0, [[3e-7] * 8], 1e-7),  # subnormal inputs: each 3.5e-8, not 5.96e-8
        (1.0, [[6e4, 1e-7] * 1024], 1e-3),
        (0.5, [[6e4, 1e-7] * 150], 1e-3),
        (math.inf, [[6e4, 3e4]], 1e-6),
    ],
)
def test_float16_outputs_in_the_subnormal_range_keep_the_stated_bound(p, rows, c):
    """The docs' bound literally: the norm of a clipped float16 slice is at most
    ``c * (1 + k eps)`` also where its outputs are subnormal in float16 (rounded to
    nearest, a subnormal output gains up to half a step of 6e-8: 19% over ``c`` for one
    element clipped to 1e-7); each output stays within one subnormal step of x c / n."""
    x = jnp.asarray(rows, jnp.float16)
    k = 2.0 if p in (1.0, 2.0, math.inf) else 1 + 2 / min(p, 1.0)
    eps, step = float(jnp.finfo(jnp.float16).eps), 2.0**-24
    a = ref.f64(x)
    n = np.max(a, axis=1) if p == math.inf else np.sum(a**p, axis=1) ** (1 / p)
    c32 = float(np.float32(c))
    for fn, norms in ((_clip_rows(p), n), (_clip_global(p), None)):
        out = ref.f64(fn(x, jnp.float32(c)))
        got = np.max(out, axis=1) if p == math.inf else np.sum(out**p, axis=1) ** (1 / p)
        if norms is None:  # the global norm: one slice
            got = np.max(out) if p == math.inf else np.sum(out**p) ** (1 / p)
            norms = np.max(a) if p == math.inf else np.sum(a**p) ** (1 / p)
        assert np.all(got <= c32 * (1 + k * eps)), (got, c32)
        want = a * np.minimum(1.0, c32 / np.reshape(norms, (-1, 1)))
        assert np.all(np.abs(out - want) <= np.maximum(step, want * eps)), (out, want)


@pytest.mark.parametrize(
    "shape, axes, p",
    [((3, 3, 16, 8), (0, 1, 2), 1.0), ((5, 5, 16, 8), (0, 1, 2), 1.0), ((3000,), None, 3.0)],
)
def test_float32_bound_counts_the_norms_own_error(shape, axes, p):
    # Constant data that XLA:CPU sums sequentially: the float32 norm is off by up to
    # 33 eps32 (within the stated 1e-5), and the factor c / n is exact for the computed
    # n, so the output's norm is within k eps of c times exact / computed, as stated,
    # and not within k eps of c alone.
    x = jnp.full(shape, 0.7, jnp.float32)
    out, norms = jax.jit(lambda x: jaxclip.clip_tree_by_norm(x, 1.0, axes=axes, norm_type=p))(x)
    rows = int(np.size(norms))
    exact = (np.prod(shape) / rows * float(np.float32(0.7)) ** p) ** (1 / p)
    norms = np.reshape(ref.f64(norms), -1)
    np.testing.assert_allclose(norms, exact, rtol=1e-5)
    slices = np.abs(
        np.moveaxis(
            ref.f64(out), axes or tuple(range(len(shape))), range(len(axes or shape))
        ).reshape(-1, rows)
    )
    got = np.sum(slices**p, axis=0) ** (1 / p)
    k = 2 if p in (1.0, 2.0) else 3
    eps = float(jnp.finfo(jnp.float32).eps)
    assert np.all(got <= (1 + k * eps) * exact / norms), (got - 1) / eps


# A finite threshold beyond float32's range, with float32 gradients whose norm (3e39) is
# over it: as a float32 it would read as inf and clipping would be silently off. Either
# the exact result (each 3e38 * 1e39 / 3e39 = 1e38, float64 formula) or a ValueError that
# names the parameter; never the unclipped update.
_BEYOND_F32 = {
    "clip_tree_by_global_norm": lambda g, c: jaxclip.clip_tree_by_global_norm(g, c)[0],
    "clip_tree_by_norm": lambda g, c: jaxclip.clip_tree_by_norm(g, c)[0],
    "clip_tree_per_example": lambda g, c: [
        jaxclip.clip_tree_per_example([g[0][None]], c, reduce="sum")[0][0]
    ],
    "clip_by_global_norm": lambda g, c: jaxclip.clip_by_global_norm(c).update(g, None)[0],
}


@pytest.mark.parametrize("name", list(_BEYOND_F32))
def test_finite_threshold_beyond_float32_range_is_not_silently_inf(name):
    g = [jnp.full(100, 3e38, jnp.float32)]
    c = 1e39
    try:
        out = _BEYOND_F32[name](g, c)
    except ValueError as e:
        assert "clip_norm=1e+39" in str(e) and "float32" in str(e), str(e)
        return
    want = 3e38 * c / (3e38 * math.sqrt(100))
    np.testing.assert_allclose(ref.f64(out[0]), np.full(100, want), rtol=1e-6)


def test_skip_threshold_beyond_float32_range_is_not_silently_inf():
    # A step of norm 3e39 over threshold=1e39 must be skipped (or the threshold refused).
    g = [jnp.full(100, 3e38, jnp.float32)]
    tx = jaxclip.skip_large_updates(optax.identity(), threshold=1e39)
    try:
        out, state = tx.update(g, tx.init(g))
    except ValueError as e:
        assert "threshold=1e+39" in str(e) and "float32" in str(e), str(e)
        return
    assert int(state.skipped) == 1
    np.testing.assert_array_equal(ref.f64(out[0]), np.zeros(100))


def test_use_norm_beyond_float32_range_does_not_zero_the_tree():
    # use_norm=3e39 (a float64 norm of these float32 leaves) must scale each 3e38 to
    # 3e38 * 1 / 3e39 = 0.1 (float64 formula), or be refused; as a float32 it is inf and
    # would zero the tree.
    g = [jnp.full(100, 3e38, jnp.float32)]
    try:
        out, _ = jaxclip.clip_tree_by_global_norm(g, 1.0, use_norm=3e39)
    except ValueError as e:
        assert "use_norm=3e+39" in str(e) and "float32" in str(e), str(e)
        return
    np.testing.assert_allclose(ref.f64(out[0]), np.full(100, 0.1), rtol=1e-6)


def test_adaptive_initial_clip_norm_beyond_float32_range_is_not_silently_inf():
    # The adaptive clip norm is a float32 state: 1e39 would be inf there, which its
    # geometric updates (multiplications) never bring back, so nothing would ever be
    # clipped. One example of norm 3e39 must be clipped to 1e39 (each 3e38 -> 1e38, float64
    # formula), or the value refused.
    g = jnp.full((1, 100), 3e38, jnp.float32)
    try:
        tx = jaxclip.adaptive_clip_per_example(1e39, reduce="sum")
    except ValueError as e:
        assert "initial_clip_norm=1e+39" in str(e) and "float32" in str(e), str(e)
        return
    out, _ = tx.update(g, tx.init(g[0]))
    np.testing.assert_allclose(ref.f64(out), np.full(100, 1e38), rtol=1e-6)
