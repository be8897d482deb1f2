"""One of two processes with 4 CPU devices each (see test_multiprocess.py): builds a global
2x4 mesh over both, runs every mode under ``jit`` over the mesh and inside ``shard_map``,
trains each mode 20 steps tensor- plus data-parallel, and (process 0) saves the results.

Usage: ``python _multiprocess_worker.py PROCESS_ID PORT OUT.npz``
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip

SPECS = {"w": P("data", "model"), "tp": P(None, "model"), "b": P()}


def host_tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"w": (8, 16), "tp": (6, 8), "b": (5,)}
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _tx(tx: optax.GradientTransformation):
    def run(g):
        updates, state = tx.update(g, tx.init(g), g)
        return updates, [v for v in jax.tree.leaves(state) if v.ndim == 0]

    return run


MODES = {
    "global_p2": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0),
    "global_inf": lambda g: jaxclip.clip_tree_by_global_norm(g, 0.5, norm_type=float("inf")),
    "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0),
    "auto_clip": _tx(jaxclip.auto_clip()),
    "zclip": _tx(jaxclip.zclip()),
    "skip": _tx(jaxclip.skip_large_updates(optax.sgd(1.0), 12.0)),
}


def train(pid: int) -> dict[str, np.ndarray]:
    """Twenty tensor- plus data-parallel training steps of each mode (``shard_map`` over
    the global mesh, as in test_training.py): the params gathered, the replicated states
    as this process holds them."""
    import test_training as tt  # after jax.distributed.initialize: it counts devices

    out = {}
    for name in tt.MODES:
        if tt.MODES[name][0] in BATCHED:
            continue
        params, state = tt._shard_map_tp(name, check_vma=True)
        leaves = [multihost_utils.process_allgather(v, tiled=True) for v in jax.tree.leaves(params)]
        for v in jax.tree.leaves(state):
            v = jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
            leaves.append(np.asarray(v.addressable_data(0)))
        out.update({f"train/{name}/{i}": v for i, v in enumerate(leaves)})
    return out


BATCHED = ("clip_per_example", "adaptive_clip_per_example")


def main(pid: int, port: str, out_path: str) -> None:
    # The test sets XLA_FLAGS to 4 host devices; nothing touches a device before this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
    assert jax.process_count() == 2 and jax.device_count() == 8
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    host = host_tree()
    g = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, SPECS[k]), lambda idx, v=v: v[idx]
        )
        for k, v in host.items()
    }
    results: dict[str, np.ndarray] = {}
    for name, fn in MODES.items():
        inside = jax.shard_map(
            fn, mesh=mesh, in_specs=(SPECS,), out_specs=(SPECS, P()), check_vma=True
        )
        for how, f in (("jit", jax.jit(fn)), ("shard_map", jax.jit(inside))):
            with jax.set_mesh(mesh):
                clipped, aux = f(g)
            for k, v in clipped.items():
                results[f"{how}/{name}/{k}"] = multihost_utils.process_allgather(v, tiled=True)
            for i, v in enumerate(jax.tree.leaves(aux)):
                results[f"{how}/{name}/aux{i}"] = multihost_utils.process_allgather(v, tiled=True)
    results.update(train(pid))
    if pid == 0:
        np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
