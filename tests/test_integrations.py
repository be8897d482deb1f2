"""Real training loops: optax wrappers, Flax NNX, Equinox, checkpointing."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
import reference as ref

RNG = np.random.default_rng(3)
X = jnp.asarray(RNG.normal(size=(32, 5)), jnp.float32)
Y = X @ jnp.asarray([3.0, -1.0, 2.0, 0.5, -4.0]) + 1.0


def _loss(params, x=X, y=Y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


PARAMS = {"w": jnp.zeros(5), "b": jnp.zeros(())}


def _train(tx, steps=20, params=PARAMS, grad_scale=None):
    state = tx.init(params)

    @jax.jit
    def step(p, s, scale):
        loss, g = jax.value_and_grad(_loss)(p)
        g = jax.tree.map(lambda t: t * scale, g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for i in range(steps):
        scale = 1.0 if grad_scale is None else grad_scale(i)
        params, state, loss = step(params, state, jnp.float32(scale))
        losses.append(float(loss))
    return params, state, losses


def test_chain_with_adamw_trains_and_logs_the_norm():
    tx = optax.chain(jaxclip.clip_by_global_norm(1.0), optax.adamw(0.1))
    _, state, losses = _train(tx, steps=60)
    assert losses[-1] < 0.05 * losses[0]
    g = jax.grad(_loss)(jax.tree.map(jnp.asarray, PARAMS))
    assert float(optax.tree.get(state, "global_norm")) > 0
    # The first step's norm is the norm of the gradient at the initial parameters.
    _, s1, _ = _train(tx, steps=1)
    np.testing.assert_allclose(optax.tree.get(s1, "global_norm"), ref.norm(jax.tree.leaves(g), 2.0), rtol=1e-5)


def test_inject_hyperparams_schedule_in_training():
    schedule = optax.linear_schedule(5.0, 0.5, transition_steps=10)
    tx = optax.chain(optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=schedule), optax.sgd(0.05))
    _, state, losses = _train(tx, steps=12)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    np.testing.assert_allclose(state[0].hyperparams["clip_norm"], 0.5, rtol=1e-6)


def test_multisteps_clips_the_accumulated_gradient():
    k = 3
    tx = optax.MultiSteps(optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(1.0)), every_k_schedule=k)
    state = tx.init(PARAMS)
    grads = [{"w": jnp.full(5, float(i + 1)), "b": jnp.asarray(2.0 * i)} for i in range(k)]
    for g in grads[:-1]:
        u, state = tx.update(g, state, PARAMS)
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
    u, state = tx.update(grads[-1], state, PARAMS)
    mean = [np.mean([ref.f64(g[key]) for g in grads], axis=0) for key in ("b", "w")]
    clipped, _ = ref.clip_global(mean, 1.0)
    np.testing.assert_allclose(u["b"], -clipped[0], rtol=1e-5)
    np.testing.assert_allclose(u["w"], -clipped[1], rtol=1e-5)


def test_masked_in_training_leaves_the_bias_unclipped():
    tx = optax.chain(optax.masked(jaxclip.clip_by_global_norm(0.1), {"w": True, "b": False}), optax.sgd(0.01))
    p, _, losses = _train(tx, steps=5)
    assert losses[-1] < losses[0]
    g_b = float(jax.grad(_loss)(jax.tree.map(jnp.asarray, PARAMS))["b"])
    p1, _, _ = _train(tx, steps=1)
    np.testing.assert_allclose(p1["b"], -0.01 * g_b, rtol=1e-5)  # an unclipped SGD step


def test_apply_if_finite_skips_nan_steps():
    tx = optax.apply_if_finite(optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(0.1)), max_consecutive_errors=5)
    p, state, losses = _train(tx, steps=6, grad_scale=lambda i: np.nan if i == 3 else 1.0)
    assert np.all(np.isfinite(losses))
    assert int(state.total_notfinite) == 1


def test_checkpoint_roundtrip_gives_the_same_next_step(tmp_path):
    tx = optax.chain(jaxclip.zclip(warmup_steps=3), jaxclip.clip_by_norm(2.0), optax.adamw(0.05))
    params, state, _ = _train(tx, steps=5)
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps(jax.device_get((params, state))))
    restored_params, restored_state = pickle.loads(path.read_bytes())
    g = jax.grad(_loss)(params)
    a, sa = jax.jit(tx.update)(g, state, params)
    b, sb = jax.jit(tx.update)(g, jax.tree.map(jnp.asarray, restored_state), jax.tree.map(jnp.asarray, restored_params))
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
        np.testing.assert_array_equal(x, y)


def test_flax_nnx_optimizer():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(5, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))[:, 0]

    model = Model(nnx.Rngs(0))
    clip = jaxclip.clip_by_global_norm(1.0, need_clip=lambda path, leaf: not path.endswith("bias"))
    optimizer = nnx.Optimizer(model, optax.chain(clip, optax.adam(0.05)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0]
    norm = float(jnp.asarray(optax.tree.get(optimizer.opt_state, "global_norm")))  # an nnx OptArray
    assert np.isfinite(norm) and norm > 0


def test_equinox_filtered_gradients_with_none_leaves():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(5, 1, width_size=8, depth=2, key=jax.random.key(0))
    tx = optax.chain(jaxclip.clip_by_global_norm(1.0), jaxclip.clip_by_value(0.5), optax.adam(0.05))
    state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(X)[:, 0] - Y) ** 2))(model)
        assert any(leaf is None for leaf in jax.tree.leaves(grads, is_leaf=lambda x: x is None))
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(40):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert float(optax.tree.get(state, "global_norm")) > 0
