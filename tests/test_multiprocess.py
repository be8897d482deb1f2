"""Two processes with 4 CPU devices each (``jax.distributed`` on localhost, gloo
collectives), one global mesh: the norm and history modes, under ``jit`` and inside
``shard_map``, give the one-process result, 20 tensor- plus data-parallel training steps
of each equal the one-device run, and the per-example modes (noise included) and
``clipped_grad`` data parallel give the one-process sums and states. Slow (two fresh JAX
processes): ``python -m pytest -m slow``."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_the_one_process_results(tmp_path):
    out = tmp_path / "results.npz"
    port = str(_free_port())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    worker = str(HERE / "_multiprocess_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(i), port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    import _multiprocess_worker as w  # the same modes and tree, run here on one process

    got = dict(np.load(out))
    host = w.host_tree()
    for name, fn in w.MODES.items():
        clipped, aux = fn(jax.tree.map(jnp.asarray, host))
        for how in ("jit", "shard_map"):
            for k in host:
                np.testing.assert_allclose(
                    got[f"{how}/{name}/{k}"], clipped[k], rtol=2e-6, err_msg=f"{how} {name} {k}"
                )
            for i, v in enumerate(jax.tree.leaves(aux)):
                np.testing.assert_allclose(
                    got[f"{how}/{name}/aux{i}"], v, rtol=2e-6, err_msg=f"{how} {name} aux{i}"
                )
    # Twenty training steps of each mode, against the one-device run.
    import test_training as tt

    for name in tt.MODES:
        if tt.MODES[name][0] in w.BATCHED:
            continue
        want = tt._single(name)
        n = len(jax.tree.leaves(want))
        leaves = [got[f"train/{name}/{i}"] for i in range(n)]
        tt._compare(name, jax.tree.unflatten(jax.tree.structure(want), leaves))
    # The per-example modes data parallel (noise included) and clipped_grad: as on one
    # process's 8 devices, and the noise-free sum against float64.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    for key, want in w.dp(mesh).items():
        np.testing.assert_allclose(got[key], want, rtol=2e-6, atol=1e-6, err_msg=key)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 300)) * np.linspace(0.001, 0.1, 16)[:, None]
    b = rng.normal(size=(16, 7))
    n = np.sqrt(np.sum(x.astype(np.float32).astype(np.float64) ** 2, 1) + np.sum(b**2, 1))
    f = np.minimum(1.0, 1.0 / n)[:, None]
    np.testing.assert_allclose(got["dp_clip/0/w"], (f * x).sum(0), rtol=1e-5, atol=1e-6)
    # And the reference itself: the global norm in float64.
    full = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in host.values()))
    np.testing.assert_allclose(got["shard_map/global_p2/aux0"], full, rtol=2e-6)
