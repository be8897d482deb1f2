"""One benchmark matrix: every mode of jaxclip against its counterpart, under ``jit``.

    python benchmarks/matrix.py                  # the full matrix (an hour or more, 2 cores)
    python benchmarks/matrix.py --quick          # a small subset, under 3 minutes
    python benchmarks/matrix.py --only bfloat16  # the cells whose key holds a substring
    python benchmarks/matrix.py --inline --trees huge  # one process, against the memory floor

Cells are mode x layout x tree x dtype. Modes are those of :data:`jaxclip._registry.MODES`
(their transforms, ``update`` with its state, as built from the registry's example); each
is timed against optax's counterpart, or the naive float32-accumulated formula where optax
has none (``clip_by_norm``); the history-based modes against ``optax.clip_by_global_norm``,
which makes the same passes (one joint norm, one scaling). Layouts: whole leaves, slices
over the trailing axis (``axes=-1``) or the leading one (``axes=0``), HWIO conv kernels per
output channel (``axes=(0, 1, 2)``), AGC's units, per-example rows. Trees: a few large
leaves, a transformer (~300 leaves), a conv net (20 HWIO kernels), 1000 small leaves; the
per-example trees are smaller ones with a leading batch axis. Dtypes: float32, bfloat16,
float16.

Each cell runs in a process of its own. Run time: the median over ``--reps`` rounds of
alternating calls of both compiled functions, and the median of the per-round ratios.
Compile time: trace + lower + compile of a fresh function, ``jax.clear_caches()`` between,
the median of ``--compiles``. A compile that takes longer than ``--cap`` seconds ends the
cell (``SIGALRM``); the cell is recorded as skipped, and later cells with the same
counterpart compile are skipped without trying. Rows go to ``results_matrix.json``
(``--out``) after every cell, replacing the file's rows of the same cells and keeping its
others (``--fresh`` drops them); the quick set's keys end in ``/quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench import _median_ratio, _time_interleaved, transformer_shapes

import jaxclip
from jaxclip import _registry

HERE = os.path.dirname(os.path.abspath(__file__))
CLIP = 1.0
DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
#: The layouts of ``clip_by_norm``: its ``axes``.
NORM_AXES: dict[str, int | tuple[int, ...] | None] = {
    "whole": None,
    "trailing": -1,
    "leading": 0,
    "hwio": (0, 1, 2),
}
TREES = ("large", "transformer", "conv", "small1000")
#: Trees outside the default matrix, for ``--trees``: "huge" (328 MiB of float32: four
#: 4096x4096 kernels, two 3x3x1024x1024 convs) puts a GPU's cells at the memory floor.
MORE_TREES = ("huge",)
HISTORY = ("auto_clip", "quantile_clip", "standard_clip", "zclip", "skip_large_updates")
PER_EXAMPLE = ("clip_per_example", "adaptive_clip_per_example")
#: Targets (issue 36): run time, and compile time over the counterpart's.
RUN_TARGET = 1.1
COMPILE_SLACK_S = 0.15
MANY_LEAVES, MANY_LEAVES_TARGET = 1000, 0.25
Shapes = dict[str, tuple[int, ...]]


class Cell(NamedTuple):
    mode: str
    layout: str
    tree: str
    dtype: str

    def key(self, quick: bool) -> str:
        """The row's key; the quick set's trees are smaller, its keys end in ``/quick``."""
        return f"{self.mode}/{self.layout}/{self.tree}/{self.dtype}" + ("/quick" if quick else "")


def _conv(widths: list[int]) -> Shapes:
    """HWIO kernels: 3x3 mostly, a 1x1 after every fourth."""
    return {
        f"conv{i:02d}": ((1, 1) if i % 4 == 3 else (3, 3)) + (w, w) for i, w in enumerate(widths)
    }


def _small(n: int) -> Shapes:
    """``n`` small leaves of 40 shapes (biases, norms, small kernels)."""
    kinds = [(k,) for k in (16, 32, 64, 100, 128, 256, 300, 512)]
    kinds += [(a, b) for a in (8, 16, 32, 64) for b in (8, 16, 24, 32, 48, 64, 96, 128)]
    return {f"p{i:04d}": kinds[i % len(kinds)] for i in range(n)}


def tree_shapes(tree: str, quick: bool, batched: bool) -> Shapes:
    """The leaves' shapes; per-example trees are smaller (a batch axis is prepended)."""
    if tree == "huge":
        return {"w0": (4096, 4096), "w1": (4096, 4096), "w2": (4096, 4096), "w3": (4096, 4096),
                "c0": (3, 3, 1024, 1024), "c1": (3, 3, 1024, 1024)}  # fmt: skip
    if tree == "large":
        if batched:
            return {"w": (512, 512), "k": (64, 64, 3, 3), "v": (4096,)}
        if quick:
            return {"w": (1024, 1024), "k": (256, 256, 3, 3), "v": (4096,)}
        return {"w": (2048, 2048), "k": (512, 512, 3, 3), "u": (1024, 4096), "v": (4096,)}
    if tree == "transformer":
        return transformer_shapes(32 if batched else (64 if quick else 128), 4 if quick else 25)
    if tree == "conv":
        widths = [16] * 20 if batched else [64] * 5 + [128] * 5 + [256] * 10
        return _conv(widths[:8] if quick else widths)
    return _small(120 if quick else 1000)


def make_tree(shapes: Shapes, dtype: Any, batch: int | None, seed: int) -> dict[str, jax.Array]:
    """Normal gradients (per-example ones spread around the clip norm, so that some
    examples are clipped and some are not)."""
    rng = np.random.default_rng(seed)
    n = sum(int(np.prod(s)) for s in shapes.values())
    lead = () if batch is None else (batch,)
    scale = 1.0 if batch is None else rng.lognormal(0.0, 1.0, (batch,)) / n**0.5
    out = {}
    for name, s in shapes.items():
        x = rng.normal(size=lead + s) * np.reshape(scale, lead + (1,) * len(s))
        out[name] = jnp.asarray(x.astype(np.float32), dtype)
    return out


# --- the two sides of a cell: functions of (grads, state, params) -----------------------


def _naive_clip_by_norm(axes: int | tuple[int, ...] | None) -> optax.GradientTransformation:
    """``tf.clip_by_norm``'s formula, accumulated in float32, with the state jaxclip's
    transform keeps (each leaf's largest norm)."""

    def one(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        n = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axes, keepdims=True))
        return (x.astype(jnp.float32) * jnp.minimum(1.0, CLIP / n)).astype(x.dtype), jnp.max(n)

    def update(g: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        pairs = {k: one(x) for k, x in g.items()}
        return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _optax_per_example() -> optax.GradientTransformation:
    """``optax.per_example_global_norm_clip``, averaged (jaxclip's ``reduce="mean"``)."""

    def update(g: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        batch = jax.tree.leaves(g)[0].shape[0]
        total, count = optax.per_example_global_norm_clip(g, CLIP)
        return jax.tree.map(lambda x: x / batch, total), count

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def sides(cell: Cell) -> tuple[optax.GradientTransformation, optax.GradientTransformation, str]:
    """(jaxclip's transform, the counterpart, the counterpart's name)."""
    mode = _registry.mode(cell.mode)
    if cell.mode == "clip_by_value":
        return mode.build(), optax.clip(CLIP), "optax.clip"
    if cell.mode == "clip_by_norm":
        axes = NORM_AXES[cell.layout]
        return mode.build(axes=axes), _naive_clip_by_norm(axes), "naive formula (float32 sums)"
    if cell.mode == "adaptive_clip":
        return mode.build(), optax.adaptive_grad_clip(0.1), "optax.adaptive_grad_clip"
    if cell.mode in PER_EXAMPLE:
        return mode.build(), _optax_per_example(), "optax.per_example_global_norm_clip, mean"
    name = "optax.clip_by_global_norm"
    return mode.build(), optax.clip_by_global_norm(CLIP), name


def cells(quick: bool, trees: tuple[str, ...] = TREES) -> list[Cell]:
    if quick:
        return [
            Cell("clip_by_global_norm", "whole", "large", "float32"),
            Cell("clip_by_global_norm", "whole", "large", "float16"),
            Cell("clip_by_norm", "leading", "large", "bfloat16"),
            Cell("clip_by_norm", "trailing", "transformer", "float32"),
            Cell("clip_by_norm", "hwio", "conv", "bfloat16"),
            Cell("adaptive_clip", "agc", "large", "float16"),
            Cell("adaptive_clip", "agc", "conv", "float32"),
            Cell("clip_by_value", "whole", "small1000", "bfloat16"),
            Cell("zclip", "whole", "transformer", "bfloat16"),
            Cell("clip_per_example", "rows", "large", "float32"),
        ]
    out = []
    for tree in trees:
        for dtype in DTYPES:
            for m in _registry.MODES:
                for layout in _layouts(m.name, tree):
                    out.append(Cell(m.name, layout, tree, dtype))
    return out


def _layouts(mode: str, tree: str) -> list[str]:
    if mode == "clip_by_norm":
        return ["whole", "trailing", "leading"] + (["hwio"] if tree == "conv" else [])
    if mode == "adaptive_clip":
        return ["agc"]
    if mode in PER_EXAMPLE:
        return [] if tree == "huge" else ["rows"]  # a batch of it would not fit
    return ["whole"]


# --- one cell, in its own process -------------------------------------------------------


def _print_fields(fields: dict[str, Any]) -> None:
    print(json.dumps(fields), flush=True)


#: Where a cell's fields go: JSON lines for the parent process, or a row (``--inline``).
_sink: list[Callable[[dict[str, Any]], None]] = [_print_fields]


def _emit(**fields: Any) -> None:
    _sink[0](fields)


def copy_bandwidth() -> float:
    """Bytes read plus bytes written per second by one large elementwise pass (``2 * x``
    over 256 MiB of float32, device-bound: calls queued, one wait), the median of 5."""
    x = jnp.arange(1 << 26, dtype=jnp.float32)
    double = jax.jit(lambda a: a * 2)
    seconds = _time_interleaved([double], [(x,)], 5, 10)[0]
    return 2 * x.nbytes / statistics.median(seconds)


def floor_bytes(cell: Cell, grads: Any, params: Any) -> int:
    """The fewest bytes a cell must move: its gradients read and its updates written (one
    example's worth for per-example sums), AGC's params read too."""
    nbytes = sum(x.nbytes for x in jax.tree.leaves(grads))
    written = nbytes // jax.tree.leaves(grads)[0].shape[0] if cell.mode in PER_EXAMPLE else nbytes
    read_params = (
        sum(x.nbytes for x in jax.tree.leaves(params)) if cell.mode == "adaptive_clip" else 0
    )
    return nbytes + written + read_params


def _compile(fn: Callable, args: tuple, cap: float) -> tuple[Any, float]:
    """Trace + lower + compile of a fresh function; the process ends (``SIGALRM``'s default
    action) if it takes more than ``cap`` seconds."""
    jax.clear_caches()
    if cap > 0:  # no cap inline (--inline): the alarm would end every cell
        signal.alarm(max(1, int(cap + 0.5)))
    t0 = time.perf_counter()
    compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    seconds = time.perf_counter() - t0
    signal.alarm(0)
    return compiled, seconds


def _compiles(side: str, fn: Callable, args: tuple, times: int, cap: float) -> Any:
    seconds = []
    for _ in range(times):
        _emit(phase=f"{side}_compile")
        compiled, s = _compile(fn, args, cap)
        seconds.append(s)
    _emit(**{f"{side}_compile_s": statistics.median(seconds), f"{side}_compiles": seconds})
    _emit(**{f"{side}_temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)})
    return compiled


def run_cell(
    cell: Cell, quick: bool, reps: int, compiles: int, cap: float, known: float, bandwidth: float
) -> None:
    """Measures one cell, emitting its fields (the parent collects them). With a measured
    ``bandwidth`` (bytes/s, ``--inline``) it also times calls queued before one wait, the
    device-bound time, against the memory floor: :func:`floor_bytes` over ``bandwidth``."""
    batch = 16 if cell.mode in PER_EXAMPLE else None
    shapes = tree_shapes(cell.tree, quick, batch is not None)
    dtype = DTYPES[cell.dtype]
    grads = make_tree(shapes, dtype, batch, seed=0)
    params = make_tree(shapes, dtype, None, seed=1)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(grads))
    ours, theirs, name = sides(cell)
    _emit(counterpart=name, leaves=len(shapes), bytes=nbytes, batch=batch)
    _emit(floor_bytes=floor_bytes(cell, grads, params))
    args_ours = (grads, ours.init(params), params)
    args_theirs = (grads, theirs.init(params), params)
    c_ours = _compiles("ours", ours.update, args_ours, compiles, cap)
    c_theirs = _compiles("theirs", theirs.update, args_theirs, 1 if known >= 0 else compiles, cap)
    if known >= 0:
        _emit(theirs_compile_s=known)
    t_ours, t_theirs = _time_interleaved([c_ours, c_theirs], [args_ours, args_theirs], reps)
    if bandwidth > 0:
        q_ours, q_theirs = _time_interleaved([c_ours, c_theirs], [args_ours, args_theirs], reps, 10)
        floor_s = floor_bytes(cell, grads, params) / bandwidth
        _emit(
            device_ms=1e3 * statistics.median(q_ours),
            counterpart_device_ms=1e3 * statistics.median(q_theirs),
            device_ratio=_median_ratio(q_ours, q_theirs),
            floor_ms=1e3 * floor_s,
            floor_ratio=statistics.median(q_ours) / floor_s,
        )
    _emit(
        run_ms=1e3 * statistics.median(t_ours),
        counterpart_run_ms=1e3 * statistics.median(t_theirs),
        run_ratio=_median_ratio(t_ours, t_theirs),
        reps=reps,
        phase="done",
    )


# --- the parent: cells in turn, rows to JSON --------------------------------------------


def _counterpart_key(cell: Cell) -> str:
    """Cells whose counterparts compile the same program share one compile measurement."""
    name = sides_name(cell)
    axes = NORM_AXES.get(cell.layout) if cell.mode == "clip_by_norm" else cell.layout
    return f"{name}/{axes}/{cell.tree}/{cell.dtype}"


def sides_name(cell: Cell) -> str:
    return sides(cell)[2]


def _collect(cell: Cell, args: argparse.Namespace, known: float) -> dict[str, Any]:
    """Runs one cell's process and folds its JSON lines into a row."""
    key = cell.key(args.quick)
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", key, "--reps", str(args.reps)]
    cmd += ["--compiles", str(args.compiles), "--cap", str(args.cap), "--known", str(known)]
    cmd += ["--quick"] if args.quick else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = dict(cell._asdict(), key=key, quick=args.quick)
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row.update(json.loads(line))
    if row.get("phase") != "done":
        died = "compile over the cap" if proc.returncode == -signal.SIGALRM else "failed"
        row["status"] = f"skipped: {row.get('phase', 'setup')} {died} ({args.cap:g} s)"
        if died == "failed":
            row["status"] = f"failed in {row.get('phase', 'setup')}: {proc.stderr[-400:]}"
    else:
        row["status"] = "ok"
    return _with_ratios(row)


def _with_ratios(row: dict[str, Any]) -> dict[str, Any]:
    row.pop("phase", None)
    if "ours_compile_s" in row and "theirs_compile_s" in row:
        ours, theirs = row["ours_compile_s"], row["theirs_compile_s"]
        row["compile_ratio"] = ours / theirs
        limit = theirs + COMPILE_SLACK_S
        if row["leaves"] >= MANY_LEAVES:
            limit = min(limit, MANY_LEAVES_TARGET * theirs)
        row["compile_ok"] = ours <= limit
    if "run_ratio" in row:
        row["run_ok"] = row["run_ratio"] <= RUN_TARGET
    return row


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {jax.devices()[0].platform}",
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "jaxclip": jaxclip.__version__,
        "git": _git_head(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/matrix.py " + " ".join(sys.argv[1:]),
        "quick": args.quick,
        "reps": args.reps,
        "compiles": args.compiles,
        "cap_s": args.cap,
        "targets": {
            "run_ratio": RUN_TARGET,
            "compile": f"<= counterpart + {COMPILE_SLACK_S} s; <= {MANY_LEAVES_TARGET}x "
            f"counterpart at >= {MANY_LEAVES} leaves",
        },
    }


def _git_head() -> str:
    """``JAXCLIP_GIT`` where set (a device machine's copy of the tree sits on the session's
    first commit), else HEAD's short hash."""
    if os.environ.get("JAXCLIP_GIT"):
        return os.environ["JAXCLIP_GIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True)
        head = out.stdout.decode().strip()
    except OSError:
        head = ""
    return head or "?"


def _write(path: str, meta: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "rows": list(rows.values())}, f, indent=1)


def _print_row(row: dict[str, Any]) -> None:
    if row["status"] != "ok":
        print(f"{row['key']}: {row['status']}", flush=True)
        return
    print(
        f"{row['key']}: run {row['run_ms']:.2f} / {row['counterpart_run_ms']:.2f} ms "
        f"({row['run_ratio']:.2f}x), compile {row['ours_compile_s']:.2f} / "
        f"{row['theirs_compile_s']:.2f} s ({row['compile_ratio']:.2f}x)"
        + (
            f", device {row['device_ms']:.3f} / {row['counterpart_device_ms']:.3f} ms "
            f"({row['device_ratio']:.2f}x), {row['floor_ratio']:.1f}x floor"
            if "device_ms" in row
            else ""
        ),
        flush=True,
    )


def _inline(cell: Cell, args: argparse.Namespace, known: float) -> dict[str, Any]:
    """Measures one cell in this process (``--inline``: no process start per cell, which
    costs seconds on an accelerator; no compile cap)."""
    row: dict[str, Any] = dict(cell._asdict(), key=cell.key(args.quick), quick=args.quick)
    _sink[0] = row.update
    try:
        run_cell(cell, args.quick, args.reps, args.compiles, 0.0, known, args.bandwidth)
        row["status"] = "ok"
    except Exception as e:  # a row that says so; the next cell runs
        row["status"] = f"failed in {row.get('phase', 'setup')}: {type(e).__name__}: {e}"[:400]
    finally:
        _sink[0] = _print_fields
    return _with_ratios(row)


def selected(args: argparse.Namespace) -> list[Cell]:
    """The cells whose key holds one of ``--only``'s comma-separated parts, in the parts'
    order (the matrix's order within a part)."""
    every = cells(args.quick, tuple(args.trees.split(",")))
    if args.only is None:
        return every
    out: list[Cell] = []
    for part in args.only.split(","):
        out += [c for c in every if part in c.key(args.quick) and c not in out]
    return out


def run_matrix(args: argparse.Namespace) -> None:
    todo = selected(args)
    if args.inline:
        args.bandwidth = copy_bandwidth()
        print(f"copy bandwidth (read + write): {args.bandwidth / 1e9:.0f} GB/s", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    if not args.fresh and os.path.exists(args.out):
        with open(args.out) as f:
            rows = {r["key"]: r for r in json.load(f)["rows"]}
    meta = _meta(args)
    if args.inline:
        meta["copy_bandwidth_GBps"] = args.bandwidth / 1e9
    compiled: dict[str, float] = {}  # counterpart key -> its median compile (s), -1 if over
    for cell in todo:
        ck = _counterpart_key(cell)
        if compiled.get(ck) == -1:
            row = dict(cell._asdict(), key=cell.key(args.quick), quick=args.quick)
            row["counterpart"] = sides_name(cell)
            row["status"] = f"skipped: its counterpart's compile is over the cap ({args.cap:g} s)"
        else:
            measure = _inline if args.inline else _collect
            row = measure(cell, args, compiled.get(ck, -1.0))
            row["git"] = meta["git"]
            over = row["status"].startswith("skipped: theirs")
            compiled[ck] = -1 if over else row.get("theirs_compile_s", compiled.get(ck, -1))
        rows[row["key"]] = row
        _print_row(row)
        _write(args.out, meta, rows)
    print(f"wrote {args.out}")


def _cell_of(key: str) -> Cell:
    return Cell(*key.split("/")[:4])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a small subset, smaller trees")
    ap.add_argument("--only", default=None, help="the cells whose key holds this substring")
    ap.add_argument(
        "--trees", default=",".join(TREES), help=f"comma-separated, of {TREES + MORE_TREES}"
    )
    ap.add_argument("--reps", type=int, default=20, help="alternating calls per cell (>= 15)")
    ap.add_argument("--compiles", type=int, default=3, help="compiles per side (the median)")
    ap.add_argument("--cap", type=float, default=120.0, help="seconds a compile may take")
    ap.add_argument("--out", default=os.path.join(HERE, "results_matrix.json"))
    ap.add_argument("--fresh", action="store_true", help="drop the file's earlier rows")
    ap.add_argument(
        "--inline",
        action="store_true",
        help="every cell in this process, no compile cap; adds device-bound times against "
        "the memory floor (for an accelerator, where a process start costs seconds)",
    )
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--known", type=float, default=-1.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell is not None:
        cell = _cell_of(args.cell)
        run_cell(cell, args.quick, args.reps, args.compiles, args.cap, args.known, 0.0)
    else:
        run_matrix(args)


if __name__ == "__main__":
    main()
