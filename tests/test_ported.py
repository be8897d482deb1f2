"""The peers' own test cases, translated to jaxclip.

Each test names the test it ports (optax's ``transforms/_clipping_test.py``, PyTorch's
``test_nn.py::test_clip_grad_norm``, TensorFlow's ``clip_ops_test.py``). Inputs are theirs;
expected values come from their formulas in float64 NumPy, not from jaxclip. Where jaxclip
documents a difference (no epsilon; an infinite global norm scales by 0, not NaN), the
test says so.
"""

from __future__ import annotations

import functools
import math
import warnings

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


# ---------------------------------------------------------------------------------------
# Opacus 1.6.0 (torch 2.14.1): DPOptimizer, DPPerLayerOptimizer, AdaClipDPOptimizer.
# The model of the recorded runs: Linear(4, 3) -> tanh -> Linear(3, 2), cross-entropy,
# weights and data from the formulas below; Opacus ran it in float64 through
# GradSampleModule and the optimizers' clip_and_accumulate / add_noise / scale_grad
# (noise_multiplier=0), and these are its p.grad after step(), in parameter order
# (weight1, bias1, weight2, bias2). Opacus divides by norm + 1e-6 (jaxclip: no
# epsilon), hence rtol 1e-5.

_OPACUS_KEYS = ("w1", "b1", "w2", "b2")


def _opacus_params() -> dict[str, jax.Array]:
    return {
        "w1": jnp.asarray(np.linspace(-1.0, 1.2, 12).reshape(3, 4), jnp.float32),
        "b1": jnp.asarray([0.1, -0.2, 0.3], jnp.float32),
        "w2": jnp.asarray(np.linspace(0.9, -1.5, 6).reshape(2, 3), jnp.float32),
        "b2": jnp.asarray([0.05, -0.05], jnp.float32),
    }


def _opacus_data(b: int) -> tuple[jax.Array, jax.Array]:
    x = [[math.sin(1.0 + i + 3 * j) * (1 + i) for j in range(4)] for i in range(b)]
    return jnp.asarray(x, jnp.float32), jnp.asarray([i % 2 for i in range(b)], jnp.int32)


def _opacus_loss(p, x, y):  # one example's cross-entropy
    z = p["w2"] @ jnp.tanh(p["w1"] @ x + p["b1"]) + p["b2"]
    return jax.nn.logsumexp(z) - z[y]


_OPACUS_PER_EXAMPLE = jax.jit(jax.vmap(jax.grad(_opacus_loss), in_axes=(None, 0, 0)))

# DPOptimizer(max_grad_norm=1.0, expected_batch_size=8, loss_reduction="mean"), 6 examples
OPACUS_FLAT_MEAN_E8 = [
    [
        [-0.0683042122, 0.0921896659, -0.114229943, 0.133983907],
        [-0.0853310323, 0.091590061, -0.096015914, 0.0985200079],
        [-0.0807723272, 0.0774652075, -0.0726076212, 0.0662967928],
    ],
    [-0.0414831603, -0.0303637575, -0.0319581952],
    [[0.0126209976, 0.0381491453, 0.0240858245], [-0.0126209976, -0.0381491453, -0.0240858245]],
    [-0.0182677334, 0.0182677334],
]
# DPOptimizer(max_grad_norm=0.5, loss_reduction="sum"), 6 examples
OPACUS_FLAT_SUM = [
    [
        [-0.204175879, 0.296034896, -0.381968773, 0.460257542],
        [-0.296436252, 0.319151056, -0.335478049, 0.345090447],
        [-0.255474363, 0.23859731, -0.216944731, 0.190950001],
    ],
    [-0.130800015, -0.101040812, -0.0920362973],
    [[0.0261620229, 0.120551728, 0.0720584425], [-0.0261620229, -0.120551728, -0.0720584425]],
    [-0.0460899266, 0.0460899266],
]
# DPPerLayerOptimizer(max_grad_norm=[0.5, 0.25, 1.0, 0.1], expected_batch_size=6, "mean")
OPACUS_PER_LAYER = [
    [
        [-0.0426382694, 0.059412175, -0.0749969455, 0.0890806516],
        [-0.0582995058, 0.0626078388, -0.0656630755, 0.0674040653],
        [-0.0517178383, 0.0488472229, -0.0449989299, 0.0402499831],
    ],
    [0.00227192491, 0.00614325091, 0.00285415013],
    [[0.103091381, 0.239870568, 0.186691416], [-0.103091381, -0.239870568, -0.186691416]],
    [0.00944144853, -0.00944144853],
]


def _assert_opacus(got, want, rtol=1e-5, atol=1e-7):
    for k, w in zip(_OPACUS_KEYS, want):
        np.testing.assert_allclose(np.asarray(got[k], np.float64), w, rtol=rtol, atol=atol)


def test_opacus_flat_clipping_mean_over_expected_batch_size():
    # privacy_engine_test.py test_flat_clipping / DPOptimizer.clip_and_accumulate +
    # scale_grad: Opacus divides by expected_batch_size, not the batch drawn; in
    # jaxclip that is reduce="sum" and a scale by 1 / expected_batch_size.
    params, (x, y) = _opacus_params(), _opacus_data(6)
    grads = _OPACUS_PER_EXAMPLE(params, x, y)
    tx = optax.chain(jaxclip.clip_per_example(1.0, reduce="sum"), optax.scale(1 / 8))
    out, _ = tx.update(grads, tx.init(params))
    _assert_opacus(out, OPACUS_FLAT_MEAN_E8)
    # clipped_grad from the loss (microbatches of 4, one padded) is the same sum.
    g = jaxclip.clipped_grad(_opacus_loss, 1.0, microbatch_size=4, batch_argnums=(1, 2))
    _assert_opacus(jax.tree.map(lambda v: v / 8, g(params, x, y)), OPACUS_FLAT_MEAN_E8)
    # loss_reduction="sum": p.grad is the clipped sum itself.
    tx = jaxclip.clip_per_example(0.5, reduce="sum")
    _assert_opacus(tx.update(grads, tx.init(params))[0], OPACUS_FLAT_SUM)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_opacus_per_layer_clipping_list_of_max_grad_norm():
    # test_per_layer_clipping / DPPerLayerOptimizer: each parameter to its own norm,
    # expected_batch_size == batch size, so reduce="mean" divides alike.
    params, (x, y) = _opacus_params(), _opacus_data(6)
    grads = _OPACUS_PER_EXAMPLE(params, x, y)
    clips = dict(zip(_OPACUS_KEYS, (0.5, 0.25, 1.0, 0.1)))
    tx = jaxclip.clip_per_example(clips, group=lambda path, leaf: path)
    _assert_opacus(tx.update(grads, tx.init(params))[0], OPACUS_PER_LAYER)
    g = jaxclip.clipped_grad(
        _opacus_loss, clips, batch_argnums=(1, 2), group=lambda path, leaf: path, reduce="mean"
    )
    _assert_opacus(g(params, x, y), OPACUS_PER_LAYER)
    # Opacus' noise for the list: noise_multiplier * ||max_grad_norm||_2, as jaxclip's.
    assert jaxclip.per_example.sensitivity(clips) == pytest.approx(
        math.sqrt(0.5**2 + 0.25**2 + 1.0**2 + 0.1**2), rel=1e-12
    )


def test_opacus_sample_grad_aggregation_and_noise_level():
    # test_sample_grad_aggregation: a huge clip norm, no noise: the mean of the
    # per-sample gradients. test_noise_level: zero gradients, the update's std is
    # noise_multiplier * max_grad_norm / expected_batch_size; test_noise_changes_every_time.
    params, (x, y) = _opacus_params(), _opacus_data(6)
    grads = _OPACUS_PER_EXAMPLE(params, x, y)
    tx = jaxclip.clip_per_example(99999.0)
    out, _ = tx.update(grads, tx.init(params))
    for k in _OPACUS_KEYS:
        np.testing.assert_allclose(out[k], np.mean(np.asarray(grads[k], np.float64), 0), 1e-5)
    zeros = {"w": jnp.zeros((5, 20000), jnp.float32)}
    tx = optax.chain(
        jaxclip.clip_per_example(2.0, noise_multiplier=1.5, reduce="sum", seed=3),
        optax.scale(1 / 64),
    )
    state = tx.init({"w": jnp.zeros(20000)})
    step = jax.jit(tx.update)
    first, state = step(zeros, state)
    second, _ = step(zeros, state)
    assert abs(np.std(np.asarray(first["w"])) / (1.5 * 2.0 / 64) - 1) < 0.02
    assert not np.allclose(first["w"], second["w"])


# AdaClipDPOptimizer(max_grad_norm=C0, target_unclipped_quantile=q,
# clipbound_learning_rate=lr, unclipped_num_std=1e-12, noise_multiplier=0,
# loss_reduction="sum", max_clipbound=1e9, min_clipbound=1e-9): max_grad_norm before
# each of 4 steps and after the last, and p.grad of the 4th step.
OPACUS_ADACLIP = {
    (0.5, 0.5, 0.2): (
        [0.5, 0.534469545, 0.571315408, 0.590680242, 0.610701442],
        [
            [
                [-0.257663751, 0.367049692, -0.469089132, 0.561739749],
                [-0.361319472, 0.388714193, -0.408328798, 0.419770698],
                [-0.317684999, 0.298598565, -0.273535678, 0.242997973],
            ],
            [-0.162545087, -0.123932725, -0.116957038],
            [
                [0.0374198324, 0.150695268, 0.0916501833],
                [-0.0374198324, -0.150695268, -0.0916501833],
            ],
            [-0.0597648475, 0.0597648475],
        ],
    ),
    (2.0, 0.0, math.log(2.0)): (
        [2.0, 1.58740103, 1.25992107, 1.0, 0.793700516],
        [
            [
                [-0.546433697, 0.737517327, -0.913839542, 1.07187125],
                [-0.682648258, 0.732720488, -0.768127312, 0.788160063],
                [-0.646178617, 0.61972166, -0.58086097, 0.530374343],
            ],
            [-0.331865283, -0.24291006, -0.255665561],
            [
                [0.100967981, 0.305193162, 0.192686596],
                [-0.100967981, -0.305193162, -0.192686596],
            ],
            [-0.146141867, 0.146141867],
        ],
    ),
}


@pytest.mark.parametrize("case", list(OPACUS_ADACLIP))
def test_opacus_adaclip_optimizer(case):
    # AdaClipDPOptimizer: geometric update from the fraction of unclipped examples over
    # the examples drawn (expected_num_records=None), no count noise.
    c0, q, lr = case
    clips, last = OPACUS_ADACLIP[case]
    params, (x, y) = _opacus_params(), _opacus_data(6)
    grads = _OPACUS_PER_EXAMPLE(params, x, y)
    tx = jaxclip.adaptive_clip_per_example(
        c0, target_unclipped_quantile=q, learning_rate=lr, reduce="sum", clipped_count_stddev=0.0
    )
    state, got = tx.init(params), [c0]
    step = jax.jit(tx.update)
    for _ in range(4):
        out, state = step(grads, state)
        got.append(float(state.clip_norm))
    np.testing.assert_allclose(got, clips, rtol=2e-6)
    _assert_opacus(out, last)
    # Opacus' add_noise uses (z**-2 - (2 * unclipped_num_std)**-2)**-1/2 for the sum.
    z, s = 1.1, 0.9
    want = (z**-2 - (2 * s) ** -2) ** -0.5
    assert jaxclip.adaptive_clip_noise_multiplier(z, s) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------
# TF-Privacy 0.9.0 (tensorflow 2.21.0): dp_query tests and the Keras optimizers' clipping.
# Literals below were recorded from TF-Privacy itself where the test says so; the rest
# are TF-Privacy's own expected values.

_SUM = jax.jit(lambda g, c: jaxclip.clip_tree_per_example(g, c)[0])


def test_tf_privacy_gaussian_sum_query_no_noise():
    # gaussian_query_test.py: test_gaussian_sum_no_clip_no_noise,
    # test_gaussian_sum_with_clip_no_noise, test_gaussian_sum_with_changing_clip_no_noise
    # (a clip norm of 0, as the tf.Variable assigned 0, is reached traced).
    np.testing.assert_allclose(_SUM(jnp.array([[2.0, 0.0], [-1.0, 1.0]]), 10.0), [1.0, 1.0])
    records = jnp.array([[-6.0, 8.0], [4.0, -3.0]])  # the first clipped to [-3, 4]
    np.testing.assert_allclose(_SUM(records, 5.0), [1.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(_SUM(records, 0.0), [0.0, 0.0])
    # normalized_query_test.py test_normalization: the sum over a denominator of 2.
    tx = optax.chain(jaxclip.clip_per_example(5.0, reduce="sum"), optax.scale(1 / 2.0))
    out, _ = tx.update({"r": records}, tx.init({"r": jnp.zeros(2)}))
    np.testing.assert_allclose(out["r"], [0.5, 0.5], rtol=1e-6)


def test_tf_privacy_gaussian_sum_query_with_noise():
    # test_gaussian_sum_with_noise and quantile_adaptive_clip_sum_query_test.py
    # test_sum_with_noise: std 1.0 (clip 5, noise_multiplier 1/5) over 1000 draws, within
    # 0.1 of it.
    grads = {"r": jnp.array([[2.71828], [3.14159]])}
    tx = jaxclip.clip_per_example(5.0, noise_multiplier=1.0 / 5.0, reduce="sum")
    state = tx.init({"r": jnp.zeros(1)})
    keys = jax.random.split(jax.random.key(0), 1000)
    draws = jax.jit(jax.vmap(lambda k: tx.update(grads, state._replace(key=k))[0]["r"][0]))(keys)
    assert abs(float(np.std(np.asarray(draws))) - 1.0) < 0.1
    assert abs(float(np.mean(np.asarray(draws))) - 5.85987) < 0.2


def test_tf_privacy_adaptive_sum_no_adaptation():
    # quantile_adaptive_clip_sum_query_test.py: test_sum_no_clip_no_noise,
    # test_sum_with_clip_no_noise (learning_rate 0: the clip norm stays).
    for records, clip in (([[2.0, 0.0], [-1.0, 1.0]], 10.0), ([[-6.0, 8.0], [4.0, -3.0]], 5.0)):
        tx = jaxclip.adaptive_clip_per_example(
            clip, target_unclipped_quantile=1.0, learning_rate=0.0, clipped_count_stddev=0.0,
            expected_num_records=2.0, reduce="sum",
        )  # fmt: skip
        out, state = tx.update({"r": jnp.asarray(records)}, tx.init({"r": jnp.zeros(2)}))
        np.testing.assert_allclose(out["r"], [1.0, 1.0], rtol=1e-6)
        assert float(state.clip_norm) == clip


# The clip norm at steps 41..49 (TF-Privacy's test checks it is near 5 there) of
# QuantileAdaptiveClipSumQuery(noise_multiplier=0, target 0.5, clipped_count_stddev=0,
# expected_num_records=n), recorded from TF-Privacy 0.9.0: test_adaptation_linspace
# (21 records linspace(0, 10), learning rate 1) and test_adaptation_all_equal (20 records
# of 5.0, learning rate 1/sqrt(t + 1) set before step t).
TF_ADAPTATION = {
    ("linspace", 1.0, True): [5.0482745, 4.9294972] * 4 + [5.0482745],
    ("linspace", 1.0, False): [5, 4.9761906] * 4 + [5],
    ("linspace", 10.0, True): [4.8954163, 5.0133724] * 4 + [4.8954163],
    ("linspace", 10.0, False): [5.0000005, 4.976191] * 4 + [5.0000005],
    ("all_equal", 1.0, True): [
        4.6289334, 4.9956913, 5.3868117, 4.9999008, 5.3824253, 5.0038447, 4.6554461,
        5.0001421, 4.6587896,
    ],
    ("all_equal", 1.0, False): [
        5.0008578, 4.9246087, 4.9999866, 5.074522, 5.0008011, 4.9278684, 5.0000372,
        4.9286084, 4.9993191,
    ],
    ("all_equal", 10.0, True): [
        4.7907567, 5.1703362, 4.7949338, 5.1659837, 4.798842, 5.1619124, 4.8025084,
        5.158093, 4.8059573,
    ],
    ("all_equal", 10.0, False): [
        5.0237379, 4.9474888, 5.0228667, 4.9483314, 5.0220523, 4.9491196, 5.0212884,
        4.9498596, 5.0205703,
    ],
}  # fmt: skip


@functools.cache
def _adaptive_scan(geometric: bool):
    tx = optax.inject_hyperparams(jaxclip.adaptive_clip_per_example)(
        initial_clip_norm=1.0, learning_rate=1.0, target_unclipped_quantile=0.5,
        clipped_count_stddev=0.0, expected_num_records=20.0, geometric_update=geometric,
        reduce="sum",
    )  # fmt: skip

    def run(records, start, n, rates):
        state = tx.init({"r": jnp.zeros(1)})
        inner = state.inner_state._replace(clip_norm=start)
        state = state._replace(inner_state=inner)
        state.hyperparams["expected_num_records"] = n

        def body(state, rate):
            state.hyperparams["learning_rate"] = rate
            _, state = tx.update({"r": records}, state)
            return state, state.inner_state.clip_norm

        return jax.lax.scan(body, state, rates)[1]

    return jax.jit(run)


@pytest.mark.parametrize("case", list(TF_ADAPTATION))
def test_tf_privacy_adaptation_linspace_and_all_equal(case):
    kind, start, geometric = case
    if kind == "linspace":
        records, rates = np.linspace(0.0, 10.0, 21, dtype=np.float32), np.ones(50, np.float32)
    else:
        records, rates = np.full(20, 5.0, np.float32), 1 / np.sqrt(np.arange(1.0, 51.0))
    clips = _adaptive_scan(geometric)(
        jnp.asarray(records)[:, None], jnp.float32(start), jnp.float32(len(records)),
        jnp.asarray(rates, jnp.float32),
    )  # fmt: skip
    tail = np.asarray(clips[41:])
    np.testing.assert_allclose(tail, TF_ADAPTATION[case], rtol=1e-5)
    assert np.all(np.abs(tail - 5.0) < (0.25 if kind == "linspace" else 0.5))  # TF's check


def test_tf_privacy_quantile_estimate_clamped_and_fixed_denominator():
    # quantile_estimator_query_test.py test_target_zero 'fixed' (expected_num_records
    # 2.0): 9, 8, 7.5, 7, 7. And, recorded from TF-Privacy 0.9.0, an expected count (2)
    # below the records' (4): the noised fraction 1.5 is clamped to 1.
    tx = jaxclip.adaptive_clip_per_example(
        10.0, target_unclipped_quantile=0.0, learning_rate=1.0, geometric_update=False,
        expected_num_records=2.0, reduce="sum",
    )  # fmt: skip
    state, clips = tx.init({"r": jnp.zeros(1)}), []
    for _ in range(5):
        _, state = tx.update({"r": jnp.array([[8.5], [7.25]])}, state)
        clips.append(float(state.clip_norm))
    np.testing.assert_allclose(clips, [9.0, 8.0, 7.5, 7.0, 7.0], rtol=1e-6)
    tx = jaxclip.adaptive_clip_per_example(
        1.0, target_unclipped_quantile=0.3, learning_rate=0.5, expected_num_records=2.0,
        reduce="sum",
    )  # fmt: skip
    state, clips, sums = tx.init({"r": jnp.zeros(1)}), [], []
    for _ in range(4):
        out, state = tx.update({"r": jnp.array([[0.5], [0.25], [-0.75], [3.0]])}, state)
        clips.append(float(state.clip_norm))
        sums.append(float(out["r"][0]))
    np.testing.assert_allclose(clips, [0.70468807, 0.63762814, 0.57694983, 0.52204579], 1e-6)
    np.testing.assert_allclose(sums, [1.0, 0.75, 0.75, 0.75], rtol=1e-6)


def test_tf_privacy_clip_gradients_vmap():
    # dp_optimizer_keras_vectorized.clip_gradients_vmap(g, 2.5) under tf.vectorized_map,
    # recorded from TF-Privacy 0.9.0.
    g0 = jnp.array([[[3.0, 0.0], [0.0, 4.0]], [[0.3, 0.1], [0.2, 0.0]], [[-6.0, 1.0], [2.0, 2.0]]])
    g1 = jnp.array([[12.0], [0.1], [-3.0]])
    (c0, c1), _ = jaxclip.clip_tree_per_example([g0, g1], 2.5, reduce=None)
    want0 = [
        [[0.576923072, 0.0], [0.0, 0.769230723]],
        [[0.300000012, 0.100000001], [0.200000003, 0.0]],
        [[-2.04124141, 0.340206891], [0.680413783, 0.680413783]],
    ]
    np.testing.assert_allclose(c0, want0, rtol=1e-6)
    np.testing.assert_allclose(c1, [[2.30769229], [0.100000001], [-1.0206207]], rtol=1e-6)


def _tf_loss(var, d0, d1):  # dp_optimizer_keras_test.py _loss: one microbatch's mean
    v0, v1 = var
    per = 0.5 * jnp.sum((d0 - v0) ** 2, axis=-1) + 0.5 * jnp.sum((d1 - v1) ** 2, axis=-1)
    return jnp.mean(per)


@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
def test_tf_privacy_clipping_norm_multiple_variables_per_microbatch(num_microbatches):
    # dp_optimizer_keras_test.py testClippingNormMultipleVariables (and testClippingNorm):
    # TF-Privacy's num_microbatches clips the gradient of each microbatch's MEAN loss,
    # which jaxclip's microbatch_size does not do (it only bounds memory). In jaxclip: give
    # clipped_grad the batch as (num_microbatches, size, ...) and the microbatch's mean loss.
    var = (jnp.array([1.0, 2.0]), jnp.array([3.0]))
    d0 = np.array([[3.0, 6.0], [5.0, 6.0], [4.0, 8.0], [-1.0, 0.0]])
    d1 = np.array([[8.0], [2.0], [3.0], [1.0]])
    m = num_microbatches
    g = jaxclip.clipped_grad(_tf_loss, 2.5, batch_argnums=(1, 2), reduce="mean")
    out = g(var, jnp.asarray(d0.reshape(m, 4 // m, 2)), jnp.asarray(d1.reshape(m, 4 // m, 1)))
    # TF-Privacy's own expected values (float64 NumPy).
    grads = np.concatenate([d0 - [1.0, 2.0], d1 - [3.0]], axis=1)
    grads = np.mean(grads.reshape(m, 4 // m, -1), axis=1)
    norms = np.linalg.norm(grads, axis=1)
    want = -np.mean(grads * (2.5 / np.maximum(2.5, norms))[:, None], axis=0)
    # float32 sums of terms of either sign: an absolute tolerance
    np.testing.assert_allclose(out[0], want[:2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[1], want[2:], rtol=1e-6, atol=1e-6)
    # testClippingNorm: one microbatch of [[3, 4], [6, 8]] at 0: mean -(4.5, 6), to norm 1.
    one = jaxclip.clipped_grad(lambda v, d: 0.5 * jnp.mean(jnp.sum((d - v) ** 2, -1)), 1.0)
    np.testing.assert_allclose(
        one(jnp.zeros(2), jnp.array([[[3.0, 4.0], [6.0, 8.0]]])), [-0.6, -0.8], rtol=1e-6
    )


# ---------------------------------------------------------------------------------------
# jax-privacy 2.0.0: tests/gradient_clipping_test.py and tests/clipping_test.py


def _mean_quadratic_loss(params, x):  # jax-privacy's: one example as a batch of 1
    return 0.5 * jnp.mean((params - x) ** 2)


@pytest.mark.parametrize("micro", [None, 1, 3])
def test_jax_privacy_sum_clipped_grad(micro):
    # test_sum_clipped_grad_basic, _with_padding_examples (without rescale_to_unit_norm,
    # which jaxclip lacks: the values times 2.5), _return_metrics, _values.
    params, x = jnp.array([2.0]), jnp.array([[1.0], [4.0], [7.0]])
    g = jax.jit(
        jaxclip.clipped_grad(
            _mean_quadratic_loss, 2.5, keep_batch_dim=True, microbatch_size=micro,
            return_norms=True, return_values=True,
        )
    )  # fmt: skip
    total, aux = g(params, x)
    np.testing.assert_allclose(total, [-3.5], atol=1e-6)
    np.testing.assert_allclose(aux.norms, [1.0, 2.0, 5.0], rtol=1e-6)
    np.testing.assert_allclose(aux.values, [0.5, 2.0, 12.5], rtol=1e-6)
    for pad, want in (([True] * 3, 0.0), ([False, True, True], 1.0)):
        np.testing.assert_allclose(g(params, x, is_padding_example=jnp.array(pad))[0], [want])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_jax_privacy_sum_clipped_grad_float16(dtype):  # test_sum_clipped_grad_float16
    g = jax.jit(jaxclip.clipped_grad(_mean_quadratic_loss, 2.5, keep_batch_dim=True))
    out = g(jnp.array([2.0], dtype), jnp.array([[1.0], [4.0], [7.0]], dtype))
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), [-3.5], atol=1e-6)


def test_jax_privacy_extra_batch_axis_and_leaf_structure():
    # test_sum_clipped_grad_extra_batch_axis: users of 3 examples each, keep_batch_dim=False,
    # a large clip: the sum over users / users is the plain gradient.
    params = jnp.array([2.0])
    x = jnp.array([[[1.0], [2.0], [3.0]], [[3.0], [4.0], [5.0]]])
    for micro in (None, 1, 2):
        g = jaxclip.clipped_grad(_mean_quadratic_loss, 1000.0, microbatch_size=micro)
        np.testing.assert_allclose(
            g(params, x) / 2, jax.grad(_mean_quadratic_loss)(params, x.reshape(6, 1)), 1e-6
        )


def _jp_single(x):  # clipping_test.py single_example_fun
    return x + 2.0


_JP_CLIPPED_FUN = jax.jit(lambda d: jaxclip.clip_tree_per_example(jax.vmap(_jp_single)(d), 1.0)[0])


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_jax_privacy_clip_sum_sensitivity():
    # clipping_test.py test_clip_sum_sensitivity: replace-one (2C), zero-out (padding, C),
    # add/remove-one (C), jax-privacy's clipped_fun as clip_tree_per_example of the outputs.
    data = jax.random.normal(jax.random.key(0), (15, 4))
    base = _JP_CLIPPED_FUN(data)
    neighbor = data.at[3].set(jnp.array([-10.0, 10.0, 20.0, 20.0]))
    assert float(jnp.linalg.norm(base - _JP_CLIPPED_FUN(neighbor))) <= 2.0 + 1e-6
    assert float(jnp.linalg.norm(base - _JP_CLIPPED_FUN(data[1:]))) <= 1.0 + 1e-6
    g = jaxclip.clipped_grad(lambda w, d: jnp.dot(w, _jp_single(d)), 1.0)
    pad = jnp.zeros(15, bool).at[3].set(True)
    diff = g(jnp.zeros(4), data) - g(jnp.zeros(4), data, is_padding_example=pad)
    assert float(jnp.linalg.norm(diff)) <= 1.0 + 1e-6
    # test_return_norms_without_aux_matches_documented_signature: clip norm inf.
    total, norms = jaxclip.clip_tree_per_example(jnp.array([1.0, 2.0, 3.0])[:, None] ** 2, math.inf)
    np.testing.assert_allclose(total, [14.0])
    np.testing.assert_allclose(norms, [1.0, 4.0, 9.0])


def test_jax_privacy_nan_example_is_reported_not_zeroed():
    # clipping_test.py test_nan_safe_by_default: jax-privacy's nan_safe=True zeros a
    # non-finite example's entries, so replace-one neighbours still differ by at most 2C.
    # jaxclip never zeros a gradient silently: the sum is NaN (dp_sgd.md says the
    # sensitivity bound holds for finite gradients), and with the NaN example
    # zeroed, as jax-privacy sums it, the bound holds.
    data = jax.random.normal(jax.random.key(0), (15, 4)).at[5].set(jnp.nan)
    assert bool(jnp.all(jnp.isnan(_JP_CLIPPED_FUN(data))))
    finite = data.at[5].set(0.0)
    neighbor = finite.at[3].set(jnp.array([-10.0, 10.0, 20.0, 20.0]))
    diff = jnp.linalg.norm(_JP_CLIPPED_FUN(finite) - _JP_CLIPPED_FUN(neighbor))
    assert float(diff) <= 2.0 + 1e-6


# ---------------------------------------------------------------------------------------
# Edge cases of the peers' clipping tests and documented behaviours, with the peers' own
# outputs recorded as literals: torch 2.14.1 (test_nn.py TestNNDeviceType
# test_clip_grad_norm_error_if_nonfinite, test_clip_grad_value, clip_grads_with_norm_),
# tensorflow 2.21.0 (clip_ops_test.py ClipTest) and paddlepaddle 3.3.1 on CPU
# (test_gradient_clip.py, test_clip_by_norm_op.py). Where jaxclip differs on purpose,
# the test names the line of docs/guides/porting.md that says so.

_GN_P = {
    p: jax.jit(lambda g, p=p: jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=p))
    for p in (0.1, 1.0, 2.0, 3.5, math.inf)
}


@pytest.mark.parametrize("scalar", [math.inf, -math.inf, math.nan, 2e22, -2e22])
def test_torch_clip_grad_norm_error_if_nonfinite_cases(scalar):
    # test_clip_grad_norm_error_if_nonfinite's positive norm types (0.1, 1, 2, 3.5, inf;
    # jaxclip refuses 0 and negative ones, see test_torch_norm_types_jaxclip_refuses):
    # grad_only_one_elem x prefix_finite_grad_param, ten elements. torch 2.14.1 raised for
    # every inf, -inf and NaN case and for none of the 2e22 ones (which it runs in
    # float64; in float32 its squares overflow at p 2 and 3.5 and it raises there too,
    # jaxclip does not: porting.md "Where a peer's norm overflows").
    for one in (False, True):
        for prefix in (False, True):
            g = np.zeros(10, np.float32)
            g[: 1 if one else 10] = scalar
            # A zero-gradient prefix changes no positive-p norm: one shape, one compile.
            grads = [jnp.full(10, 1.0 if prefix else 0.0), jnp.asarray(g)]
            for p, step in _GN_P.items():
                _, total = step(grads)
                x = np.concatenate([np.ones(10) if prefix else np.zeros(10), np.float64(g)])
                if math.isinf(scalar) or math.isnan(scalar):
                    assert not np.isfinite(total)
                    assert np.isnan(total) == math.isnan(scalar)
                else:
                    a = np.abs(x) / np.abs(x).max()  # scaled: 2e22**p overflows no float64
                    want = np.abs(x).max() * (1.0 if p == math.inf else np.sum(a**p) ** (1 / p))
                    np.testing.assert_allclose(total, want, rtol=2e-6)
            if not np.isfinite(scalar):
                with pytest.raises(RuntimeError, match="non-finite"):
                    jaxclip.clip_tree_by_global_norm(grads, 1.0, error_if_nonfinite=True)


def test_torch_clip_grad_norm_nonfinite_outputs_and_empty():
    # torch 2.14.1, foreach None/True/False alike, p 1, 2, inf:
    # [1, inf], [1, 1] -> total inf, [0, nan], [0, 0]; [1, nan], [1, 1] -> all NaN.
    for p in (1.0, 2.0, math.inf):
        out, total = _GN_P[p]([jnp.array([1.0, jnp.inf]), jnp.ones(2)])
        assert total == np.inf
        np.testing.assert_array_equal(out[0], [0.0, np.nan])
        np.testing.assert_array_equal(out[1], [0.0, 0.0])
        out, total = _GN_P[p]([jnp.array([1.0, jnp.nan]), jnp.ones(2)])
        assert np.isnan(total) and all(np.isnan(o).all() for o in out)
    # clip_grad_norm_([]) and all-None grads -> tensor(0.); None grads are skipped.
    for tree in ([], [None, None]):
        out, total = jaxclip.clip_tree_by_global_norm(tree, 1.0)
        assert out == tree and float(total) == 0.0
    (none, b), total = jaxclip.clip_tree_by_global_norm([None, jnp.array([3.0, 4.0])], 1.0)
    assert none is None and float(total) == 5.0
    np.testing.assert_allclose(b, [0.6, 0.8], rtol=1e-6)


def test_torch_norm_types_jaxclip_refuses():
    # torch 2.14.1 clip_grad_norm_ of [3, 0], [0, 4] at max_norm 1: norm_type 0 -> total
    # 2.0 (vector_norm's ord 0 twice: the number of tensors with a nonzero), -inf and -1
    # -> 0.0 (no clipping), 1e-4 -> inf (all zeros). jaxclip refuses these
    # (porting.md: "norm_type ... p >= 2**-10 or inf").
    for p in (0, 0.0, -1.0, -math.inf, 1e-4):
        with pytest.raises(ValueError, match="norm_type"):
            jaxclip.clip_tree_by_global_norm([jnp.array([3.0, 0.0])], 1.0, norm_type=p)
    # 'inf' as a string, as torch takes it.
    assert float(jaxclip.global_norm([jnp.array([3.0, -4.0])], "inf")) == 4.0


def test_torch_16bit_and_mixed_dtype_totals():
    # torch 2.14.1: the total has the gradients' dtype (float16 [3, 4] -> tensor(5.,
    # dtype=float16)) and overflows with it: nine float16 30000s -> total inf, gradients
    # all 0; bfloat16 30000s -> 90112 (bfloat16), each 0.3320. jaxclip's total is float32
    # (porting.md "the total norm is float32"), and it clips: each 1/3.
    out, total = jaxclip.clip_tree_by_global_norm([jnp.full(9, 30000.0, jnp.float16)], 1.0)
    assert total.dtype == jnp.float32 and out[0].dtype == jnp.float16
    np.testing.assert_allclose(total, 90000.0, rtol=1e-6)  # 30000 is a float16
    np.testing.assert_allclose(np.float32(out[0]), 1 / 3, rtol=1e-3)
    # Mixed float16 + float32 leaves: torch's total is float32, 5.0; grads 0.6001 (f16), 0.8.
    (a, b), total = jaxclip.clip_tree_by_global_norm(
        [jnp.array([3.0, 0.0], jnp.float16), jnp.array([0.0, 4.0])], 1.0
    )
    assert total.dtype == jnp.float32 and float(total) == 5.0
    assert a.dtype == jnp.float16 and b.dtype == jnp.float32
    np.testing.assert_allclose(np.float32(a), [0.6, 0.0], rtol=1e-3)
    np.testing.assert_allclose(b, [0.0, 0.8], rtol=1e-6)


def test_torch_clip_grads_with_norm_and_max_norm_inf():
    # torch 2.14.1 clip_grads_with_norm_(params, 1.0, total) on [3, 0], [0, 4]:
    # total 10 -> [0.3, 0], [0, 0.4]; 0.5 and 0 -> unchanged; inf -> all 0.
    grads = [jnp.array([3.0, 0.0]), jnp.array([0.0, 4.0])]
    for used, want in ((10.0, 0.1), (0.5, 1.0), (0.0, 1.0), (math.inf, 0.0)):
        out, _ = jaxclip.clip_tree_by_global_norm(grads, 1.0, use_norm=used)
        for o, g in zip(out, grads):
            np.testing.assert_allclose(o, np.asarray(g) * want, rtol=1e-6)
    # max_norm inf: torch keeps finite gradients as they are ([3, 4] -> [3, 4]) but turns
    # an inf total into all-NaN gradients (inf / inf); TensorFlow and Paddle give NaN even
    # for finite ones (tf.clip_by_global_norm and ClipGradByGlobalNorm of [[-2, 0, 0],
    # [4, 0, 0]], [1, -2] at inf: all NaN). jaxclip returns them unchanged, inf included
    # (porting.md "clip_norm=float('inf')").
    out, total = jaxclip.clip_tree_by_global_norm(grads, math.inf)
    assert float(total) == 5.0 and all(np.array_equal(o, g) for o, g in zip(out, grads))
    bad = [jnp.array([1.0, jnp.inf]), jnp.ones(2)]
    out, total = jaxclip.clip_tree_by_global_norm(bad, math.inf)
    assert total == np.inf and all(np.array_equal(o, g) for o, g in zip(out, bad))


def test_torch_clip_grad_value_bounds_jaxclip_refuses():
    # torch 2.14.1 clip_grad_value_(p, v) is clamp(-v, v): v=0 -> all 0, v=-1 -> all -1
    # (torch.clamp with min > max gives max), None -> TypeError. Paddle's ClipGradByValue
    # asserts max > 0 when min is None, as jaxclip checks (porting.md).
    for v in (0.0, -1.0):
        with pytest.raises(ValueError, match="max must be > 0"):
            jaxclip.clip_by_value(v)
    with pytest.raises(TypeError):
        jaxclip.clip_by_value(None)
    # v = inf: unchanged in torch, as here.
    x = jnp.array([-3.0, 0.2, 2.0])
    np.testing.assert_array_equal(jaxclip.clip_tree_by_value(x, math.inf), x)


_TF_M = jnp.array([[-3.0, 0.0, 0.0], [4.0, 3.0, 0.0]])
_TF_NORM = jax.jit(
    lambda t, axes: jaxclip.clip_tree_by_norm(t, 4.0, axes=axes)[0], static_argnames="axes"
)


def test_tf_clip_by_norm_axes_forms():
    # tf.clip_by_norm(m, 4.0, axes=...) in tensorflow 2.21.0.
    rows = [[-3.0, 0.0, 0.0], [3.2000000476837158, 2.4000000953674316, 0.0]]
    cols = [[-2.4000000953674316, 0.0, 0.0], [3.200000047683716, 3.0, 0.0]]
    both = [[-2.057983160018921, 0.0, 0.0], [2.7439775466918945, 2.057983160018921, 0.0]]
    for axes, want in (
        (1, rows),
        ((1,), rows),
        (-1, rows),
        ((-2,), cols),
        ((0, 1), both),
        ((), _TF_M),
    ):
        np.testing.assert_allclose(_TF_NORM(_TF_M, axes), want, rtol=1e-6)
    np.testing.assert_allclose(jaxclip.clip_tree_by_norm(_TF_M, 4.0, axes=[-2])[0], cols, 1e-6)
    # TF: InvalidArgumentError for [1, -1] (duplicate) and 2 (out of range).
    for axes in ([1, -1], 2):
        with pytest.raises(ValueError, match="axes"):
            jaxclip.clip_tree_by_norm(_TF_M, 4.0, axes=axes)


def test_tf_clip_by_norm_special_inputs():
    # tensorflow 2.21.0: zeros -> zeros; [3, inf] -> [0, nan]; [3, nan] -> [nan, nan];
    # a (0, 3) tensor -> (0, 3), with and without axes=[1].
    step = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0)[0])
    np.testing.assert_array_equal(step(jnp.zeros(2)), [0.0, 0.0])
    np.testing.assert_array_equal(step(jnp.array([3.0, jnp.inf])), [0.0, np.nan])
    assert np.isnan(step(jnp.array([3.0, jnp.nan]))).all()
    for axes in (None, 1):
        out, norms = jaxclip.clip_tree_by_norm(jnp.zeros((0, 3)), 1.0, axes=axes)
        assert out.shape == (0, 3) and np.shape(norms) == (() if axes is None else (0,))
    # tf.clip_by_norm of an int32 tensor: InvalidArgumentError. jaxclip returns integer
    # leaves unchanged, as it does gradients' integer leaves (porting.md).
    out, _ = jaxclip.clip_tree_by_norm(jnp.array([3, 4]), 1.0)
    np.testing.assert_array_equal(out, [3, 4])


def test_tf_clip_by_global_norm_none_inf_and_average_norm():
    x0, x1 = jnp.array([[-2.0, 0.0, 0.0], [4.0, 0.0, 0.0]]), jnp.array([1.0, -2.0])
    # tensorflow 2.21.0: [x0, None] -> norm 4.4721360206604, [[-0.894427, ..], [1.788854,
    # ..]], None; [None, None] and [] -> norm 0.0, unchanged.
    (c0, none), gn = jaxclip.clip_tree_by_global_norm([x0, None], 2.0)
    assert none is None
    np.testing.assert_allclose(gn, 4.4721360206604, rtol=1e-7)
    np.testing.assert_allclose(c0, [[-0.8944271802902222, 0, 0], [1.7888543605804443, 0, 0]], 1e-6)
    for tree in ([None, None], []):
        out, gn = jaxclip.clip_tree_by_global_norm(tree, 2.0)
        assert out == tree and float(gn) == 0.0
    # An infinite global norm: TF gives [[nan, nan], [nan, nan]]; jaxclip, as torch,
    # [[0, nan], [0, 0]] (porting.md "For an infinite global norm").
    out, gn = jaxclip.clip_tree_by_global_norm([jnp.array([1.0, jnp.inf]), x1], 2.0)
    assert gn == np.inf
    np.testing.assert_array_equal(out[0], [0.0, np.nan])
    np.testing.assert_array_equal(out[1], [0.0, 0.0])
    # tf.compat.v1.clip_by_average_norm([[-3, 0, 0], [4, 0, 0]], 0.8) -> [[-2.88, 0, 0],
    # [3.84, 0, 0]]: clip_by_norm at 0.8 times the size (porting.md).
    t = jnp.array([[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
    out, _ = jaxclip.clip_tree_by_norm(t, 0.8 * t.size)
    np.testing.assert_allclose(out, [[-2.88, 0, 0], [3.84, 0, 0]], rtol=1e-6)


def test_tf_clip_by_value_tensor_bounds():
    # tf.clip_by_value(x, [[0], [-3]], [2, 4, 6]) in tensorflow 2.21.0 -> [[1, 4, 6],
    # [-1, -3, -3]]; min > max: TF gives min everywhere ([1, 1, 1]), torch max; jaxclip
    # refuses concrete bounds that cross.
    x = jnp.array([[1.0, 5.0, 9.0], [-1.0, -5.0, -9.0]])
    out = jaxclip.clip_tree_by_value(x, jnp.array([2.0, 4.0, 6.0]), jnp.array([[0.0], [-3.0]]))
    np.testing.assert_array_equal(out, [[1, 4, 6], [-1, -3, -3]])
    with pytest.raises(ValueError, match="min must be <= max"):
        jaxclip.clip_tree_by_value(x, -1.0, 1.0)
    # A NaN bound is named as NaN, not as min > max ("got min=nan > max=1.0").
    with pytest.raises(ValueError, match="min=nan is NaN"):
        jaxclip.clip_tree_by_value(x, 1.0, math.nan)
    # Also a bfloat16 bound (ml_dtypes' bfloat16 is not a NumPy floating subtype).
    with pytest.raises(ValueError, match="is NaN"):
        jaxclip.clip_tree_by_value(x, jnp.array(math.nan, jnp.bfloat16), -1.0)
    # And a NaN max with min=None (the range [-max, max]), not "max must be > 0".
    with pytest.raises(ValueError, match=r"max=nan is NaN"):
        jaxclip.clip_tree_by_value(x, math.nan)


def test_clip_by_value_bound_past_the_dtype_range_warns_nothing():
    # torch.clamp of float16 [-3, 60000, 2] at +-70000 (past float16's 65504) returns it
    # unchanged, silently; jaxclip did too, but with three NumPy "overflow encountered in
    # cast" RuntimeWarnings (an error under -W error), as for 1e39 on any float32 leaf.
    x = jnp.array([-3.0, 60000.0, 2.0], jnp.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(jaxclip.clip_tree_by_value(x, 70000.0), x)
        np.testing.assert_array_equal(jaxclip.clip_tree_by_value(x, 1e39, -1e39), x)
        y = jnp.array([1.0, -2.0])
        np.testing.assert_array_equal(jaxclip.clip_tree_by_value(y, 1e39), y)


def test_paddle_need_clip_none_grads_and_zero_size():
    # paddlepaddle 3.3.1 dygraph, ClipGradByGlobalNorm(1.0) on [3, 0], [0, 4]:
    # second need_clip=False -> [1, 0], [0, 4]; both False -> unchanged; all grads None ->
    # unchanged; group_name="g1" -> as the default ([0.6, 0], [0, 0.8]); a (0, 3) grad
    # beside [3, 4] -> [], [0.6, 0.8]. ClipGradByNorm(1.0) of a (0, 3) grad -> (0, 3).
    g = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([0.0, 4.0])}
    out, _ = jaxclip.clip_tree_by_global_norm(g, 1.0, need_clip={"w": True, "b": False})
    np.testing.assert_array_equal(out["w"], [1.0, 0.0])
    np.testing.assert_array_equal(out["b"], [0.0, 4.0])
    out, gn = jaxclip.clip_tree_by_global_norm(g, 1.0, need_clip={"w": False, "b": False})
    assert float(gn) == 0.0 and all(np.array_equal(out[k], g[k]) for k in g)
    tx = jaxclip.clip_by_global_norm(1.0)
    out, _ = tx.update({"w": None, "b": None}, tx.init({"w": None, "b": None}))
    assert out == {"w": None, "b": None}
    out, _ = jaxclip.clip_tree_by_global_norm([jnp.zeros((0, 3)), jnp.array([3.0, 4.0])], 1.0)
    assert out[0].shape == (0, 3)
    np.testing.assert_allclose(out[1], [0.6, 0.8], rtol=1e-6)
    # ClipGradByNorm(0.0) and (-1.0): ValueError "max_norm should be greater than 0", as
    # jaxclip's; ClipGradByValue(max=-1.0, min=-2.0) of [-3, 0.5, 2] -> [-2, -1, -1].
    for c in (0.0, -1.0):
        with pytest.raises(ValueError, match="clip_norm"):
            jaxclip.clip_by_norm(c)
    np.testing.assert_array_equal(
        jaxclip.clip_tree_by_value(jnp.array([-3.0, 0.5, 2.0]), -1.0, -2.0), [-2, -1, -1]
    )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_paddle_clip_by_norm_op_16bit(dtype):
    # test_clip_by_norm_op.py TestClipByNormOpFp16 / TestClipByNormBF16Op (CUDA only in
    # Paddle: its CPU build has no 16-bit clip_by_norm kernel): input random in [0, 1)
    # with |x| < 0.006 set to 0.5; out = max_norm * x / norm where norm > max_norm, from
    # float64 NumPy; Paddle's tolerance atol 1e-3.
    rng = np.random.default_rng(0)
    for shape, max_norm in (((100,), 1.0), ((100,), 1e20), ((16, 16), 0.1), ((4, 8, 16), 1.0)):
        x = rng.random(shape)
        x[np.abs(x) < 0.006] = 0.5
        x = np.asarray(jnp.asarray(x, dtype), np.float64)  # the inputs as the dtype holds them
        norm = np.sqrt(np.sum(np.square(x)))
        want = max_norm * x / norm if norm > max_norm else x
        out, _ = jaxclip.clip_tree_by_norm(jnp.asarray(x, dtype), max_norm)
        assert out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-3, rtol=0)
