"""Two processes with 4 CPU devices each (``jax.distributed`` on localhost, gloo
collectives), one global mesh: every mode, under ``jit`` and inside ``shard_map``, gives
the one-process result, and 20 tensor- plus data-parallel training steps of every mode
equal the one-device run. Slow (two fresh JAX processes): ``python -m pytest -m slow``."""

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
    # And the reference itself: the global norm in float64.
    full = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in host.values()))
    np.testing.assert_allclose(got["shard_map/global_p2/aux0"], full, rtol=2e-6)
