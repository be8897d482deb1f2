"""jaxclip against optax (and torch, when installed), side by side in one process.

    python benchmarks/bench.py            # full run, a few minutes on 2 CPU cores
    python benchmarks/bench.py --quick    # smaller trees, under a minute

For each mode and tree it reports the compile time (trace + lower + compile), the median
run time over repeated calls (jaxclip and its counterpart interleaved, so machine noise
hits both), the ratio to the counterpart (the median of per-round ratios), the ratio to
the memory floor (one reduction pass plus one scaling pass over one contiguous array of
the same bytes) and XLA's
``temp_size_in_bytes``. It also times ``optax.chain(clip, optax.adamw(1e-3))`` against
``optax.adamw(1e-3)`` alone. The table is printed as Markdown and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip

CLIP = 1.0


def transformer_shapes(d: int, layers: int) -> dict[str, tuple[int, ...]]:
    """A transformer's leaves: an ``8d x d`` embedding, then per layer the attention
    kernels and biases and a ``4d`` MLP (12 leaves a layer)."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (8 * d, d)}
    for i in range(layers):
        per_layer = {
            "q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
            "q_b": (d,), "k_b": (d,), "v_b": (d,), "o_b": (d,),
            "mlp_in": (d, 4 * d), "mlp_in_b": (4 * d,), "mlp_out": (4 * d, d), "mlp_out_b": (d,),
        }  # fmt: skip
        shapes.update({f"layer{i:02d}/{k}": s for k, s in per_layer.items()})
    return shapes


def trees(quick: bool) -> dict[str, dict[str, jax.Array]]:
    """(a) 10 large leaves, (b) a transformer-shaped tree, (c) 1000 small leaves (120 with
    --quick), (d) (c) in bf16."""
    rng = np.random.default_rng(0)
    big = (256, 1024) if quick else (1024, 1640)  # full: 16.8M float32 parameters
    d, layers = (128, 8) if quick else (256, 16)
    large = {f"w{i}": rng.normal(size=big).astype(np.float32) for i in range(10)}
    tf: dict[str, Any] = {
        k: rng.normal(size=s).astype(np.float32) for k, s in transformer_shapes(d, layers).items()
    }
    n_small = 120 if quick else 1000
    small = {f"p{i:04d}": rng.normal(size=(1000,)).astype(np.float32) for i in range(n_small)}
    out = {"a_10_large": large, "b_transformer": tf, f"c_{n_small}_small": small}
    out[f"d_{n_small}_small_bf16"] = {k: v.astype(jnp.bfloat16) for k, v in small.items()}
    return {name: jax.tree.map(jnp.asarray, t) for name, t in out.items()}


def _floor(x: jax.Array) -> jax.Array:
    """One reduction pass and one scaling pass over one contiguous array."""
    xs = jax.lax.optimization_barrier(x)  # keeps XLA:CPU from a widened bf16 copy
    n = jnp.sqrt(jnp.sum(jnp.square(xs.astype(jnp.float32))))
    return (x.astype(jnp.float32) * (CLIP / jnp.maximum(n, CLIP))).astype(x.dtype)


def _compile(fn: Callable, *args: Any) -> tuple[Callable, float, int]:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    return compiled, seconds, int(compiled.memory_analysis().temp_size_in_bytes)


def _time_interleaved(
    fns: list[Callable], args: list[tuple], reps: int, calls: int = 1
) -> list[list[float]]:
    """Seconds per call of each fn, fns interleaved round-robin (one list per fn). With
    ``calls`` > 1 that many calls are queued before one wait: device-bound on an
    accelerator, where one blocking call also holds the host's dispatch."""
    for f, a in zip(fns, args):
        jax.block_until_ready(f(*a))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, (f, a) in enumerate(zip(fns, args)):
            t0 = time.perf_counter()
            jax.block_until_ready([f(*a) for _ in range(calls)])
            times[i].append((time.perf_counter() - t0) / calls)
    return times


def _median_ratio(a: list[float], b: list[float]) -> float:
    """Median of per-round ratios: robust to load that drifts during the run."""
    return statistics.median(x / y for x, y in zip(a, b))


MODES: dict[str, tuple[Callable, Callable, str]] = {
    "clip_by_global_norm": (
        lambda g: jaxclip.clip_tree_by_global_norm(g, CLIP)[0],
        lambda g: optax.clip_by_global_norm(CLIP).update(g, optax.EmptyState())[0],
        "optax.clip_by_global_norm",
    ),
    "clip_by_norm": (
        lambda g: jaxclip.clip_tree_by_norm(g, CLIP)[0],
        lambda g: optax.clip_by_block_rms(CLIP).update(g, optax.EmptyState())[0],
        "optax.clip_by_block_rms (per-leaf shape)",
    ),
    "clip_by_value": (
        lambda g: jaxclip.clip_tree_by_value(g, CLIP),
        lambda g: optax.clip(CLIP).update(g, optax.EmptyState())[0],
        "optax.clip",
    ),
}


def _torch_time(tree: dict[str, jax.Array], reps: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    params = []
    for x in jax.tree.leaves(tree):
        p = torch.nn.Parameter(torch.zeros(x.shape, dtype=torch.float32))
        p.grad = torch.from_numpy(np.asarray(x, np.float32)).clone()
        params.append(p)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(quick: bool, reps: int) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {jax.devices()[0].platform}",
        "versions": {
            "jax": jax.__version__,
            "optax": optax.__version__,
            "jaxclip": jaxclip.__version__,
        },
        "quick": quick,
        "reps": reps,
        "rows": [],
        "chain": [],
    }
    for tree_name, tree in trees(quick).items():
        nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
        flat = jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
        floor_fn, _, _ = _compile(_floor, flat)
        for mode, (ours, theirs, theirs_name) in MODES.items():
            ours_c, ours_compile, ours_temp = _compile(ours, tree)
            theirs_c, theirs_compile, theirs_temp = _compile(theirs, tree)
            times = _time_interleaved(
                [ours_c, theirs_c, floor_fn], [(tree,), (tree,), (flat,)], reps
            )
            t_ours, t_theirs, t_floor = (statistics.median(t) for t in times)
            row = {
                "tree": tree_name, "mode": mode, "counterpart": theirs_name,
                "leaves": len(jax.tree.leaves(tree)), "bytes": nbytes,
                "compile_s": ours_compile, "counterpart_compile_s": theirs_compile,
                "compile_ratio": ours_compile / theirs_compile,
                "run_ms": t_ours * 1e3, "counterpart_run_ms": t_theirs * 1e3,
                "floor_ms": t_floor * 1e3,
                "run_ratio": _median_ratio(times[0], times[1]),
                "floor_ratio": _median_ratio(times[0], times[2]),
                "temp_bytes": ours_temp, "counterpart_temp_bytes": theirs_temp,
            }  # fmt: skip
            if mode == "clip_by_global_norm" and "bf16" not in tree_name:
                t_torch = _torch_time(tree, reps)
                if t_torch is not None:
                    row["torch_foreach_ms"] = t_torch * 1e3
            results["rows"].append(row)
            print(_fmt_row(row), flush=True)
        params = jax.tree.map(jnp.zeros_like, tree)
        for mode, make in [
            ("clip_by_global_norm", lambda: jaxclip.clip_by_global_norm(CLIP)),
            ("clip_by_value", lambda: jaxclip.clip_by_value(CLIP)),
        ]:
            chained = optax.chain(make(), optax.adamw(1e-3))
            alone = optax.adamw(1e-3)
            fns, args = [], []
            for tx in (chained, alone):
                step = lambda g, s, p, tx=tx: tx.update(g, s, p)  # noqa: E731
                c, _, _ = _compile(step, tree, tx.init(params), params)
                fns.append(c)
                args.append((tree, tx.init(params), params))
            t_chain, t_alone = _time_interleaved(fns, args, reps)
            ratio = _median_ratio(t_chain, t_alone)
            results["chain"].append(
                {
                    "tree": tree_name,
                    "mode": mode,
                    "chain_ms": statistics.median(t_chain) * 1e3,
                    "adamw_ms": statistics.median(t_alone) * 1e3,
                    "ratio": ratio,
                }
            )
            print(f"  chain {mode} + adamw on {tree_name}: {ratio:.2f}x adamw alone", flush=True)
    return results


def _fmt_row(r: dict[str, Any]) -> str:
    torch_ms = f"{r['torch_foreach_ms']:.2f}" if "torch_foreach_ms" in r else "—"
    return (
        f"| {r['tree']} | {r['mode']} | {r['compile_s']:.2f} / {r['counterpart_compile_s']:.2f} "
        f"({r['compile_ratio']:.2f}x) | {r['run_ms']:.2f} / {r['counterpart_run_ms']:.2f} "
        f"({r['run_ratio']:.2f}x) | {r['floor_ratio']:.2f}x | {r['temp_bytes']} | {torch_ms} |"
    )


HEADER = (
    "| tree | mode | compile s: jaxclip / counterpart | median run ms: jaxclip / counterpart "
    "| vs floor | temp bytes | torch foreach ms |\n|---|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller trees and fewer repetitions")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per function")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.json"))
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 30)
    print(HEADER, flush=True)
    results = run(args.quick, reps)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(
        f"wrote {args.out} ({results['machine']}, jax {jax.__version__}, optax {optax.__version__})"
    )


if __name__ == "__main__":
    main()
