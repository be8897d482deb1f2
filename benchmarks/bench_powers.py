"""Fractional ``norm_type``: jaxclip's global norm beside the naive formula
``sum(|x| ** p) ** (1 / p)`` (XLA's pow per element), side by side in one process, with
each one's error against float64 NumPy on the same data.

    python benchmarks/bench_powers.py           # about half a minute on 2 CPU cores
    python benchmarks/bench_powers.py --quick   # fewer calls

The data spans magnitudes 1e-20..1e20 (log-normal rows): the naive formula overflows
there, so its error is shown on a copy scaled into range. Prints a Markdown table
(median per call, median of per-round ratios).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench import _median_ratio, _time_interleaved

import jaxclip

PS = (0.25, 0.9, 1.5, 3.5, 12.0)


def data(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = rng.lognormal(0, 2, (n // 1000, 1000)) * 10 ** rng.uniform(-20, 20, (n // 1000, 1))
    return rows.astype(np.float32).reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 7 if args.quick else 25
    x = data(4_000_000)
    small = x * np.float32(1e-20)  # in range for the naive formula at every p here
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {x.size} float32 elements\n")
    print("| p | jaxclip ms | naive ms | ratio | jaxclip rel. error | naive rel. error |")
    print("|---|---|---|---|---|---|")
    xd, sd = jnp.asarray(x), jnp.asarray(small)
    for p in PS:
        ours = jax.jit(lambda v, p=p: jaxclip.global_norm(v, norm_type=p))
        naive = jax.jit(lambda v, p=p: jnp.sum(jnp.abs(v) ** p) ** (1 / p))
        t = _time_interleaved([ours, naive], [(xd,), (xd,)], reps)
        a = np.abs(small.astype(np.float64))
        want = (a**p).sum() ** (1 / p)
        err_ours = abs(float(ours(sd)) / want - 1)
        err_naive = abs(float(naive(sd)) / want - 1)
        print(
            f"| {p:g} | {1e3 * statistics.median(t[0]):.2f} | {1e3 * statistics.median(t[1]):.2f}"
            f" | {_median_ratio(t[0], t[1]):.2f}x | {err_ours:.1e} | {err_naive:.1e} |"
        )


if __name__ == "__main__":
    main()
