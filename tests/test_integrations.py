"""Real training loops: optax wrappers, Flax NNX, Equinox, checkpointing."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from _helpers import train

import jaxclip

RNG = np.random.default_rng(3)
X = jnp.asarray(RNG.normal(size=(32, 5)), jnp.float32)
Y = X @ jnp.asarray([3.0, -1.0, 2.0, 0.5, -4.0]) + 1.0


def _loss(params, x=X, y=Y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


PARAMS = {"w": jnp.zeros(5), "b": jnp.zeros(())}


def _train(tx, steps=20, params=PARAMS, grad_scale=None):
    return train(tx, _loss, params, steps, grad_scale)


def test_chain_with_adamw_trains_and_logs_the_norm():
    tx = optax.chain(jaxclip.clip_by_global_norm(1.0), optax.adamw(0.1))
    _, state, losses = _train(tx, steps=60)
    assert losses[-1] < 0.05 * losses[0]
    g = jax.grad(_loss)(jax.tree.map(jnp.asarray, PARAMS))
    assert float(optax.tree.get(state, "global_norm")) > 0
    # The first step's norm is the norm of the gradient at the initial parameters.
    _, s1, _ = _train(tx, steps=1)
    np.testing.assert_allclose(
        optax.tree.get(s1, "global_norm"), ref.norm(jax.tree.leaves(g), 2.0), rtol=1e-5
    )


def test_inject_hyperparams_schedule_in_training():
    schedule = optax.linear_schedule(5.0, 0.5, transition_steps=10)
    tx = optax.chain(
        optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=schedule), optax.sgd(0.05)
    )
    _, state, losses = _train(tx, steps=12)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    np.testing.assert_allclose(state[0].hyperparams["clip_norm"], 0.5, rtol=1e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_multisteps_clips_the_accumulated_gradient():
    k = 3
    tx = optax.MultiSteps(
        optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(1.0)), every_k_schedule=k
    )
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
    tx = optax.chain(
        optax.masked(jaxclip.clip_by_global_norm(0.1), {"w": True, "b": False}), optax.sgd(0.01)
    )
    _, _, losses = _train(tx, steps=5)
    assert losses[-1] < losses[0]
    g_b = float(jax.grad(_loss)(jax.tree.map(jnp.asarray, PARAMS))["b"])
    p1, _, _ = _train(tx, steps=1)
    np.testing.assert_allclose(p1["b"], -0.01 * g_b, rtol=1e-5)  # an unclipped SGD step


def test_apply_if_finite_skips_nan_steps():
    tx = optax.apply_if_finite(
        optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(0.1)), max_consecutive_errors=5
    )
    _, state, losses = _train(tx, steps=6, grad_scale=lambda i: np.nan if i == 3 else 1.0)
    assert np.all(np.isfinite(losses))
    assert int(state.total_notfinite) == 1


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_checkpoint_roundtrip_gives_the_same_next_step(tmp_path):
    tx = optax.chain(jaxclip.zclip(warmup_steps=3), jaxclip.clip_by_norm(2.0), optax.adamw(0.05))
    params, state, _ = _train(tx, steps=5)
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps(jax.device_get((params, state))))
    restored_params, restored_state = pickle.loads(path.read_bytes())
    g = jax.grad(_loss)(params)
    a, sa = jax.jit(tx.update)(g, state, params)
    b, sb = jax.jit(tx.update)(
        g, jax.tree.map(jnp.asarray, restored_state), jax.tree.map(jnp.asarray, restored_params)
    )
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
        np.testing.assert_array_equal(x, y)


def _by_path(tree):
    """{"hidden/kernel": float64 copy, ...}: the array leaves of ``tree`` (None left out) by
    path, without the ``value`` attribute of Flax NNX variables."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(p, simple=True, separator="/").removesuffix("/value"): ref.f64(x)
        for p, x in leaves
    }


def _expected_first_step(grads, lr, clip_norm, selected, value_clip=None):
    """The first step of chain(clip_by_global_norm(clip_norm, need_clip=selected),
    [clip_by_value(value_clip)], sgd(lr, momentum)) in float64 (the momentum trace starts
    at 0, so the step is -lr times the clipped gradient), and the pre-clip norm."""
    chosen = [k for k in grads if selected(k)]
    clipped, norm = ref.clip_global([grads[k] for k in chosen], clip_norm)
    clipped = dict(zip(chosen, clipped))
    step = {}
    for k, g in grads.items():
        c = clipped.get(k, g)
        step[k] = -lr * (c if value_clip is None else np.clip(c, -value_clip, value_clip))
    return step, norm


def _assert_applied(after, before, expected):
    """The parameters moved by the expected step (up to float32 rounding of the parameters)."""
    assert after.keys() == expected.keys()
    for k in expected:
        moved = after[k] - before[k]
        np.testing.assert_allclose(moved, expected[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("need_clip", ["rule", "mask of nnx.state", "plain dict mask"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_flax_nnx_optimizer(need_clip):
    """``nnx.Optimizer`` passes bare arrays: a mask built from ``nnx.state(model,
    nnx.Param)`` (Param-wrapped bools) and a plain dict mask must both line up with them."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(5, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))[:, 0]

    model, lr = Model(nnx.Rngs(0)), 0.05
    selected = lambda path: not path.endswith("bias")  # noqa: E731
    if need_clip == "rule":
        mask = lambda path, leaf: selected(path)  # noqa: E731
    elif need_clip == "mask of nnx.state":
        mask = jax.tree.map(lambda p: p.ndim > 1, nnx.state(model, nnx.Param))
    else:
        mask = {k: {"kernel": True, "bias": False} for k in ("hidden", "out")}
    clip = jaxclip.clip_by_global_norm(1.0, need_clip=mask)
    optimizer = nnx.Optimizer(model, optax.chain(clip, optax.sgd(lr, momentum=0.9)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
        optimizer.update(model, grads)
        return loss, grads

    def logged_norm():
        norm = optax.tree.get(optimizer.opt_state, "global_norm")  # an nnx OptArray
        return float(jnp.asarray(norm))

    before = _by_path(nnx.state(model, nnx.Param))
    loss, grads = step(model, optimizer)
    grads = _by_path(grads)
    expected, norm = _expected_first_step(grads, lr, 1.0, selected)
    assert norm > 1.0  # the step is clipped
    np.testing.assert_allclose(logged_norm(), norm, rtol=1e-5)  # biases left out of the norm
    after = _by_path(nnx.state(model, nnx.Param))
    assert after.keys() == {"hidden/bias", "hidden/kernel", "out/bias", "out/kernel"}
    _assert_applied(after, before, expected)
    losses = [float(loss)]
    for _ in range(39):
        loss, grads = step(model, optimizer)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    last = _by_path(grads)
    last_norm = ref.norm([last[k] for k in last if selected(k)], 2.0)
    np.testing.assert_allclose(logged_norm(), last_norm, rtol=1e-5)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_equinox_filtered_gradients_with_none_leaves():
    eqx = pytest.importorskip("equinox")
    model, lr = eqx.nn.MLP(5, 1, width_size=8, depth=2, key=jax.random.key(0)), 0.05
    clip = optax.chain(jaxclip.clip_by_global_norm(1.0), jaxclip.clip_by_value(0.5))
    tx = optax.chain(clip, optax.sgd(lr, momentum=0.9))
    state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((jax.vmap(m)(X)[:, 0] - Y) ** 2)
        )(model)
        assert any(leaf is None for leaf in jax.tree.leaves(grads, is_leaf=lambda x: x is None))
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss, grads

    before = _by_path(eqx.filter(model, eqx.is_array))
    model, state, loss, grads = step(model, state)
    grads = _by_path(grads)
    assert grads.keys() == before.keys() and len(grads) == 6  # three layers' weight and bias
    expected, norm = _expected_first_step(grads, lr, 1.0, lambda path: True, value_clip=0.5)
    assert norm > 1.0
    np.testing.assert_allclose(optax.tree.get(state, "global_norm"), norm, rtol=1e-5)
    after = _by_path(eqx.filter(model, eqx.is_array))
    _assert_applied(after, before, expected)
    losses = [float(loss)]
    for _ in range(39):
        model, state, loss, grads = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    last_norm = ref.norm(jax.tree.leaves(grads), 2.0)
    np.testing.assert_allclose(optax.tree.get(state, "global_norm"), last_norm, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# optax.inject_hyperparams with jaxclip's static arguments, and clip_stats for logging.

GRADS2 = {"w": jnp.array([[3.0, 4.0], [0.0, 12.0]]), "b": jnp.array([100.0, 0.0])}


def test_inject_hyperparams_takes_selectors_without_static_args():
    schedule = optax.linear_schedule(20.0, 10.0, transition_steps=1)
    tx = optax.inject_hyperparams(jaxclip.clip_by_global_norm)(
        clip_norm=schedule,
        need_clip=jaxclip.exclude_names("b"),
        group=jaxclip.Selector(lambda path, leaf: "all"),
    )
    update = jax.jit(tx.update)
    state = tx.init(GRADS2)
    for clip_norm in (20.0, 10.0):  # the norm of w is 13: unclipped, then clipped
        out, state = update(GRADS2, state)
        assert out["b"] is not None and np.array_equal(out["b"], GRADS2["b"])
        np.testing.assert_allclose(
            out["w"], ref.f64(GRADS2["w"]) * min(1.0, clip_norm / 13.0), rtol=1e-6
        )
        stats = jaxclip.clip_stats(state)
        assert stats.keys() == {"clip_norm", "global_norm/all"}
        np.testing.assert_allclose(stats["clip_norm"], clip_norm)
        np.testing.assert_allclose(stats["global_norm/all"], 13.0, rtol=1e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_inject_hyperparams_static_arguments_say_what_to_pass():
    # A plain function is taken for a schedule by optax (called with the step count)
    # before jaxclip sees it: the error is Python's; static_args (or a Selector) fixes it.
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'leaf'"):
        optax.inject_hyperparams(jaxclip.clip_by_global_norm)(
            clip_norm=1.0, need_clip=lambda path, leaf: True
        ).init(GRADS2)
    tx = optax.inject_hyperparams(jaxclip.clip_by_global_norm, static_args=("need_clip",))(
        clip_norm=1.0, need_clip=lambda path, leaf: path != "b"
    )
    out, _ = tx.update(GRADS2, tx.init(GRADS2))
    np.testing.assert_allclose(out["w"], ref.f64(GRADS2["w"]) / 13.0, rtol=1e-6)
    # axes becomes an array: concrete (eager) it works; traced (jit) the error says what
    # to pass.
    tx = optax.inject_hyperparams(jaxclip.clip_by_norm)(clip_norm=5.0, axes=0)
    out, _ = tx.update(GRADS2, tx.init(GRADS2))
    np.testing.assert_allclose(
        out["w"], [[3.0, 5 * 4 / np.hypot(4, 12)], [0.0, 5 * 12 / np.hypot(4, 12)]], rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"axes=.* is traced.*static_args=\('axes',\)"):
        jax.jit(tx.update)(GRADS2, tx.init(GRADS2))
    tx = optax.inject_hyperparams(jaxclip.clip_by_norm, static_args=("axes",))(
        clip_norm=5.0, axes=0
    )
    out2, _ = jax.jit(tx.update)(GRADS2, tx.init(GRADS2))
    np.testing.assert_allclose(out2["w"], out["w"], rtol=1e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_clip_stats_finds_every_mode_where_tree_get_cannot():
    tx = optax.chain(
        optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=100.0),
        jaxclip.clip_by_norm(50.0, need_clip=jaxclip.min_rank(2)),
        jaxclip.skip_large_updates(optax.chain(jaxclip.zclip(warmup_steps=2)), threshold=1e3),
        optax.sgd(0.1),
    )
    ms = optax.MultiSteps(tx, every_k_schedule=1)
    state = ms.init(GRADS2)
    _, state = jax.jit(ms.update)(GRADS2, state, GRADS2)
    with pytest.raises(KeyError, match="Found multiple values"):
        optax.tree.get(state, "global_norm")
    stats = jaxclip.clip_stats(state)
    norm = float(np.sqrt(3**2 + 4**2 + 12**2 + 100**2))
    assert stats.keys() == {
        "0/clip_norm",
        "0/global_norm",
        "1/norms/w",
        "2/global_norm",
        "2/skipped",
        "2/0/global_norm",
        "2/0/threshold",
    }
    np.testing.assert_allclose(stats["0/clip_norm"], 100.0)
    np.testing.assert_allclose(stats["0/global_norm"], norm, rtol=1e-6)
    np.testing.assert_allclose(stats["1/norms/w"], 13.0 * 100.0 / norm, rtol=1e-6)
    assert int(stats["2/skipped"]) == 0


def test_clip_stats_keeps_both_norms_of_a_mode_wrapped_alone():
    # skip_large_updates and a mode it wraps directly both log "global_norm": the inner
    # one goes under "inner/", so the norm that decides skipping is not overwritten.
    grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}  # 13 in all, w alone 5
    inner = jaxclip.clip_by_global_norm(1.0, need_clip=jaxclip.by_name("w"))
    tx = jaxclip.skip_large_updates(inner, threshold=100.0)
    _, state = jax.jit(tx.update)(grads, tx.init(grads))
    stats = {k: float(v) for k, v in jaxclip.clip_stats(state).items()}
    assert stats == {"global_norm": 13.0, "skipped": 0.0, "inner/global_norm": 5.0}
    big = jax.tree.map(lambda g: 10 * g, grads)  # 130 > 100: skipped, the inner one not run
    _, state = jax.jit(tx.update)(big, state)
    stats = {k: float(v) for k, v in jaxclip.clip_stats(state).items()}
    np.testing.assert_allclose(stats["global_norm"], 130.0, rtol=1e-6)
    assert stats["skipped"] == 1.0


def test_clip_stats_reports_history_and_per_example_modes():
    tx = optax.chain(
        jaxclip.clip_per_example(150.0, reduce="sum", batch_size=2),
        jaxclip.standard_clip(global_threshold=True, history_length=4),
    )
    per_example = jax.tree.map(lambda g: jnp.stack([g, 2 * g]), GRADS2)  # norms n, 2n
    n = float(np.sqrt(3**2 + 4**2 + 12**2 + 100**2))
    _, state = tx.update(per_example, tx.init(GRADS2), GRADS2)
    stats = jaxclip.clip_stats(state)
    assert stats.keys() == {"0/norms", "0/clipped_fraction", "1/threshold", "1/norm"}
    np.testing.assert_allclose(stats["0/norms"], [n, 2 * n], rtol=1e-6)
    np.testing.assert_allclose(stats["0/clipped_fraction"], 0.5)  # 2n > 150 > n
    np.testing.assert_allclose(stats["1/norm"], n + 150.0, rtol=1e-6)  # n plus the clipped 2n
