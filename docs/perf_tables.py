"""Writes the performance guide's tables from the benchmarks' JSON output.

Called by ``conf.py`` at every docs build (and runnable on its own): reads
``benchmarks/results_matrix.json`` (``python benchmarks/matrix.py``; ``results_matrix_gpu.json``
from ``bash benchmarks/device.sh`` on a GPU), ``benchmarks/results.json``
(``python benchmarks/bench.py``) and ``benchmarks/results_modes*.json``
(``python benchmarks/bench_modes.py``) and writes ``docs/_generated/performance_tables.md``,
which ``guides/performance.md`` includes. A new benchmark run changes the docs with no edit.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

HERE = pathlib.Path(__file__).parent
BENCH = HERE.parent / "benchmarks"
OUT = HERE / "_generated" / "performance_tables.md"


def _tree(row: dict[str, Any]) -> str:
    """The benchmark's tree name, with its size from the same row."""
    return f"{row['tree']} ({row['leaves']} leaves, {row['bytes'] / 2**20:.1f} MiB)"


def _setup(data: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
    return f"Machine: {data.get('machine', '?')}; {versions}."


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def jit_tables(data: dict[str, Any]) -> str:
    reps = data.get("reps", "?")
    out = [
        "### Under `jit`: jaxclip against its optax counterpart",
        "",
        f"{_setup(data)} {reps} interleaved repetitions"
        f"{' (a --quick run)' if data.get('quick') else ''}; run times are medians. The floor "
        "is one reduction pass plus one scaling pass over one contiguous array of the same "
        "bytes.",
        "",
    ]
    rows = [
        [
            _tree(r),
            f"`{r['mode']}`",
            r["counterpart"],
            f"{r['compile_s']:.2f} / {r['counterpart_compile_s']:.2f} ({r['compile_ratio']:.2f}x)",
            f"{r['run_ms']:.2f} / {r['counterpart_run_ms']:.2f} ({r['run_ratio']:.2f}x)",
            f"{r['floor_ratio']:.2f}x",
            f"{r['temp_bytes']:,} / {r['counterpart_temp_bytes']:,}",
        ]
        for r in data["rows"]
    ]
    header = [
        "tree",
        "jaxclip",
        "counterpart",
        "compile s: jaxclip / counterpart",
        "run ms: jaxclip / counterpart",
        "run / floor",
        "temp bytes: jaxclip / counterpart",
    ]
    out.append(_table(header, rows))
    if data.get("chain"):
        out += ["", "### In a chain with `optax.adamw`", ""]
        rows = [
            [
                c["tree"],
                f"`{c['mode']}`",
                f"{c['chain_ms']:.2f}",
                f"{c['adamw_ms']:.2f}",
                f"{c['ratio']:.2f}x",
            ]
            for c in data["chain"]
        ]
        out.append(_table(["tree", "mode", "chain ms", "adamw alone ms", "ratio"], rows))
    return "\n".join(out)


def mode_table(data: dict[str, Any], title: str) -> str:
    out = [f"### {title}", "", _setup(data), ""]
    rows = [
        [
            r["case"],
            r["counterpart"],
            f"{r['ms']:.3g}",
            f"{r['counterpart_ms']:.3g}",
            f"{r['ratio']:.2f}x",
        ]
        for r in data["rows"]
    ]
    out.append(_table(["case", "against", "ms", "against ms", "ratio"], rows))
    if "eager_rss_growth_mb" in data:
        out += [
            "",
            f"Memory growth over {data.get('eager_calls', '?')} eager calls: "
            f"{data['eager_rss_growth_mb']:.2f} MB of RSS.",
        ]
    return "\n".join(out)


def _ratio(value: float | None, ok: bool | None) -> str:
    """A ratio, marked where it misses its target."""
    if value is None:
        return "—"
    return f"{value:.2f}x" + ("" if ok in (True, None) else " (over)")


def _matrix_row(r: dict[str, Any]) -> list[str]:
    tree = f"{r['tree']}{' (quick)' if r.get('quick') else ''}, {r.get('leaves', '?')} leaves"
    cell = [f"`{r['mode']}`", r["layout"], tree, r["dtype"], r.get("counterpart", "?")]
    if r.get("status", "ok") != "ok":
        return [*cell, r["status"], "", "", ""]
    return [
        *cell,
        f"{r['run_ms']:.2f} / {r['counterpart_run_ms']:.2f}",
        _ratio(r.get("run_ratio"), r.get("run_ok")),
        f"{r['ours_compile_s']:.2f} / {r['theirs_compile_s']:.2f}",
        _ratio(r.get("compile_ratio"), r.get("compile_ok")),
    ]


def matrix_table(data: dict[str, Any]) -> str:
    """The benchmark matrix: one row per cell, in the order the file has them."""
    targets = data.get("targets", {})
    out = [
        "### The matrix: every mode, dtype, layout and tree",
        "",
        f"{_setup(data)} The last run: `{data.get('command', 'python benchmarks/matrix.py')}` "
        f"at {data.get('git', '?')}, {data.get('date', '?')} (a run replaces its cells' rows "
        "and keeps the others; `benchmarks/last_run.md` says which run gave which). Run times "
        f"are medians of {data.get('reps', '?')} alternating calls, the ratio the median of "
        "per-round ratios; "
        f"compile times (trace + lower + compile) medians of {data.get('compiles', '?')}. "
        f"Targets: run time at most {targets.get('run_ratio', '?')}x, compile time "
        f"{targets.get('compile', '?')}; a cell that misses one says (over). Rows whose tree "
        "is marked quick come from the smaller trees of `--quick`.",
        "",
    ]
    header = ["mode", "layout", "tree", "dtype", "counterpart", "run ms: jaxclip / counterpart"]
    header += ["run ratio", "compile s: jaxclip / counterpart", "compile ratio"]
    out.append(_table(header, [_matrix_row(r) for r in data["rows"]]))
    return "\n".join(out)


def _gpu_row(r: dict[str, Any]) -> list[str]:
    cell = [
        f"`{r['mode']}`",
        r["layout"],
        f"{r['tree']}, {r.get('leaves', '?')} leaves",
        r["dtype"],
    ]
    if r.get("status", "ok") != "ok" or "device_ms" not in r:
        return [*cell, r.get("status", "?"), "", "", "", "", ""]
    return [
        *cell,
        f"{1e3 * r['device_ms']:.0f} / {1e3 * r['counterpart_device_ms']:.0f}",
        f"{r['device_ratio']:.2f}x",
        f"{r['floor_ratio']:.1f}x",
        f"{r['run_ratio']:.2f}x",
        f"{r['ours_compile_s']:.2f} / {r['theirs_compile_s']:.2f}",
        r.get("git", "?"),
    ]


def gpu_matrix_table(data: dict[str, Any]) -> str:
    """The matrix measured on a GPU (``matrix.py --inline``): device-bound times against the
    memory floor."""
    runs = "; ".join(
        f"{run['git']} at {run['date']}, {run['cells']} cells, copy bandwidth "
        f"{run['copy_bandwidth_GBps']:.0f} GB/s"
        for run in data.get("runs", [])
    )
    out = [
        "### The matrix on a GPU",
        "",
        f"{_setup(data)} `{data.get('command', '?')}`, runs: {runs}. Device time: "
        f"{data.get('reps', '?')} rounds of 10 calls queued before one wait, alternating "
        "sides, medians; the ratio is the median of per-round ratios. The floor is the "
        "gradients read once and the updates written once (AGC's params read too; one "
        "example's worth written for per-example sums) over the measured copy bandwidth: "
        "these trees are small for an H200 (tens of MB), so every cell is bound by kernel "
        "launches, not bytes. The blocking ratio times each call with its dispatch, as the "
        "CPU matrix does. Compile times are single compiles (trace + lower + compile).",
        "",
    ]
    header = ["mode", "layout", "tree", "dtype", "device µs: jaxclip / counterpart"]
    header += ["device ratio", "x floor", "blocking ratio", "compile s", "at"]
    out.append(_table(header, [_gpu_row(r) for r in data["rows"]]))
    return "\n".join(out)


def write() -> pathlib.Path:
    parts = ["<!-- generated by docs/perf_tables.py from benchmarks/*.json; do not edit -->", ""]
    matrix = BENCH / "results_matrix.json"
    if matrix.exists():
        parts += [matrix_table(json.loads(matrix.read_text())), ""]
    else:
        parts += ["No matrix measured yet: run `python benchmarks/matrix.py`.", ""]
    gpu = BENCH / "results_matrix_gpu.json"
    if gpu.exists():
        parts += [gpu_matrix_table(json.loads(gpu.read_text())), ""]
    results = BENCH / "results.json"
    if results.exists():
        parts += [jit_tables(json.loads(results.read_text())), ""]
    for path, title in [
        (BENCH / "results_modes.json", "Outside plain `jit` (CPU)"),
        (BENCH / "results_modes_gpu.json", "Outside plain `jit` (GPU)"),
    ]:
        if path.exists():
            parts += [mode_table(json.loads(path.read_text()), title), ""]
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(parts))
    return OUT


if __name__ == "__main__":
    print(write())
