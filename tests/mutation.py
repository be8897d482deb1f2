"""Mutation testing of the numerics core: how much of ``jaxclip/_norms`` the tests guard.

Each mutant changes one token of the core: a number (``n`` to ``n + 1``; a float ``x`` to
``2x``, 0 to 1), a comparison (``<`` and ``<=``, ``>`` and ``>=``, ``==`` and ``!=``
swapped), a logical or arithmetic operator (``&``/``|``, ``and``/``or``, ``+``/``-``,
``*``/``/``), or a constant ``True``/``False``. Docstrings, comments and annotations are
not mutated. A mutant that does not compile or import is not counted (it cannot run).
For each mutant the chosen tests run in a copy of the checkout, stopping at the first
failure: a failure kills the mutant. The score is killed / (killed + survived).

Run from the repository root (not part of the default suite; it takes a while)::

    python tests/mutation.py --sample 80 --seed 0 --workers 2
    python tests/mutation.py --list            # the mutation sites, numbered
    python tests/mutation.py --only 17 203     # given mutants, e.g. to re-check survivors
    python tests/mutation.py --files jaxclip/adaptive.py --list   # a module outside the core

``--tests`` chooses the test files run on every mutant (by default ``tests/test_core.py``,
written to fail fast), ``--then`` those run on its survivors; both are parts of the
default suite, so a mutant they kill is killed by the default suite too. Each run writes
its results to ``--out`` (JSON), with every survivor's file, line and change.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "jaxclip" / "_norms"
#: The default selection: the tests of the core's numerics and mechanisms, fastest first.
TESTS = (
    "tests/test_core.py",
    "tests/test_numerics.py",
    "tests/test_zero_slices.py",
    "tests/test_mechanisms.py",
    "tests/test_differential.py",
    "tests/test_trust.py",
    "tests/test_per_example.py",
    "tests/test_clipping.py",
    "tests/test_one_pass.py",
    "tests/test_shard_map.py",
)
SWAP = {
    "<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
    "&": "|", "|": "&", "+": "-", "-": "+", "*": "/", "/": "*", "//": "/",
    "and": "or", "or": "and", "True": "False", "False": "True",
}  # fmt: skip


class Mutant(NamedTuple):
    number: int
    path: str  # relative to the repository root
    line: int
    col: int
    old: str
    new: str


def _excluded_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Source spans that are not code that runs: docstrings and annotations."""
    spans = []
    for node in ast.walk(tree):
        notes: list[ast.AST | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes.append(node.returns)
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                notes.append(a.annotation if a is not None else None)
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.BinOp, ast.Subscript)):
            # type aliases (``Axes = tuple[int, ...] | None``) at module level
            if node.col_offset == 0 and all(isinstance(t, ast.Name) for t in node.targets):
                if all(n[0].isupper() for t in node.targets for n in [t.id]):  # type: ignore[attr-defined]
                    notes.append(node.value)
        for n in notes:
            if isinstance(n, ast.expr) and n.end_lineno is not None:
                spans.append(((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset or 0)))
    return spans


def sites(files: list[pathlib.Path] | None = None) -> list[Mutant]:
    """Every mutation site of the core (or of ``files``), in file order."""
    out: list[Mutant] = []
    for path in files or sorted(CORE.glob("*.py")):
        text = path.read_text()
        spans = _excluded_spans(ast.parse(text))

        def excluded(pos: tuple[int, int], spans: list = spans) -> bool:
            return any(a <= pos < b for a, b in spans)

        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if excluded(tok.start):
                continue
            new = None
            if tok.type == tokenize.NUMBER:
                new = _number(tok.string)
            elif tok.type in (tokenize.OP, tokenize.NAME) and tok.string in SWAP:
                new = SWAP[tok.string]
            if new is not None:
                rel = str(path.relative_to(ROOT))
                out.append(Mutant(len(out), rel, tok.start[0], tok.start[1], tok.string, new))
    return out


def _number(s: str) -> str | None:
    try:
        v = int(s, 0)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            return None
        return "1.0" if f == 0 else repr(f * 2)
    return str(v + 1)


def apply(m: Mutant, root: pathlib.Path) -> None:
    path = root / m.path
    lines = path.read_text().splitlines(keepends=True)
    line = lines[m.line - 1]
    assert line[m.col : m.col + len(m.old)] == m.old, (m, line)
    lines[m.line - 1] = line[: m.col] + m.new + line[m.col + len(m.old) :]
    path.write_text("".join(lines))


def _copy(dest: pathlib.Path, source: pathlib.Path = ROOT) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(source / "jaxclip", dest / "jaxclip", ignore=ignore)
    shutil.copytree(source / "tests", dest / "tests", ignore=ignore)
    for name in ("pyproject.toml", "conftest.py"):
        shutil.copy(source / name, dest / name)


def run(m: Mutant, base: pathlib.Path, tests: list[str], then: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxclip-mutant-") as tmp:
        root = pathlib.Path(tmp)
        _copy(root, base)
        apply(m, root)
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "JAX_COMPILATION_CACHE_DIR": str(base / "cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        try:
            compile((root / m.path).read_text(), m.path, "exec")
            subprocess.run(
                [sys.executable, "-c", "import jaxclip"], cwd=root, env=env, check=True,
                capture_output=True, timeout=120,
            )  # fmt: skip
        except (SyntaxError, subprocess.CalledProcessError):
            return {**m._asdict(), "status": "invalid", "seconds": 0.0}
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider"]
        status, failed = "survived", ""
        for selection in (tests, then):  # the second selection only for survivors
            if status != "survived" or not selection:
                continue
            try:
                r = subprocess.run(
                    [*cmd, *selection], cwd=root, env=env, capture_output=True, text=True,
                    timeout=timeout,
                )  # fmt: skip
                status = "survived" if r.returncode == 0 else "killed"
                failed = next((ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")), "")
            except subprocess.TimeoutExpired:  # not counted: slow is not wrong
                status, failed = "timeout", ""
        return {
            **m._asdict(),
            "status": status,
            "by": failed[:200],
            "seconds": round(time.perf_counter() - start, 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sample", type=int, default=0, help="mutants drawn at random (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=int, nargs="*", help="these mutant indices")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tests", nargs="*", default=list(TESTS[:1]), help="run on every mutant")
    ap.add_argument("--then", nargs="*", default=list(TESTS[1:]), help="run on their survivors")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default="mutation_results.json")
    ap.add_argument(
        "--files", nargs="*", help="mutate these modules instead of the core (jaxclip/adaptive.py)"
    )
    args = ap.parse_args()
    all_sites = sites([ROOT / f for f in args.files] if args.files else None)
    if args.list:
        for m in all_sites:
            print(f"{m.number:5d} {m.path}:{m.line}:{m.col} {m.old!r} -> {m.new!r}")
        return
    chosen = all_sites
    if args.only:
        chosen = [all_sites[i] for i in args.only]
    elif args.sample:
        chosen = sorted(random.Random(args.seed).sample(all_sites, args.sample))
    tests = [t for t in args.tests if (ROOT / t).exists()]
    then = [t for t in args.then if (ROOT / t).exists()]
    base = pathlib.Path(tempfile.mkdtemp(prefix="jaxclip-mutation-"))  # the checkout as it is now
    _copy(base)
    print(f"{len(all_sites)} sites; {len(chosen)} mutants; {tests}, then for survivors {then}")
    results = []
    with ThreadPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run, m, base, tests, then, args.timeout) for m in chosen]
        for future in as_completed(futures):
            r = future.result()
            results.append(r)
            print(f"{r['number']:5d} {r['status']:8s} {r['seconds']:6.1f}s {r['path']}:{r['line']} "
                  f"{r['old']!r}->{r['new']!r} {r.get('by', '')[:90]}", flush=True)  # fmt: skip
    killed = sum(r["status"] == "killed" for r in results)
    survived = [r for r in results if r["status"] == "survived"]
    valid = killed + len(survived)
    score = killed / valid if valid else float("nan")
    print(
        f"score: {killed}/{valid} killed = {score:.1%} "
        f"({len(results) - valid} invalid or timed out)"
    )
    for r in survived:
        print(f"survivor {r['number']}: {r['path']}:{r['line']} {r['old']!r} -> {r['new']!r}")
    summary = {"sites": len(all_sites), "score": score, "killed": killed, "results": results}
    pathlib.Path(args.out).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
