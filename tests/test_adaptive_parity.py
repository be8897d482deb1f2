"""Adaptive modes step by step against their reference implementations.

Two kinds of expected values, neither taken from jaxclip:

- float64 NumPy transcriptions of the reference sources (each function below names its
  file and commit), with jaxclip's documented deviations marked where they apply;
- the outputs of the real reference packages (``zclip`` 1.0.0, ``autoclip`` 0.2.1, on
  torch 2.13.0 CPU), recorded by ``tests/reference/record_adaptive.py`` in a separate
  environment into ``tests/reference/adaptive_outputs.json``;

and, where optax has the mode, optax itself (``adaptive_grad_clip``, ``apply_if_finite``).
Each configuration is one ``lax.scan`` over its steps (one compile), with a NaN and an
inf step inserted that the references never see: jaxclip keeps non-finite norms out of
its statistics, so the finite steps must match the references run without them.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip

RECORDED = json.loads(
    (pathlib.Path(__file__).parent / "reference" / "adaptive_outputs.json").read_text()
)
KEYS = ("p0", "p1", "p2")  # jax.tree.leaves order == the torch model's parameter order


def _f64(x: Any) -> np.ndarray:
    return np.asarray([math.nan if v is None else v for v in np.ravel(x)], np.float64).reshape(
        np.shape(x)
    )


def _steps(inputs: list, insert: dict[int, float], leaves: tuple[int, ...] = (0, 1, 2)):
    """The recorded inputs as a stacked tree, with a copy of step ``i`` whose ``leaves``
    hold ``insert[i]`` (NaN or inf) added before it; and, per jaxclip step, the
    reference's step (-1 for an added one)."""
    rows, where = [], []
    for i, row in enumerate(inputs):
        if i in insert:
            bad = [np.array(g, np.float32) for g in row]
            for j in leaves:
                bad[j].flat[0] = insert[i]
            rows.append(bad)
            where.append(-1)
        rows.append([np.asarray(g, np.float32) for g in row])
        where.append(i)
    stacked = {k: jnp.asarray(np.stack([r[j] for r in rows])) for j, k in enumerate(KEYS)}
    return stacked, where


@functools.partial(jax.jit, static_argnames=("make", "static"))
def _run(stacked: dict, numeric: dict, make: Any, static: tuple) -> tuple[dict, Any]:
    """``make(**numeric, **static)`` over the stacked steps in one ``lax.scan``; the
    numeric hyperparameters are traced, so configurations that differ only in them share
    one compile (the suite's time budget is tight)."""
    tx = make(**numeric, **dict(static))

    def step(state, g):
        out, state = tx.update(g, state)
        return state, (out, state)

    return jax.lax.scan(step, tx.init(jax.tree.map(lambda x: x[0], stacked)), stacked)[1]


def _split(config: dict) -> tuple[dict, tuple]:
    """A configuration as (traced numbers, static options); None caps are inf."""
    numeric, static = {}, []
    for k, v in config.items():
        if isinstance(v, bool) or isinstance(v, str) or k in ("history_length", "warmup_steps"):
            static.append((k, v))
        else:
            numeric[k] = jnp.float32(math.inf if v is None else v)
    return numeric, tuple(sorted(static))


def _scan(make: Any, stacked: dict, config: dict, **fixed: Any) -> tuple[dict, Any]:
    numeric, static = _split({**fixed, **config})
    return jax.device_get(_run(stacked, numeric, make, static))


def _check_nonfinite_step(out: dict, k: int) -> None:
    # The bad leaf p1 holds NaN/inf: the step is not finite (as in the references).
    assert not np.all(np.isfinite(np.asarray(out["p1"][k])))


# ----------------------------------------------------------------------------------------
# AGC: NFNets' unitwise_norm and optax.adaptive_grad_clip


def _nfnets_agc(g: np.ndarray, p: np.ndarray, clipping: float, eps: float) -> np.ndarray:
    """``unitwise_norm`` + ``SGD_AGC.update_param`` of google-deepmind/deepmind-research
    ``nfnets/optim.py`` (commit 68473a22), in float64; rank 5 as optax's
    ``unitwise_norm`` (the NFNets one raises there)."""
    g, p = g.astype(np.float64), p.astype(np.float64)

    def unitwise_norm(x: np.ndarray) -> np.ndarray:
        if len(np.squeeze(x).shape) <= 1:
            axis, keepdims = None, False
        elif len(x.shape) in [2, 3]:
            axis, keepdims = 0, True
        elif len(x.shape) == 4:
            axis, keepdims = (0, 1, 2), True
        else:  # optax: rank 5
            axis, keepdims = (0, 1, 2, 3), True
        return np.sum(x**2, axis=axis, keepdims=keepdims) ** 0.5

    param_norm = np.maximum(unitwise_norm(p), eps)
    grad_norm = unitwise_norm(g)
    max_norm = param_norm * clipping
    trigger = grad_norm > max_norm
    clipped_grad = g * (max_norm / np.maximum(grad_norm, 1e-6))
    return np.where(trigger, clipped_grad, g)


# The units that changed in issue 14 and the ranks beyond test_adaptive's (4, 3) and HWIO.
AGC_SHAPES = {
    "row": (1, 5),  # squeezed rank 1: one unit (per column before issue 14)
    "heads": (4, 2, 3),  # multi-head: axis 0 (axes (0, 1) before issue 14)
    "conv1x1": (1, 1, 3, 4),  # squeezed rank 2, rank 4: axes (0, 1, 2)
    "conv3d": (2, 2, 2, 3, 4),  # optax's rank 5
}


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_adaptive_clip_matches_nfnets_and_optax():
    rng = np.random.default_rng(14)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in AGC_SHAPES.items()}
    # Gradient scales that put some units above and some below the limit.
    grads = {
        k: (rng.normal(size=s) * rng.choice([0.01, 0.3], size=s)).astype(np.float32)
        for k, s in AGC_SHAPES.items()
    }
    clipping, eps = 0.1, 1e-3
    ours_tx, theirs_tx = (
        jaxclip.adaptive_clip(clipping, eps),
        optax.adaptive_grad_clip(clipping, eps),
    )
    # optax's axis= against jaxclip's axes= on the multi-head leaf.
    axes = [(1, 2)]
    over = [
        (jaxclip.adaptive_clip(0.1, axes=a), optax.adaptive_grad_clip(0.1, axis=a)) for a in axes
    ]

    @jax.jit
    def both(g, p):
        h, q = g["heads"], p["heads"]
        return (
            ours_tx.update(g, None, p)[0],
            theirs_tx.update(g, None, p)[0],
            [(o.update(h, None, q)[0], t.update(h, None, q)[0]) for o, t in over],
        )

    ours, theirs, overridden = jax.device_get(both(grads, params))
    clipped_any = 0
    for k in AGC_SHAPES:
        expected = _nfnets_agc(grads[k], params[k], clipping, eps)
        np.testing.assert_allclose(ours[k], expected, rtol=2e-6, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(ours[k], theirs[k], rtol=2e-6, atol=1e-12, err_msg=k)
        clipped_any += int(np.any(np.abs(expected - grads[k]) > 1e-7))
    assert clipped_any >= 3  # most leaves have clipped units, so the units matter
    for a, (o, t) in zip(axes, overridden):
        np.testing.assert_allclose(o, t, rtol=2e-6, err_msg=str(a))
        assert not np.allclose(o, ours["heads"], rtol=1e-4), a  # another unit, another result


# ----------------------------------------------------------------------------------------
# ZClip


def _zclip_reference(grads: list[list[np.ndarray]], warmup_steps: int, **config: Any) -> list:
    """``ZClip.step`` of bluorion-com/ZClip ``zclip/zclip.py`` (commit 584ce4f5), with
    torch's ``clip_grad_norm_`` (``max_norm / (total + 1e-6)``, clamped to 1), in float64.
    Returns per step the clipped gradients, mean and var."""
    alpha = config.get("alpha", 0.97)
    z_thresh = config.get("z_thresh", 2.5)
    max_grad_norm = config.get("max_grad_norm", 1.0)
    eps = config.get("eps", 1e-6)
    mode = config.get("mode", "zscore")
    clip_option = config.get("clip_option", "adaptive_scaling")
    clip_factor = config.get("clip_factor", 1.0)
    skip_update_on_spike = config.get("skip_update_on_spike", False)
    buffer: list[float] = []
    mean = var = None
    out = []
    for row in grads:
        g = [x.astype(np.float64) for x in row]
        total_norm = math.sqrt(sum(float(np.sum(x**2)) for x in g))
        if mean is None:
            buffer.append(total_norm)
            if len(buffer) >= warmup_steps:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
            if max_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_
                coef = min(max_grad_norm / (total_norm + 1e-6), 1.0)
                g = [x * coef for x in g]
            out.append((g, mean, var))
            continue
        std = var**0.5
        clip_val = None
        if mode == "percentile":
            threshold = mean + z_thresh * std
            if total_norm > threshold:
                clip_val = threshold
        else:
            z = (total_norm - mean) / (std + eps)
            if z > z_thresh:
                if clip_option == "adaptive_scaling":
                    eta = z / z_thresh
                    clip_val = (mean + (z_thresh * std) / eta) * clip_factor
                else:
                    clip_val = mean
        adaptive = clip_val if clip_val is not None else total_norm
        effective = min(adaptive, max_grad_norm) if max_grad_norm is not None else adaptive
        coef = effective / (total_norm + 1e-6) if total_norm > effective else 1.0
        g = [x * coef for x in g]
        if not (clip_val is not None and skip_update_on_spike):
            new = clip_val if clip_val is not None else total_norm
            mean = alpha * mean + (1 - alpha) * new
            var = alpha * var + (1 - alpha) * (new - mean) ** 2
        out.append((g, mean, var))
    return out


ZCLIP = RECORDED["zclip"]


@pytest.mark.parametrize("run", ZCLIP["runs"], ids=[str(r["config"]) for r in ZCLIP["runs"]])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_zclip_matches_reference_and_recorded_package(run):
    config = run["config"]
    inputs = [[np.asarray(g, np.float32) for g in row] for row in ZCLIP["inputs"]]
    warmup = ZCLIP["warmup_steps"]
    # A NaN step inside the warm-up and an inf step after it.
    stacked, where = _steps(ZCLIP["inputs"], {2: math.nan, 10: math.inf})
    # max_grad_norm: the reference's default (1.0) unless the config says otherwise.
    defaults = {
        "alpha": 0.97,
        "z_thresh": 2.5,
        "max_grad_norm": 1.0,
        "eps": 1e-6,
        "clip_factor": 1.0,
    }
    outs, states = _scan(jaxclip.zclip, stacked, config, warmup_steps=warmup, **defaults)
    expected = _zclip_reference(inputs, warmup, **config)
    clipped = 0
    for k, i in enumerate(where):
        if i < 0:
            _check_nonfinite_step(outs, k)
            continue
        rec = run["steps"][i]
        got = [outs[key][k] for key in KEYS]
        want, mean, var = expected[i]
        for j in range(len(KEYS)):
            # The reference scales by c / (n + 1e-6); norms here are >= 0.8.
            np.testing.assert_allclose(got[j], want[j], rtol=3e-6, atol=1e-9)
            np.testing.assert_allclose(got[j], _f64(rec["grads"][j]), rtol=3e-6, atol=1e-9)
        clipped += not np.allclose(got[0], inputs[i][0], rtol=1e-6)
        if mean is not None:
            np.testing.assert_allclose(states.mean[k], mean, rtol=2e-6)
            np.testing.assert_allclose(states.var[k], var, rtol=2e-5, atol=1e-9)
            np.testing.assert_allclose(states.mean[k], rec["mean"], rtol=2e-6)
            np.testing.assert_allclose(states.var[k], rec["var"], rtol=2e-5, atol=1e-9)
        np.testing.assert_allclose(states.global_norm[k], rec["total_norm"], rtol=2e-6)
    assert clipped >= 2  # the spikes (at least) were clipped


#: zclip's test_zscore_clipping and neighbours: statistics preset to mean 1, var 0.25 past the
#: warm-up, one gradient of norm 3. Recorded from zclip 1.0.0 (torch 2.13 CPU): the post-clip
#: norm, then mean and var after the step. Its scale has ``+ 1e-6`` in the denominator.
ZCLIP_PRESET = [
    ({"z_thresh": 2.0}, 0.9999996423721313, 1.01500003, 0.24955677822702824),
    (
        {"z_thresh": 2.0, "max_grad_norm": None},
        1.5000004768371582,
        1.01500003,
        0.24955677822702824,
    ),
    ({"clip_option": "mean", "max_grad_norm": None}, 0.9999996423721313, 1.0, 0.2425),
    (
        {"z_thresh": 2.0, "clip_factor": 0.5, "max_grad_norm": None},
        0.7500002384185791,
        0.992500015,
        0.24426418044325704,
    ),
]


@pytest.mark.parametrize(("kw", "post", "mean", "var"), ZCLIP_PRESET)
def test_zclip_from_preset_statistics_as_the_package(kw, post, mean, var):
    """The docstring's recipe: mean, var and finite_count set past the warm-up."""
    tx = jaxclip.zclip(warmup_steps=5, **kw)
    g = {"w": jnp.zeros((4, 3)).at[0, 0].set(3.0), "b": jnp.zeros(3)}
    state = tx.init(g)._replace(mean=jnp.float32(1.0), var=jnp.float32(0.25), finite_count=5)
    out, state = tx.update(g, state)
    np.testing.assert_allclose(float(jaxclip.global_norm(out)), post, rtol=2e-6)
    np.testing.assert_allclose(float(state.mean), mean, rtol=2e-6)
    np.testing.assert_allclose(float(state.var), var, rtol=2e-5)


def test_zclip_defaults_are_the_reference_defaults():
    import inspect

    params = inspect.signature(jaxclip.zclip).parameters
    # ZClip.__init__(alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup_steps=25,
    # mode="zscore", clip_option="adaptive_scaling", clip_factor=1.0,
    # skip_update_on_spike=False)
    reference = {
        "alpha": 0.97,
        "z_thresh": 2.5,
        "max_grad_norm": 1.0,
        "eps": 1e-6,
        "warmup_steps": 25,
        "mode": "zscore",
        "clip_option": "adaptive_scaling",
        "clip_factor": 1.0,
        "skip_update_on_spike": False,
    }
    for name, value in reference.items():
        default = params[name].default
        assert (int(default) if name == "warmup_steps" else default) == value, name
    with pytest.raises(ValueError, match="mode='bogus' must be one of"):
        jaxclip.zclip(mode="bogus")
    with pytest.raises(ValueError, match="clip_option='max' must be one of"):
        jaxclip.zclip(clip_option="max")
    with pytest.raises(ValueError, match=r"clip_factor=0\.0 must be > 0"):
        jaxclip.zclip(clip_factor=0.0)
    with pytest.raises(ValueError, match="pass max_grad_norm only"):
        jaxclip.zclip(max_grad_norm=2.0, max_norm=3.0)


# ----------------------------------------------------------------------------------------
# AutoClip package: QuantileClip, StandardClip


def _autoclip_reference(
    grads: list[list[np.ndarray]],
    cls: str,
    quantile: float = 0.9,
    deviations: float = 2.0,
    history_length: int = 1000,
    global_threshold: bool = False,
) -> list[list[np.ndarray]]:
    """``QuantileClip._clip_local/_clip_global`` (HesitantlyHuman/autoclip
    ``autoclip/torch/quantile.py``, commit 34badefb) and ``StandardClip``'s
    (``autoclip/torch/std.py``): the threshold from the earlier norms (inf for the first),
    torch's ``clip_grad_norm_``, then the pre-clip norm appended; in float64. Called on
    finite steps only (jaxclip's documented deviation: non-finite norms are not recorded).
    jaxclip's other documented deviation: StandardClip with one recorded norm (torch.std
    is NaN, so the reference's step is NaN) does not clip."""
    n_params = len(grads[0])
    histories: list[list[float]] = [[] for _ in range(1 if global_threshold else n_params)]

    def threshold(history: list[float]) -> float:
        if not history:
            return math.inf
        if cls == "QuantileClip":
            return float(np.quantile(history, quantile))  # linear, as torch.quantile
        if len(history) < 2:
            return math.inf  # (deviation; the reference: NaN)
        return float(np.std(history, ddof=1)) * deviations

    def clip(gs: list[np.ndarray], history: list[float]) -> list[np.ndarray]:
        t = threshold(history)
        total = math.sqrt(sum(float(np.sum(x**2)) for x in gs))
        coef = min(t / (total + 1e-6), 1.0)
        history.append(total)
        del history[:-history_length]
        return [x * coef for x in gs]

    out = []
    for row in grads:
        g = [x.astype(np.float64) for x in row]
        if global_threshold:
            out.append(clip(g, histories[0]))
        else:
            out.append([clip([x], h)[0] for x, h in zip(g, histories)])
    return out


AUTOCLIP = RECORDED["autoclip"]
_FACTORY = {"QuantileClip": jaxclip.quantile_clip, "StandardClip": jaxclip.standard_clip}


@pytest.mark.parametrize(
    "run", AUTOCLIP["runs"], ids=[f"{r['class']}{r['config']}" for r in AUTOCLIP["runs"]]
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_autoclip_package_matches_reference_and_recorded(run):
    cls, config = run["class"], run["config"]
    inputs = [[np.asarray(g, np.float32) for g in row] for row in AUTOCLIP["inputs"]]
    stacked, where = _steps(AUTOCLIP["inputs"], {3: math.nan, 7: math.inf})
    outs, states = _scan(_FACTORY[cls], stacked, config)
    expected = _autoclip_reference(inputs, cls, **config)
    clipped = 0
    for k, i in enumerate(where):
        if i < 0:
            _check_nonfinite_step(outs, k)
            continue
        rec = run["steps"][i]
        for j, key in enumerate(KEYS):
            got = outs[key][k]
            # atol: two equal norms in float64 have a std of 1e-8, in float32 of 0.
            np.testing.assert_allclose(got, expected[i][j], rtol=3e-6, atol=1e-6)
            recorded = _f64(rec[j])
            if cls == "StandardClip" and i == 1 and np.all(np.isnan(recorded)):
                # The reference's documented bug (std of one norm is NaN): not clipped here.
                np.testing.assert_array_equal(got, inputs[i][j])
                continue
            np.testing.assert_allclose(got, recorded, rtol=3e-6, atol=1e-6)
            clipped += not np.allclose(got, inputs[i][j], rtol=1e-6)
    assert clipped >= 3
    # The NaN/inf steps never entered the history.
    finite = np.asarray(states.finite_count[-1])
    assert (
        np.all(finite == len(inputs))
        if config.get("global_threshold")
        else (np.all(finite == len(inputs) - np.array([0, 2, 0]))) or np.all(finite == len(inputs))
    )


def test_quantile_clip_per_leaf_nonfinite_stays_in_its_leaf():
    # Per parameter: NaN/inf in p1 is p1's alone; p0 and p2 record those steps as usual.
    config = AUTOCLIP["runs"][0]["config"]  # the same compile as that run's
    stacked, where = _steps(AUTOCLIP["inputs"], {3: math.nan, 7: math.inf}, leaves=(1,))
    outs, states = _scan(jaxclip.quantile_clip, stacked, config)
    n = len(AUTOCLIP["inputs"])
    np.testing.assert_array_equal(states.finite_count[-1], [n + 2, n, n + 2])
    for k in [i for i, w in enumerate(where) if w < 0]:
        for key in ("p0", "p2"):
            assert np.all(np.isfinite(outs[key][k]))
        assert not np.all(np.isfinite(outs["p1"][k]))


_BAD = [1.0, math.nan, 1.0, math.nan, math.nan, math.inf, math.nan, 2.0, 3e38, math.inf, 1.0]


def _bad_steps() -> dict:
    rng = np.random.default_rng(16)
    base = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=(2,))}
    rows = []
    for v in _BAD:
        row = {k: x.astype(np.float32) for k, x in base.items()}
        if v == 3e38:  # finite, but its norm is beyond float32's range: applied by both
            row["w"][:2, 0] = np.float32(3e38)
        elif not math.isfinite(v):
            row["w"][1, 1] = np.float32(v)
        else:
            row = {k: x * np.float32(v) for k, x in row.items()}
        rows.append(row)
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in base}


@jax.jit
def _skip_vs_apply_if_finite(stacked: dict, max_errors: Any) -> tuple:
    # max_errors traced (both accept it), so the three cases share one compile.
    inner = optax.sgd(0.1, momentum=0.9)
    txs = (
        jaxclip.skip_large_updates(inner, max_consecutive_errors=max_errors),
        optax.apply_if_finite(inner, max_consecutive_errors=max_errors),
    )

    def run(tx):
        def step(state, g):
            out, state = tx.update(g, state)
            return state, (out, state)

        return jax.lax.scan(step, tx.init(jax.tree.map(lambda x: x[0], stacked)), stacked)[1]

    return tuple(run(tx) for tx in txs)


@pytest.mark.parametrize("max_errors", [0, 2, 5])
def test_skip_large_updates_matches_apply_if_finite(max_errors):
    (ours, os), (theirs, ts) = jax.device_get(
        _skip_vs_apply_if_finite(_bad_steps(), jnp.int32(max_errors))
    )
    for a, b in zip(
        jax.tree.leaves((ours, os.inner_state)), jax.tree.leaves((theirs, ts.inner_state))
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(os.consecutive, ts.notfinite_count)
    # Skipped: the bad steps that were not applied past the limit.
    bad = ~np.asarray(ts.last_finite)
    applied_bad = bad & (np.asarray(ts.notfinite_count) > max_errors)
    np.testing.assert_array_equal(os.skipped, np.cumsum(bad & ~applied_bad))
    # Bad steps: 1, then a run of four (3-6), then 9; the 3e38 step (8) is finite.
    assert int(os.skipped[-1]) == {0: 0, 2: 4, 5: 6}[max_errors]


def test_skip_large_updates_threshold_with_max_consecutive_errors():
    # A finite threshold: steps over it are bad too; after 2 in a row the 3rd is applied.
    norms = [1.0, 20.0, 30.0, 40.0, 50.0, 2.0, 20.0, 3.0]
    grads = jnp.asarray([[0.6 * n, 0.8 * n] for n in norms], jnp.float32)
    tx = jaxclip.skip_large_updates(optax.sgd(1.0), 10.0, max_consecutive_errors=2)

    def step(state, g):
        out, state = tx.update(g, state)
        return state, (out, state.skipped)

    _, (outs, skipped) = jax.jit(lambda: jax.lax.scan(step, tx.init(grads[0]), grads))()
    consecutive, expected_skip = 0, []
    for n in norms:  # apply_if_finite's rule with "bad" = over the threshold
        consecutive = consecutive + 1 if n > 10.0 else 0
        expected_skip.append(n > 10.0 and consecutive <= 2)
    for out, g, skip in zip(np.asarray(outs), np.asarray(grads), expected_skip):
        np.testing.assert_array_equal(out, 0.0 if skip else -g)
    np.testing.assert_array_equal(skipped, np.cumsum(expected_skip))
