"""Adaptive modes against hand-written float64 references on scripted norm sequences."""

from __future__ import annotations

import collections
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from _helpers import train

import jaxclip

# A scripted sequence of global norms: steady, a spike, a NaN step, steady again.
NORMS = [1.0, 2.0, 1.5, 3.0, 2.5, 80.0, float("nan"), 2.0, 2.2, 1.8]


def _grads(n: float) -> dict[str, jax.Array]:
    # Global norm n, split over two leaves (3-4-5 triangle).
    return {"a": jnp.array([0.6 * n], jnp.float32), "b": jnp.array([[0.8 * n]], jnp.float32)}


def _run(tx, norms, jit=True):
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(_grads(1.0))
    outs, states = [], []
    for n in norms:
        out, state = update(_grads(n), state)
        outs.append(float(ref.norm(jax.tree.leaves(out), 2.0)) if np.isfinite(n) else out)
        states.append(state)
    return outs, states


# ----------------------------------------------------------------------------------------
# AGC


def _agc_reference(g, p, clipping, eps):
    # NFNets' unitwise_norm (deepmind-research nfnets/optim.py), with optax's rank 5.
    g, p = ref.f64(g), ref.f64(p)
    if np.squeeze(g).ndim <= 1:
        axes = None
    else:
        axes = (0,) if g.ndim in (2, 3) else tuple(range(g.ndim - 1))
    gn = ref.norm([g], 2.0, axes=axes) if axes else ref.norm([g], 2.0)
    pn = ref.norm([p], 2.0, axes=axes) if axes else ref.norm([p], 2.0)
    limit = clipping * np.maximum(pn, eps)
    return g * np.where(gn <= limit, 1.0, limit / np.where(gn <= limit, 1.0, gn))


class AdaptiveClipTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_reference_and_optax(self):
        rng = np.random.default_rng(0)
        params = {
            "kernel": rng.normal(size=(4, 3)).astype(np.float32),
            "conv": rng.normal(size=(3, 3, 2, 5)).astype(np.float32) * 0.1,
            "bias": np.zeros(3, np.float32),
            "scalar": np.float32(2.0),
        }
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.normal(size=np.shape(p)) * 3, jnp.float32), params
        )
        params = jax.tree.map(jnp.asarray, params)
        tx = jaxclip.adaptive_clip(0.05)
        out, _ = self.variant(tx.update)(grads, tx.init(params), params)
        for k in params:
            np.testing.assert_allclose(
                out[k], _agc_reference(grads[k], params[k], 0.05, 1e-3), rtol=2e-6, atol=1e-9
            )
        theirs, _ = optax.adaptive_grad_clip(0.05).update(grads, optax.EmptyState(), params)
        for k in params:
            np.testing.assert_allclose(out[k], theirs[k], rtol=2e-6, atol=1e-9)


def test_adaptive_clip_of_an_overflowing_unit_among_stacked_leaves():
    # Twelve small kernels stacked into one group; one unit's gradient squares overflow
    # float32 (1e25) and another's underflow (1e-30): each is clipped to its own limit as
    # in float64, not zeroed (an overflowed plain norm would give a factor of 0) nor kept.
    rng = np.random.default_rng(2)
    params = {f"w{i:02d}": rng.normal(size=(6, 5)).astype(np.float32) for i in range(12)}
    grads = {k: rng.normal(size=(6, 5)).astype(np.float32) for k in params}
    grads["w04"][:, 2] *= np.float32(1e25)
    grads["w09"][:, 1] *= np.float32(1e-30)
    tx = jaxclip.adaptive_clip(0.01, 1e-3)
    out, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for k in params:
        want = _agc_reference(grads[k], params[k], 0.01, 1e-3)
        np.testing.assert_allclose(
            np.asarray(out[k], np.float64), want, rtol=1e-5, atol=0, err_msg=k
        )


@pytest.mark.parametrize(
    "dtype, param_dtype",
    [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32)],
)
def test_adaptive_clip_where_the_param_norm_overflows_float32(dtype, param_dtype):
    # Units whose param norm (and gradient norm) is beyond float32's range: the limit
    # 0.01 * ||p|| is finite in float64 (~6e36), so each unit is scaled by about 0.01; a
    # limit formed as a float32 number is inf and left the units unclipped.
    rng = np.random.default_rng(5)
    params = {
        "v": np.full(4, 3e38),
        "conv": rng.uniform(2e38, 3e38, size=(3, 3, 2, 4)),
        "w": rng.uniform(1e38, 3e38, size=(16, 3)),
    }
    params = {k: jnp.asarray(v.astype(np.float32), param_dtype) for k, v in params.items()}
    grads = jax.tree.map(lambda p: (p * 0.5).astype(dtype), params)
    grads["w"] = grads["w"].at[:, 1].set(1.0)  # a unit within its limit: kept
    tx = jaxclip.adaptive_clip(0.01)
    eps = float(jnp.finfo(dtype).eps)
    for update in (tx.update, jax.jit(tx.update)):
        out, _ = update(grads, tx.init(params), params)
        for k in params:
            want = _agc_reference(grads[k], params[k], 0.01, 1e-3)
            np.testing.assert_allclose(
                np.asarray(out[k], np.float64), want, rtol=2 * eps, atol=0, err_msg=k
            )


@pytest.mark.parametrize(
    "dtype, param_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)]
)
def test_adaptive_clip_of_16_bit_gradients_of_32_bit_params(dtype, param_dtype):
    # Mixed precision: leaves that bucket in one width and not the other (a 16385-element
    # vector), 16-bit params among 32-bit ones, rows of slices, a conv kernel. Both trees
    # are laid out in the units they share; each unit clipped as in float64.
    rng = np.random.default_rng(7)
    shapes = {
        "a": (3, 5),
        "big": (16385,),
        "b": (4, 4),
        "c": (16,),
        "w": (6, 16),
        "conv": (3, 3, 4, 8),
    }
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads = {
        k: (rng.normal(size=s) * rng.choice([0.01, 1.0], size=s[-1:])).astype(np.float32)
        for k, s in shapes.items()
    }
    params = {
        k: jnp.asarray(v, jnp.bfloat16 if k == "c" else param_dtype) for k, v in params.items()
    }
    grads = {k: jnp.asarray(v, dtype) for k, v in grads.items()}
    fn = jax.jit(lambda g, p: jaxclip.clip_tree_adaptive(g, p, 0.05))
    out = fn(grads, params)
    eps = float(jnp.finfo(dtype).eps)
    for k in shapes:
        want = _agc_reference(grads[k], params[k], 0.05, 1e-3)
        assert out[k].dtype == dtype
        np.testing.assert_allclose(ref.f64(out[k]), want, rtol=2 * eps, atol=0, err_msg=k)
        assert not np.array_equal(want, ref.f64(grads[k])), k  # every leaf has a clipped unit


@pytest.mark.parametrize("one, other", [(jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.float16)])
def test_adaptive_clip_of_leaves_whose_dtypes_swap_between_the_trees(one, other):
    # Leaf "a" is a `one` gradient of an `other` param, leaf "b" the other way round: the
    # pairs differ, so no bucket may hold both (it concatenated a bfloat16 and a float32
    # gradient, a TypeError, or reinterpreted float16 bits as bfloat16).
    rng = np.random.default_rng(3)
    g = {k: rng.normal(size=(4, 3)).astype(np.float32) for k in "ab"}
    p = {k: rng.normal(size=(4, 3)).astype(np.float32) for k in "ab"}
    grads = {"a": jnp.asarray(g["a"], one), "b": jnp.asarray(g["b"], other)}
    params = {"a": jnp.asarray(p["a"], other), "b": jnp.asarray(p["b"], one)}
    out = jax.jit(lambda g, p: jaxclip.clip_tree_adaptive(g, p, 0.01))(grads, params)
    for k in "ab":
        want = _agc_reference(grads[k], params[k], 0.01, 1e-3)
        eps = float(jnp.finfo(grads[k].dtype).eps)
        assert out[k].dtype == grads[k].dtype
        np.testing.assert_allclose(ref.f64(out[k]), want, rtol=2 * eps, atol=0, err_msg=k)


def test_adaptive_clip_needs_params_and_axes_override():
    tx = jaxclip.adaptive_clip(0.1)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
    g, p = jnp.array([[3.0, 4.0], [30.0, 40.0]]), jnp.array([[1.0, 0.0], [0.0, 1.0]])
    out, _ = jaxclip.adaptive_clip(1.0, axes=1).update(g, None, p)  # rows as units
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.6, 0.8]], rtol=1e-6)


# ----------------------------------------------------------------------------------------
# AutoClip


@pytest.mark.parametrize("window", [1000, 4])
def test_auto_clip_scripted(window):
    pct = 25.0
    outs, states = _run(jaxclip.auto_clip(pct, window=window), NORMS)
    history: list[float] = []
    for n, out, state in zip(NORMS, outs, states):
        if np.isfinite(n):
            history = [*history, n][-window:]
        threshold = np.percentile(history, pct)
        np.testing.assert_allclose(optax.tree.get(state, "threshold"), threshold, rtol=1e-6)
        if np.isfinite(n):
            np.testing.assert_allclose(out, min(n, threshold), rtol=1e-6)
        else:
            assert all(np.all(np.isnan(x)) for x in jax.tree.leaves(out))
    assert int(states[-1].finite_count) == sum(np.isfinite(NORMS))


# ----------------------------------------------------------------------------------------
# ZClip


def _zclip_reference(
    norms, alpha, z_thresh, warmup, max_norm=None, eps=1e-6, mode="zscore", stats=None, skip=False
):
    """An independent float64 transcription of the ZClip algorithm; ``stats`` (a list)
    receives ``(mean, std)`` after each step once warm."""
    buf, mean, var, out = [], None, None, []
    for n in norms:
        if not np.isfinite(n):
            out.append(None)
            continue
        cap = math.inf if max_norm is None else max_norm
        if mean is None:
            buf.append(n)
            out.append(min(n, cap))
            if len(buf) == warmup:
                mean = np.mean(buf)
                var = np.mean((np.array(buf) - mean) ** 2)
                stats is None or stats.append((mean, math.sqrt(var)))
            continue
        std = math.sqrt(var)
        if mode == "percentile":
            spike = n > mean + z_thresh * std
            clip = mean + z_thresh * std if spike else n
        else:
            z = (n - mean) / (std + eps)
            spike = z > z_thresh
            clip = mean + z_thresh * std / (z / z_thresh) if spike else n
        out.append(min(clip, cap, n))
        if spike and skip:
            stats is None or stats.append((mean, std))
            continue
        mean = alpha * mean + (1 - alpha) * clip
        var = alpha * var + (1 - alpha) * (clip - mean) ** 2
        stats is None or stats.append((mean, math.sqrt(var)))
    return out


@pytest.mark.parametrize("max_norm", [None, 2.4])
def test_zclip_scripted(max_norm):
    # max_norm: the former name of max_grad_norm, still accepted.
    tx = jaxclip.zclip(alpha=0.9, z_thresh=2.0, warmup_steps=3, max_norm=max_norm)
    outs, states = _run(tx, NORMS)
    expected = _zclip_reference(NORMS, 0.9, 2.0, 3, max_norm)
    for out, e in zip(outs, expected):
        if e is None:
            assert all(np.all(np.isnan(x)) for x in jax.tree.leaves(out))
        else:
            np.testing.assert_allclose(out, e, rtol=2e-6)
    assert outs[5] < 4.0  # the spike of 80 is clipped hard
    assert np.isfinite(float(states[-1].mean)) and np.isfinite(float(states[-1].var))


@pytest.mark.parametrize("mode", ["zscore", "percentile"])
@pytest.mark.parametrize(
    ("scale", "eps"), [(1.0, 0.0), (1e25, 0.0), (1e-25, 0.0), (1e-34, 0.0), (1e25, 1e-6)]
)
def test_zclip_at_any_magnitude(scale, eps, mode):
    # Norms of 1e25 and 1e-25 scale, whose float32 squares overflow or underflow: the
    # spikes are found and clipped as in float64 (a variance held as float32 squares
    # was inf, never a spike, or 0, every step above the mean a spike).
    norms = [n * scale for n in NORMS]
    tx = jaxclip.zclip(0.9, 2.0, None, eps, 3, mode=mode)
    outs, states = _run(tx, norms)
    stats: list = []
    expected = _zclip_reference(norms, 0.9, 2.0, 3, None, eps, mode, stats)
    for out, e in zip(outs, expected):
        if e is not None:
            np.testing.assert_allclose(out, e, rtol=2e-6)
    warm = [s for s, n in zip(states, norms) if np.isfinite(n)][2:]
    got = np.array([(float(s.mean), float(s.std)) for s in warm])
    np.testing.assert_allclose(got, stats, rtol=2e-6)
    if scale == 1.0:  # the reference's var, std**2 (inf or 0 where float32 cannot hold it)
        np.testing.assert_allclose(float(warm[-1].var), stats[-1][1] ** 2, rtol=5e-6)


def test_zclip_at_the_top_of_float32():
    # Warm-up norms whose float32 sum overflows (3 x 2e38) and a spike near float32's
    # largest: the mean, the std and the clip as in float64.
    norms = [2e38, 2.2e38, 2.1e38, 2.05e38, 3.3e38, 2.1e38]
    tx = jaxclip.zclip(0.9, 1.0, None, 0.0, 3)
    outs, states = _run(tx, norms)
    stats: list = []
    expected = _zclip_reference(
        np.float32(norms).astype(float), 0.9, 1.0, 3, None, 0.0, "zscore", stats
    )
    np.testing.assert_allclose(outs, expected, rtol=2e-6)
    assert expected[4] < 2.3e38  # the spike is clipped
    got = np.array([(float(s.mean), float(s.std)) for s in states[2:]])
    np.testing.assert_allclose(got, stats, rtol=2e-6)


def test_zclip_clips_a_spike_near_float32s_largest():
    # Warm-up mean 5.75e37, std 8.2e37; 3.4e38 has z = 3.43 > 2.5: its limit (2.07e38, below
    # the norm) must not pass through z_thresh**2 * std = 5.1e38 (inf in float32).
    norms = [1e37, 1e37, 1e37, 2e38, 3.4e38]
    tx = jaxclip.zclip(0.97, 2.5, None, 1e-6, 4)
    outs, _ = _run(tx, norms)
    want = _zclip_reference(np.float32(norms).astype(float), 0.97, 2.5, 4, None, 1e-6)
    np.testing.assert_allclose(outs, want, rtol=2e-6)
    assert want[-1] < 2.1e38


def test_zclip_six_field_state_as_a_scan_carry():
    # A state built without std (the six fields) keeps that structure through update, so
    # it can be a lax.scan carry; its statistics follow sqrt(var).
    tx = jaxclip.zclip(0.9, 2.0, None, 0.0, 3)
    norms = jnp.array([n for n in NORMS if np.isfinite(n)], jnp.float32)

    def step(state, n):
        out, state = tx.update(_grads(n), state)
        return state, jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(out)))

    six = jaxclip.ZClipState(*tx.init(_grads(1.0))[:6])
    state, got = jax.lax.scan(step, six, norms)
    assert state.std is None
    expected = _zclip_reference(list(np.asarray(norms, np.float64)), 0.9, 2.0, 3, None, 0.0)
    np.testing.assert_allclose(got, expected, rtol=2e-6)


def test_zclip_state_through_warmup():
    # mean and std stay 0 until the warm-up's last norm, then are the warm-up norms' mean
    # and population std (all of them, whatever their order); warmup keeps those norms.
    norms = [1.0, 4.0, 2.0, 7.0, 3.0, 3.5]
    tx = jaxclip.zclip(0.9, 2.5, None, 0.0, 4)
    _, states = _run(tx, norms)
    for s in states[:3]:
        assert float(s.mean) == 0.0 and float(s.std) == 0.0
    w = np.array(norms[:4])
    np.testing.assert_allclose(
        [float(states[3].mean), float(states[3].std)], [w.mean(), w.std()], rtol=1e-6
    )
    for s in states[3:]:
        np.testing.assert_allclose(np.asarray(s.warmup), w, rtol=1e-6)


@pytest.mark.parametrize(
    ("mode", "clip_option", "skip", "want_norm", "want_mean"),
    [
        ("zscore", "adaptive_scaling", False, 1.5, 0.9 + 0.1 * 1.5),
        ("zscore", "mean", False, 1.0, 1.0),
        ("percentile", "adaptive_scaling", False, 2.0, 0.9 + 0.1 * 2.0),
        ("zscore", "adaptive_scaling", True, 1.5, 1.0),
    ],
)
@pytest.mark.parametrize("build", ["replace", "six_fields"])
def test_zclip_from_given_statistics(mode, clip_option, skip, want_norm, want_mean, build):
    # The reference's tests set zclip.mean = 1.0, zclip.var = 0.25 (std 0.5) and step a
    # norm of 3 (z = 4 with z_thresh 2): adaptive scaling clips it to 1 + 1 / 2, "mean" to
    # 1, percentile to 1 + 2 * 0.5; the mean moves to the clipped norm unless skipped.
    tx = jaxclip.zclip(0.9, 2.0, None, 0.0, 3, mode, clip_option, skip_update_on_spike=skip)
    state = tx.init(_grads(1.0))
    given = {"mean": jnp.float32(1.0), "var": jnp.float32(0.25), "finite_count": jnp.int32(3)}
    state = state._replace(**given)
    if build == "six_fields":  # a state built without std, as before it existed
        state = jaxclip.ZClipState(*state[:6])
    out, state = jax.jit(tx.update)(_grads(3.0), state)
    np.testing.assert_allclose(float(ref.norm(jax.tree.leaves(out), 2.0)), want_norm, rtol=1e-6)
    np.testing.assert_allclose(float(state.mean), want_mean, rtol=1e-6)
    if build == "replace":  # six fields stay six (std None)
        np.testing.assert_allclose(float(state.var), float(state.std) ** 2, rtol=1e-6)


def test_zclip_warmup_mean_is_correctly_rounded():
    # 25 close warm-up norms: a float32 mean is off by up to ~2.5 ulp; the mean's
    # rounding taken back out leaves it within half an ulp of the float64 mean.
    tx = jaxclip.zclip(0.9, 2.5, None, 0.0, 25)
    step = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for trial in range(4):
        state = tx.init(jnp.zeros(1))
        for n in 1 + rng.random(25) * 10.0 ** -rng.integers(1, 4):
            _, state = step(jnp.asarray([n], jnp.float32), state)
        w = np.asarray(state.warmup, np.float64)
        ulp = np.spacing(np.float32(w.mean()))
        assert abs(float(state.mean) - w.mean()) <= 0.5001 * ulp, trial
        np.testing.assert_allclose(float(state.std), w.std(), rtol=1e-5)


@pytest.mark.parametrize("mode", ["zscore", "percentile"])
def test_zclip_norm_at_the_threshold_is_not_a_spike(mode):
    # Warm-up 1, 3: mean 2, std 1; with z_thresh 1 and eps 0 a norm of 3 is at the
    # threshold, not over it (the reference's strict >): the statistics take it even with
    # skip_update_on_spike.
    tx = jaxclip.zclip(0.5, 1.0, None, 0.0, 2, mode=mode, skip_update_on_spike=True)
    outs, states = _run(tx, [1.0, 3.0, 3.0])
    np.testing.assert_allclose(outs[2], 3.0, rtol=1e-6)
    np.testing.assert_allclose(float(states[2].mean), 2.5, rtol=1e-6)


@pytest.mark.parametrize("mode", ["zscore", "percentile"])
def test_zclip_skip_update_on_spike(mode):
    # A spike (80) and a NaN after warm-up: neither enters the statistics.
    tx = jaxclip.zclip(0.9, 2.0, None, 0.0, 3, mode=mode, skip_update_on_spike=True)
    outs, states = _run(tx, NORMS)
    stats: list = []
    expected = _zclip_reference(NORMS, 0.9, 2.0, 3, None, 0.0, mode, stats, skip=True)
    for out, e in zip(outs, expected):
        if e is not None:
            np.testing.assert_allclose(out, e, rtol=2e-6)
    warm = [s for s, n in zip(states, NORMS) if np.isfinite(n)][2:]
    np.testing.assert_allclose([(float(s.mean), float(s.std)) for s in warm], stats, rtol=2e-6)


def test_zclip_inside_inject_hyperparams_and_scan():
    tx = optax.inject_hyperparams(jaxclip.zclip, static_args=("warmup_steps",))(
        z_thresh=2.0, warmup_steps=3, max_grad_norm=None
    )
    norms = jnp.array([n for n in NORMS if np.isfinite(n)], jnp.float32)

    def step(state, n):
        out, state = tx.update(_grads(n), state)
        return state, ref_norm(out)

    def ref_norm(out):
        return jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(out)))

    _, got = jax.lax.scan(step, tx.init(_grads(1.0)), norms)
    expected = _zclip_reference(list(np.asarray(norms)), 0.97, 2.0, 3)
    np.testing.assert_allclose(got, expected, rtol=2e-6)


# ----------------------------------------------------------------------------------------
# Grouped global norms


def test_grouped_global_norm():
    grads = {
        "enc": {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])},
        "dec": {"w": jnp.array([0.1, 0.2])},
    }
    group = lambda path, leaf: path.split("/")[0]  # noqa: E731
    tx = jaxclip.clip_by_global_norm(1.0, group=group)
    state = tx.init(grads)
    assert set(state.global_norm) == {"enc", "dec"}
    out, state = jax.jit(tx.update)(grads, state)
    norms = optax.tree.get(state, "global_norm")
    np.testing.assert_allclose(norms["enc"], 13.0, rtol=1e-6)
    np.testing.assert_allclose(norms["dec"], ref.norm([grads["dec"]["w"]], 2.0), rtol=1e-6)
    np.testing.assert_allclose(out["enc"]["b"], [12.0 / 13.0], rtol=1e-6)
    np.testing.assert_array_equal(out["dec"]["w"], grads["dec"]["w"])  # its own norm is below 1


# ----------------------------------------------------------------------------------------
# Spike skipping


def test_skip_large_updates_keeps_inner_state():
    tx = jaxclip.skip_large_updates(optax.adam(0.1), threshold=10.0)
    state = tx.init(_grads(1.0))
    update = jax.jit(tx.update)
    out, state = update(_grads(2.0), state)
    before = state
    for n in [80.0, float("nan")]:
        out, state = update(_grads(n), state)
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
        chex.assert_trees_all_equal(state.inner_state, before.inner_state)
    assert int(state.skipped) == 2 and int(state.consecutive) == 2
    out, state = update(_grads(3.0), state)
    assert int(state.consecutive) == 0 and int(state.skipped) == 2
    assert int(optax.tree.get(state, "count")) == 2  # adam counted the two applied steps
    np.testing.assert_allclose(state.global_norm, 3.0, rtol=1e-6)
    assert all(np.all(np.asarray(x) != 0) for x in jax.tree.leaves(out))


# ----------------------------------------------------------------------------------------
# End to end: a spike injected into a small model's training.


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxclip.zclip(warmup_steps=5),
        lambda: jaxclip.auto_clip(10.0, window=50),
        lambda: jaxclip.skip_large_updates(optax.identity(), threshold=50.0),
        lambda: jaxclip.clip_by_global_norm(5.0),
    ],
    ids=["zclip", "auto_clip", "skip", "global"],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_spike_in_training_keeps_loss_finite(make):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(64, 4)), jnp.float32)
    y = x @ jnp.array([1.0, -2.0, 0.5, 3.0])
    params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
    loss = lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)  # noqa: E731
    tx = optax.chain(make(), optax.sgd(0.05))
    _, _, losses = train(tx, loss, params, steps=40, grad_scale=lambda i: 1e6 if i == 20 else 1.0)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[19]  # still learning after the spike
    # Unclipped, the same spike sends the loss to ~1e12.
    assert losses[21] < 10 * losses[0]


def test_inject_hyperparams_with_defaults():
    grads = _grads(5.0)
    tx = optax.inject_hyperparams(jaxclip.auto_clip)(percentile=50.0)
    out, state = jax.jit(tx.update)(grads, tx.init(grads))
    np.testing.assert_allclose(optax.tree.get(state, "threshold"), 5.0, rtol=1e-6)
    tx = optax.inject_hyperparams(jaxclip.adaptive_clip)(clipping=0.1)
    params = jax.tree.map(lambda g: jnp.ones_like(g), grads)
    out, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(out["a"], [0.1], rtol=1e-6)  # |g| = 3 > 0.1 * |p| = 0.1


def test_adaptive_clip_with_integer_params_and_float0_grads():
    params = {"w": jnp.array([[0.0], [4.0]]), "step": jnp.array(3, jnp.int32)}
    grads = {"w": jnp.array([[0.0], [16.0]]), "step": np.zeros((), jax.dtypes.float0)}
    tx = jaxclip.adaptive_clip(0.5)
    out, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(out["w"], [[0.0], [2.0]], rtol=1e-6)
    assert out["step"] is grads["step"]


def test_adaptive_clip_float_gradient_of_an_integer_param_names_the_leaf():
    # Was numpy's "ValueError: data type <class 'numpy.int32'> not inexact", no leaf named.
    grads = {"w": jnp.ones(2), "step": jnp.ones(3)}
    params = {"w": jnp.ones(2), "step": jnp.ones(3, jnp.int32)}
    with pytest.raises(TypeError, match=r"parameter at 'step' has dtype int32.*need_clip"):
        jaxclip.clip_tree_adaptive(grads, params, 0.1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: jaxclip.quantile_clip(1.5), r"quantile=1\.5 must be in \[0, 1\]"),
        (lambda: jaxclip.quantile_clip(0.5, 0), r"history_length=0 must be a Python int >= 1"),
        (lambda: jaxclip.standard_clip(-1.0), r"deviations=-1\.0 must be finite and >= 0"),
        (
            lambda: jaxclip.skip_large_updates(optax.sgd(1.0), max_consecutive_errors=-1),
            r"max_consecutive_errors=-1 must be an int >= 0",
        ),
        (
            lambda: jaxclip.skip_large_updates(optax.sgd(1.0), max_consecutive_errors=1.5),
            r"max_consecutive_errors=1\.5 must be an int >= 0",
        ),
        (lambda: jaxclip.zclip(max_grad_norm=0.0), r"max_grad_norm=0\.0 must be > 0"),
    ],
)
def test_new_hyperparameters_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_quantile_clip_state_has_one_row_per_selected_leaf():
    tree = {"a": jnp.ones(2), "b": jnp.ones((2, 3)), "n": jnp.array(1, jnp.int32)}
    state = jaxclip.quantile_clip(0.5, 4).init(tree)
    assert state.history.shape == (2, 4) and state.threshold.shape == (2,)
    state = jaxclip.quantile_clip(0.5, 4, global_threshold=True).init(tree)
    assert state.history.shape == (4,) and state.threshold.shape == ()
    with pytest.raises(ValueError, match="has an entry for the leaf at 'b'"):
        jaxclip.quantile_clip(0.5, 4).update(
            {"a": jnp.ones(2)}, jaxclip.quantile_clip(0.5).init(tree)
        )


@pytest.mark.parametrize(
    "make", [jaxclip.quantile_clip, jaxclip.standard_clip], ids=["quantile", "standard"]
)
def test_per_leaf_histories_follow_their_leaves_by_path(make):
    """A tree with as many selected leaves under other paths, or the same paths in another
    order, is refused, eagerly and under jit; it does not take over the other leaves'
    histories (a leaf of norm 100 was clipped to its renamed neighbour's threshold). The
    record holds no arrays (optax.tree_map_params hands it to transform_non_params whole).
    A state of the other kind of threshold is refused."""
    tx = make(0.5, 4, need_clip=jaxclip.exclude_names("frozen"))
    first = {"a": jnp.array([3.0, 4.0]), "frozen": jnp.ones(2), "c": jnp.array([0.01])}
    state = tx.init(first)
    for _ in range(3):
        _, state = jax.jit(tx.update)(first, state)
    np.testing.assert_allclose(state.history[:, :3], [[5.0] * 3, [0.01] * 3], rtol=1e-6)
    renamed = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([100.0]), "frozen": jnp.ones(2)}
    reordered = collections.OrderedDict(
        [("c", first["c"]), ("frozen", first["frozen"]), ("a", first["a"])]
    )
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError, match=r"entry for the leaf at 'c' .*init selected it"):
            update(renamed, state)
        with pytest.raises(ValueError, match=r"leaf at 'c' in place 0, where init had .* 'a'"):
            update(reordered, state)
    assert state.paths == {"a\nc\n": optax.EmptyState()}
    # A tree that is one array (its path is "") against a tree of none selected.
    one, none = make(0.5, 4), make(0.5, 4, need_clip=False)
    out, _ = one.update(first["a"], one.init(first["a"]))  # the root leaf's own history
    np.testing.assert_array_equal(out, first["a"])
    with pytest.raises(ValueError, match="update selects the leaf at the root"):
        one.update(first["a"], none.init(first["a"]))
    abstract = optax.tree_map_params(
        tx,
        lambda x: x,
        state,
        transform_non_params=lambda t: jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), t
        ),
    )
    assert abstract.paths == state.paths
    tg = make(0.5, 4, global_threshold=True)
    with pytest.raises(ValueError, match=r"keeps per-leaf histories.*global_threshold=True"):
        tx.update(first, tg.init(first))
    with pytest.raises(ValueError, match=r"keeps one global history.*global_threshold=False"):
        tg.update(first, state)
    # The global threshold keeps one history whatever the paths.
    tg = make(0.5, 4, global_threshold=True)
    _, sg = tg.update(first, tg.init(first))
    out, _ = tg.update(renamed, sg)
    n = math.sqrt(25 + 2 + 1e4)
    want = 1.0 if make is jaxclip.standard_clip else min(1.0, math.sqrt(25 + 2 + 1e-4) / n)
    np.testing.assert_allclose(out["b"], [100.0 * want], rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [jaxclip.auto_clip, jaxclip.zclip, lambda: jaxclip.zclip(warmup_steps=1)],
    ids=["auto_clip", "zclip-warmup", "zclip-spike"],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_a_finite_step_whose_norm_overflows_float32_is_clipped_not_zeroed(make):
    """[3e38, 3e38] has norm 4.2e38 (inf in float32): scaled to the threshold 1 along its
    direction, as clip_by_global_norm does, not multiplied by 1/inf = 0."""
    tx = make()
    _, state = tx.update(jnp.array([0.6, 0.8]), tx.init(jnp.zeros(2)))
    out, state = tx.update(jnp.array([3e38, 3e38]), state)
    np.testing.assert_allclose(out, [2**-0.5, 2**-0.5], rtol=1e-6)
    assert float(state.threshold) == 1.0 and float(state.global_norm) == math.inf


def test_reference_spellings_port_unchanged():
    """ZClip(alpha, z_thresh, max_grad_norm, eps, warmup_steps, ...) positionally, and
    AutoClip's clip_percentile / history_size names."""
    tx = jaxclip.zclip(0.97, 2.5, 2.0, 1e-6, 3)
    out, state = tx.update(jnp.array([3.0, 4.0]), tx.init(jnp.zeros(2)))
    np.testing.assert_allclose(out, [1.2, 1.6], rtol=1e-6)  # capped at max_grad_norm=2
    assert state.warmup.shape == (3,)
    ours = jaxclip.auto_clip(50.0, window=4)
    theirs = jaxclip.auto_clip(clip_percentile=50.0, history_size=4)
    s1, s2 = ours.init(jnp.zeros(1)), theirs.init(jnp.zeros(1))
    for g in (1.0, 3.0, 100.0):
        (o1, s1), (o2, s2) = ours.update(jnp.array([g]), s1), theirs.update(jnp.array([g]), s2)
        np.testing.assert_array_equal(o1, o2)
    with pytest.raises(TypeError, match="both percentile= and clip_percentile="):
        jaxclip.auto_clip(20.0, clip_percentile=50.0)


# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [jaxclip.quantile_clip, jaxclip.standard_clip], ids=["quantile", "standard"]
)
def test_history_clippers_pass_trees_with_nothing_selected(make):
    # jnp.stack of no per-leaf norms crashed; every other mode returns such trees as given.
    g = {"w": jnp.array([3.0, 4.0])}
    for tx, tree in [
        (make(need_clip=False), g),
        (optax.masked(make(), {"w": False}), g),
        (make(), {}),
    ]:
        state = tx.init(tree)
        for _ in range(2):
            out, state = tx.update(tree, state)
            chex.assert_trees_all_equal(out, tree)


def test_numpy_float64_hyperparameters_keep_float32_states():
    # Under x64 a NumPy float64 alpha (a np.logspace sweep) made zclip's mean, var and
    # threshold float64 after one update: lax.scan rejected the carry.
    g = {"w": jnp.array([3.0, 4.0])}
    with jax.enable_x64(True):
        for tx in [
            jaxclip.zclip(np.float64(0.9), np.float64(2.0), np.float64(1.0), warmup_steps=1),
            jaxclip.standard_clip(np.float64(2.0)),
        ]:
            state = tx.init(g)
            steps = jnp.stack([jnp.array([3.0, 4.0]) * k for k in (1.0, 2.0, 50.0)])
            step = lambda s, x, tx=tx: (tx.update({"w": x}, s)[1], None)  # noqa: E731
            final, _ = jax.lax.scan(step, state, steps)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(final)):
                assert a.dtype == b.dtype, (a.dtype, b.dtype)


def test_auto_clip_never_zeroes_a_finite_first_step_beyond_float32():
    # The float32 norm of 4 x 3e38 is inf: not recorded, it left a threshold of 0 and a
    # zero update. The paper's percentile of one norm is that norm: the step passes.
    g = jnp.full(4, 3e38, jnp.float32)
    tx = jaxclip.auto_clip(10.0)
    out, state = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(out, g)
    assert float(state.threshold) == math.inf and int(state.finite_count) == 0


@pytest.mark.parametrize("scale", [1e25, 1e-30, 1.0])
@pytest.mark.parametrize("deviations", [0.0, 1.0, 2.5])
def test_standard_clip_threshold_at_any_magnitude(scale, deviations):
    # The std of the recorded norms (float64, Bessel's n - 1) times deviations, finite at
    # 1e25 and 1e-30, where the squares of float32 norms overflow or underflow: no
    # unclipped, zeroed or NaN step.
    tx = jaxclip.standard_clip(deviations, 3)
    state = tx.init({"w": jnp.zeros(2)})
    step = jax.jit(tx.update)
    x = np.array([3.0, 4.0])
    for s in (1.0, 2.0, 4.0):
        out, state = step({"w": jnp.asarray(x * s * scale, jnp.float32)}, state)
    recorded = np.asarray(state.history[0, :2], np.float64)  # the norms before the last
    threshold = deviations * np.std(recorded, ddof=1)
    np.testing.assert_allclose(float(state.threshold[0]), threshold, rtol=1e-6)
    n = 20.0 * scale
    want = np.float32(x * 4 * scale) * (threshold / n if n > threshold else 1.0)
    np.testing.assert_allclose(np.asarray(out["w"], np.float64), want, rtol=1e-6, atol=0)


def test_standard_clip_threshold_of_close_norms():
    # Norms 1000 (1 + k 1e-6): a float32 sum of squared deviations from a rounded mean
    # loses the std to cancellation (2.7e-5 relative); the corrected sum keeps it.
    tx = jaxclip.standard_clip(1.0, 8)
    state = tx.init({"w": jnp.zeros(1)})
    step = jax.jit(tx.update)
    for k in range(8):
        _, state = step({"w": jnp.asarray([1000.0 * (1 + k * 1e-6)], jnp.float32)}, state)
    recorded = np.asarray(state.history[0], np.float64)[:7]  # all but the last step's
    np.testing.assert_allclose(float(state.threshold[0]), np.std(recorded, ddof=1), rtol=1e-5)


@pytest.mark.parametrize(
    "norms", [(2e38, 3e38, 1.0), (1.7e38, 1.71e38, 1.0), (8.6e37, 1.0, 1.0), (1e38, 1.0, 1.0, 1.0)]
)
def test_standard_clip_threshold_at_the_top_of_float32(norms):
    # Norms near float32's largest: the scale stays a normal power of two (2**128 is inf,
    # and its inverse a subnormal that XLA:CPU flushes: NaN or zeroed updates).
    tx = jaxclip.standard_clip(2.0, 50, global_threshold=True)
    state = tx.init(jnp.zeros(1))
    step = jax.jit(tx.update)
    for k, v in enumerate(norms):
        out, state = step(jnp.asarray([v], jnp.float32), state)
        if k >= 2:
            recorded = np.asarray(norms[:k], np.float32).astype(np.float64)
            want = 2.0 * np.std(recorded, ddof=1)
            np.testing.assert_allclose(float(state.threshold), want, rtol=1e-6)
            expect = np.float32(v) * min(1.0, want / v)
            np.testing.assert_allclose(float(out[0]), expect, rtol=1e-6)


@pytest.mark.parametrize("other", [jnp.float32, jnp.bfloat16])
def test_adaptive_clip_float64_param_norm_past_float32_under_x64(other):
    # float64 params beside float32 gradients: the param norm (6e38) is held in the
    # gradients' float32 with its exponent apart, not cast to inf (which left the unit
    # unclipped). A unit within its limit is kept bit for bit.
    with jax.enable_x64(True):
        params = {"a": jnp.full(4, 3e38, jnp.float64), "b": jnp.full(3, 1.0, jnp.float64)}
        grads = {"a": jnp.full(4, 3e38, jnp.float32), "b": jnp.full(3, 1e-3, other)}
        for fn in (jaxclip.clip_tree_adaptive, jax.jit(jaxclip.clip_tree_adaptive)):
            out = fn(grads, params, 0.01)
            np.testing.assert_allclose(np.asarray(out["a"], np.float64), 3e36, rtol=1e-6)
            assert out["a"].dtype == jnp.float32
            np.testing.assert_array_equal(out["b"], grads["b"])


@pytest.mark.parametrize("jac", [jax.jacfwd, jax.jacrev])
def test_adaptive_clip_derivatives_float64_param_norm_past_float32_under_x64(jac):
    # The param norm (1.4e40, 2**133) past float32's range beside float32 gradients: the
    # clipped values were right, but the derivatives NaN (jacfwd both, jacrev in the
    # gradients): the whole exponent moved to exp, so x / n overflowed float32 and the
    # limit's tangent underflowed. Against d(g * c ||p|| / ||g||) in float64.
    with jax.enable_x64(True):
        p = np.array([1e40, -1e40, 2e39, 0.0])
        g = np.array([5e37, 1e37, -5e37, 2e37], np.float32)
        c = 1e-3
        jg, jp = jax.jit(jac(jaxclip.clip_tree_adaptive, argnums=(0, 1)), static_argnums=2)(
            jnp.asarray(g), jnp.asarray(p), c
        )
    g64 = g.astype(np.float64)
    gn, pn = np.linalg.norm(g64 / 1e37) * 1e37, np.linalg.norm(p / 1e40) * 1e40
    u = g64 / gn
    assert c * pn < gn  # clipped
    want_g = (c * pn / gn) * (np.eye(4) - np.outer(u, u))
    want_p = np.outer(c * u, p / pn)
    np.testing.assert_allclose(np.asarray(jg, np.float64), want_g, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(jp, np.float64), want_p, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: jaxclip.auto_clip(10.0, window=4), "history"),
        (lambda: jaxclip.zclip(warmup_steps=2, max_grad_norm=None), "warmup"),
    ],
    ids=["auto_clip", "zclip"],
)
def test_eager_update_from_a_state_restored_as_numpy(make, field):
    # A checkpoint (pickle of jax.device_get(state), msgpack, np.asarray per leaf) gives
    # NumPy arrays: the eager update takes them as the jitted one does (was an
    # AttributeError: 'numpy.ndarray' object has no attribute 'at').
    tx = make()
    state = jax.tree.map(np.asarray, tx.init(_grads(1.0)))
    out, state = tx.update(_grads(5.0), state)  # the first step: recorded, not clipped
    chex.assert_trees_all_equal(out, _grads(5.0))
    np.testing.assert_allclose(getattr(state, field)[0], 5.0, rtol=1e-6)


def test_standard_clip_of_constant_norms_zeroes_the_update_as_the_reference():
    # autoclip's StandardClip clips at deviations * std of the recorded norms (not mean +
    # deviations * std): equal norms give std 0, a threshold of 0 and a zero update, as
    # torch's clip_grad_norm_(max_norm=0) does there (the docstring says so).
    tx = jaxclip.standard_clip(2.0, global_threshold=True)
    state = tx.init(jnp.zeros(2))
    update = jax.jit(tx.update)
    outs = []
    for _ in range(3):
        out, state = update(jnp.array([3.0, 4.0]), state)
        outs.append(np.asarray(out))
    np.testing.assert_array_equal(outs[:2], [[3.0, 4.0], [3.0, 4.0]])  # two norms first
    np.testing.assert_array_equal(outs[2], [0.0, 0.0])
    assert float(state.threshold) == 0.0
