"""The 16-bit cases of issue 36, each beside its counterpart in one process.

    python benchmarks/bench_16bit.py              # all, about a minute on 2 CPU cores
    python benchmarks/bench_16bit.py agc conv     # some of them

One float16 2048x2048 leaf (``adaptive_clip`` against ``optax.adaptive_grad_clip``;
``clip_tree_by_norm(axes=0)``, ``clip_by_global_norm`` and whole-leaf ``clip_by_norm``
against the naive float32-accumulated formula or optax) and one (512, 512, 3, 3) HWIO conv
kernel per output slice (``axes=0``; bfloat16, and float32 for scale). Compile: trace +
lower + compile of a fresh function, the median of 3; run: the median of 25 alternating
calls, and the median of the per-call ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip


def naive(axes: Any) -> Callable[[Any], Any]:
    """``tf.clip_by_norm``'s formula, accumulated in float32."""

    def one(x: jax.Array) -> jax.Array:
        n = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axes, keepdims=True))
        return (x.astype(jnp.float32) * jnp.minimum(1.0, 1.0 / n)).astype(x.dtype)

    return lambda g: jax.tree.map(one, g)


def compile_time(fn: Callable, args: tuple, times: int = 3) -> tuple[Any, float]:
    seconds, compiled = [], None
    for _ in range(times):
        jax.clear_caches()
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        seconds.append(time.perf_counter() - t0)
    return compiled, statistics.median(seconds)


def side_by_side(name: str, ours: Callable, theirs: Callable, args: tuple, targs: tuple) -> None:
    (co, to), (ct, tt) = compile_time(ours, args), compile_time(theirs, targs)
    ro: list[float] = []
    rt: list[float] = []
    for _ in range(25):
        for c, a, r in ((co, args, ro), (ct, targs, rt)):
            jax.block_until_ready(c(*a))
            t0 = time.perf_counter()
            jax.block_until_ready(c(*a))
            r.append(time.perf_counter() - t0)
    ratio = statistics.median(a / b for a, b in zip(ro, rt))
    print(
        f"{name}: run {statistics.median(ro) * 1e3:.2f} / {statistics.median(rt) * 1e3:.2f} ms"
        f" ({ratio:.2f}x); compile {to:.2f} / {tt:.2f} s",
        flush=True,
    )


def main() -> None:
    rng = np.random.default_rng(0)

    def leaf(shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape).astype(np.float32), dtype)

    w, p = {"w": leaf((2048, 2048), jnp.float16)}, {"w": leaf((2048, 2048), jnp.float16)}
    sel = sys.argv[1:] or ["agc", "axes0", "conv", "global", "whole"]
    if "agc" in sel:
        a, o = jaxclip.adaptive_clip(0.1), optax.adaptive_grad_clip(0.1)
        args, targs = (w, a.init(p), p), (w, o.init(p), p)
        side_by_side("adaptive_clip, float16 2048x2048", a.update, o.update, args, targs)
    if "axes0" in sel:
        f = lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=0)[0]  # noqa: E731
        side_by_side("clip_tree_by_norm(axes=0), float16 2048x2048", f, naive(0), (w,), (w,))
    if "conv" in sel:
        for dtype in (jnp.bfloat16, jnp.float32):
            k = {"k": leaf((512, 512, 3, 3), dtype)}
            name = f"{jnp.dtype(dtype).name} (512, 512, 3, 3)"
            f = lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=0)[0]  # noqa: E731
            side_by_side(f"clip_tree_by_norm(axes=0), {name}", f, naive(0), (k,), (k,))
            t = jaxclip.clip_by_norm(1.0, axes=0)
            g = lambda x, s: naive(0)(x)  # noqa: E731
            side_by_side(f"clip_by_norm(axes=0), {name}", t.update, g, (k, t.init(k)), (k, None))
    if "global" in sel:
        a, o = jaxclip.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
        args, targs = (w, a.init(w)), (w, o.init(w))
        side_by_side("clip_by_global_norm, float16 2048x2048", a.update, o.update, args, targs)
    if "whole" in sel:
        t = jaxclip.clip_by_norm(1.0)
        g = lambda x, s: naive(None)(x)  # noqa: E731
        args, targs = (w, t.init(w)), (w, None)
        side_by_side("clip_by_norm whole, float16 2048x2048", t.update, g, args, targs)


if __name__ == "__main__":
    main()
