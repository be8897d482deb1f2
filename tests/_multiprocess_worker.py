"""One of two processes with 4 CPU devices each (see test_multiprocess.py): builds a global
2x4 mesh over both, runs the norm and history modes under ``jit`` over the mesh and inside
``shard_map``, trains each 20 steps tensor- plus data-parallel, runs the per-example modes
and ``clipped_grad`` data parallel (:func:`dp`), and (process 0) saves the results.

Usage: ``python _multiprocess_worker.py PROCESS_ID PORT OUT.npz``
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
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

#: The per-example modes data parallel: the batch split over both mesh axes.
DP = {
    "dp_clip": lambda: jaxclip.clip_per_example(1.0, reduce="sum", axis_name=()),
    "dp_noised": lambda: jaxclip.clip_per_example(
        1.0, reduce="sum", noise_multiplier=1.0, seed=jax.random.PRNGKey(1), axis_name=()
    ),
    "dp_adaptive": lambda: jaxclip.adaptive_clip_per_example(
        1.0, reduce="sum", noise_multiplier=0.5, seed=jax.random.PRNGKey(2), axis_name=()
    ),
}


def dp(mesh: jax.sharding.Mesh) -> dict[str, np.ndarray]:
    """Three steps of each DP mode inside ``shard_map`` (each device's examples clipped,
    the sums psum'd, noise included) and ``clipped_grad``: the sums and the states."""
    rng = np.random.default_rng(1)
    host = {
        "w": (rng.normal(size=(16, 300)) * np.linspace(0.001, 0.1, 16)[:, None]),
        "b": rng.normal(size=(16, 7)),
    }
    axes = ("data", "model")
    rows = NamedSharding(mesh, P(axes))
    g = {
        k: jax.make_array_from_callback(v.shape, rows, lambda i, v=v: v[i].astype(np.float32))
        for k, v in host.items()
    }
    params = {k: np.zeros(v.shape[1:], np.float32) for k, v in host.items()}
    out: dict[str, np.ndarray] = {}
    with jax.set_mesh(mesh):
        for name, make in DP.items():
            tx = make()

            def step(g, s, tx=tx):
                u, s = tx.update(g, s)
                return jax.tree.map(lambda x: lax.psum(x, axes), u), s

            run = jax.jit(jax.shard_map(step, in_specs=(P(axes), P()), out_specs=(P(), P())))
            s = tx.init(params)
            for i in range(3):
                u, s = run(g, s)
                for k, v in u.items():
                    out[f"{name}/{i}/{k}"] = np.asarray(v.addressable_data(0))
                for j, v in enumerate(jax.tree.leaves(s)):
                    typed = jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
                    v = jax.random.key_data(v) if typed else v
                    out[f"{name}/{i}/state{j}"] = np.asarray(v.addressable_data(0))
        grad = jaxclip.clipped_grad(lambda w, x: 0.5 * jnp.sum((w - x) ** 2), 1.0)
        run = jax.jit(
            jax.shard_map(
                lambda w, x: lax.psum(grad(w, x), axes), in_specs=(P(), P(axes)), out_specs=P()
            )
        )
        out["clipped_grad"] = np.asarray(run(np.zeros(300, np.float32), g["w"]).addressable_data(0))
    return out


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
    results.update(dp(mesh))
    if pid == 0:
        np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
