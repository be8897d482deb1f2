"""How XLA:CPU spreads a call's kernels over its threads: ``clip_by_norm`` against the naive
formula (and, for whole leaves, the naive formula with every sum before any scaling), from
a ``jax.profiler`` trace.

    pip install xprof   # reads the trace; not a dependency of jaxclip
    python benchmarks/thread_timeline.py --tree conv            # whole leaves
    python benchmarks/thread_timeline.py --tree large --axes -1 --kernels 12

Per side, the medians over ``--calls`` calls of: the span from the first kernel's start to
the last one's end, the kernels' summed time (busy), their ratio (how many threads were at
work on average) and the two busiest threads' shares; with ``--kernels``, the costliest kinds
of kernel (XLA's fusion names without their numbers). A side whose busy time is no larger
but whose span is, lost its time to kernels waiting for a thread, not to kernels doing more.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import statistics
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import matrix
import numpy as np
from bench import _floor

import jaxclip

# Trace events that are not kernels: the executor's own spans, Python frames, ends.
NOT_KERNELS = (
    "ThreadpoolListener::Region",
    "ThunkExecutor::Execute",
    "ThunkExecutor::Execute (wait for completion)",
    "SlinkyThreadPool::Await",
)


def _events(trace_dir: str) -> list[dict[str, Any]]:
    from xprof.convert import raw_to_tool_data  # only this script needs it

    files = glob.glob(f"{trace_dir}/plugins/profile/*/*.xplane.pb")
    data, _ = raw_to_tool_data.xspace_to_tool_data(files, "trace_viewer", {})
    return [e for e in json.loads(data)["traceEvents"] if e.get("ph") == "X"]


def _per_call(events: list[dict[str, Any]], sides: list[str]) -> dict[str, list[tuple]]:
    """Per side (calls alternate in ``sides``' order): (span, busy, busy per thread, busy
    per kernel name)."""
    calls = [e for e in events if e["name"].startswith("PjitFunction")]
    calls.sort(key=lambda e: e["ts"])
    top: list[dict[str, Any]] = []
    for c in calls:  # a call's nested PjitFunction events are not calls
        if not top or c["ts"] >= top[-1]["ts"] + top[-1]["dur"]:
            top.append(c)
    out: dict[str, list[tuple]] = collections.defaultdict(list)
    for i, c in enumerate(top[:-1]):
        t0, t1 = c["ts"], top[i + 1]["ts"]
        kernels = [
            e
            for e in events
            if t0 <= e["ts"] < t1
            and e["tid"] != c["tid"]
            and e["name"] not in NOT_KERNELS
            and not e["name"].startswith(("$", "end:"))
        ]
        if not kernels:
            continue
        span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
        threads: collections.Counter = collections.Counter()
        for e in kernels:
            threads[e["tid"]] += e["dur"]
        shares = sorted(threads.values(), reverse=True)
        names: collections.Counter = collections.Counter()
        for e in kernels:  # fusion.12 and fusion.3 are one kind of kernel
            names[e["name"].split(".")[0]] += e["dur"]
        out[sides[i % len(sides)]].append((span, sum(shares), shares, names))
    return out


def _sums_first(g: dict[str, jax.Array]) -> list[jax.Array]:
    """The naive formula with an ``optimization_barrier`` after the sums: every leaf's norm
    before any scaling, as jaxclip's joint rare-path check orders them."""
    xs = jax.tree.leaves(g)
    norms = [jnp.sqrt(jnp.sum(jnp.square(x))) for x in xs]
    norms, xs = jax.lax.optimization_barrier((norms, xs))
    return [x * (1.0 / jnp.maximum(n, 1.0)) for x, n in zip(xs, norms)]


def main() -> None:
    ap = argparse.ArgumentParser(description="XLA:CPU's threads at work, against the naive formula")
    ap.add_argument("--tree", default="conv", choices=matrix.TREES)
    ap.add_argument("--axes", type=int, default=None, help="clip_by_norm's axes (whole leaves)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--kernels", type=int, default=0, help="list the N costliest kinds of kernel")
    args = ap.parse_args()
    shapes = matrix.tree_shapes(args.tree, False, False)
    rng = np.random.default_rng(0)
    g = {k: jnp.asarray(rng.normal(size=s).astype(np.float32)) for k, s in shapes.items()}
    tx = jaxclip.clip_by_norm(1.0, axes=args.axes)
    state = tx.init(g)
    ours = jax.jit(lambda g, s: tx.update(g, s)[0])
    naive = jax.jit(lambda g: jax.tree.map(_floor, g))
    calls = {"jaxclip": lambda: ours(g, state), "naive formula": lambda: naive(g)}
    if args.axes is None:  # whole leaves: the naive formula with every sum before any scaling
        calls["naive, sums first"] = functools.partial(jax.jit(_sums_first), g)
    for _ in range(10):
        for call in calls.values():
            jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.calls):
            for call in calls.values():
                jax.block_until_ready(call())
        jax.profiler.stop_trace()
        rows = _per_call(_events(trace_dir), list(calls))
    what = f"clip_by_norm(axes={args.axes}), float32, {len(shapes)} leaves"
    print(f"{args.tree}, {what} (microseconds, medians)")
    for side, calls in rows.items():
        span = statistics.median(c[0] for c in calls)
        busy = statistics.median(c[1] for c in calls)
        shares = [statistics.median(c[2][k] for c in calls if len(c[2]) > k) for k in range(2)]
        print(
            f"  {side:14s} span {span:7.0f}  busy {busy:7.0f}  threads at work {busy / span:.2f}"
            f"  per thread {' / '.join(f'{s:.0f}' for s in shares)}"
        )
        kinds = {k for c in calls for k in c[3]}
        costs = {k: statistics.median(c[3].get(k, 0) for c in calls) for k in kinds}
        for k in sorted(costs, key=lambda k: costs[k], reverse=True)[: args.kernels]:
            print(f"      {costs[k]:7.0f}  {k}")


if __name__ == "__main__":
    main()
