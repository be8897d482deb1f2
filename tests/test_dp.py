"""clipped_grad, per-group clip norms and adaptive_clip_per_example.

Expected values come from float64 NumPy formulas (the per-example gradient of a linear
model is closed form), from TF-Privacy's own scripted tests of
``QuantileAdaptiveClipSumQuery`` (its expected sums and clip norms, ported as they are),
and from the paper's update rule; noise is checked by statistics over many draws.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import xla_cpu_only

import jaxclip

B, D = 10, 5


def _linear_loss(params, x, y):  # one example: residual r = w.x + b - y
    r = jnp.dot(params["w"], x) + params["b"] - y
    return 0.5 * r**2


def _data(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=D).astype(dtype), "b": np.array(0.3, dtype)}
    x = rng.normal(size=(B, D)).astype(dtype) * np.linspace(0.1, 3.0, B)[:, None].astype(dtype)
    y = rng.normal(size=B).astype(dtype)
    return params, x, y


def _reference(params, x, y, clip, valid=None, groups=False):
    """float64: per-example gradients (r x, r), their norms, the clipped sum."""
    w, b = np.asarray(params["w"], np.float64), float(params["b"])
    x, y = x.astype(np.float64), y.astype(np.float64)
    r = x @ w + b - y
    gw, gb = r[:, None] * x, r
    valid = np.ones(len(r), bool) if valid is None else valid
    if groups:  # "w" and "b" clipped each to their own norm
        nw, nb = np.linalg.norm(gw, axis=1), np.abs(gb)
        fw = np.minimum(1, clip["w"] / nw) * valid
        fb = np.minimum(1, clip["b"] / nb) * valid
        return {"w": fw @ gw, "b": fb @ gb}, {"w": nw, "b": nb}
    n = np.sqrt(np.sum(gw**2, axis=1) + gb**2)
    f = np.minimum(1.0, clip / n) * valid
    return {"w": f @ gw, "b": f @ gb}, n


@functools.cache
def _jitted(micro, reduce="sum", groups=False):
    group = (lambda path, leaf: path) if groups else None

    def f(params, x, y, clip, pad):
        g = jaxclip.clipped_grad(
            _linear_loss, clip, microbatch_size=micro, reduce=reduce, group=group,
            batch_argnums=(1, 2), return_norms=True, return_values=True,
        )  # fmt: skip
        return g(params, x, y, is_padding_example=pad)

    return jax.jit(f)


@pytest.mark.parametrize(
    "micro", [None, 3, *(pytest.param(m, marks=pytest.mark.slow) for m in (1, 16))]
)  # whole, 1 row, 3 not dividing 10, > B
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_clipped_grad_matches_float64_formula(micro):
    params, x, y = _data()
    want, norms = _reference(params, x, y, 1.5)
    assert 0 < np.sum(norms > 1.5) < B  # some clipped, some kept
    total, aux = _jitted(micro)(params, x, y, 1.5, np.zeros(B, bool))
    for k in want:
        np.testing.assert_allclose(total[k], want[k], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(aux.norms, norms, rtol=1e-6)
    assert aux.norms.shape == (B,) and aux.values.shape == (B,)
    r = x.astype(np.float64) @ params["w"] + float(params["b"]) - y
    np.testing.assert_allclose(aux.values, 0.5 * r**2, rtol=1e-5)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_clipped_grad_padding_examples_add_nothing():
    params, x, y = _data(1)
    pad = np.zeros(B, bool)
    pad[[2, 7, 9]] = True
    x = x.copy()
    x[7] *= 1e6  # a padding row with a huge gradient: still nothing
    want, norms = _reference(params, x, y, 1.0, valid=~pad)
    for micro in (None, 4):
        total, aux = _jitted(micro)(params, x, y, 1.0, pad)
        for k in want:
            np.testing.assert_allclose(total[k], want[k], rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(aux.norms, norms, rtol=1e-6)  # padding norms reported


def test_clipped_grad_mean_divides_by_the_rows():
    params, x, y = _data(2)
    want, _ = _reference(params, x, y, 0.7)
    total, _ = _jitted(4, "mean")(params, x, y, 0.7, np.zeros(B, bool))
    np.testing.assert_allclose(total["w"], want["w"] / B, rtol=2e-6, atol=1e-7)


def test_clipped_grad_per_group_clip_norms():
    params, x, y = _data(3)
    clip = {"w": 0.8, "b": 0.3}
    want, norms = _reference(params, x, y, clip, groups=True)
    total, aux = _jitted(3, groups=True)(params, x, y, clip, np.zeros(B, bool))
    for k in want:
        np.testing.assert_allclose(total[k], want[k], rtol=2e-6, atol=1e-6)
        # |r| itself carries float32 cancellation (w.x + b - y), beyond the norm's 1e-6
        np.testing.assert_allclose(aux.norms[k], norms[k], rtol=1e-5)


def _mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


@pytest.mark.slow  # the float64 formula tests above cover float32 in the default run
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clipped_grad_equals_whole_batch_vmap(dtype):
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (6, 16), dtype),
        "b1": jnp.zeros(16, dtype),
        "w2": jax.random.normal(k[1], (16, 3), dtype),
    }
    x = jax.random.normal(k[2], (24, 6), dtype)
    y = jax.random.randint(k[3], (24,), 0, 3)

    @jax.jit  # one compiled program for both (eager vmap(grad) dispatches op by op)
    def both(p, x, y):
        grads = jax.vmap(jax.grad(_mlp_loss), in_axes=(None, 0, 0))(p, x, y)
        whole = jaxclip.clip_tree_per_example(grads, 1.0)
        micro = jaxclip.clipped_grad(
            _mlp_loss, 1.0, microbatch_size=5, return_norms=True, batch_argnums=(1, 2)
        )(p, x, y)
        return whole, micro

    (want, want_norms), (got, aux) = both(params, x, y)
    # bfloat16: both round one float32 sum once; the sums may differ in the last float32
    # bits, which can move a rounding to the neighbouring bfloat16 value.
    rtol = 2e-6 if dtype == jnp.float32 else 2**-7
    for key in want:
        assert got[key].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got[key], np.float32), np.asarray(want[key], np.float32),
            rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(want[key].astype(jnp.float32)))),
        )  # fmt: skip
    np.testing.assert_allclose(aux.norms, want_norms, rtol=1e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_clipped_grad_options_aux_keep_batch_dim_argnums_need_clip():
    params, x, y = _data(4)

    def batched_loss(p, s, x, y):  # a batch of one: x (1, D); a second differentiated arg
        r = x @ p["w"] + p["b"] * s - y
        return 0.5 * jnp.sum(r**2), {"r": r[0]}

    g = jaxclip.clipped_grad(
        batched_loss, 1e9, argnums=(0, 1), batch_argnums=(2, 3), has_aux=True,
        keep_batch_dim=True, microbatch_size=4,
        need_clip=lambda path, leaf: not path.endswith("b"),
    )  # fmt: skip
    (gp, gs), aux = g(params, np.float32(1.0), x, y)
    r = x.astype(np.float64) @ params["w"] + float(params["b"]) - y
    np.testing.assert_allclose(aux.aux["r"], r, rtol=1e-5)
    np.testing.assert_allclose(gp["w"], r @ x, rtol=1e-5)
    np.testing.assert_allclose(gp["b"], r.sum(), rtol=1e-5)  # unselected: summed unclipped
    np.testing.assert_allclose(gs, float(params["b"]) * r.sum(), rtol=1e-5)
    assert aux.norms is None and aux.values is None


def test_clipped_grad_errors():
    params, x, y = _data()
    group = lambda path, leaf: path  # noqa: E731
    with pytest.raises(ValueError, match="clip_norm has no value for the group label 'b'"):
        jaxclip.clipped_grad(_linear_loss, {"w": 1.0}, group=group, batch_argnums=(1, 2))(
            params, x, y
        )
    with pytest.raises(ValueError, match=r"label 'v'.*no selected leaf"):
        jaxclip.clipped_grad(
            _linear_loss, {"w": 1, "b": 1, "v": 1}, group=group, batch_argnums=(1, 2)
        )(params, x, y)
    with pytest.raises(ValueError, match=r"clip_norm\['b'\]=-1.0 must be > 0"):
        jaxclip.clipped_grad(_linear_loss, {"w": 1.0, "b": -1.0}, group=group)
    with pytest.raises(ValueError, match="but group is None"):
        jaxclip.clipped_grad(_linear_loss, {"w": 1.0})
    with pytest.raises(ValueError, match="overlap"):
        jaxclip.clipped_grad(_linear_loss, 1.0, argnums=1)
    with pytest.raises(ValueError, match="argument 2 has 9 rows, but argument 1 has 10"):
        jaxclip.clipped_grad(_linear_loss, 1.0, batch_argnums=(1, 2))(params, x, y[:9])
    with pytest.raises(ValueError, match=r"is_padding_example.*shape \(10,\)"):
        jaxclip.clipped_grad(_linear_loss, 1.0, batch_argnums=(1, 2))(
            params, x, y, is_padding_example=np.zeros(9, bool)
        )
    with pytest.raises(ValueError, match="reduce=None"):
        jaxclip.clipped_grad(_linear_loss, 1.0, reduce=None)
    with pytest.raises(ValueError, match="microbatch_size") as err:
        jaxclip.clipped_grad(_linear_loss, 1.0, microbatch_size=0)
    # A function, not a transform: no state for inject_hyperparams to trace.
    assert "each microbatch" in str(err.value) and "inject_hyperparams" not in str(err.value)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_clip_tree_per_example_dict_clip_norm_and_sensitivity_noise():
    rng = np.random.default_rng(5)
    g = {"a": rng.normal(size=(6, 3)).astype(np.float32), "b": rng.normal(size=(6, 4)) * 3}
    g["b"] = g["b"].astype(np.float32)
    clip = {"a": 0.5, "b": 2.0}
    group = lambda path, leaf: path  # noqa: E731
    total, norms = jaxclip.clip_tree_per_example(g, clip, group=group)
    for k in g:
        x = g[k].astype(np.float64)
        n = np.linalg.norm(x, axis=1)
        np.testing.assert_allclose(norms[k], n, rtol=1e-6)
        np.testing.assert_allclose(total[k], np.minimum(1, clip[k] / n) @ x, rtol=2e-6)
    # The noise of clip_per_example: noise_multiplier * sqrt(sum_g c_g**2) on zero grads.
    zeros = {"a": np.zeros((2, 20000), np.float32), "b": np.zeros((2, 20000), np.float32)}
    tx = jaxclip.clip_per_example(clip, noise_multiplier=0.7, reduce="sum", group=group)
    out, _ = tx.update(zeros, tx.init({"a": np.zeros(20000), "b": np.zeros(20000)}))
    want = 0.7 * math.sqrt(0.5**2 + 2.0**2)
    for k in out:  # 20000 draws: the sample std is within 1% (about 4 standard errors)
        assert abs(np.std(np.asarray(out[k])) / want - 1) < 0.02


# ---------------------------------------------------------------------------------------
# adaptive_clip_per_example: TF-Privacy's quantile_adaptive_clip_sum_query_test cases


def _run_scripted(records, steps, **kw):
    tx = jaxclip.adaptive_clip_per_example(reduce="sum", **kw)
    state = tx.init({"w": jnp.zeros(1)})
    update = jax.jit(tx.update)
    grads = {"w": jnp.array([[r] for r in records], jnp.float32)}
    sums, clips = [], []
    for _ in range(steps):
        out, state = update(grads, state)
        sums.append(float(out["w"][0]))
        clips.append(float(state.clip_norm))
    return sums, clips


def test_adaptation_target_zero_arithmetic():
    sums, clips = _run_scripted(
        [8.5, -7.25], 5, initial_clip_norm=10.0, target_unclipped_quantile=0.0,
        learning_rate=1.0, geometric_update=False,
    )  # fmt: skip
    np.testing.assert_allclose(sums, [1.25, 1.25, 0.75, 0.25, 0.0], atol=1e-6)
    np.testing.assert_allclose(clips, [9.0, 8.0, 7.5, 7.0, 7.0], atol=1e-6)


def test_adaptation_target_zero_geometric():
    r = 4 / np.sqrt(2.0)
    sums, clips = _run_scripted(
        [5.0, -2.5], 5, initial_clip_norm=16.0, target_unclipped_quantile=0.0,
        learning_rate=np.log(2.0),
    )  # fmt: skip
    np.testing.assert_allclose(sums, [2.5, 2.5, 1.5, r - 2.5, 0.0], atol=1e-5)
    np.testing.assert_allclose(clips, [8.0, 4.0, r, 2.0, 2.0], rtol=1e-6)


def test_adaptation_target_one_arithmetic_from_zero():
    # TF-Privacy starts this one at initial_l2_norm_clip=0.0 (a clip norm of 0 clips every
    # example to 0; its updates move it).
    sums, clips = _run_scripted(
        [-1.5, 2.75], 5, initial_clip_norm=0.0, target_unclipped_quantile=1.0,
        learning_rate=1.0, geometric_update=False,
    )  # fmt: skip
    np.testing.assert_allclose(sums, [0.0, 0.0, 0.5, 1.0, 1.25], atol=1e-6)
    np.testing.assert_allclose(clips, [1.0, 2.0, 2.5, 3.0, 3.0], atol=1e-6)
    with pytest.raises(ValueError, match="geometric_update=True: a geometric update"):
        jaxclip.adaptive_clip_per_example(0.0)  # it would stay 0


def test_adaptation_target_one_geometric():
    r = 2 * np.sqrt(2.0)
    sums, clips = _run_scripted(
        [-1.5, 3.0], 5, initial_clip_norm=0.5, target_unclipped_quantile=1.0,
        learning_rate=np.log(2.0),
    )  # fmt: skip
    np.testing.assert_allclose(sums, [0.0, 0.0, 0.5, r - 1.5, 1.5], atol=1e-5)
    np.testing.assert_allclose(clips, [1.0, 2.0, r, 4.0, 4.0], rtol=1e-6)


@pytest.mark.parametrize(("geometric", "start"), [(False, 10.0), (True, 1.0)])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_adaptation_linspace_converges_to_the_median(geometric, start):
    tx = jaxclip.adaptive_clip_per_example(
        start, target_unclipped_quantile=0.5, learning_rate=1.0, geometric_update=geometric
    )
    records = np.linspace(0.0, 10.0, 21, dtype=np.float32)

    def body(state, _):
        _, state = tx.update({"w": jnp.asarray(records)[:, None]}, state)
        return state, state.clip_norm

    _, clips = jax.lax.scan(body, tx.init({"w": jnp.zeros(1)}), None, length=50)
    assert np.all(np.abs(np.asarray(clips[41:]) - 5.0) < 0.25)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_noised_states_with_a_raw_key_checkpoint_as_plain_arrays():
    # The documented way to checkpoint through NumPy: a raw PRNGKey seed keeps the state
    # plain arrays, and the restored state takes the same next step.
    grads = {"w": jnp.asarray(np.arange(8.0, dtype=np.float32).reshape(4, 2))}
    for tx in (
        jaxclip.clip_per_example(1.0, noise_multiplier=0.5, seed=jax.random.PRNGKey(3)),
        jaxclip.adaptive_clip_per_example(1.0, noise_multiplier=0.5, seed=jax.random.PRNGKey(3)),
    ):
        _, state = tx.update(grads, tx.init({"w": jnp.zeros(2)}))
        saved = jax.tree.map(np.asarray, state)  # a typed key would raise here
        restored = jax.tree.map(jnp.asarray, saved)
        np.testing.assert_array_equal(
            np.asarray(tx.update(grads, restored)[0]["w"]),
            np.asarray(tx.update(grads, state)[0]["w"]),
        )


def test_clipped_grad_of_an_empty_batch_is_zero():
    # A Poisson-sampled batch may draw no example: the clipped sum (and the mean, which
    # clipped_grad takes over max(B, 1) rows) is 0 with or without microbatches.
    loss = lambda w, x: 0.5 * jnp.sum((w - x) ** 2)  # noqa: E731
    w, xs = jnp.ones(2), jnp.zeros((0, 2))
    for size in (None, 2):
        for reduce in ("sum", "mean"):
            fn = jaxclip.clipped_grad(loss, 1.0, microbatch_size=size, reduce=reduce)
            np.testing.assert_array_equal(np.asarray(fn(w, xs)), np.zeros(2, np.float32))
    g, aux = jaxclip.clipped_grad(loss, 1.0, return_norms=True)(w, xs)
    np.testing.assert_array_equal(np.asarray(g), np.zeros(2, np.float32))
    assert aux.norms.shape == (0,)


def test_adaptive_hyperparameters_injected_under_jit():
    # optax.inject_hyperparams makes every numeric argument an array, traced under jit
    # (noise_multiplier's default 0 included): the update must not need their values.
    # Rows of norms 0.5, 0.8, 0.9 and 3 against C = 1, E = 8: b = (3/2 - 1/2)/8 + 1/2, and
    # C' = C exp(-lr (b - target)); the sum is the float64 clipped sum.
    rows = np.array([[0.3, 0.4], [0.0, 0.8], [0.9, 0.0], [3.0, 0.0]], np.float32)
    grads = {"w": jnp.asarray(rows)}
    kw = dict(initial_clip_norm=1.0, learning_rate=0.2, expected_num_records=8.0, reduce="sum")
    tx = optax.inject_hyperparams(jaxclip.adaptive_clip_per_example)(
        target_unclipped_quantile=lambda count: 0.5, **kw
    )
    out, state = jax.jit(tx.update)(grads, tx.init({"w": jnp.zeros(2)}))
    b = (3 * 0.5 - 0.5) / 8 + 0.5
    np.testing.assert_allclose(float(state.inner_state.clip_norm), np.exp(-0.2 * (b - 0.5)), 1e-6)
    norms = np.linalg.norm(rows.astype(np.float64), axis=1, keepdims=True)
    want = np.sum(rows * np.minimum(1.0, 1.0 / norms), axis=0)
    np.testing.assert_allclose(np.asarray(out["w"], np.float64), want, rtol=1e-6)
    # A traced noise multiplier draws the noise the static one does, with the same key.
    noisy = optax.inject_hyperparams(jaxclip.adaptive_clip_per_example)(noise_multiplier=0.5, **kw)
    plain = jaxclip.adaptive_clip_per_example(noise_multiplier=0.5, **kw)
    got, s1 = jax.jit(noisy.update)(grads, noisy.init({"w": jnp.zeros(2)}))
    ref, s2 = plain.update(grads, plain.init({"w": jnp.zeros(2)}))
    assert not np.allclose(np.asarray(ref["w"]), want)  # noise was added
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(ref["w"]), rtol=1e-6)
    np.testing.assert_allclose(float(s1.inner_state.clip_norm), float(s2.clip_norm), rtol=1e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_adaptive_noise_statistics():
    # The sum's noise: std noise_multiplier * C (TF's test_sum_with_noise: std 1 around
    # the sum of two records, clip 5). The count's: b = (count - n/2 + N(0, s^2))/E + 1/2,
    # so with 30 of 100 unclipped, b ~ N(0.3, (s/E)^2) and log(C'/C) = -lr (b - target).
    tx = jaxclip.adaptive_clip_per_example(
        5.0, noise_multiplier=1.0 / 5.0, clipped_count_stddev=5.0, reduce="sum",
        target_unclipped_quantile=0.5, learning_rate=0.2,
    )  # fmt: skip
    norms = np.where(np.arange(100) < 30, 1.0, 9.0).astype(np.float32)
    grads = {"w": jnp.asarray(norms)[:, None]}
    state = tx.init({"w": jnp.zeros(1)})
    keys = jax.random.split(jax.random.key(7), 4000)
    out, states = jax.jit(jax.vmap(lambda k: tx.update(grads, state._replace(key=k))))(keys)
    total = np.asarray(out["w"][:, 0], np.float64)
    want_sum = 30 * 1.0 + 70 * 5.0
    se = 1 / math.sqrt(4000)
    assert abs(total.mean() - want_sum) < 4 * se
    assert abs(total.std() - 1.0) < 4 * se / math.sqrt(2) * 1.5
    b = np.asarray(states.unclipped_fraction, np.float64)
    assert abs(b.mean() - 0.3) < 4 * 0.05 * se
    assert abs(b.std() - 0.05) < 0.05 * 0.05
    np.testing.assert_allclose(
        np.asarray(states.clip_norm, np.float64), 5.0 * np.exp(-0.2 * (b - 0.5)), rtol=1e-6
    )
    assert len({int(jax.random.key_data(s)[0]) for s in states.key[:50]}) == 50


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_adaptive_with_clipped_grad_equals_per_example_path_and_chains():
    params, x, y = _data(6)
    pad = np.zeros(B, bool)
    pad[-2:] = True
    kw = dict(target_unclipped_quantile=0.5, learning_rate=0.3, expected_num_records=8.0)
    tx = optax.chain(jaxclip.adaptive_clip_per_example(1.0, **kw), optax.sgd(0.1))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        c = optax.tree.get(state, "clip_norm")
        g, aux = jaxclip.clipped_grad(
            _linear_loss, c, microbatch_size=4, batch_argnums=(1, 2), return_norms=True
        )(params, x, y, is_padding_example=pad)
        updates, state = tx.update(g, state, params, norms=aux.norms, is_padding_example=pad)
        return optax.apply_updates(params, updates), state, g

    per_ex = jaxclip.adaptive_clip_per_example(1.0, reduce="sum", **kw)
    ref_state = per_ex.init(params)
    for _ in range(3):
        c = float(ref_state.clip_norm)
        want, norms = _reference(params, x, y, c, valid=~pad)
        new_params, state, g = step(params, state)
        grads = jax.vmap(jax.grad(_linear_loss), in_axes=(None, 0, 0))(params, x, y)
        ref_out, ref_state = per_ex.update(grads, ref_state, is_padding_example=pad)
        for k in want:
            np.testing.assert_allclose(g[k], want[k], rtol=2e-6, atol=1e-6)
            np.testing.assert_allclose(ref_out[k], want[k], rtol=2e-6, atol=1e-6)
            # mean over the 10 rows, then sgd(0.1)
            np.testing.assert_allclose(new_params[k] - params[k], -0.1 * want[k] / B, atol=1e-6)
        b = ((norms <= c) & ~pad).sum() - 0.5 * (~pad).sum()
        b = min(max(b / 8.0 + 0.5, 0.0), 1.0)
        want_c = c * math.exp(-0.3 * (b - 0.5))
        np.testing.assert_allclose(optax.tree.get(state, "clip_norm"), want_c, rtol=1e-6)
        np.testing.assert_allclose(ref_state.clip_norm, want_c, rtol=1e-6)
        params = new_params


def test_adaptive_noise_multiplier_and_errors():
    z, s = 1.1, 3.0
    want = 1 / math.sqrt(1 / z**2 - 1 / (2 * s) ** 2)
    assert jaxclip.adaptive_clip_noise_multiplier(z, s) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="too small"):
        jaxclip.adaptive_clip_noise_multiplier(1.0, 0.5)
    with pytest.raises(ValueError, match=r"target_unclipped_quantile=1\.5"):
        jaxclip.adaptive_clip_per_example(1.0, target_unclipped_quantile=1.5)
    with pytest.raises(ValueError, match=r"initial_clip_norm=-1\.0 must be >= 0"):
        jaxclip.adaptive_clip_per_example(-1.0)
    with pytest.raises(ValueError, match="expected_num_records=0"):
        jaxclip.adaptive_clip_per_example(1.0, expected_num_records=0)


@xla_cpu_only
def test_strided_microbatches_read_the_batch_in_place():
    """Microbatch k holds rows k, k + steps, ... (each device's own on a mesh): read from
    the rows in the loop, not from a transposed copy of the batch (3 MiB here; the
    temporaries of 32 examples' gradients are a tenth of that)."""
    x = np.random.default_rng(0).normal(size=(256, 3072)).astype(np.float32)
    w = np.full(3072, 0.01, np.float32)
    g = jax.jit(jaxclip.clipped_grad(lambda w, xr: jnp.dot(xr, w) ** 2, 1.0, microbatch_size=32))
    temp = g.lower(w, x).compile().memory_analysis().temp_size_in_bytes
    assert temp < x.nbytes / 4, temp
    r = x.astype(np.float64) @ w.astype(np.float64)
    per = 2 * r[:, None] * x
    norms = np.linalg.norm(per, axis=1)
    want = (np.minimum(1.0, 1.0 / norms)[:, None] * per).sum(0)
    got = np.asarray(g(w, x), np.float64)  # float32 sums of 256 terms of either sign
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_noise_refuses_norms_that_do_not_bound_the_l2_sensitivity():
    # An example clipped to an inf-norm (or p > 2) of 1 can have L2 norm sqrt(d): ten here,
    # so noise of noise_multiplier * clip_norm would be calibrated to a tenth of the
    # sensitivity. float64 check of the claim, then the refusal.
    g = jaxclip.clipped_grad(lambda w, x: jnp.dot(w, x), 1.0, norm_type=math.inf)
    out = np.asarray(g(jnp.zeros(100), jnp.ones((1, 100))), np.float64)
    assert np.linalg.norm(out) == pytest.approx(10.0, rel=1e-6)
    for p in (3.0, math.inf):
        with pytest.raises(ValueError, match="L2 norm"):
            jaxclip.clip_per_example(1.0, noise_multiplier=1.0, norm_type=p)
        with pytest.raises(ValueError, match="L2 norm"):
            jaxclip.adaptive_clip_per_example(1.0, noise_multiplier=1.0, norm_type=p)
        jaxclip.clip_per_example(1.0, norm_type=p)  # without noise: fine
    jaxclip.clip_per_example(1.0, noise_multiplier=1.0, norm_type=1.5)  # L2 <= p-norm


def test_empty_poisson_batch_noise_only_step():
    # Opacus (DPOptimizer.clip_and_accumulate's empty batch) returns the noise over the
    # expected batch size for a batch of no examples; in jaxclip that is reduce="sum"
    # and a scale, and the state's clipped fraction is 0 (nothing clipped), not NaN.
    tx = optax.chain(
        jaxclip.clip_per_example(1.0, noise_multiplier=1.0, reduce="sum"), optax.scale(1 / 8)
    )
    out, state = tx.update({"w": jnp.zeros((0, 4000))}, tx.init({"w": jnp.zeros(4000)}))
    assert abs(float(np.std(np.asarray(out["w"]))) / (1.0 / 8) - 1) < 0.05
    assert float(state[0].clipped_fraction) == 0.0
    # reduce="mean" refuses, and says what to do instead of skipping the step.
    with pytest.raises(ValueError, match="expected batch size") as err:
        jaxclip.clip_per_example(1.0, noise_multiplier=1.0).update(
            {"w": jnp.zeros((0, 3))}, jaxclip.clip_per_example(1.0).init({"w": jnp.zeros(3)})
        )
    assert "Skip empty batches" not in str(err.value)


@pytest.mark.parametrize("derivative", ["jvp", "vjp"])
def test_derivative_of_the_clipped_sum_ignores_padding_examples(derivative):
    # d/dx of sum_b clip(g_b) with g_b = p * x_b**2 (loss 0.5 * sum((p x_b)**2)), padding
    # rows weighted 0: each real example contributes (c/n)(dg - g (g . dg) / n**2) when
    # clipped, else dg, with dg = 2 p x_b v_b (float64 formula); padding rows nothing,
    # forward and reverse.
    rng = np.random.default_rng(3)
    p = rng.normal(size=6).astype(np.float32)
    x = rng.normal(size=(5, 6)).astype(np.float32) * np.float32([[0.3], [2.0], [1.0], [4.0], [0.1]])
    v = rng.normal(size=x.shape).astype(np.float32)
    pad = np.array([False, True, False, False, True])
    c = 1.0
    grad = jaxclip.clipped_grad(lambda q, xb: 0.5 * jnp.sum((q * xb) ** 2), c, microbatch_size=2)

    def summed(xs: jax.Array) -> jax.Array:
        return grad(jnp.asarray(p), xs, is_padding_example=pad)

    p64, x64, v64 = (np.asarray(a, np.float64) for a in (p, x, v))
    want = np.zeros(6)
    for b in np.flatnonzero(~pad):
        g, dg = p64 * x64[b] ** 2, 2 * p64 * x64[b] * v64[b]
        n = np.linalg.norm(g)
        want += c / n * (dg - g * np.dot(g, dg) / n**2) if n > c else dg
    if derivative == "jvp":
        got = jax.jit(lambda xs, t: jax.jvp(summed, (xs,), (t,))[1])(x, v)
    else:  # the vjp with cotangent e_j, for each output j: rows of the Jacobian
        jac = jax.jit(jax.jacrev(summed))(jnp.asarray(x))  # (6, 5, 6)
        got = np.einsum("jbk,bk->j", np.asarray(jac, np.float64), v64)
        assert not np.any(np.asarray(jac)[:, pad]), "padding rows have a derivative"
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxclip.clip_per_example(1.0, noise_multiplier=1.0, seed=3),
        lambda: jaxclip.adaptive_clip_per_example(1.0, noise_multiplier=1.0, seed=3),
    ],
)
def test_noisy_state_from_an_int_seed_checkpoints_as_numpy(make):
    # A checkpointer turns the state into NumPy arrays (flax.serialization, np.asarray):
    # a typed key refuses that. Restored, the next update draws the same noise; and the
    # draws are jax.random.key(seed)'s.
    tx = make()
    g = {"w": jnp.arange(12.0).reshape(3, 4) / 10}
    state = tx.init({"w": jnp.zeros(4)})
    saved = jax.tree.map(np.asarray, state)
    assert saved.key.dtype == np.uint32
    np.testing.assert_array_equal(saved.key, jax.random.key_data(jax.random.key(3)))
    restored = jax.tree.map(jnp.asarray, saved)
    a, _ = tx.update(g, state)
    b, _ = tx.update(g, restored)
    np.testing.assert_array_equal(a["w"], b["w"])
