"""A/B in one process: this checkout's jaxclip against an earlier commit's, beside optax.

    python benchmarks/ab.py --base 62f82ff            # a few minutes on 2 CPU cores
    python benchmarks/ab.py --base HEAD~3 --reps 30
    python benchmarks/ab.py --base HEAD~1 --only global   # the modes whose name holds it

The earlier commit's ``jaxclip`` is exported (``git archive``) into a temporary folder and
imported as ``jaxclip_base``. For each mode and tree it reports, for the base, this
checkout and optax's counterpart: the compile time (trace + lower + compile, the median
of ``--compiles`` fresh compiles), the run time (median over interleaved calls, so load
hits all three alike) and XLA's ``temp_size_in_bytes``; and the ratios new/base and
new/optax. The trees are ``bench.py``'s, plus 1200 mixed small leaves.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench

import jaxclip

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_base(rev: str) -> Any:
    """``jaxclip`` at ``rev``, imported as ``jaxclip_base``."""
    data = subprocess.run(
        ["git", "archive", rev, "jaxclip"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    out = pathlib.Path(tempfile.mkdtemp(prefix="jaxclip-ab-"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    (out / "jaxclip").rename(out / "jaxclip_base")
    for path in (out / "jaxclip_base").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"^(\s*)from jaxclip([ .])", r"\1from jaxclip_base\2", text, flags=re.M)
        text = re.sub(r"^(\s*)import jaxclip\b", r"\1import jaxclip_base", text, flags=re.M)
        path.write_text(text)
    sys.path.insert(0, str(out))
    return importlib.import_module("jaxclip_base")


def mixed_small(n: int = 1200) -> dict[str, jax.Array]:
    """``n`` small leaves of 40 shapes (biases, norms, small kernels)."""
    rng = np.random.default_rng(1)
    shapes = [(k,) for k in (16, 32, 64, 100, 128, 256, 300, 512)]
    shapes += [(a, b) for a in (8, 16, 32, 64) for b in (8, 16, 24, 32, 48, 64, 96, 128)]
    return {
        f"p{i:04d}": jnp.asarray(rng.normal(size=shapes[i % len(shapes)]).astype(np.float32))
        for i in range(n)
    }


def modes(lib: Any) -> dict[str, Callable[[Any], Any]]:
    tx_norm = lib.clip_by_norm(bench.CLIP)
    tx_global = lib.clip_by_global_norm(bench.CLIP)
    return {
        "clip_tree_by_global_norm": lambda g: lib.clip_tree_by_global_norm(g, bench.CLIP)[0],
        "clip_by_global_norm (transform)": lambda g: tx_global.update(g, tx_global.init(g))[0],
        "clip_tree_by_norm": lambda g: lib.clip_tree_by_norm(g, bench.CLIP)[0],
        "clip_by_norm (transform, state)": lambda g: tx_norm.update(g, tx_norm.init(g)),
    }


OPTAX = {
    "clip_tree_by_global_norm": lambda g: optax.clip_by_global_norm(bench.CLIP).update(
        g, optax.EmptyState()
    )[0],
    "clip_tree_by_norm": lambda g: optax.clip_by_block_rms(bench.CLIP).update(
        g, optax.EmptyState()
    )[0],
}
OPTAX["clip_by_global_norm (transform)"] = OPTAX["clip_tree_by_global_norm"]
OPTAX["clip_by_norm (transform, state)"] = OPTAX["clip_tree_by_norm"]


def _compile(fn: Callable, tree: Any, times: int) -> tuple[Callable, float, int]:
    seconds = []
    for _ in range(times):
        jax.clear_caches()
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(tree).compile()
        seconds.append(time.perf_counter() - t0)
    return compiled, statistics.median(seconds), compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare against")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compiles", type=int, default=3)
    ap.add_argument("--only", default="", help="the modes whose name holds this text")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results_ab.json"))
    args = ap.parse_args()
    base = load_base(args.base)
    trees = {**bench.trees(quick=False), "e_1200_mixed_small": mixed_small()}
    rows = []
    for tree_name, tree in trees.items():
        for mode in [m for m in modes(jaxclip) if args.only in m]:
            fns = [modes(base)[mode], modes(jaxclip)[mode], OPTAX[mode]]
            built = [_compile(f, tree, args.compiles) for f in fns]
            times = bench._time_interleaved([b[0] for b in built], [(tree,)] * 3, args.reps)
            row = {
                "tree": tree_name,
                "mode": mode,
                "compile_s": [round(b[1], 3) for b in built],
                "run_ms": [round(1e3 * statistics.median(t), 3) for t in times],
                "temp_bytes": [int(b[2]) for b in built],
                "run_new_over_base": round(bench._median_ratio(times[1], times[0]), 3),
                "run_new_over_optax": round(bench._median_ratio(times[1], times[2]), 3),
                "compile_new_over_base": round(built[1][1] / built[0][1], 3),
                "compile_new_over_optax": round(built[1][1] / built[2][1], 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"base": args.base, "machine": bench.platform.machine(), "jax": jax.__version__}
    pathlib.Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
