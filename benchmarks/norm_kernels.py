"""The 2-norm's kernels on this backend: which strategy :mod:`jaxclip._norms` should pick.

    python benchmarks/norm_kernels.py           # sizes 1e5 .. 1e8 (1e7 on CPU)
    python benchmarks/norm_kernels.py --quick

Per dtype and size, median ms of ``jaxclip.global_norm`` on one array with each strategy
(``ONE_PASS=True``: Blue's three accumulators in one variadic reduce, no ``lax.cond``;
``False``: the plain sum of squares, a ``lax.cond`` to the rare path), against the naive
``sqrt(sum(x**2))`` (``optax.global_norm``) and against the memory floor: the array's
bytes over the bandwidth of a device copy measured here (bytes read plus written).
Calls are interleaved round-robin; compile time is reported for each too.

The "scaled" column is ``sqrt(sum((x * f)**2))`` with ``f`` a run-time scalar: the
common path of a design with one kernel per leaf and no conditional, a ``while_loop``
that runs it once with ``f = 1`` and a second time, rescaled, only when the sum is out
of range. On XLA:CPU that kernel is ~1.5x the plain sum (2 cores, 2026-11-23): the plain
sum goes to a library kernel (a ``__ynn_fusion`` in the optimized HLO), the scaled one
to a generated loop. That is why the two-path strategy keeps two kernels per leaf there.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip
from jaxclip._norms import backend


def _jit(fn: Callable, x: jax.Array, one_pass: bool | None = None) -> tuple[Callable, float]:
    """``fn`` compiled for ``x``, tracing jaxclip with the given strategy."""
    backend.ONE_PASS = one_pass
    jax.clear_caches()  # jaxclip's inner jits would reuse the other strategy's trace
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(x).compile()
        return compiled, time.perf_counter() - t0
    finally:
        backend.ONE_PASS = None


def _naive(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _scaled(x: jax.Array, f: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32) * f)))


def _bandwidth(reps: int) -> float:
    """Bytes read plus written per second by a device copy of 256 MiB."""
    x = jnp.ones((64 << 20,), jnp.float32)
    copy = jax.jit(lambda v: v + 1).lower(x).compile()
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cpu = jax.default_backend() == "cpu"
    reps = 10 if args.quick else 30
    sizes = [10**5, 10**6] if args.quick else [10**5, 10**6, 10**7] + ([] if cpu else [10**8])
    bw = _bandwidth(reps)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; copy: {bw / 1e9:.0f} GB/s")
    print(
        "| dtype | elements | floor ms | naive ms | one pass ms (x naive) | "
        "two paths ms (x naive) | scaled ms (x naive) | compile s: one pass / two paths |"
    )
    print("|---|---|---|---|---|---|---|---|")  # fmt: skip
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        for n in sizes:
            x = jnp.asarray(rng.standard_normal(n, np.float32)).astype(dtype)
            one, c_one = _jit(jaxclip.global_norm, x, True)
            two, c_two = _jit(jaxclip.global_norm, x, False)
            naive, _ = _jit(_naive, x)
            scaled = jax.jit(_scaled).lower(x, f=jnp.float32(1.0)).compile()
            fns = [naive, one, two, functools.partial(scaled, f=jnp.float32(1.0))]
            for f in fns:
                jax.block_until_ready(f(x))
            times: list[list[float]] = [[] for _ in fns]
            for _ in range(reps):
                for i, f in enumerate(fns):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x))
                    times[i].append(time.perf_counter() - t0)
            med = [statistics.median(t) * 1e3 for t in times]
            ratio = [statistics.median(a / b for a, b in zip(t, times[0])) for t in times]
            floor = x.nbytes / bw * 1e3
            print(
                f"| {jnp.dtype(dtype).name} | {n:.0e} | {floor:.3f} | {med[0]:.3f} | "
                f"{med[1]:.3f} ({ratio[1]:.2f}x) | {med[2]:.3f} ({ratio[2]:.2f}x) | "
                f"{med[3]:.3f} ({ratio[3]:.2f}x) | {c_one:.2f} / {c_two:.2f} |"
            )


if __name__ == "__main__":
    main()
