"""Per-example clipping (DP-SGD): clip_tree_per_example and clip_per_example.

Expected values come from float64 NumPy formulas (``_reference``) or from optax's own
per-example functions; the noise is checked statistically with fixed seeds. Shapes are
small and fixed so that each jitted function compiles once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from _helpers import xla_cpu_only

import jaxclip

B = 6


def _grads(dtype=np.float32, seed=0, scale=1.0):
    """Per-example gradients of a (3, 4) kernel, a (4,) bias and a nested list leaf, with
    per-example norms spread over [0.1, 10]: some are clipped at 1, some not."""
    rng = np.random.default_rng(seed)
    s = np.geomspace(0.1, 10.0, B) * scale
    tree = {
        "kernel": rng.normal(size=(B, 3, 4)) * s[:, None, None] / 4,
        "bias": rng.normal(size=(B, 4)) * s[:, None] / 4,
        "head": [rng.normal(size=(B, 2)) * s[:, None] / 4],
    }
    return jax.tree.map(lambda x: np.asarray(x, dtype), tree)


def _reference(tree, c, p=2.0, selected=None, reduce="sum"):
    """float64: per-example norms over the selected leaves, factor min(1, c/n), reduced."""
    leaves, treedef = jax.tree.flatten(tree)
    sel = [True] * len(leaves) if selected is None else selected
    x64 = [np.asarray(x, np.float64) for x in leaves]
    flat = np.concatenate([x.reshape(B, -1) for x, s in zip(x64, sel) if s], axis=1)
    a = np.abs(flat)
    n = a.max(1) if p == math.inf else (a**p).sum(1) ** (1 / p)
    f = np.where(n <= c, 1.0, c / np.where(n > 0, n, 1))
    out = []
    for x, s in zip(x64, sel):
        y = x * f.reshape((B,) + (1,) * (x.ndim - 1)) if s else x
        out.append(y if reduce is None else y.sum(0) / (B if reduce == "mean" else 1))
    return jax.tree.unflatten(treedef, out), n


def _close(got, want, rtol):
    """Within ``rtol``, relative to each leaf's largest magnitude (sums cancel)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, rtol=rtol, atol=rtol * abs(w).max()
        )


@pytest.mark.parametrize(
    "p, reduce",
    [(2.0, "sum"), (2.0, "mean"), (2.0, None), (1.0, None), (1.5, "sum"), (math.inf, "mean")],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_matches_float64_reference(p, reduce):
    g = _grads()
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, norm_type=p, reduce=reduce)
    want, n = _reference(g, 1.0, p, reduce=reduce)
    np.testing.assert_allclose(norms, n, rtol=2e-6)
    _close(got, want, 2e-7 if reduce is None else 1e-6)  # sums: six terms, rounded once each
    assert 0 < np.mean(n > 1.0) < 1  # the case has clipped and unclipped examples


def test_unclipped_examples_bit_for_bit():
    g = _grads()
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, reduce=None)
    kept = np.asarray(norms) <= 1.0
    assert kept.any() and not kept.all()
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(got)):
        assert np.array_equal(np.asarray(y)[kept].view(np.uint32), x[kept].view(np.uint32))


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_parity_with_optax_global_and_layer_and_dp_aggregate():
    g = _grads()
    leaves = jax.tree.leaves(g)
    ours, norms = jaxclip.clip_tree_per_example(leaves, 1.0)
    theirs, clipped = jax.jit(optax.per_example_global_norm_clip)(leaves, 1.0)
    _close(ours, [np.asarray(t, np.float64) for t in theirs], 2e-6)
    assert int(clipped) == int(np.sum(np.asarray(norms) > 1.0))
    # Per layer: optax clips each of the K leaves to c / sqrt(K) (uniform=True).
    k = len(leaves)
    ours, _ = jaxclip.clip_tree_per_example(
        leaves, 1.0 / math.sqrt(k), group=lambda path, leaf: path
    )
    theirs, _ = jax.jit(optax.per_example_layer_norm_clip)(leaves, 1.0)
    _close(ours, [np.asarray(t, np.float64) for t in theirs], 2e-6)
    # DP aggregate without noise: the mean of the clipped examples.
    params = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), g)
    dp = optax.contrib.differentially_private_aggregate(1.0, 0.0, jax.random.key(0))
    theirs, _ = jax.jit(dp.update)(g, dp.init(params))
    tx = jaxclip.clip_per_example(1.0)
    ours, _ = tx.update(g, tx.init(params))
    _close(ours, jax.tree.map(lambda t: np.asarray(t, np.float64), theirs), 2e-6)


def test_groups_clip_each_label_on_its_own():
    g = _grads()
    label = lambda path, leaf: "kernel" if path == "kernel" else "rest"  # noqa: E731
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, group=label, reduce=None)
    want_k, nk = _reference(g, 1.0, selected=[False, False, True], reduce=None)
    want_r, nr = _reference(g, 1.0, selected=[True, True, False], reduce=None)
    np.testing.assert_allclose(norms["kernel"], nk, rtol=2e-6)
    np.testing.assert_allclose(norms["rest"], nr, rtol=2e-6)
    np.testing.assert_allclose(got["kernel"], want_k["kernel"], rtol=2e-7)
    np.testing.assert_allclose(got["bias"], want_r["bias"], rtol=2e-7)


def test_low_precision_leaves():
    """A bfloat16 kernel, a float16 bias and a float32 head in one tree (one compile)."""
    g = _grads()
    dtypes = {"kernel": jnp.bfloat16, "bias": jnp.float16, "head": jnp.float32}
    g = {k: jax.tree.map(lambda x, d=d: np.asarray(x).astype(d), g[k]) for k, d in dtypes.items()}
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, reduce="mean")
    want, n = _reference(g, 1.0, reduce="mean")  # from the rounded 16-bit inputs
    np.testing.assert_allclose(norms, n, rtol=2e-6)
    for k, d in dtypes.items():
        # One rounding into the leaf's dtype after a float32 accumulation (float32: the
        # sum's own rounding, relative to the leaf's largest magnitude).
        tol = max(float(jnp.finfo(d).eps), 1e-6)
        for gl, wl in zip(jax.tree.leaves(got[k]), jax.tree.leaves(want[k])):
            assert gl.dtype == d
            a = np.asarray(gl, np.float64)
            np.testing.assert_allclose(a, wl, rtol=tol, atol=tol * abs(wl).max())


@pytest.mark.parametrize(
    "which", [pytest.param("_contract_split", marks=xla_cpu_only), "_contract_wide"]
)
def test_bf16_contraction_both_strategies_match_float64(which):
    """XLA:CPU lowers the split contraction and other platforms the widened one
    (``lax.platform_dependent``); CI has only a CPU, so each is called here directly.
    Factors like ``c / n`` (not bf16-representable), positive bf16 data over a wide range:
    float32 rounding only (1.5-1.8e-7 of the sum here), against float64. A split that
    dropped its third part would be 1.6e-6 off."""
    from jaxclip import per_example

    rng = np.random.default_rng(3)
    w = rng.uniform(0.01, 1.0, size=(64,)).astype(np.float32)
    x = np.abs(rng.normal(size=(64, 300))) * 10.0 ** rng.integers(-20, 20, size=(64, 1))
    x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    x2 = np.asarray(jnp.asarray(rng.normal(size=(64, 3, 5)), jnp.bfloat16))
    # Several leaves share one split of the weights.
    out, out2 = jax.jit(getattr(per_example, which))(w, x, x2)
    assert out.dtype == jnp.float32 and out.shape == (300,) and out2.shape == (3, 5)
    want = w.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=5e-7)
    want2 = np.tensordot(w.astype(np.float64), x2.astype(np.float64), 1)
    np.testing.assert_allclose(np.asarray(out2, np.float64), want2, rtol=5e-7, atol=1e-6)
    # Factors down to float32's normal range (norms ~1e37 times clip_norm): the split's
    # parts would be subnormal, which XLA:CPU flushes (80% off in a cancelling sum).
    x = np.asarray(jnp.asarray([[3e30, 1e30], [-2.9e30, 1e30]], jnp.bfloat16))
    x64 = x.astype(np.float64)
    for c in [1e-3, 1e-6]:
        w = (c / np.linalg.norm(x64, axis=1)).astype(np.float32)
        (out,) = jax.jit(getattr(per_example, which))(w, x)
        want = w.astype(np.float64) @ x64
        bound = np.abs(w.astype(np.float64)) @ np.abs(x64)  # the cancelling sum's scale
        np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - want), 2e-7 * bound)


def test_bf16_beyond_float32_squares_and_f32_extremes():
    # bf16 elements of 3e19: their squares overflow float32; every example has norm 6e19.
    g = {"w": jnp.full((B, 4), 3e19, jnp.bfloat16)}
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, reduce="mean")
    np.testing.assert_allclose(norms, np.full(B, 2 * float(jnp.bfloat16(3e19))), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got["w"], np.float64), 0.5, rtol=2**-8)
    for scale, c in [(1e30, 1.0), (1e-30, 1e-31)]:
        g = _grads(scale=scale)
        got, norms = jaxclip.clip_tree_per_example(g, c, reduce=None)
        want, n = _reference(g, c, reduce=None)
        np.testing.assert_allclose(norms, n, rtol=2e-6)
        _close(got, want, 2e-6)


def test_nan_propagates_to_its_example_and_the_sum():
    g = _grads()
    g["bias"][2, 1] = np.nan
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, reduce=None)
    norms = np.asarray(norms)
    assert np.isnan(norms[2]) and np.isfinite(np.delete(norms, 2)).all()
    assert np.isnan(np.asarray(got["kernel"])[2]).all()
    assert np.isfinite(np.delete(np.asarray(got["kernel"]), 2, axis=0)).all()
    total, _ = jaxclip.clip_tree_per_example(g, 1.0)
    assert np.isnan(np.asarray(total["kernel"])).all()


@pytest.mark.parametrize(
    "need_clip",
    [
        {"kernel": True, "bias": False, "head": True},
        lambda path, leaf: not path.endswith("bias"),
    ],
    ids=["mask", "callable"],
)
def test_need_clip_unselected_leaves_reduced_unclipped(need_clip):
    g = _grads()
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, need_clip=need_clip)
    want, n = _reference(g, 1.0, selected=[False, True, True])  # flat order: bias, head, kernel
    np.testing.assert_allclose(norms, n, rtol=2e-6)
    _close(got, want, 2e-6)


@pytest.mark.parametrize(
    "need_clip", [jaxclip.min_rank(2), jaxclip.exclude_biases_and_norms()], ids=repr
)
def test_rules_see_one_example_not_the_batch_axis(need_clip):
    # Among the params only the (3, 4) kernel is a matrix: bias (4,) and head/0 (2,) are
    # vectors, and must not be picked because their per-example gradients have rank 2.
    g = _grads()
    got, norms = jaxclip.clip_tree_per_example(g, 1.0, need_clip=need_clip)
    want, n = _reference(g, 1.0, selected=[False, False, True])  # bias, head/0, kernel
    np.testing.assert_allclose(norms, n, rtol=2e-6)
    _close(got, want, 2e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_init_and_update_find_the_same_groups_by_rank():
    # init sees the params, update the per-example gradients: a rank rule must agree.
    g = _grads()
    params = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), g)
    tx = jaxclip.clip_per_example(1.0, group=lambda path, leaf: leaf.ndim, batch_size=B)
    _, state = tx.update(g, tx.init(params))
    assert set(state.norms) == {1, 2}
    _, n = _reference({"kernel": g["kernel"]}, 1.0)
    np.testing.assert_allclose(state.norms[2], n, rtol=2e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_grad_and_chain():  # jit: the doctests and test_inject_hyperparams_...
    g = jax.tree.map(jnp.asarray, _grads())
    g = {**g, "head": [g["head"][0].at[0].set(0.0)]}
    g["kernel"] = g["kernel"].at[0].set(0.0)
    g["bias"] = g["bias"].at[0].set(0.0)  # example 0 is all zeros: norm 0

    def loss(t):
        return sum(jnp.sum(x) for x in jax.tree.leaves(jaxclip.clip_tree_per_example(t, 1.0)[0]))

    grads = jax.grad(loss)(g)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(grads))
    # Unclipped examples (norm <= 1) pass the identity's derivative: all ones.
    _, n = _reference(g, 1.0)
    np.testing.assert_allclose(np.asarray(grads["bias"])[n <= 1.0], 1.0, rtol=1e-6)
    params = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), g)
    tx = optax.chain(jaxclip.clip_per_example(1.0, batch_size=B), optax.sgd(0.1))
    updates, state = tx.update(g, tx.init(params))
    want, _ = _reference(g, 1.0, reduce="mean")
    _close(jax.tree.map(lambda u: -u / 0.1, updates), want, 2e-6)
    np.testing.assert_allclose(optax.tree.get(state, "norms"), n, rtol=2e-6)
    assert float(optax.tree.get(state, "clipped_fraction")) == pytest.approx(np.mean(n > 1.0))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"batch_size": 2, "group": lambda path, leaf: path}],
    ids=["no_batch_size", "batch_size_group"],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_init_state_matches_update_state(kwargs):
    g = _ZEROS  # the noise test's tree: the same compiled program without group
    params = jax.tree.map(lambda x: x[0], g)
    tx = jaxclip.clip_per_example(0.5, noise_multiplier=3.0, seed=1, **kwargs)
    s0 = tx.init(params)
    _, s1 = tx.update(g, s0)
    assert isinstance(s1, jaxclip.ClipPerExampleState)
    assert jax.tree.structure(s0) == jax.tree.structure(s1)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        assert jax.typeof(a) == jax.typeof(b)  # shape, dtype and weak type


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_inject_hyperparams_traced_clip_norm_no_recompile():
    g = _grads()
    params = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), g)
    make = optax.inject_hyperparams(jaxclip.clip_per_example, static_args=("batch_size",))
    tx = make(clip_norm=2.0, batch_size=B)
    update = jax.jit(tx.update)
    _, state = update(g, tx.init(params))
    state.hyperparams["clip_norm"] = jnp.asarray(0.5, jnp.float32)
    updates, state = update(g, state)
    assert update._cache_size() == 1
    want, n = _reference(g, 0.5, reduce="mean")
    _close(updates, want, 2e-6)
    np.testing.assert_allclose(state.inner_state.norms, n, rtol=2e-6)


_ZEROS = {"a": np.zeros((2, 4000), np.float32), "b": np.zeros((2, 4000), np.float32)}


def test_noise_statistics():
    """std = noise_multiplier * clip_norm on the sum, divided by B for the mean; zero mean;
    independent across leaves and steps. A reused key or a wrong std fails."""
    zeros = _ZEROS
    params = jax.tree.map(lambda x: x[0], zeros)
    tx = jaxclip.clip_per_example(0.5, noise_multiplier=3.0, seed=1)
    s = tx.init(params)
    u1, s = tx.update(zeros, s)
    u2, s = tx.update(zeros, s)
    std = 0.5 * 3.0 / 2  # the mean over B = 2 examples
    for u in (u1, u2):
        for x in (np.asarray(u["a"]), np.asarray(u["b"])):
            assert abs(x.mean()) < 4 * std / math.sqrt(x.size)
            assert abs(x.std() / std - 1) < 0.05  # 4000 draws: the sd of this ratio is 1.1%
    for x, y in [(u1["a"], u1["b"]), (u1["a"], u2["a"]), (u1["b"], u2["b"])]:
        assert abs(np.corrcoef(np.asarray(x), np.asarray(y))[0, 1]) < 0.07  # sd 0.016
    again = tx.update(zeros, tx.init(params))[0]["a"]
    np.testing.assert_array_equal(u1["a"], again)  # the seed fixes the noise
    other = jaxclip.clip_per_example(0.5, noise_multiplier=3.0, seed=2)
    assert not np.array_equal(u1["a"], other.update(zeros, other.init(params))[0]["a"])


def test_an_empty_batch_has_no_mean():
    empty = {"w": np.zeros((0, 3), np.float32)}
    with pytest.raises(ValueError, match=r"batch size 0, and the mean over no examples"):
        jaxclip.clip_tree_per_example(empty, 1.0, reduce="mean")
    tx = jaxclip.clip_per_example(1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"batch size 0"):
        tx.update(empty, tx.init({"w": np.zeros(3, np.float32)}))
    total, norms = jaxclip.clip_tree_per_example(empty, 1.0)  # the sum of nothing is 0
    np.testing.assert_array_equal(total["w"], np.zeros(3))
    assert norms.shape == (0,)


@pytest.mark.parametrize(("batch", "shape"), [(16, (70, 113)), (3, (130, 113)), (5, (4,))])
def test_float16_sums_over_blocks_of_columns(batch, shape):
    """float16 per-example sums (XLA:CPU: a dot per block of columns, with a tail) against
    float64: several blocks and a tail, two blocks and a tail, and one small leaf."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batch, *shape)) * rng.lognormal(0, 2, (batch,) + (1,) * len(shape))
    x = x.astype(np.float16)
    x64 = x.astype(np.float64).reshape(batch, -1)
    f = np.minimum(1.0, 0.5 / np.linalg.norm(x64, axis=1))[:, None]
    got, _ = jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 0.5))({"x": jnp.asarray(x)})
    assert got["x"].dtype == jnp.float16
    want = (f * x64).sum(0).reshape(shape)
    np.testing.assert_allclose(np.asarray(got["x"], np.float64), want, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_16_bit_sums_of_an_empty_batch_are_zero(dtype):
    g = {"w": jnp.zeros((0, 64, 300), dtype), "b": jnp.zeros((0, 3), dtype)}
    out, norms = jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1.0))(g)
    assert norms.shape == (0,)
    for k, v in out.items():
        assert v.dtype == dtype and v.shape == g[k].shape[1:] and not np.any(np.asarray(v))


def test_complex_leaves_get_noise_on_both_parts():
    # A complex parameter is two real ones (its norm is that of the pair): the Gaussian
    # mechanism adds the full std to each part, independently.
    zeros = {"z": np.zeros((2, 4000), np.complex64)}
    tx = jaxclip.clip_per_example(0.5, noise_multiplier=3.0, reduce="sum", seed=1)
    u = np.asarray(tx.update(zeros, tx.init({"z": zeros["z"][0]}))[0]["z"])
    assert u.dtype == np.complex64
    for part in (u.real, u.imag):
        assert abs(part.std() / 1.5 - 1) < 0.05
    assert abs(np.corrcoef(u.real, u.imag)[0, 1]) < 0.07


def test_errors_name_the_leaf():
    g = _grads()
    with pytest.raises(ValueError, match=r"'head/0' has batch size 6.*'bias' has 5"):
        jaxclip.clip_tree_per_example({**g, "bias": g["bias"][:5]}, 1.0)
    with pytest.raises(ValueError, match=r"'scale' is a scalar.*batch axis"):
        jaxclip.clip_tree_per_example({**g, "scale": np.float32(1.0)}, 1.0)
    with pytest.raises(ValueError, match="reduce="):
        jaxclip.clip_tree_per_example(g, 1.0, reduce="max")
    with pytest.raises(ValueError, match=r"noise_multiplier > 0 needs reduce"):
        jaxclip.clip_per_example(1.0, noise_multiplier=1.0, reduce=None)
    with pytest.raises(ValueError, match=r"noise_multiplier=-1.0 must be >= 0"):
        jaxclip.clip_per_example(1.0, noise_multiplier=-1.0)
    tx = jaxclip.clip_per_example(1.0, batch_size=B + 1)
    params = jax.tree.map(lambda x: x[0], g)
    with pytest.raises(ValueError, match=f"batch size {B}.*batch_size={B + 1}"):
        tx.update(g, tx.init(params))


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_integer_and_float0_leaves_with_a_reduction():
    # An integer param: jax.grad(allow_int=True) gives a float0 gradient, which loses its
    # batch axis like every reduced leaf, so the update has the params' shapes.
    params = {"w": jnp.ones((3,)), "step": jnp.zeros((2,), jnp.int32)}

    def loss(p, x):
        return jnp.sum(p["w"] * x) + 0.0 * jnp.sum(p["step"])

    xs = jnp.arange(12.0).reshape(4, 3)
    g = jax.vmap(jax.grad(loss, allow_int=True), in_axes=(None, 0))(params, xs)
    assert g["step"].dtype == jax.dtypes.float0 and g["step"].shape == (4, 2)
    tx = jaxclip.clip_per_example(1e6)
    updates, _ = tx.update(g, tx.init(params), params)
    assert updates["step"].dtype == jax.dtypes.float0 and updates["step"].shape == (2,)
    np.testing.assert_allclose(updates["w"], np.mean(np.arange(12.0).reshape(4, 3), 0))
    # An integer array cannot be summed: an error naming it, not its batch axis passed on.
    bad = {**g, "step": jnp.zeros((4, 2), jnp.int32)}
    with pytest.raises(ValueError, match=r"'step' has dtype int32.*float0"):
        tx.update(bad, tx.init(params), params)
    with pytest.raises(ValueError, match=r"'step' has dtype int32"):
        jaxclip.clip_tree_per_example(bad, 1.0)
    # Without a reduction the examples come back as they are, other leaves too.
    kept, _ = jaxclip.clip_tree_per_example(bad, 1e6, reduce=None)
    assert kept["step"].shape == (4, 2)


@xla_cpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_no_per_example_copy_and_temp_within_optax(dtype):
    """The sum contracts the per-example factors with each leaf: XLA's temp holds no
    clipped or widened (batch, ...) copy and stays at optax's (whose
    per_example_global_norm_clip contracts too, but widens bf16) up to a few per-example
    vectors. Several alike leaves: with the rescaled rare path read by XLA:CPU's library
    reduction, their per-example scales were materialised at a leaf's size (1 MB here).
    The rare path (examples out of the exact range) reads one example's rows of the small
    leaves (rows of at most 64 KiB) concatenated: a copy of one example, 1/batch of the
    tree, in the temporaries."""
    batch = 16
    g = {f"w{i}": jnp.ones((batch, 64, 128), dtype) for i in range(4)}
    g |= {f"b{i}": jnp.ones((batch, 128), dtype) for i in range(4)}
    ours = jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1.0)).lower(g).compile()
    temp = ours.memory_analysis().temp_size_in_bytes
    example = sum(x.nbytes for x in g.values()) // batch
    # A float32 copy of a "w" would be over this (twice it; float16: 1.6 times; its float32
    # sums' accumulators, a "w" example each, are temporaries too, and XLA:CPU widens a float16
    # dot's operand: the dot runs over blocks of columns, each widened alone; the whole
    # tree was 2.2 MB).
    assert temp < batch * 64 * 128 * 4 / (2 if dtype == jnp.float16 else 4) + example, temp
    if dtype == jnp.float32:  # optax widens bf16 (137 MB on the benchmark's MLP): no contest
        theirs = jax.jit(lambda t: optax.per_example_global_norm_clip(t, 1.0)).lower(g).compile()
        assert temp <= theirs.memory_analysis().temp_size_in_bytes + 16 * batch * 4 + example


def test_averaged_gradients_are_refused_when_params_are_given():
    """optax's test_aggregated_updates_as_input_fails: updates of the params' own shapes
    (leaves that happen to share a leading size) are not per-example gradients."""
    params = {"a": jnp.zeros((4, 3)), "b": jnp.zeros((4, 5))}
    tx = jaxclip.clip_per_example(1.0)
    averaged = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match=r"update at 'a' has shape \(4, 3\), but its param"):
        tx.update(averaged, tx.init(params), params)
    per_example = jax.tree.map(lambda x: jnp.ones((8, *x.shape)), params)
    out, _ = tx.update(per_example, tx.init(params), params)
    assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, params)


def _flagged_batch(dtype, magnitudes):
    """16 examples of three leaves (16-bit ones at their own scale), example b's leaves
    scaled by ``magnitudes[b]``: 0 for a padding example, tiny ones whose squares
    underflow float32, huge ones whose squares overflow it."""
    rng = np.random.default_rng(3)
    m = np.asarray(magnitudes, np.float64)[:, None]
    tree = {
        "w": rng.normal(size=(16, 300)) * m,
        "b": rng.normal(size=(16, 7)) * m,
        "h": rng.normal(size=(16, 65)) * m,
    }
    return jax.tree.map(lambda x: np.asarray(x).astype(dtype), tree)


def _norms64(g, p=2.0):
    """float64: each example's p-norm over all leaves of ``g``."""
    x = np.concatenate([np.asarray(v, np.float64) for v in jax.tree.leaves(g)], axis=1)
    return (np.abs(x) ** p).sum(1) ** (1 / p)


_MOST = [0.5, 2.0] * 8
_FLAGGED = {
    # At most one in eight examples out of range: their rows are read one at a time.
    "one padding example": {15: 0.0},
    "zero and tiny": {0: 0.0, 7: 1e-25},
    # More: the whole batch is rescaled at once.
    "half padding": dict.fromkeys(range(8, 16), 0.0),
    "tiny, huge and zero": {1: 1e-30, 2: 1e30, 3: 0.0, 4: 3e-21, 5: 1e25},
}


@pytest.mark.parametrize("case", list(_FLAGGED))
@pytest.mark.parametrize(
    "p", [2.0, 3.0, pytest.param(0.5, marks=pytest.mark.slow)]
)  # p=0.5: the slow step
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_examples_out_of_range_match_float64(case, p):
    """Padding (all-zero) examples and examples whose powers underflow or overflow take
    the rare path, alone or with the whole batch: each example's norm and the sum match
    float64 (the in-range examples' norms too, to the bit of the plain path)."""
    mags = list(_MOST)
    for b, v in _FLAGGED[case].items():
        mags[b] = v
    g = _flagged_batch(np.float32, mags)
    got, norms = _per_example_jit(p)(g)
    n = _norms64(g, p)
    np.testing.assert_allclose(np.asarray(norms, np.float64), n, rtol=2e-6)
    assert float(np.min(n)) == 0.0 or case == "tiny, huge and zero"
    f = np.where(n <= 1.0, 1.0, 1.0 / np.where(n > 0, n, 1))
    for k in g:
        want = (np.asarray(g[k], np.float64) * f[:, None]).sum(0)
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@functools.cache
def _per_example_jit(p):
    return jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1.0, norm_type=p))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_low_precision_padding_examples(dtype):
    """16-bit leaves with one padding and one tiny example (rows read one at a time)."""
    mags = list(_MOST)
    mags[3], mags[9] = 0.0, 1e-30 if dtype == jnp.bfloat16 else 1e-4
    g = _flagged_batch(dtype, mags)
    norms = jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1.0)[1])(g)
    np.testing.assert_allclose(norms, _norms64(g), rtol=2e-6)


def test_vmapped_global_norm_with_padding_examples():
    """jax.vmap(global_norm) runs the per-example path: a zero and a tiny example."""
    mags = list(_MOST)
    mags[0], mags[5] = 0.0, 1e-24
    g = _flagged_batch(np.float32, mags)
    got = jax.jit(jax.vmap(jaxclip.global_norm))(g)
    np.testing.assert_allclose(got, _norms64(g), rtol=2e-6)


def test_bfloat16_leaves_of_one_group_share_one_split_of_the_weights():
    # XLA:CPU's contraction splits the weights into three bfloat16 parts: once per group
    # of leaves, not once per leaf (each copy was some 80 lines of StableHLO to trace,
    # lower and deduplicate).
    g = {f"p{i:02d}": jnp.ones((8, 16 + i), jnp.bfloat16) for i in range(20)}
    tx = jaxclip.clip_per_example(1.0)
    state = tx.init(jax.tree.map(lambda x: x[0], g))
    text = jax.jit(tx.update).lower(g, state).as_text()
    lines = text.splitlines()
    assert sum("dot_general" in line for line in lines) == 20
    splits = [ln for ln in lines if "stablehlo.concatenate" in ln and "tensor<3x8xbf16>" in ln]
    assert len(splits) == (1 if jax.default_backend() == "cpu" else 0)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("scale", [1.0, 1e25, 1e-30])
def test_a_tree_of_split_and_whole_leaves_on_an_explicit_mesh(scale):
    # One leaf split over the batch, one whole: the whole leaf's rare-path sums are
    # shifted by per-example factors that are split, and must still select their NaN
    # mark (a ShardingTypeError before).
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(4)
    host = {
        "a": (rng.normal(size=(16, 5, 3)) * scale).astype(np.float32),
        "b": (rng.normal(size=(16, 7)) * scale).astype(np.float32),
    }
    n = np.sqrt(
        sum(np.sum(v.astype(np.float64) ** 2, axis=tuple(range(1, v.ndim))) for v in host.values())
    )
    f = np.minimum(1.0, 1e-3 * scale / n)
    with jax.set_mesh(mesh):
        g = {
            "a": jax.device_put(host["a"], NamedSharding(mesh, P("data"))),
            "b": jax.device_put(host["b"], NamedSharding(mesh, P())),
        }
        out, _ = jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1e-3 * scale))(g)
    for k, v in host.items():
        want = np.tensordot(f, v.astype(np.float64), 1)
        got = np.asarray(out[k], np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_averaged_gradient_error_spells_the_per_example_shape():
    tx = jaxclip.clip_per_example(1.0)
    for params, want in (
        ({"s": jnp.float32(2.0)}, "(batch,)"),
        ({"w": jnp.ones((3, 2))}, "(batch, 3, 2)"),
    ):
        with pytest.raises(ValueError, match="averaged gradient") as err:
            tx.update(params, tx.init(params), params)
        assert f"per-example gradients have shape {want}." in str(err.value)
        assert f"update at '{next(iter(params))}'" in str(err.value)


# The gradient of a weighted clipped sum, w . sum_b x_b min(1, c / n_b), with respect to
# the per-example gradients, against float64: for a clipped example
# (c / n_b) (w - x_b (w . x_b) / n_b**2), else w. The contraction's own derivative formed
# w . x_b: inf for 16 elements near 1e38, flushed to 0 (the norm's part lost, 37% off)
# for elements near 1e-37 whose outputs are partly subnormal.
_GRAD_EXAMPLES = {
    "large": (np.linspace(0.55, 0.95, 16) * 1e38, 1.2e38, 0.25, [0.5, -1.0, 0.25, 2.0, -0.75]),
    "tiny": (
        np.array([9.775674e-38, -3.1055655e-38, -3.288239e-38, -7.921467e-38, 4.5495806e-38]),
        3e-38,
        4.0,
        [-0.099198, 0.545289, -0.607186, 0.126828, -0.892274],  # w . x_0 subnormal
    ),
}


@pytest.mark.parametrize("case", list(_GRAD_EXAMPLES))
def test_gradient_through_the_clipped_sum_at_extreme_magnitudes(case):
    row, c, other, weights = _GRAD_EXAMPLES[case]
    x = np.stack([row, row * other]).astype(np.float32)  # every input normal
    w = np.resize(weights, x.shape[1]).astype(np.float32)
    c = float(np.float32(c))

    def loss(g):
        total, _ = jaxclip.clip_tree_per_example([g], c, reduce="sum")
        return jnp.sum(jnp.asarray(w) * total[0])

    got = ref.f64(jax.jit(jax.grad(loss))(jnp.asarray(x)))
    x64, w64 = ref.f64(x), ref.f64(w)
    want = np.empty_like(x64)
    for b, xb in enumerate(x64):
        n = np.sqrt(np.sum(xb**2))
        want[b] = c / n * (w64 - xb * np.dot(w64, xb) / n**2) if n > c else w64
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.max(np.abs(want)))
