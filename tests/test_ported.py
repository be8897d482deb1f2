"""The peers' own test cases, translated to jaxclip.

Each test names the test it ports (optax's ``transforms/_clipping_test.py``, PyTorch's
``test_nn.py::test_clip_grad_norm``, TensorFlow's ``clip_ops_test.py``). Inputs are theirs;
expected values come from their formulas in float64 NumPy, not from jaxclip. Where jaxclip
documents a difference (no epsilon; an infinite global norm scales by 0, not NaN), the
test says so.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

GRADS = (np.array([500.0, 5.0]), np.array([300.0, 3.0]))  # optax's per_step_updates
PARAMS = (np.array([1.0, 2.0]), np.array([3.0, 4.0]))  # optax's init_params
STEPS = 50


def _tree(values: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(v, jnp.float32) for v in values)


def test_optax_clip():  # ClippingTest.test_clip
    tx = jaxclip.clip_by_value(1e6)
    out, _ = tx.update(_tree(GRADS), tx.init(_tree(GRADS)))
    for o, g in zip(out, GRADS):
        np.testing.assert_array_equal(o, g)
    tx = jaxclip.clip_by_value(1.0)
    out, _ = tx.update(_tree(GRADS), tx.init(_tree(GRADS)))
    for o in out:
        np.testing.assert_array_equal(o, 1.0)


_GN = jax.jit(lambda g, c: jaxclip.clip_tree_by_global_norm(g, c))
_LEAF = jax.jit(lambda g, c: jaxclip.clip_tree_by_norm(g, c))


def test_optax_clip_by_global_norm_repeatedly():  # ClippingTest.test_clip_by_global_norm
    updates = _tree(GRADS)
    for i in range(1, STEPS + 1):
        c = np.float32(1.0 / i)
        updates, _ = _GN(updates, c)
        total = math.sqrt(sum(float(np.sum(np.float64(u) ** 2)) for u in updates))
        np.testing.assert_allclose(total, 1.0 / i, rtol=2e-7)
        # Clipping the clipped updates again changes nothing numerically.
        once, _ = _GN(_tree(GRADS), c)
        for a, b in zip(updates, once):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_optax_per_leaf_norm_repeatedly():  # test_clip_by_block_rms, with the norm
    updates = _tree(GRADS)
    for i in range(1, STEPS + 1):
        updates, _ = _LEAF(updates, np.float32(1.0 / i))
        for u in updates:
            np.testing.assert_allclose(np.linalg.norm(np.float64(u)), 1.0 / i, rtol=2e-7)


def _unitwise(x: np.ndarray) -> np.ndarray:  # optax's unitwise_norm for rank <= 1
    return np.sqrt(np.sum(np.float64(x) ** 2)) * np.ones_like(x, np.float64)


def test_optax_adaptive_grad_clip():  # ClippingTest.test_adaptive_grad_clip
    updates, params = _tree(GRADS), _tree(PARAMS)
    step = jax.jit(jaxclip.clip_tree_adaptive)  # one compile: the ratio is traced
    for i in range(1, STEPS + 1):
        clip = 1.0 / i
        updates = step(updates, params, np.float32(clip))
        for u, p in zip(updates, PARAMS):
            assert np.all(_unitwise(u) - clip * _unitwise(p) < 1e-6)
    grads = [jnp.array([[1.0, 2.0], [3.0, 4.0]])]
    tx = jaxclip.adaptive_clip(1.0)
    out = tx.update(grads, tx.init([jnp.ones((2, 2))]), [jnp.ones((2, 2))])[0][0]
    # Rank 2: a unit per column (axis 0 reduced); each column's param norm is sqrt(2).
    np.testing.assert_allclose(
        out, np.array([[1, 2], [3, 4]]) / np.sqrt([10.0, 20.0]) * np.sqrt(2.0), rtol=1e-6
    )


def test_optax_adaptive_grad_clip_with_axes():  # test_adaptive_grad_clip_with_axis
    g, p = jnp.full((2, 2, 2, 3, 4), 2.0), jnp.ones((2, 2, 2, 3, 4))
    tx = jaxclip.adaptive_clip(0.5, axes=(0, 1, 2))
    out = tx.update([g], tx.init([p]), [p])[0][0]
    # Each (3, 4) unit: grad norm 2 * sqrt(8), param norm sqrt(8): clipped to 0.5 * sqrt(8).
    np.testing.assert_allclose(out, 0.5, rtol=1e-6)
    tx = jaxclip.adaptive_clip(2.0, axes=(0, 1, 2))
    small = jnp.full((2, 2, 2, 3, 4), 0.1)
    np.testing.assert_array_equal(tx.update([small], tx.init([p]), [p])[0][0], small)


def test_optax_per_example_global_norm_clip():  # test_per_example_global_norm_clip
    grads = [
        jnp.array([[0, -0.5], [3, 4], [5, 6], [0, 0]], jnp.float32),
        jnp.array([[0], [5], [-3], [0]], jnp.float32),
    ]
    want = [
        np.array([0, -0.5]) + np.array([3, 4]) / np.sqrt(50) + np.array([5, 6]) / np.sqrt(70),
        np.array([0]) + np.array([5]) / np.sqrt(50) + np.array([-3]) / np.sqrt(70),
    ]
    out, norms = jaxclip.clip_tree_per_example(grads, 1.0)
    for o, w in zip(out, want):
        np.testing.assert_allclose(o, w, atol=1e-6)
    np.testing.assert_allclose(norms, [0.5, np.sqrt(50), np.sqrt(70), 0.0], rtol=1e-6)
    assert int(np.sum(np.asarray(norms) > 1.0)) == 2  # optax's num_clipped


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_optax_per_example_layer_norm_clip():  # test_per_example_layer_norm_clip, uniform
    grads = [jnp.array([[0.5], [1.5], [-2.0], [3.0]]), jnp.ones((4, 3, 3, 2), jnp.float32)]
    # Uniform variant: global clip sqrt(2) over 2 layers is 1.0 per layer.
    out, norms = jaxclip.clip_tree_per_example(grads, 1.0, group=lambda path, leaf: path)
    np.testing.assert_allclose(out[0], [1.5], rtol=1e-6)
    np.testing.assert_allclose(out[1], 4 / np.sqrt(18), rtol=1e-6)
    clipped = [int(np.sum(np.asarray(n) > 1.0)) for n in norms.values()]
    assert sorted(clipped) == [3, 4]
    # And against optax itself.
    ref, _ = optax.per_example_layer_norm_clip(grads, jnp.sqrt(2.0), uniform=True)
    for o, r in zip(out, ref):
        np.testing.assert_allclose(o, r, rtol=1e-6)


def _torch_total_norm(grads: list[np.ndarray], p: float) -> float:
    if p == math.inf:
        return max(float(np.max(np.abs(g))) for g in grads)
    return float(sum(np.sum(np.abs(g) ** p) for g in grads) ** (1 / p))


@pytest.mark.parametrize("p", [0.5, 1.5, 2.0, 4.0, math.inf])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_torch_clip_grad_norm(p):  # test_nn.py TestNN.test_clip_grad_norm
    max_norm = 2.0
    grads = [np.arange(1.0, 101).reshape(10, 10), np.ones(10) / 1000]
    out, norm = jaxclip.clip_tree_by_global_norm(_tree(tuple(grads)), max_norm, norm_type=p)
    total = _torch_total_norm(grads, p)
    np.testing.assert_allclose(norm, total, rtol=1e-6)
    for o, g in zip(out, grads):  # torch: max_norm / (total + 1e-6); jaxclip: no epsilon
        np.testing.assert_allclose(o, g * (max_norm / total), rtol=1e-5)
    # Gradients within the limit are returned as they are.
    rng = np.random.default_rng(0)
    small = [rng.random((10, 10)) / 10000, np.ones(10) / 500]
    out, norm = jaxclip.clip_tree_by_global_norm(_tree(tuple(small)), max_norm, norm_type=p)
    np.testing.assert_allclose(norm, _torch_total_norm(small, p), rtol=1e-5)
    for o, g in zip(out, _tree(tuple(small))):
        np.testing.assert_array_equal(o, g)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_torch_clip_grad_norm_error_if_nonfinite(p):  # test_clip_grad_norm_error_if_nonfinite
    grads = [jnp.array([1.0, jnp.inf]), jnp.ones(3)]
    with pytest.raises(FloatingPointError, match="non-finite"):
        jaxclip.clip_tree_by_global_norm(grads, 1.0, norm_type=p, error_if_nonfinite=True)
    out, norm = jaxclip.clip_tree_by_global_norm(grads, 1.0, norm_type=p)
    assert norm == np.inf  # without the check: scaled by 0, the inf entry becomes NaN
    np.testing.assert_array_equal(out[1], 0.0)


@pytest.mark.parametrize(
    "x, clip, axes, want",
    [  # clip_ops_test.py: testClipByNorm*
        ([[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], 4.0, None, [[-2.4, 0, 0], [3.2, 0, 0]]),
        ([[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], 6.0, None, [[-3.0, 0, 0], [4.0, 0, 0]]),
        ([[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], 4.0, 0, [[-2.4, 0, 0], [3.2, 0, 0]]),
        ([[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], 4.0, 1, [[-3.0, 0, 0], [4.0, 0, 0]]),
        ([[-3.0, 0.0, 0.0], [4.0, 3.0, 0.0]], 4.0, 1, [[-3.0, 0, 0], [3.2, 2.4, 0]]),
        ([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], 4.0, None, [[0.0, 0, 0], [0.0, 0, 0]]),
    ],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_tf_clip_by_norm(x, clip, axes, want):
    out, _ = jaxclip.clip_tree_by_norm(jnp.asarray(x), clip, axes=axes)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)


def test_tf_clip_by_global_norm():  # clip_ops_test.py: testClipByGlobalNorm*
    x0, x1 = jnp.array([[-2.0, 0.0, 0.0], [4.0, 0.0, 0.0]]), jnp.array([1.0, -2.0])
    (c0, c1), norm = jaxclip.clip_tree_by_global_norm([x0, x1], 2.0)
    np.testing.assert_allclose(norm, 5.0, rtol=1e-7)
    np.testing.assert_allclose(c0, [[-0.8, 0, 0], [1.6, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(c1, [0.4, -0.8], rtol=1e-6)
    # use_norm: TensorFlow's precomputed norm.
    (c0, _), norm = jaxclip.clip_tree_by_global_norm([x0, x1], 2.0, use_norm=10.0)
    np.testing.assert_allclose(c0, np.asarray(x0) * 0.2, rtol=1e-6)
    # All zero: unchanged, norm 0 (testClipByGlobalNormZero).
    (z0, z1), norm = jaxclip.clip_tree_by_global_norm([jnp.zeros((2, 3)), jnp.zeros(2)], 1.0)
    assert float(norm) == 0.0 and not np.any(z0) and not np.any(z1)
    # A None leaf is skipped (testClipByGlobalNormWithIndexedSlicesClipped's None).
    (c0, none), norm = jaxclip.clip_tree_by_global_norm([x0, None], 2.0)
    assert none is None
    np.testing.assert_allclose(norm, math.sqrt(20.0), rtol=1e-7)


def test_paddle_clip_grad_by_global_norm_doc_example():  # paddle.nn.ClipGradByGlobalNorm
    # Paddle's documented semantics: g * clip_norm / max(global_norm, clip_norm).
    rng = np.random.default_rng(3)
    w, b = rng.uniform(-10, 10, (10, 10)), rng.uniform(-10, 10, 10)
    out, _ = jaxclip.clip_tree_by_global_norm(
        {"weight": jnp.asarray(w, jnp.float32), "bias": jnp.asarray(b, jnp.float32)},
        1.0,
        need_clip={"weight": True, "bias": False},  # bias_attr=ParamAttr(need_clip=False)
    )
    gn = np.linalg.norm(np.float32(w).astype(np.float64))
    np.testing.assert_allclose(out["weight"], np.float32(w) / max(gn, 1.0), rtol=1e-6)
    np.testing.assert_array_equal(out["bias"], np.float32(b))
