"""Per-example clipping (DP-SGD) against optax, side by side in one process.

    python benchmarks/bench_per_example.py            # a minute or two on 2 CPU cores
    python benchmarks/bench_per_example.py --quick    # smaller batches, fewer repetitions

Modes: ``jaxclip.clip_tree_per_example(g, c)`` (sum) against
``optax.per_example_global_norm_clip(g, c)``, and ``jaxclip.clip_per_example(c,
noise_multiplier=1.0).update`` against ``optax.contrib.differentially_private_aggregate(c,
1.0).update``. For each it reports the compile time, the median run time over repeated calls
(interleaved, so machine noise hits both), the median of per-round ratios, and XLA's
``temp_size_in_bytes``. The table is printed as Markdown and appended as a section to
``benchmarks/last_run.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from bench import _compile, _time_interleaved

import jaxclip

CLIP = 1.0


def trees(quick: bool) -> dict[str, dict[str, jax.Array]]:
    """Per-example gradients: an MLP (784-256-256-10) in float32 and bfloat16, and a small
    transformer-shaped tree (many leaves), each with a leading batch axis."""
    rng = np.random.default_rng(0)
    batch = 32 if quick else 64
    mlp = {"w1": (784, 256), "b1": (256,), "w2": (256, 256), "b2": (256,), "w3": (256, 10)}
    mlp["b3"] = (10,)
    d = 64
    tf: dict[str, tuple[int, ...]] = {"embed": (512, d)}
    for layer in range(4):
        for name, s in {"qkv": (d, 3 * d), "o": (d, d), "mlp_in": (d, 4 * d)}.items():
            tf[f"l{layer}/{name}"] = s
        tf.update({f"l{layer}/mlp_out": (4 * d, d), f"l{layer}/ln": (d,), f"l{layer}/b": (d,)})

    def make(shapes: dict[str, tuple[int, ...]], dtype: Any) -> dict[str, jax.Array]:
        # Norms spread around CLIP, so that some examples are clipped and some are not.
        scale = rng.lognormal(0.0, 1.0, size=(batch,))
        n = sum(int(np.prod(s)) for s in shapes.values())
        return {
            k: jnp.asarray(
                rng.normal(size=(batch, *s)) * scale.reshape((batch,) + (1,) * len(s)) / n**0.5,
                dtype,
            )
            for k, s in shapes.items()
        }

    return {
        f"mlp_b{batch}_f32": make(mlp, jnp.float32),
        f"mlp_b{batch}_bf16": make(mlp, jnp.bfloat16),
        f"transformer_b{batch}_f32": make(tf, jnp.float32),
    }


def _modes(tree: dict[str, jax.Array]) -> dict[str, tuple[Callable, Callable, tuple, tuple]]:
    """mode -> (ours, theirs, ours' args, theirs' args)."""
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), tree)
    ours_tx = jaxclip.clip_per_example(CLIP, noise_multiplier=1.0)
    theirs_tx = optax.contrib.differentially_private_aggregate(CLIP, 1.0, jax.random.key(0))
    return {
        "sum of clipped examples": (
            lambda g: jaxclip.clip_tree_per_example(g, CLIP),
            lambda g: optax.per_example_global_norm_clip(g, CLIP),
            (tree,),
            (tree,),
        ),
        "DP-SGD aggregate (noise 1.0)": (
            ours_tx.update,
            theirs_tx.update,
            (tree, ours_tx.init(params)),
            (tree, theirs_tx.init(params)),
        ),
    }


def run(quick: bool, reps: int) -> list[dict[str, Any]]:
    rows = []
    for tree_name, tree in trees(quick).items():
        for mode, (ours, theirs, ours_args, theirs_args) in _modes(tree).items():
            ours_c, ours_compile, ours_temp = _compile(ours, *ours_args)
            theirs_c, theirs_compile, theirs_temp = _compile(theirs, *theirs_args)
            t_ours, t_theirs = _time_interleaved([ours_c, theirs_c], [ours_args, theirs_args], reps)
            row = {
                "tree": tree_name, "mode": mode,
                "bytes": sum(x.nbytes for x in jax.tree.leaves(tree)),
                "compile_s": ours_compile, "counterpart_compile_s": theirs_compile,
                "run_ms": statistics.median(t_ours) * 1e3,
                "counterpart_run_ms": statistics.median(t_theirs) * 1e3,
                "run_ratio": statistics.median(a / b for a, b in zip(t_ours, t_theirs)),
                "temp_bytes": ours_temp, "counterpart_temp_bytes": theirs_temp,
            }  # fmt: skip
            rows.append(row)
            print(_fmt_row(row), flush=True)
    return rows


HEADER = (
    "| per-example gradients | mode | compile s: jaxclip / optax "
    "| median run ms: jaxclip / optax | temp bytes: jaxclip / optax |\n|---|---|---|---|---|"
)


def _fmt_row(r: dict[str, Any]) -> str:
    return (
        f"| {r['tree']} ({r['bytes'] / 2**20:.1f} MiB) | {r['mode']} | {r['compile_s']:.2f} / "
        f"{r['counterpart_compile_s']:.2f} | {r['run_ms']:.2f} / {r['counterpart_run_ms']:.2f} "
        f"({r['run_ratio']:.2f}x) | {r['temp_bytes']} / {r['counterpart_temp_bytes']} "
        f"({r['temp_bytes'] / max(r['counterpart_temp_bytes'], 1):.3f}x) |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller batches, fewer repetitions")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per function")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "last_run.md"))
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 30)
    print(HEADER, flush=True)
    rows = run(args.quick, reps)
    machine = f"{platform.machine()} {os.cpu_count()} cores, {jax.devices()[0].platform}"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with open(args.out, "a") as f:
        f.write(
            f"\n## Per-example clipping (DP-SGD) vs optax\n\n`python benchmarks/"
            f"bench_per_example.py{' --quick' if args.quick else ''}`, {stamp}, {machine}, "
            f"jax {jax.__version__}, optax {optax.__version__}, median of {reps} interleaved "
            "calls; ratio = median of per-round ratios.\n\n"
        )
        f.write(HEADER + "\n" + "\n".join(_fmt_row(r) for r in rows) + "\n")
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
