"""Outside plain ``jit``: eager calls, ``vmap`` and all-zero leaves, side by side in one
process (the targets of DESIGN.md "Speed": eager at most 2x optax per call with no memory
growth, ``vmap`` at most 1.2x the naive vmapped formula, zero leaves at most 1.1x).

    python benchmarks/bench_modes.py           # about two minutes on 2 CPU cores
    python benchmarks/bench_modes.py --quick   # fewer calls

Prints a Markdown table (median per call, and the median of per-round ratios, calls
interleaved so that machine noise hits both sides) and writes ``results_modes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from bench import _median_ratio, _time_interleaved

import jaxclip

CLIP = 1.0


def mlp_tree(batch: int | None = None) -> dict[str, jax.Array]:
    """A 12-leaf MLP-shaped tree (784-256-256-10, twice), with a leading batch axis."""
    rng = np.random.default_rng(0)
    shapes = [(784, 256), (256,), (256, 256), (256,), (256, 10), (10,)] * 2
    lead = () if batch is None else (batch,)
    return {
        f"l{i}": jnp.asarray(rng.normal(size=lead + s).astype(np.float32))
        for i, s in enumerate(shapes)
    }


def _naive_norm(t: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(t)))


def _naive_clip(t: Any) -> tuple[Any, jax.Array]:
    n = _naive_norm(t)
    return jax.tree.map(lambda x: x * jnp.minimum(1.0, CLIP / n), t), n


def _transform_update(tx: Any, like: Any) -> Callable:
    """``tx.update`` under ``jit``, its state (and its logged norms) kept as an output."""
    state = tx.init(like)
    return jax.jit(lambda g: tx.update(g, state))


def _row(name: str, ours: Callable, theirs: Callable, args: tuple, reps: int, what: str) -> dict:
    times = _time_interleaved([ours, theirs], [args, args], reps)
    row = {
        "case": name,
        "counterpart": what,
        "ms": statistics.median(times[0]) * 1e3,
        "counterpart_ms": statistics.median(times[1]) * 1e3,
        "ratio": _median_ratio(times[0], times[1]),
    }
    print(
        f"| {name} | {what} | {row['ms']:.2f} / {row['counterpart_ms']:.2f} | "
        f"{row['ratio']:.2f}x |",
        flush=True,
    )
    return row


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(reps: int, eager_calls: int) -> dict[str, Any]:
    rows = []
    print("| case | counterpart | median ms: jaxclip / counterpart | ratio |\n|---|---|---|---|")
    tree = mlp_tree()
    state = optax.EmptyState()

    # Eager: one dispatch per call, no retracing.
    tx, otx = jaxclip.clip_by_global_norm(CLIP), optax.clip_by_global_norm(CLIP)
    s = tx.init(tree)
    rows.append(
        _row(
            "eager clip_by_global_norm.update",
            lambda g: tx.update(g, s)[0],
            lambda g: otx.update(g, state)[0],
            (tree,),
            reps,
            "optax.clip_by_global_norm eager",
        )
    )
    rows.append(
        _row(
            "eager global_norm",
            jaxclip.global_norm,
            optax.global_norm,
            (tree,),
            reps,
            "optax.global_norm eager",
        )
    )
    ntx, notx = jaxclip.clip_by_norm(CLIP), optax.clip_by_block_rms(CLIP)
    ns = ntx.init(tree)
    rows.append(
        _row(
            "eager clip_by_norm.update",
            lambda g: ntx.update(g, ns)[0],
            lambda g: notx.update(g, state)[0],
            (tree,),
            reps,
            "optax.clip_by_block_rms eager",
        )
    )
    before = _rss_mb()
    for _ in range(eager_calls):
        jax.block_until_ready(tx.update(tree, s)[0])
    growth = _rss_mb() - before
    print(f"\npeak RSS growth over {eager_calls} eager updates: {growth:.1f} MB\n")

    # vmap: per-example norms, against the naive vmapped formula.
    batched = mlp_tree(batch=64)
    print("| case | counterpart | median ms: jaxclip / counterpart | ratio |\n|---|---|---|---|")
    rows.append(
        _row(
            "vmap global_norm (64 examples)",
            jax.jit(jax.vmap(jaxclip.global_norm)),
            jax.jit(jax.vmap(_naive_norm)),
            (batched,),
            reps,
            "vmap of sqrt(sum of squares)",
        )
    )
    rows.append(
        _row(
            "vmap clip_tree_by_global_norm (64 examples)",
            jax.jit(jax.vmap(lambda g: jaxclip.clip_tree_by_global_norm(g, CLIP))),
            jax.jit(jax.vmap(_naive_clip)),
            (batched,),
            reps,
            "vmap of x * min(1, c / norm)",
        )
    )

    # All-zero leaves (frozen parameters) and zero rows (unused embedding rows).
    zero_leaf = dict(tree, l2=jnp.zeros_like(tree["l2"]))
    emb = jnp.asarray(np.random.default_rng(1).normal(size=(4096, 64)).astype(np.float32))
    zero_rows = emb.at[::3].set(0.0)
    # An embedding's gradient: rows of tokens absent from the batch are zero.
    big = jnp.asarray(np.random.default_rng(2).normal(size=(50000, 512)).astype(np.float32))
    unused = big.at[jnp.arange(big.shape[0]) % 10 != 0].set(0.0)
    # DP-SGD batches padded to a fixed size: the padding examples' gradients are zero.
    padded = jax.tree.map(lambda x: x.at[-1].set(0.0), batched)
    padded8 = jax.tree.map(lambda x: x.at[-8:].set(0.0), batched)
    for name, fn, args, base in [
        (
            "clip_by_norm, one all-zero leaf",
            jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, CLIP)[0]),
            (zero_leaf,),
            (tree,),
        ),
        (
            "clip_by_global_norm, one all-zero leaf",
            jax.jit(lambda g: jaxclip.clip_tree_by_global_norm(g, CLIP)[0]),
            (zero_leaf,),
            (tree,),
        ),
        (
            "clip_by_norm(axes=1), a third of the rows zero",
            jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, CLIP, axes=1)[0]),
            (zero_rows,),
            (emb,),
        ),
        (
            "clip_by_norm(axes=1), 50000x512 embedding, 90% of the rows zero",
            jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, CLIP, axes=1)[0]),
            (unused,),
            (big,),
        ),
        (
            "clip_by_norm transform (state: each leaf's largest norm), one all-zero leaf",
            _transform_update(jaxclip.clip_by_norm(CLIP), tree),
            (zero_leaf,),
            (tree,),
        ),
        (
            "clip_by_norm(axes=1) transform, 50000x512 embedding, 90% of the rows zero",
            _transform_update(jaxclip.clip_by_norm(CLIP, axes=1), big),
            (unused,),
            (big,),
        ),
        (
            "clip_tree_per_example (64 examples), the last one all zero",
            jax.jit(lambda g: jaxclip.clip_tree_per_example(g, CLIP)[0]),
            (padded,),
            (batched,),
        ),
        (
            "clip_tree_per_example (64 examples), the last 8 all zero",
            jax.jit(lambda g: jaxclip.clip_tree_per_example(g, CLIP)[0]),
            (padded8,),
            (batched,),
        ),
    ]:
        times = _time_interleaved([fn, fn], [args, base], reps)
        row = {
            "case": name,
            "counterpart": "the same call, no zeros",
            "ms": statistics.median(times[0]) * 1e3,
            "counterpart_ms": statistics.median(times[1]) * 1e3,
            "ratio": _median_ratio(times[0], times[1]),
        }
        print(
            f"| {name} | no zeros | {row['ms']:.2f} / {row['counterpart_ms']:.2f} | "
            f"{row['ratio']:.2f}x |",
            flush=True,
        )
        rows.append(row)
    return {
        "machine": f"{os.cpu_count()} cores, {jax.devices()[0].platform}",
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "rows": rows,
        "eager_rss_growth_mb": growth,
        "eager_calls": eager_calls,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results_modes.json"))
    args = ap.parse_args()
    reps, calls = (20, 200) if args.quick else (60, 1000)
    results = run(reps, calls)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
