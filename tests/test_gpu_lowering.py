"""What XLA:GPU is given, checked without a GPU: programs lowered for ``cuda`` on this host.

XLA:CPU's measures (``jaxclip._norms.backend``) are chosen per platform when lowering. A loop
over chunks of a float16 leaf is one of them: on a GPU each of its steps is a kernel launch
(float16 norms ran 20-50x slower than optax's on an H200 while it was lowered there too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jaxclip
from jaxclip._norms import backend

SHAPES = {"w": (512, 512), "k": (3, 3, 64, 128), "u": (256, 1024), "v": (40000,)}
CASES = {
    "global_norm": lambda t: jaxclip.global_norm(t),
    "clip_tree_by_global_norm": lambda t: jaxclip.clip_tree_by_global_norm(t, 1.0)[0],
    "axes=None": lambda t: jaxclip.clip_tree_by_norm(t, 1.0)[0],
    "axes=0": lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=0)[0],
    "axes=-1": lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)[0],
    "norm_type=3": lambda t: jaxclip.global_norm(t, norm_type=3),
    "adaptive_clip": lambda t: jaxclip.clip_tree_adaptive(t, t, 0.1),
}


def _tree(dtype) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.lognormal(0.0, 2.0, s), dtype) for k, s in SHAPES.items()}


def _loops(fn, tree, platform: str) -> int:
    text = jax.jit(fn).trace(tree).lower(lowering_platforms=(platform,)).as_text()
    return text.count("stablehlo.while")


@pytest.mark.parametrize(
    "dtype", [jnp.float16, pytest.param(jnp.float8_e4m3fn, marks=pytest.mark.slow)]
)  # suite budget: the slow step runs float8 (CI runs both)
def test_no_loop_in_norms_lowered_for_gpu(dtype, monkeypatch):
    """On a GPU host: no loop lowered for the GPU, the loop lowered for its CPU."""
    tree = _tree(dtype)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.clear_caches()
    try:
        on_cpu = {name: _loops(fn, tree, "cpu") for name, fn in CASES.items()}
        assert sum(on_cpu.values()) >= len(CASES), on_cpu  # the measure is there on CPU
        on_gpu = {name: _loops(fn, tree, "cuda") for name, fn in CASES.items()}
        assert not any(on_gpu.values()), on_gpu
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_the_other_backends_sums_against_float64(monkeypatch):
    """The branch other backends lower, run here: each sum at once (float16, the loop's
    leaves), within the stated 1e-5 of float64; NaN and inf carried."""
    monkeypatch.setattr(backend, "_on_cpu", lambda loop, x, plain: plain(x))
    jax.clear_caches()
    try:
        tree = _tree(jnp.float16)
        f64 = {k: np.asarray(v, np.float64) for k, v in tree.items()}
        got = jax.jit(jaxclip.global_norm)(tree)
        want = np.sqrt(sum(np.sum(v * v) for v in f64.values()))
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
        for axes in (0, -1):
            norms = jax.jit(lambda t, a=axes: jaxclip.clip_tree_by_norm(t, 1.0, axes=a)[1])
            w = tree["u"].at[3, 5].set(jnp.nan).at[7, 9].set(jnp.inf)
            got = ref.f64(norms(w))
            x = np.asarray(w, np.float64)
            want = np.sqrt(np.sum(x * x, axis=axes))
            np.testing.assert_allclose(got, want, rtol=1e-5)
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_magnitudes_bits_clear_the_sign_as_an_integer():
    """XLA:GPU's float64 ``abs`` keeps a NaN's sign bit (seen on an H200, jax 0.11.2): the
    bits of ``abs(-nan)`` were negative, below every magnitude, and the maximum dropped the
    NaN. The sign bit is cleared by an integer ``and``, for every width."""
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
        x = jnp.asarray([1.0, -2.0, 3.0], dtype)
        text = jax.jit(backend.max_keeping_nan).trace(x).lower(lowering_platforms=("cuda",))
        ops = text.as_text()
        assert "stablehlo.and" in ops and "stablehlo.abs" not in ops, dtype
        nan = np.asarray(-np.nan, np.float32)
        top = float(jnp.finfo(dtype).max)  # float8_e4m3fn has no inf
        bits = backend.magnitude_bits(jnp.asarray([nan, -top, 1.0], dtype))
        assert int(bits[0]) > int(bits[1]) > int(bits[2]) > 0, dtype


def test_bfloat16_outputs_round_toward_zero_only_where_subnormals_are_kept(monkeypatch):
    """bfloat16 outputs subnormal (float32's subnormals) are rounded toward zero by
    truncating float32's bits (an integer ``and`` with -65536) where the backend keeps
    float32 subnormals (GPUs); XLA:CPU flushes the products to 0 already: no such op."""
    x = {"w": jnp.full((4, 8), 3.0, jnp.bfloat16)}

    def masks(platform: str) -> int:
        fn = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1e-3, axes=-1)[0])
        return fn.trace(x).lower(lowering_platforms=(platform,)).as_text().count("-65536")

    assert masks("cpu") == 0
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.clear_caches()
    try:
        assert masks("cuda") >= 1
        assert masks("cpu") == 0
        x = {"w": jnp.full((4, 8), 3.0, jnp.float32)}  # float32 outputs: rounded once
        assert masks("cuda") == 0
    finally:
        monkeypatch.undo()
        jax.clear_caches()
