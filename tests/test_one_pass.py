"""The single-pass 2-norm (the GPU/TPU strategy, ``_norms.backend.ONE_PASS``) run here on CPU.

On GPU and TPU, 2-norms are Blue's three accumulators in one variadic reduce with no
``lax.cond``; on CPU the plain sum of squares with a rare path (see ``jaxclip/_norms/backend.py``).
CI has no accelerator, so this module forces the single pass and runs the p=2 cases of
the differential harness (float64 references, every dtype over its whole range,
non-finite values, mixed trees, derivatives, vmap, 8 devices) through it, and checks the
mechanism: no conditional, one read of each leaf.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import test_differential as d

import jaxclip
from jaxclip._norms import backend


@pytest.fixture(autouse=True, scope="module")
def one_pass():
    """Traces in this module take the single pass; caches are cleared on the way in and
    out, so no function traced with the other strategy is reused (here or elsewhere)."""
    backend.ONE_PASS = True
    jax.clear_caches()
    yield
    backend.ONE_PASS = None
    jax.clear_caches()


#: The dtypes whose cases run in the default step; the others run in the slow step.
QUICK = ("float32",)


def _p2(cases, at: int = 1):
    """The p=2 cases; those of dtypes outside :data:`QUICK` marked slow (suite budget)."""
    out = []
    for c in cases:
        if c.values[at] != 2.0:
            continue
        if at == 1 and c.values[0] not in QUICK:
            c = pytest.param(*c.values, id=c.id, marks=[*c.marks, pytest.mark.slow])
        out.append(c)
    return out


@pytest.mark.parametrize("name, p, m", _p2(d._core_cases()))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_core_sweep(name, p, m):
    d.test_modes_match_float64_over_dtypes_and_magnitudes(name, p, m)


@pytest.mark.parametrize("name, p, bad, where", _p2(d._nonfinite_cases()))
def test_nonfinite(name, p, bad, where):
    d.test_nonfinite_propagates_for_every_norm_type(name, p, bad, where)


@pytest.mark.parametrize("mix", list(d.MIXES))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_mixed_trees(mix):
    d.test_mixed_trees_spanning_the_range(mix)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(d.X64_CASES))
def test_mixed_float32_float64_tree(case):
    d.test_mixed_float32_float64_tree(case)


@pytest.mark.slow
def test_leaf_sizes_1_to_1e6():
    d.test_leaf_sizes_1_to_1e6()


@pytest.mark.parametrize("p, s", _p2(d._deriv_cases(), at=0))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_derivatives(p, s):
    d.test_derivatives_match_float64(p, s)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_vmap_over_batched_leaves():
    d.test_vmap_over_batched_leaves()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_sharded_over_8_devices():
    d.test_sharded_over_8_devices(2.0)


def test_long_sums_are_blocked_on_cpu():
    """On XLA:CPU the pass runs in blocks of 256 whatever the default backend (chosen when
    lowering): one fused reduce adds sequentially, 1e-3 off over 3e6 elements."""
    x = jnp.full((3_000_000,), 0.7, jnp.float32)
    want = np.sqrt(3e6) * float(np.float32(0.7))
    np.testing.assert_allclose(float(jaxclip.global_norm(x)), want, rtol=1e-6)
    np.testing.assert_allclose(float(jaxclip.clip_tree_by_norm(x, 1.0)[1]), want, rtol=1e-6)


@pytest.mark.slow
def test_large_leaf_at_1e20():
    """3e6 float32 elements of 1e20 (every square overflows), and bfloat16 of 1e-25
    (every square underflows): one pass gets both exactly."""
    for value, dtype in ((1e20, jnp.float32), (1e-25, jnp.bfloat16)):
        x = jnp.full(3_000_000, value, dtype)
        v = float(np.asarray(value, np.float64).astype(dtype))
        want = np.sqrt(3e6) * v
        np.testing.assert_allclose(float(jaxclip.global_norm(x)), want, rtol=1e-6)
        norm = jaxclip.clip_tree_by_norm(x, 1.0)[1]
        np.testing.assert_allclose(float(norm), want, rtol=1e-6)


def _conds(jaxpr: jax.extend.core.Jaxpr) -> int:
    """The ``lax.cond`` equations in ``jaxpr`` and its sub-jaxprs, but for those of
    ``lax.platform_dependent`` (resolved when lowering: one branch is compiled)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and eqn.params.get("branches_platforms") is None:
            count += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _conds(sub)
    return count


def _has_cond(fn, tree) -> bool:
    """Whether ``fn``'s traced program holds a ``lax.cond`` (the strategy is chosen while
    tracing; compiled HLO would not tell: on an H100, XLA:GPU's optimized HLO held no
    conditional at all)."""
    return _conds(jax.make_jaxpr(fn)(tree).jaxpr) > 0


@pytest.mark.parametrize("mode", ["global", "norm", "norm_axes"])
def test_no_conditional(mode):
    tree = {f"w{i}": jnp.ones((64, 300 + i)) for i in range(3)}
    fn = {
        "global": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[0],
        "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0)[0],
        "norm_axes": lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=1)[0],
    }[mode]
    assert not _has_cond(fn, tree)
    backend.ONE_PASS = False
    try:  # the test itself can fail: the CPU strategy has the cond
        jax.clear_caches()
        assert _has_cond(fn, tree)
    finally:
        backend.ONE_PASS = True
        jax.clear_caches()


def test_per_example_norms_keep_the_two_paths():
    """Per-example rows (``lead``) keep the plain sum and its rare path: on an H100 the
    single pass ran no faster there and held 6-25x the temporaries."""
    g = {"w": jnp.ones((8, 40, 30))}
    assert _has_cond(lambda t: jaxclip.clip_tree_per_example(t, 1.0)[0], g)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_environment_variable():
    def run(value: str) -> subprocess.CompletedProcess:
        code = "from jaxclip._norms import backend; print(backend.ONE_PASS)"
        env = {**os.environ, "JAXCLIP_ONE_PASS": value}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    assert run("1").stdout.strip() == "True"
    bad = run("yes")
    assert bad.returncode != 0 and "JAXCLIP_ONE_PASS must be 1 or 0" in bad.stderr
