"""Where compile time goes: one mode on one tree, with the compiled program's size.

    python benchmarks/compile_probe.py dedup                # XLA:CPU reuses identical kernels
    python benchmarks/compile_probe.py tree transformer     # every mode vs optax on one tree
    python benchmarks/compile_probe.py tree small --leaves 1000 --shapes 50
    python benchmarks/compile_probe.py tree small --leaves 10000 --only "clip_by_norm"

``dedup`` compiles the same per-leaf clipping over 300 leaves of one shape and of 300
distinct shapes: XLA:CPU compiles each distinct kernel once, so the second costs ~30x the
first (1.4 s against 47 s on 2 cores). Any per-leaf value sliced out of a stacked vector
makes each leaf's kernel distinct in the same way (issue 16's note).

``tree`` prints, per mode, trace+lower and compile seconds, the number of fusions and
conditionals in the optimized HLO, and the process's peak RSS so far, jaxclip beside optax
(``--only`` keeps the modes whose name contains the given text).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip


def _measure(fn: Callable[..., Any], *args: Any) -> str:
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text() or ""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return (
        f"trace+lower {t1 - t0:6.2f} s  compile {t2 - t1:6.2f} s  "
        f"fusions {text.count(' fusion('):5d}  conds {text.count('conditional('):4d}  "
        f"peak RSS {rss:6.0f} MiB"
    )


def _dedup() -> None:
    def clip(xs: list[jax.Array]) -> list[jax.Array]:
        return [x * jnp.minimum(1, 1 / jnp.sqrt(jnp.sum(x * x))) for x in xs]

    same = [jnp.ones((1000,), jnp.float32) for _ in range(300)]
    distinct = [jnp.ones((1000 + i,), jnp.float32) for i in range(300)]
    print("300 leaves, one shape:        ", _measure(clip, same), flush=True)
    print("300 leaves, distinct shapes:  ", _measure(clip, distinct), flush=True)


def _tree(kind: str, leaves: int, shapes: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    if kind == "transformer":  # benchmarks/bench.py's tree (b)
        d, layers = 256, 16
        tree = {"embed": rng.normal(size=(8 * d, d))}
        for layer in range(layers):
            for name, s in {
                "q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
                "q_b": (d,), "k_b": (d,), "v_b": (d,), "o_b": (d,),
                "mlp_in": (d, 4 * d), "mlp_in_b": (4 * d,),
                "mlp_out": (4 * d, d), "mlp_out_b": (d,),
            }.items():  # fmt: skip
                tree[f"layer{layer}/{name}"] = rng.normal(size=s)
    elif kind == "large":  # tree (a)
        tree = {f"w{i}": rng.normal(size=(1024, 1640)) for i in range(10)}
    else:  # `leaves` small leaves in `shapes` distinct sizes
        tree = {f"p{i:05d}": rng.normal(size=(64 + i % shapes,)) for i in range(leaves)}
    return {k: jnp.asarray(v, jnp.float32) for k, v in tree.items()}


def _modes(tree: dict[str, jax.Array]) -> dict[str, Callable[..., Any]]:
    params = jax.tree.map(lambda x: x * 0.5, tree)
    agc, ogc = jaxclip.adaptive_clip(0.01), optax.adaptive_grad_clip(0.01)
    empty = optax.EmptyState()
    return {
        "jaxclip clip_by_global_norm": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[0],
        "optax clip_by_global_norm": lambda g: optax.clip_by_global_norm(1.0).update(g, empty)[0],
        "jaxclip clip_by_norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0)[0],
        "optax clip_by_block_rms": lambda g: optax.clip_by_block_rms(1.0).update(g, empty)[0],
        "jaxclip adaptive_clip": lambda g: agc.update(g, agc.init(params), params)[0],
        "optax adaptive_grad_clip": lambda g: ogc.update(g, ogc.init(params), params)[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["dedup", "tree"])
    parser.add_argument(
        "kind", nargs="?", default="transformer", choices=["transformer", "large", "small"]
    )
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--shapes", type=int, default=50)
    parser.add_argument("--only", default="", help="modes whose name contains this")
    args = parser.parse_args()
    if args.what == "dedup":
        _dedup()
        return
    tree = _tree(args.kind, args.leaves, args.shapes)
    for name, fn in _modes(tree).items():
        if args.only not in name:
            continue
        print(f"{name:28s} {_measure(fn, tree)}", flush=True)


if __name__ == "__main__":
    main()
