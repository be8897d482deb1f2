"""One pass or two on an accelerator: jaxclip's 2-norms both ways, beside the counterpart.

    python benchmarks/gpu_passes.py --out /tmp/passes.json            # on a GPU machine
    python benchmarks/gpu_passes.py --trees large --dtypes float32 --budget 60

On GPU/TPU the core takes Blue's single pass (``backend.ONE_PASS`` unset); with
``ONE_PASS = False`` it takes the plain sum of squares and a ``lax.cond`` rare path, as on
CPU. Each cell compiles jaxclip's ``update`` both ways (the flag is read when tracing, so
each is compiled ahead of time with it set) and the counterpart of ``matrix.py``, then
times the three interleaved: ``--calls`` calls queued before one wait (device-bound), the
median of ``--reps`` rounds, and the median of per-round ratios. Also the number of
kernels (``fusion`` and custom calls in the optimised HLO's entry) and XLA's temp bytes.
Rows go to ``--out`` after every cell; cells stop being started after ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import matrix
from bench import _median_ratio, _time_interleaved

from jaxclip._norms import backend, passes

#: jaxclip's variants: (name, ``backend.ONE_PASS``, Blue's sums as sibling reductions).
VARIANTS = (("one", True, False), ("sib", True, True), ("two", False, False))

LAYOUTS = {
    "clip_by_global_norm": ["whole"],
    "clip_by_norm": ["whole", "trailing", "leading", "hwio"],
    "adaptive_clip": ["agc"],
    "clip_per_example": ["rows"],
}


def cells(trees: list[str], dtypes: list[str]) -> list[matrix.Cell]:
    out = []
    for dtype in dtypes:
        for tree in trees:
            for mode, layouts in LAYOUTS.items():
                for layout in layouts:
                    if layout == "hwio" and tree != "conv":
                        continue
                    if layout == "rows" and tree == "huge":
                        continue
                    if tree == "transformer" and layout in ("leading", "agc"):
                        continue
                    out.append(matrix.Cell(mode, layout, tree, dtype))
    return out


def kernels(compiled: Any) -> int:
    """Fusions and custom calls in the optimised module's entry computation."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    return len(re.findall(r"= (?:\([^=]*?\)|\S+) (?:fusion|custom-call)\(", entry))


def _siblings(x: Any, elem: Any, axes: Any, fused: bool) -> tuple[Any, ...]:
    return backend.variadic_sum(x, elem, axes, False)


def compile_with(
    flag: bool | None, fn: Any, args: tuple, siblings: bool = False
) -> tuple[Any, float]:
    """``fn`` compiled (``matrix._compile``: fresh, timed) with ``backend.ONE_PASS =
    flag``; with ``siblings``, Blue's three sums as three reductions (XLA's sibling
    fusion) instead of one variadic reduce."""
    backend.ONE_PASS = flag
    if siblings:
        passes.variadic_sum = _siblings
    try:
        return matrix._compile(fn, args, 0.0)  # no cap: no alarm
    finally:
        backend.ONE_PASS = None
        passes.variadic_sum = backend.variadic_sum


def run_cell(cell: matrix.Cell, reps: int, calls: int, bandwidth: float) -> dict[str, Any]:
    batch = 16 if cell.mode in matrix.PER_EXAMPLE else None
    shapes = matrix.tree_shapes(cell.tree, False, batch is not None)
    dtype = matrix.DTYPES[cell.dtype]
    grads = matrix.make_tree(shapes, dtype, batch, seed=0)
    params = matrix.make_tree(shapes, dtype, None, seed=1)
    ours, theirs, name = matrix.sides(cell)
    args_ours = (grads, ours.init(params), params)
    args_theirs = (grads, theirs.init(params), params)
    built = [compile_with(flag, ours.update, args_ours, sib) for _, flag, sib in VARIANTS]
    built.append(compile_with(None, theirs.update, args_theirs))
    fns = [c for c, _ in built]
    n = len(VARIANTS)
    t = _time_interleaved(fns, [args_ours] * n + [args_theirs], reps, calls)
    row: dict[str, Any] = {"key": cell.key(False), "counterpart": name}
    for i, (v, _, _) in enumerate(VARIANTS):
        row[f"{v}_ms"] = 1e3 * statistics.median(t[i])
        row[f"{v}_ratio"] = _median_ratio(t[i], t[n])
    row["counterpart_ms"] = 1e3 * statistics.median(t[n])
    row["floor_ms"] = 1e3 * matrix.floor_bytes(cell, grads, params) / bandwidth
    row["kernels"] = [kernels(c) for c in fns]
    row["temp_bytes"] = [int(c.memory_analysis().temp_size_in_bytes) for c in fns]
    row["compile_s"] = [s for _, s in built]
    return row


PROBES = (
    ((4096, 4096), "float32", (0,)),
    ((4096, 4096), "float32", (1,)),
    ((4096, 4096), "float32", None),
    ((3, 3, 1024, 1024), "float32", (0, 1, 2)),
    ((2048, 2048), "float32", (0,)),
    ((512, 512, 3, 3), "float32", (0,)),
    ((4096, 4096), "bfloat16", (0,)),
)


def _probe_fns(x: jax.Array, axes: tuple[int, ...] | None) -> list[Any]:
    elem = passes._blue_elem(passes.acc_dtype(x.dtype))
    dims = tuple(range(x.ndim)) if axes is None else axes
    return [
        lambda v: backend.variadic_sum(v, elem, axes, True),
        lambda v: backend.variadic_sum(v, elem, axes, False),
        lambda v: jnp.sum(jnp.square(v.astype(jnp.float32)), dims, keepdims=True),
        lambda v: _max_then_scaled(v, dims),
    ]


def _max_then_scaled(v: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """Two plain reductions, no conditional: the largest magnitude, then the sum of
    squares scaled by its power of two (its speed only: extreme exponents, whose scale
    is not a normal float32, are not handled here)."""
    a = jnp.abs(v.astype(jnp.float32))
    m = jnp.max(a, dims, keepdims=True)
    scale = jnp.ldexp(jnp.ones_like(m), -jnp.frexp(m)[1])
    return jnp.sum(jnp.square(a * scale), dims, keepdims=True)


def probe(reps: int, calls: int) -> None:
    """Blue's sums alone over one array: one variadic reduce, three sibling reductions,
    the plain sum of squares (the floor of any exact norm's pass), and a maximum then a
    sum scaled by it (exact with no conditional, reading the array twice)."""
    heads = " ".join(f"{h:>9}" for h in ("variadic", "siblings", "plain", "max+sum"))
    print(f"{'array':34} {heads}  kernels", flush=True)
    for shape, dtype, axes in PROBES:
        x = matrix.make_tree({"x": shape}, matrix.DTYPES[dtype], None, 0)["x"]
        compiled = [jax.jit(f).lower(x).compile() for f in _probe_fns(x, axes)]
        t = _time_interleaved(compiled, [(x,)] * len(compiled), reps, calls)
        ms = " ".join(f"{1e3 * statistics.median(s):9.3f}" for s in t)
        label = f"{dtype} {shape} {axes}"
        print(f"{label:34} {ms}  {[kernels(c) for c in compiled]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="One pass or two on an accelerator")
    ap.add_argument("--trees", default="huge,large,conv,transformer")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds to start cells in")
    ap.add_argument("--out", default="passes.json")
    ap.add_argument("--probe", action="store_true", help="Blue's sums alone first")
    args = ap.parse_args()
    start = time.perf_counter()
    if args.probe:
        probe(args.reps, args.calls)
    bandwidth = matrix.copy_bandwidth()
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "GBps": bandwidth / 1e9}
    print(json.dumps(meta), flush=True)
    names = [v for v, _, _ in VARIANTS]
    head = " ".join(f"{v:>7}" for v in [*names, "theirs", "floor"])
    print(f"{'cell':46} {head}  ratios to theirs  kernels", flush=True)
    rows = []
    for cell in cells(args.trees.split(","), args.dtypes.split(",")):
        if time.perf_counter() - start > args.budget:
            print(f"budget spent; not started: {cell.key(False)} and later", flush=True)
            break
        try:
            row = run_cell(cell, args.reps, args.calls, bandwidth)
        except Exception as e:  # a row that says so; the next cell runs
            row = {"key": cell.key(False), "error": f"{type(e).__name__}: {e}"[:300]}
            print(row, flush=True)
        else:
            ms = " ".join(f"{row[f'{v}_ms']:7.3f}" for v in names)
            ratios = " ".join(f"{row[f'{v}_ratio']:.2f}" for v in names)
            print(
                f"{row['key']:46} {ms} {row['counterpart_ms']:7.3f} {row['floor_ms']:7.3f}  "
                f"{ratios}  {row['kernels']}",
                flush=True,
            )
        rows.append(row)
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
