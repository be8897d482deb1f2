"""Where XLA:CPU's compile time goes, by its own timers: one matrix cell, one side.

    python benchmarks/compile_passes.py clip_by_norm/whole/small1000/float32
    python benchmarks/compile_passes.py clip_per_example/rows/small1000/float32 --side theirs

Compiles the cell's ``update`` (``matrix.py``'s trees and counterparts) in a child process
with XLA's verbose log on (``TF_CPP_MAX_VLOG_LEVEL=1``), then sums the timers it prints:
per HLO pass (thread time), and per kind of kernel the LLVM and MLIR module compiles
(thread time over the compile threads: more than the wall time on 2 cores). The log
itself slows the compile; compare sides, not absolute seconds.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

import jax
import matrix

_TIMER = re.compile(r"\] (.*?) time: ([\d.]+) (us|ms|s) \(")
_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _compile(key: str, side: str) -> None:
    """The child: one compile of one side of the cell."""
    mode, layout, tree, dtype = key.split("/")[:4]
    cell = matrix.Cell(mode, layout, tree, dtype)
    batch = 16 if mode in matrix.PER_EXAMPLE else None
    shapes = matrix.tree_shapes(tree, key.endswith("/quick"), batch is not None)
    grads = matrix.make_tree(shapes, matrix.DTYPES[dtype], batch, 0)
    params = matrix.make_tree(shapes, matrix.DTYPES[dtype], None, 1)
    ours, theirs, _ = matrix.sides(cell)
    tx = ours if side == "ours" else theirs
    lowered = jax.jit(lambda *a: tx.update(*a)).lower(grads, tx.init(params), params)
    t0 = time.perf_counter()
    lowered.compile()
    print(f"compile {time.perf_counter() - t0:.2f} s (with the log on)", flush=True)


def _largest(seconds: dict[str, float], top: int) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda kv: -kv[1])[:top]


def summarize(log: str, top: int) -> str:
    passes: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, float] = collections.defaultdict(float)
    modules = {"LLVM": 0, "MLIR": 0}
    for line in log.splitlines():
        m = _TIMER.search(line)
        if not m:
            continue
        name, seconds = m.group(1), float(m.group(2)) * _SCALE[m.group(3)]
        if name.startswith("HLO pass: "):
            passes[name[len("HLO pass: ") :]] += seconds
        elif name.startswith(("Compiled LLVM module", "Compiled MLIR module")):
            kind = name.split()[1]
            modules[kind] += 1
            kernel = re.sub(r"\.?\d+", "", name.split(": ", 1)[1]).replace("__compute_module_", "")
            kernels[f"{kind} {kernel}"] += seconds
    out = [f"HLO passes {sum(passes.values()):.2f} s"]
    out += [f"  {s:7.2f} s  {name}" for name, s in _largest(passes, top)]
    out.append(
        f"kernel modules {sum(kernels.values()):.2f} s "
        f"({modules['LLVM']} LLVM, {modules['MLIR']} MLIR modules)"
    )
    out += [f"  {s:7.2f} s  {name}" for name, s in _largest(kernels, top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("cell", help="a matrix key: mode/layout/tree/dtype[/quick]")
    parser.add_argument("--side", choices=["ours", "theirs"], default="ours")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _compile(args.cell, args.side)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_MAX_VLOG_LEVEL="1")
    cmd = [sys.executable, __file__, args.cell, "--side", args.side, "--child"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    print(f"{args.cell}, {args.side}: {run.stdout.strip()}")
    print(summarize(run.stderr, args.top))


if __name__ == "__main__":
    main()
