"""A/B in one process: the ``clip_by_norm`` transform per layout, base against this checkout.

    python benchmarks/ab_slices.py --base b8b78f1      # about 3 minutes on 2 CPU cores
    python benchmarks/ab_slices.py --base HEAD~1 --full --only transformer

For each (tree, dtype, axes) of the matrix's quick trees (``matrix.tree_shapes``; its
full ones with ``--full``), normal data: the compile time of ``update`` with its state
(trace + lower + compile of a fresh function, the median of 3) and its run time (the
median of ``--reps`` interleaved calls), for the base (``ab.load_base``) and this
checkout, and their ratios new/base.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ab
import jax
import jax.numpy as jnp
import matrix
import numpy as np

import jaxclip

CELLS: list[tuple[str, str, Any]] = [
    ("large", "float32", -1),
    ("large", "float32", None),
    ("transformer", "float32", -1),
    ("transformer", "float32", None),
    ("conv", "float32", (0, 1, 2)),
    ("conv", "float32", 0),
    ("conv", "bfloat16", -1),
    ("large", "float16", 0),
    ("transformer", "float32", 0),
    ("transformer", "bfloat16", -1),
    ("transformer", "float16", 0),
    ("small1000", "float32", -1),
    ("small1000", "float32", 0),
    ("conv", "bfloat16", 0),
]


def _compiled(lib: Any, tree: Any, axes: Any) -> tuple[Any, Any, float]:
    tx = lib.clip_by_norm(1.0, axes=axes)
    state = tx.init(tree)
    seconds = []
    for _ in range(3):
        jax.clear_caches()
        t0 = time.perf_counter()
        compiled = jax.jit(tx.update).lower(tree, state).compile()
        seconds.append(time.perf_counter() - t0)
    return compiled, state, statistics.median(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare against")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--full", action="store_true", help="the matrix's full trees")
    ap.add_argument("--only", default="", help="the cells whose tree/dtype/axes holds this")
    args = ap.parse_args()
    libs = {"base": ab.load_base(args.base), "new": jaxclip}
    rng = np.random.default_rng(0)
    for tree_name, dtype, axes in CELLS:
        if args.only not in f"{tree_name}/{dtype}/axes={axes}":
            continue
        shapes = matrix.tree_shapes(tree_name, not args.full, False)
        tree = {k: jnp.asarray(rng.normal(size=s), matrix.DTYPES[dtype]) for k, s in shapes.items()}
        built = {k: _compiled(lib, tree, axes) for k, lib in libs.items()}
        runs: dict[str, list[float]] = {k: [] for k in built}
        for _ in range(args.reps):
            for k, (compiled, state, _) in built.items():
                jax.block_until_ready(compiled(tree, state))
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(tree, state))
                runs[k].append(time.perf_counter() - t0)
        cb, cn = built["base"][2], built["new"][2]
        rb, rn = (statistics.median(runs[k]) * 1e3 for k in ("base", "new"))
        print(
            f"{tree_name}/{dtype}/axes={axes} ({len(shapes)} leaves): compile base {cb:.2f} s"
            f" new {cn:.2f} s ({cn / cb:.2f}x); run base {rb:.2f} ms new {rn:.2f} ms"
            f" ({rn / rb:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
