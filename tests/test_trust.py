"""Regressions of the trust issue, one per point, each failing on the code it was filed on.

The broad float64 comparison lives in ``test_differential.py``; these are the exact cases
the issue names, so that each point has a test that reads like its report.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from _helpers import xla_cpu_only

import jaxclip


def test_huge_finite_values_are_clipped_not_passed_or_zeroed():
    out, norm = jaxclip.clip_tree_by_global_norm({"w": jnp.full(4, 1e38)}, 1.0)
    np.testing.assert_allclose(norm, 2e38, rtol=1e-6)
    np.testing.assert_allclose(out["w"], 0.5, rtol=2e-7)
    out, _ = jaxclip.clip_tree_by_global_norm({"w": jnp.full(4, 5e37)}, 1.0)
    np.testing.assert_allclose(out["w"], 0.5, rtol=2e-7)
    out, norm = jaxclip.clip_tree_by_global_norm({"w": jnp.full(4, 1e38)}, 1.0, norm_type=math.inf)
    np.testing.assert_allclose(out["w"], 1.0, rtol=2e-7)
    # The norm of four 3e38 exceeds float32: reported inf, yet the clip is exact.
    out, norm = jaxclip.clip_tree_by_global_norm({"w": jnp.full(4, 3e38)}, 1.0)
    assert norm == np.inf
    np.testing.assert_allclose(out["w"], 0.5, rtol=2e-7)
    tx = jaxclip.skip_large_updates(optax.sgd(1.0), 1.0)
    upd, state = tx.update(jnp.full(4, 1e38), tx.init(jnp.zeros(4)))
    assert int(state.skipped) == 1 and not np.any(upd)


@pytest.mark.slow  # suite budget: test_differential's 3e7-element cases run by default
def test_large_low_precision_sums_are_accurate():
    np.testing.assert_allclose(
        jaxclip.global_norm([jnp.ones(30_000_000, jnp.float16)]), math.sqrt(3e7), rtol=1e-5
    )
    leaves = [jnp.ones(30_000, jnp.bfloat16) for _ in range(1000)]
    np.testing.assert_allclose(jaxclip.global_norm(leaves), math.sqrt(3e7), rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, value, axes",
    [
        (jnp.float16, 0.7, (1,)),  # float16 reads through XLA's sequential fused reduce
        (jnp.float32, 1e25, (1,)),  # squares overflow: the rare path's fused reduce
        (jnp.float32, 1e25, (0, 2)),  # axes not adjacent
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_slices_over_middle_axes_are_accurate(dtype, value, axes):
    """Slices over a middle axis were one sequential sum: 9e-3 off at 3e5 elements."""
    shape = (2, 300_000, 2) if axes == (1,) else (300, 2, 1000)
    x = jnp.full(shape, value, dtype)
    v = float(np.asarray(value, np.float64).astype(dtype))
    n = jaxclip.clip_tree_by_norm(x, 1.0, axes=axes)[1]
    want = math.sqrt(math.prod(shape[a] for a in axes)) * v
    np.testing.assert_allclose(ref.f64(n), np.full(n.shape, want), rtol=1e-5)


def test_complex_modulus_beyond_float32_clips_exactly():
    """|3e38 + 3e38j| overflows float32; the real and imaginary parts do not (the output
    was 0: the norm's terms took the overflowed modulus)."""
    z = jnp.array([3e38 + 3e38j, 1.0 + 0j], jnp.complex64)
    for out in (jaxclip.clip_tree_by_global_norm(z, 1.0)[0], jaxclip.clip_tree_by_norm(z, 1.0)[0]):
        np.testing.assert_allclose(np.asarray(out)[0], (1 + 1j) / math.sqrt(2), rtol=1e-6)


def test_float8_e8m0fnu_leaves_are_not_zero_padded():
    """This dtype has no zero: the padding of a bucket row was NaN."""
    x = jnp.ones((65,), jnp.float8_e8m0fnu)
    np.testing.assert_allclose(float(jaxclip.clip_tree_by_norm(x, 100.0)[1]), math.sqrt(65))


@pytest.mark.parametrize(
    "p", [0.5, *(pytest.param(p, marks=pytest.mark.slow) for p in (1.5, 7.5, 9.0))]
)
def test_nan_propagates_for_every_norm_type(p):
    g = {"w": jnp.array([1.0, jnp.nan, 1.0])}
    assert np.isnan(jaxclip.global_norm(g, p))
    with pytest.raises(FloatingPointError, match="non-finite"):
        jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=p, error_if_nonfinite=True)
    tx = jaxclip.skip_large_updates(optax.sgd(1.0), 10.0, norm_type=p)
    _, state = tx.update(g, tx.init(g))
    assert int(state.skipped) == 1


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_derivatives_through_the_scaled_path():
    x = jnp.array([1.0, 2.0, 3.0, 4.0])
    for s in (1e25, 1e-22):
        np.testing.assert_allclose(
            jax.grad(jaxclip.global_norm)(x * s), x / math.sqrt(30), rtol=1e-6
        )
    w = jnp.array([1.0, -2.0, 0.5, 3.0])
    grad = jax.grad(lambda g: jnp.sum(jaxclip.clip_tree_by_global_norm(g, 1.0)[0] * w))(x * 1e-25)
    np.testing.assert_array_equal(grad, w)  # nothing is clipped: the identity's derivative


def test_mixed_float32_float64_trees():
    with jax.enable_x64(True):
        tree = [jnp.array([1e-25, 1e-25], jnp.float32), jnp.array([1e-30], jnp.float64)]
        np.testing.assert_allclose(jaxclip.global_norm(tree), ref.norm(tree, 2.0), rtol=1e-6)
        tree = [jnp.zeros(3, jnp.float32), jnp.array([1e-300], jnp.float64)]
        np.testing.assert_allclose(jaxclip.global_norm(tree), 1e-300, rtol=1e-12)
        out, _ = jaxclip.clip_tree_by_global_norm(tree, 1e-301)
        np.testing.assert_allclose(out[1], 1e-301, rtol=1e-12)
        assert not np.any(np.isnan(out[0]))


@pytest.mark.parametrize("fn", ["global", "norm", "value"])
def test_below_the_threshold_is_bit_for_bit_subnormals_included(fn):
    x = jnp.array([1e-40, -1e-45, 0.5, 0.0], jnp.float32)  # two float32 subnormals
    f = {
        "global": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[0],
        "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0)[0],
        "value": lambda g: jaxclip.clip_tree_by_value(g, 1.0),
    }[fn]
    for out in (f(x), jax.jit(f)(x)):
        np.testing.assert_array_equal(
            np.asarray(out).view(np.uint32), np.asarray(x).view(np.uint32)
        )


def test_traced_threshold_at_or_below_zero_never_flips_a_sign():
    sched = jax.jit(lambda g, c: jaxclip.clip_tree_by_global_norm(g, c)[0])
    g = jnp.array([3.0, -4.0])
    for c in (0.0, -1.0):
        np.testing.assert_array_equal(sched(g, c), jnp.zeros(2))  # "updates of norm 0"
    # A schedule that decays through zero: 1.0 at step 0, -1.0 from step 1 on.
    tx = optax.inject_hyperparams(jaxclip.clip_by_norm)(
        clip_norm=optax.linear_schedule(1.0, -1.0, 1)
    )
    update = jax.jit(tx.update)
    out, state = update(g, tx.init(g))
    np.testing.assert_allclose(out, g / 5, rtol=1e-6)
    out, _ = update(g, state)
    np.testing.assert_array_equal(out, jnp.zeros(2))


def test_sums_over_leading_axes_are_accurate():
    # AGC's units of an (in, out) kernel and tf.clip_by_norm(axes=0) reduce over axis 0;
    # XLA's fused reduce adds sequentially (1.4e-4 off here before chunking).
    f = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=0)[1])
    for dtype, value in [(jnp.float16, 0.1), (jnp.float32, 1e20)]:
        x = jnp.full((32768, 4), value, dtype)
        want = math.sqrt(32768) * float(np.asarray(x[0, 0], np.float64))
        np.testing.assert_allclose(ref.f64(f(x)), want, rtol=1e-5)


def test_fractional_norm_type_on_a_large_float16_leaf():
    x = jnp.full((1 << 25,), 0.1, jnp.float16)
    want = ((1 << 25) * math.sqrt(float(np.asarray(x[0], np.float64)))) ** 2
    np.testing.assert_allclose(jax.jit(lambda t: jaxclip.global_norm([t], 0.5))(x), want, rtol=1e-5)


@xla_cpu_only  # XLA:GPU makes a float32 copy here (benchmarks/last_run.md)
@pytest.mark.parametrize("p", [1.5, 0.5])
def test_no_widened_copy_of_bfloat16_for_fractional_norm_types(p):
    """Whole, and over the leading axis (the row loop XLA:CPU widened bfloat16 in)."""
    g = [jnp.ones((1024, 1024), jnp.bfloat16)]
    for f in (
        jax.jit(lambda t: jaxclip.clip_tree_by_global_norm(t, 1.0, norm_type=p)),
        jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=0, norm_type=p)),
    ):
        temp = f.lower(g).compile().memory_analysis().temp_size_in_bytes
        # An f32 copy would be 200%; the leading axis's loop keeps a few column vectors
        # (2.0% with jax 0.11.2's XLA, 1.6% with 0.10.2's).
        assert temp <= 0.03 * g[0].nbytes, temp


_VALUE_CLIP = jax.jit(lambda x, lo, hi: jaxclip.clip_tree_by_value(x, hi, lo))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_value_bounds_hold_for_subnormals(dtype, jit):
    """XLA:CPU's float compares treat subnormals as 0: min=0 let -1e-40 through, and
    min = max = 1e-40 let 0 and 2e-40 through."""
    fi = jnp.finfo(dtype)
    sub = float(fi.smallest_subnormal)
    tiny, big = float(fi.tiny), float(fi.max)
    small = [-3 * sub, -sub, -0.0, 0.0, sub, 2 * sub, 3 * sub, tiny, -tiny]
    xs = np.array([*small, 1.0, -1.0, big, -big, np.inf, -np.inf, np.nan]).astype(dtype)
    # Bounds of normal magnitude take float compares, the others integer keys.
    bounds = [(0.0, 1.0), (sub, sub), (2 * sub, 1.0), (-sub, sub), (-1.0, -sub), (-0.0, 0.0)]
    bounds += [(-1.0, 1.0), (tiny, 1.0), (-1.0, -tiny), (-np.inf, tiny)]
    for lo, hi in bounds:
        lo_d, hi_d = np.asarray(lo).astype(dtype), np.asarray(hi).astype(dtype)
        fn = _VALUE_CLIP if jit else (lambda x, a, b: jaxclip.clip_tree_by_value(x, b, a))
        out = np.asarray(fn(jnp.asarray(xs), lo_d, hi_d)).astype(np.float64)
        x64, lo64, hi64 = (np.asarray(v).astype(np.float64) for v in (xs, lo_d, hi_d))
        want = np.where(x64 < lo64, lo64, np.where(x64 > hi64, hi64, x64))  # NaN stays
        np.testing.assert_array_equal(out, want, err_msg=f"bounds {lo, hi}")
        inside = (x64 >= lo64) & (x64 <= hi64)  # returned bit for bit, -0.0 included
        np.testing.assert_array_equal(np.signbit(out[inside]), np.signbit(x64[inside]))


def test_value_clipping_by_keys_passes_the_derivative_of_what_it_keeps():
    """The integer-key path (large bfloat16 leaves; bounds of zero or subnormal magnitude)
    selects its result as bits; its derivative is the float select's: 1 where x is kept
    (the bounds included), 0 elsewhere, and the bound's where x takes it. Taken through
    the bits, it was 0 everywhere."""
    x16 = np.linspace(-3, 3, 300 * 300).reshape(300, 300)
    x32 = np.linspace(-3, 3, 11)  # 0 and 1 among them: kept
    cases = [(x16, jnp.bfloat16, -1.0, 1.0), (x32, jnp.float32, 0.0, 1.0)]
    for x, dtype, lo, hi in cases:
        xd = jnp.asarray(x, dtype)
        x64 = np.asarray(xd, np.float64)
        loss = lambda v, h: jnp.sum(jaxclip.clip_tree_by_value(v, h, lo).astype(jnp.float32))  # noqa: E731,B023
        for grad in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
            dx, dhi = grad(xd, jnp.asarray(hi, dtype))
            want = ((x64 >= lo) & (x64 <= hi)).astype(np.float64)
            np.testing.assert_array_equal(np.asarray(dx, np.float64), want)
            if dtype == jnp.float32:  # a bfloat16 bound's cotangent is summed in bfloat16
                assert float(dhi) == float(np.sum(x64 > hi))


@pytest.mark.parametrize("shape", [(4096, 16), (1820, 4, 3, 3)])
def test_float16_value_clipping_keeps_every_value_inside_bit_for_bit(shape):
    """Every float16 bit pattern (NaN of both signs, subnormals, both zeros) against normal
    bounds, scalar and per-element: inside values (and NaN) come back bit for bit, the
    others are the bound they crossed."""
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    x = np.resize(every, math.prod(shape)).reshape(shape)
    x64 = x.astype(np.float64)
    per_element = np.where(np.arange(math.prod(shape)) % 2, 1e-4, 2.0).reshape(shape)
    for lo, hi in [(-1.0, 1.0), (-65504.0, 6e-5), (-2.0, per_element), (0.5, np.inf)]:
        lo_d, hi_d = np.asarray(lo).astype(np.float16), np.asarray(hi).astype(np.float16)
        out = np.asarray(_VALUE_CLIP(jnp.asarray(x), lo_d, hi_d))
        lo64, hi64 = lo_d.astype(np.float64), hi_d.astype(np.float64)
        inside = ((x64 >= lo64) & (x64 <= hi64)) | np.isnan(x64)
        np.testing.assert_array_equal(out.view(np.uint16)[inside], x.view(np.uint16)[inside])
        want = np.where(x64 < lo64, lo64, hi64)
        np.testing.assert_array_equal(out.astype(np.float64)[~inside], want[~inside])


def test_value_clipping_derivative_is_one_on_the_bounds_in_every_dtype():
    """As torch.clamp's: 1 inside the bounds and on them, 0 outside (float16 takes
    lax.clamp alone, whose own derivative is 0 on the bounds)."""
    v = np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], np.float32)
    want = np.array([0, 1, 1, 1, 1, 0], np.float32)
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        for hi in (1.0, np.ones(6, np.float32)):  # concrete bounds: each dtype's own kernel

            def loss(t, hi=hi):
                return jnp.sum(jaxclip.clip_tree_by_value(t, hi) * 1.0)

            g = jax.grad(loss)(jnp.asarray(v, dtype))
            np.testing.assert_array_equal(np.asarray(g, np.float32), want, err_msg=str(dtype))


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_typed_prng_key_leaves_pass_through():
    """A typed key leaf crashed every mode (``Cannot interpret 'key<fry>' as a data type``)."""
    key = jax.random.key(0)
    tree = {"w": jnp.full(3, 3.0), "k": key}
    out, norm = jaxclip.clip_tree_by_global_norm(tree, 1.0)
    np.testing.assert_allclose(norm, math.sqrt(27.0), rtol=1e-6)
    assert out["k"] is key
    assert jaxclip.clip_tree_by_value(tree, 1.0)["k"] is key
    assert jaxclip.clip_tree_by_norm(tree, 1.0)[1]["k"] is None
    keys = jax.random.split(key, 4)
    out, norms = jaxclip.clip_tree_per_example({"w": jnp.ones((4, 3)), "k": keys}, 1.0)
    np.testing.assert_allclose(out["w"], 4 / math.sqrt(3.0), rtol=1e-6)
    assert out["k"] is keys and norms.shape == (4,)
    with pytest.raises(TypeError, match="'k' has dtype key<fry>"):
        jaxclip.global_norm(tree, need_clip={"w": True, "k": True})


@pytest.mark.parametrize(
    "p",
    [
        2.0,
        pytest.param(1.0, marks=pytest.mark.slow),
        pytest.param(math.inf, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_size_zero_leaves_with_axes(p):
    """A size-0 leaf whose kept dimensions hold the 0 crashed per-slice p != inf norms
    (``cannot reshape array of shape (1, 0) into shape ()``)."""
    for shape, axes in [((7, 0), 0), ((0, 7), 1), ((2, 0, 3), 1)]:
        tree = {"empty": jnp.zeros(shape), "w": jnp.full((3, 4), 2.0)}
        out, norms = jaxclip.clip_tree_by_norm(tree, 1.0, axes=axes, norm_type=p)
        assert out["empty"].shape == shape
        assert norms["empty"].shape == tuple(d for i, d in enumerate(shape) if i != axes)
        w = np.full((3, 4), 2.0)
        np.testing.assert_allclose(out["w"], w / ref.norm([w], p, (axes,)), rtol=1e-6)
    params = {"empty": jnp.zeros((7, 0)), "w": jnp.ones((3, 4))}
    out = jaxclip.clip_tree_adaptive(params, params, 0.05)
    assert out["empty"].shape == (7, 0)
    np.testing.assert_allclose(out["w"], 0.05, rtol=1e-6)


def test_traced_value_bounds_that_cross_give_max():
    """min > max (traced, so unchecked) gives max everywhere, as ``lax.clamp``,
    ``jnp.clip`` and ``torch.clamp`` do; the integer-key path gave min below it."""
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):  # 16-bit: integer keys always
        x = jnp.array([-3.0, 0.5, 3.0], dtype)
        two, one = np.asarray(2.0, dtype), np.asarray(1.0, dtype)
        np.testing.assert_array_equal(_VALUE_CLIP(x, two, one), np.ones(3, dtype))
        f = jax.jit(lambda t, m: jaxclip.clip_tree_by_value(t, m))
        np.testing.assert_array_equal(f(x, -1.0), -np.ones(3, dtype))
        if dtype == jnp.float32:
            continue
        # Constant bounds on a 16-bit leaf large enough to clamp integer keys: NaN of
        # either sign bit kept, inside values bit for bit.
        y = np.full(1 << 16, 0.5, np.float32)
        y[:6] = [np.nan, -np.nan, -0.0, 0.25, -7.0, np.inf]
        out = np.asarray(jaxclip.clip_tree_by_value(jnp.asarray(y, dtype), 1.0))[:6]
        out = out.astype(np.float64)
        assert np.isnan(out[:2]).all() and np.signbit(out[2]), out
        np.testing.assert_array_equal(out[2:], [-0.0, 0.25, -1.0, 1.0])


@pytest.mark.parametrize(
    "p",
    [
        pytest.param(0.5, marks=pytest.mark.slow),
        pytest.param(1.0, marks=pytest.mark.slow),
        3.0,
        pytest.param(100.0, marks=pytest.mark.slow),
        pytest.param(math.inf, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_complex_modulus_beyond_float32_for_every_norm_type(p):
    """Finite parts, ``|z|`` above float32's largest value: every p but 2 scaled by 0
    (``|z|`` overflowed in the maxima)."""
    z = np.array([2.5e38 + 2.5e38j, 1 + 1j], np.complex64)
    mags = np.abs(z.astype(np.complex128))
    top = mags.max()
    n64 = top if p == math.inf else top * float(np.sum((mags / top) ** p) ** (1 / p))
    want = z.astype(np.complex128) / n64  # the second element is subnormal: flushed on CPU
    (out,), norm = jaxclip.clip_tree_by_global_norm([jnp.asarray(z)], 1.0, norm_type=p)
    assert norm == np.inf  # beyond float32, as a number
    np.testing.assert_allclose(np.asarray(out)[0], want[0], rtol=1e-6)
    out, _ = jaxclip.clip_tree_by_norm(jnp.stack([z, z]), 1.0, axes=1, norm_type=p)
    np.testing.assert_allclose(np.asarray(out)[:, 0], want[0], rtol=1e-6)
    (out,), _ = jaxclip.clip_tree_per_example([jnp.stack([z, z])], 1.0, norm_type=p)
    np.testing.assert_allclose(np.asarray(out)[0], 2 * want[0], rtol=1e-6)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_per_example_norms_beyond_clip_norm_times_2_126_are_not_zeroed(reduce):
    """With a reduction, a factor ``c / n`` below float32's normal range was formed as a
    number and flushed to 0 by XLA:CPU: examples of norm above ~1e38 vanished from the sum
    (optax's per_example_global_norm_clip drops them too)."""
    x = np.array([[2.5e38, 2.5e38], [1e38, 1.0], [0.3, 0.4]], np.float32)
    n = np.linalg.norm(x.astype(np.float64), axis=1)
    want = np.sum(x / np.maximum(n, 1.0)[:, None], axis=0) / (3 if reduce == "mean" else 1)
    (out,), _ = jaxclip.clip_tree_per_example([jnp.asarray(x)], 1.0, reduce=reduce)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    tx = jaxclip.clip_per_example(1.0, reduce=reduce)
    (out,), _ = jax.jit(tx.update)([jnp.asarray(x)], tx.init([jnp.zeros(2)]))
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_per_example_lift_leaves_room_for_large_clip_norms():
    """p < 1 lets a norm pass 2**128 with clip_norm = 2**40: a fixed 2**90 lift of every
    weight overflowed the kept examples' terms to inf."""
    x = np.zeros((2, 1 << 20), np.float32)
    x[0, 0], x[1, :] = 2.0**39, 2.0**127
    (out,), _ = jaxclip.clip_tree_per_example([jnp.asarray(x)], 2.0**40, norm_type=0.5)
    # Example 1: 2**20 elements of 2**127, n = (2**20 * 2**63.5)**2 = 2**167: c / n = 2**-127.
    np.testing.assert_allclose(np.asarray(out)[:2], [2.0**39 + 1.0, 1.0], rtol=1e-6)


def test_per_example_sums_keep_examples_clipped_by_factors_far_below_normal():
    """A factor c / n down to 2**-220 (n near float32's largest, c 1e-28 to 1e-36) was
    lifted by at most 2**90 in the contraction: still subnormal, the example was dropped
    from the sum (its row, reduce=None, was right)."""
    for big, c in ((1e38, 1e-28), (3e38, 1e-30), (1e30, 1e-36)):
        x = np.array([[big, big], [c / 10, 0.0]], np.float32)
        x64 = x.astype(np.float64)
        n = np.linalg.norm(x64, axis=1, keepdims=True)
        want = np.sum(x64 * np.minimum(1.0, np.float64(np.float32(c)) / n), axis=0)
        (out,), _ = jaxclip.clip_tree_per_example([jnp.asarray(x)], c)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-6, err_msg=str(c))


@pytest.mark.parametrize(
    "p",
    [
        pytest.param(0.5, marks=pytest.mark.slow),
        pytest.param(1.0, marks=pytest.mark.slow),
        2.0,
        pytest.param(3.0, marks=pytest.mark.slow),
        math.inf,
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_derivative_through_a_complex_modulus_beyond_float32_is_finite(p):
    """|z| overflowed in the derivative rule: NaN gradients for p > 1 (p=2 included)."""
    z = jnp.asarray([3e38 + 3e38j], jnp.complex64)
    for fn in (
        lambda z: jaxclip.clip_tree_by_norm([z], 1.0, norm_type=p)[0][0],
        lambda z: jaxclip.clip_tree_by_global_norm([z, jnp.ones(2)], 1.0, norm_type=p)[0][0],
    ):
        g = jax.grad(lambda z, fn=fn: jnp.real(fn(z)).sum())(z)
        assert np.all(np.isfinite(np.asarray(g)))  # the exact one, ~c / |z|, underflows


@pytest.mark.parametrize(
    ("n", "x", "c", "p"),
    [
        (4, 3e38, 1.5e-38, 2.0),  # the norm beyond float32, c near its smallest normal
        (10_000, 3e38, 2e-38, 2.0),
        pytest.param(100_000, 1e38, 1.0, 0.1, marks=pytest.mark.slow),  # p=0.1: a norm of 1e88
        (4, 3e38, 1e-30, 2.0),  # c / n ~ 2**-228: two normal factors still reach it
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_factors_beyond_two_normal_factors_never_leave_outputs_above_c(n, x, c, p):
    """c / n below ~2**-251 was clamped there: outputs stayed 8x (p=2, c=1.5e-38) to 1e12x
    (p=0.1) above c. Outputs are x * c / n to float32's rounding, 0 where that is below
    its normal range (XLA:CPU flushes it)."""
    g = {"w": jnp.full(n, x, jnp.float32)}
    norm64 = n ** (1 / p) * x  # float64: all elements equal
    want = x * c / norm64
    want = 0.0 if want < np.finfo(np.float32).tiny else want
    for out in (
        jaxclip.clip_tree_by_norm(g, c, norm_type=p)[0],
        jaxclip.clip_tree_by_global_norm(g, c, norm_type=p)[0],
    ):
        w = np.asarray(out["w"], np.float64)
        np.testing.assert_allclose(w, want, rtol=4e-6, atol=np.finfo(np.float32).tiny)
        out_norm = float(np.sum(np.abs(w) ** p) ** (1 / p))
        assert out_norm <= c * (1 + 1e-5)


@pytest.mark.slow  # 100 000 elements at three norm types: the slow step
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU flushes subnormals")
def test_flushed_subnormals_count_as_zero_in_fractional_norms():
    """frexp's normalising product flushed subnormals, whose bits then read as
    0.5 * 2**-150: at p=0.1 each counted 2.8e-5 (a leaf of 100 x 1e-3 and 99 900 x 1e-40
    had norm 1.74e17, not the documented 1e17, nor the exact 6.2e17)."""
    w = np.concatenate([np.full(100, 1e-3), np.full(99_900, 1e-40)]).astype(np.float32)
    np.testing.assert_allclose(jaxclip.global_norm(w, norm_type=0.1), 1e17, rtol=1e-5)
    sub = np.full(257, 6e-39, np.float32)
    for p in (0.1, 0.2, 0.9):
        assert float(jaxclip.global_norm(sub, norm_type=p)) == 0.0
        assert float(jaxclip.clip_tree_by_norm(sub, 1.0, norm_type=p)[1]) == 0.0
