"""DP-SGD from a loss: ``jaxclip.clipped_grad`` against jax-privacy's, side by side in one
process, on an MLP, a small transformer and a small conv net, float32 and bfloat16.

    PYTHONPATH=. python benchmarks/bench_dp.py            # jax-privacy where installed
    PYTHONPATH=. python benchmarks/bench_dp.py --quick    # fewer repetitions

jax-privacy (``pip install jax-privacy``) is optional: without it only jaxclip's rows and
a naive ``vmap(grad)`` + clip are measured. For each model, dtype and microbatch size
``m`` (None: the whole batch in one vmap) it reports XLA's ``temp_size_in_bytes`` of the
compiled gradient function and the median run time over calls interleaved round-robin
(so that machine noise hits every row alike), and the ratios the targets are stated in:
temporaries against (m/B) x the whole batch's, time against jax-privacy's at the same m
and against jaxclip's whole batch. Results go to ``benchmarks/results_dp.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench import _time_interleaved

import jaxclip

try:
    from jax_privacy import clipping as jp_clipping
except ImportError:  # optional
    jp_clipping = None

CLIP = 1.0
HERE = os.path.dirname(__file__)


# --- models: a per-example loss(params, x, y) and (params, x, y) ----------------------


def mlp(key: Any, batch: int, dtype: Any):
    sizes = [784, 512, 512, 10]
    keys = jax.random.split(key, len(sizes) + 1)
    params = {
        f"l{i}": {
            "w": jax.random.normal(keys[i], (a, b), dtype) / np.sqrt(a),
            "b": jnp.zeros(b, dtype),
        }
        for i, (a, b) in enumerate(itertools.pairwise(sizes))
    }

    def loss(p, x, y):
        h = x
        for i in range(len(sizes) - 1):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            if i < len(sizes) - 2:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h.astype(jnp.float32), y)

    x = jax.random.normal(keys[-1], (batch, 784), dtype)
    y = jnp.arange(batch) % 10
    return loss, params, x, y


def transformer(key: Any, batch: int, dtype: Any):
    """Two pre-norm blocks, d=128, 4 heads, sequence 32, vocabulary 512, mean-pooled into
    10 classes."""
    d, heads, seq, vocab, layers = 128, 4, 32, 512, 2
    ks = iter(jax.random.split(key, 64))

    def dense(a, b):
        return jax.random.normal(next(ks), (a, b), dtype) / np.sqrt(a)

    params: dict[str, Any] = {"embed": dense(vocab, d), "pos": dense(seq, d), "out": dense(d, 10)}
    for i in range(layers):
        params[f"block{i}"] = {
            "ln1": jnp.ones(d, dtype),
            "qkv": dense(d, 3 * d),
            "o": dense(d, d),
            "ln2": jnp.ones(d, dtype),
            "up": dense(d, 4 * d),
            "down": dense(4 * d, d),
        }

    def norm(h, g):
        h32 = h.astype(jnp.float32)
        h32 = (h32 - h32.mean(-1, keepdims=True)) * jax.lax.rsqrt(h32.var(-1, keepdims=True) + 1e-6)
        return h32.astype(h.dtype) * g

    def loss(p, tokens, y):
        h = p["embed"][tokens] + p["pos"]
        for i in range(layers):
            b = p[f"block{i}"]
            q, k, v = jnp.split(norm(h, b["ln1"]) @ b["qkv"], 3, -1)
            q, k, v = (t.reshape(seq, heads, d // heads) for t in (q, k, v))
            att = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32) / np.sqrt(d // heads)
            att = jax.nn.softmax(att, -1).astype(h.dtype)
            h = h + jnp.einsum("hqk,khd->qhd", att, v).reshape(seq, d) @ b["o"]
            h = h + jax.nn.gelu(norm(h, b["ln2"]) @ b["up"]) @ b["down"]
        logits = (h.mean(0) @ p["out"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    tokens = jax.random.randint(next(ks), (batch, seq), 0, vocab)
    return loss, params, tokens, jnp.arange(batch) % 10


def convnet(key: Any, batch: int, dtype: Any):
    """28x28x1 -> conv3x3x16 -> conv3x3x32 (stride 2 each) -> dense 10."""
    ks = jax.random.split(key, 4)
    params = {
        "c1": jax.random.normal(ks[0], (3, 3, 1, 16), dtype) / 3.0,
        "c2": jax.random.normal(ks[1], (3, 3, 16, 32), dtype) / 12.0,
        "out": jax.random.normal(ks[2], (7 * 7 * 32, 10), dtype) / 40.0,
    }
    dims = ("NHWC", "HWIO", "NHWC")

    def loss(p, x, y):
        h = x[None]
        for name in ("c1", "c2"):
            h = jax.lax.conv_general_dilated(h, p[name], (2, 2), "SAME", dimension_numbers=dims)
            h = jax.nn.relu(h)
        logits = (h.reshape(-1) @ p["out"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    x = jax.random.normal(ks[3], (batch, 28, 28, 1), dtype)
    return loss, params, x, jnp.arange(batch) % 10


MODELS = {"mlp": (mlp, 128), "transformer": (transformer, 64), "convnet": (convnet, 128)}


# --- the functions compared ------------------------------------------------------------


def ours(loss: Callable, m: int | None, unroll: int | bool = 1) -> Callable:
    return jaxclip.clipped_grad(loss, CLIP, microbatch_size=m, batch_argnums=(1, 2), unroll=unroll)


def naive(loss: Callable) -> Callable:
    def f(p, x, y):
        g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x, y)
        return jaxclip.clip_tree_per_example(g, CLIP)[0]

    return f


def theirs(loss: Callable, m: int | None) -> Callable:
    assert jp_clipping is not None

    def batched(p, x, y):  # jax-privacy's default: a batch of one example
        return jnp.sum(jax.vmap(loss, in_axes=(None, 0, 0))(p, x, y))

    return jp_clipping.clipped_grad(
        batched, l2_clip_norm=CLIP, batch_argnums=(1, 2), microbatch_size=m
    )


def run(model: str, dtype: Any, micro: list[int | None], reps: int) -> list[dict[str, Any]]:
    make, batch = MODELS[model]
    loss, params, x, y = make(jax.random.key(0), batch, dtype)
    rows: list[tuple[str, int | None, Callable]] = [("vmap(grad)+clip_tree_per_example", None,
                                                     naive(loss))]  # fmt: skip
    for m in micro:
        rows.append(("jaxclip.clipped_grad", m, ours(loss, m)))
        if jp_clipping is not None:
            rows.append(("jax_privacy.clipped_grad", m, theirs(loss, m)))
    if model == "convnet":  # XLA:CPU's slow convolution gradients inside a loop
        rows.append(("jaxclip.clipped_grad(unroll=True)", batch // 8, ours(loss, batch // 8, True)))
    compiled, temps, compile_s = [], [], []
    for _, _, f in rows:
        t0 = time.perf_counter()
        c = jax.jit(f).lower(params, x, y).compile()
        compile_s.append(time.perf_counter() - t0)
        temps.append(int(c.memory_analysis().temp_size_in_bytes))
        compiled.append(c)
    times = _time_interleaved(compiled, [(params, x, y)] * len(compiled), reps)
    out = []
    for (name, m, _), t, s, tt in zip(rows, temps, compile_s, times):
        out.append({
            "model": model, "dtype": jnp.dtype(dtype).name, "batch": batch, "fn": name,
            "microbatch_size": m, "temp_bytes": t, "compile_s": round(s, 2),
            "median_ms": round(1e3 * statistics.median(tt), 2),
            "times_ms": [round(1e3 * v, 2) for v in tt],
        })  # fmt: skip
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | dtype | fn | m | temporaries MB | temp / ((m/B) x whole) | median ms "
        "| / jax-privacy same m | / jaxclip whole |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        same = [
            o for o in results
            if (o["model"], o["dtype"]) == (r["model"], r["dtype"])
        ]  # fmt: skip
        whole = next(
            (o for o in same if o["fn"] == r["fn"] and o["microbatch_size"] is None),
            next(
                o
                for o in same
                if o["fn"] == "jaxclip.clipped_grad" and o["microbatch_size"] is None
            ),
        )
        b, m = r["batch"], r["microbatch_size"] or r["batch"]
        temp_ratio = r["temp_bytes"] / max(whole["temp_bytes"] * m / b, 1)
        jp = [
            o for o in same
            if o["fn"].startswith("jax_privacy") and o["microbatch_size"] == r["microbatch_size"]
        ]  # fmt: skip
        ours_whole = next(
            o for o in same if o["fn"] == "jaxclip.clipped_grad" and o["microbatch_size"] is None
        )
        vs_jp = f"{r['median_ms'] / jp[0]['median_ms']:.2f}" if jp else "-"
        vs_whole = f"{r['median_ms'] / ours_whole['median_ms']:.2f}"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['fn']} | {r['microbatch_size'] or 'B=' + str(b)} "
            f"| {r['temp_bytes'] / 1e6:.1f} | {temp_ratio:.2f} | {r['median_ms']:.1f} "
            f"| {vs_jp} | {vs_whole} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=os.path.join(HERE, "results_dp.json"))
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    results = []
    for model in args.models.split(","):
        batch = MODELS[model][1]
        micro = [None, batch // 8, batch // 2]
        for dtype in args.dtypes.split(","):
            results += run(model, jnp.dtype(dtype), micro, reps)
            print(f"done {model} {dtype}", file=sys.stderr, flush=True)
    text = table(results)
    print(text)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "jax_privacy": None if jp_clipping is None else __import__("jax_privacy").__version__,
        "command": " ".join(sys.argv),
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
