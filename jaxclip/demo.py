"""Exploding gradients, with and without clipping: ``python -m jaxclip.demo``.

A tanh RNN must remember the first input of a long sequence. Its recurrent matrix starts
with spectral radius above 1 and the learning rate is large, so back-propagation through
time produces rare, huge gradients: unclipped SGD diverges, every clipping mode keeps it
training. The same data, initialisation and optimizer are used for every mode.

Prints a table (final loss, steps with a non-finite loss, largest pre-clip norm, fraction
of steps clipped) and writes a plot of loss and gradient norm per mode (``--out``).
Needs the ``demo`` extra (matplotlib; tqdm for the progress bar).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip

HIDDEN, SEQ, BATCH, LR = 32, 60, 64, 0.3


class Trace(NamedTuple):
    loss: np.ndarray
    pre_norm: np.ndarray
    clipped: np.ndarray


def modes() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """Every clipping mode, tuned by hand once; ``none`` is plain SGD."""
    return {
        "none": optax.identity,
        "clip_by_value(0.1)": lambda: jaxclip.clip_by_value(0.1),
        "clip_by_norm(1.0)": lambda: jaxclip.clip_by_norm(1.0),
        "clip_by_global_norm(1.0)": lambda: jaxclip.clip_by_global_norm(1.0),
        "adaptive_clip(0.05)": lambda: jaxclip.adaptive_clip(0.05),
        "auto_clip(10)": lambda: jaxclip.auto_clip(10.0, window=200),
        # Spike detection alone: without the reference's default cap (max_grad_norm=1.0) it
        # would be clip_by_global_norm(1.0) here, where nearly every step is an outlier.
        "zclip(max_grad_norm=None)": lambda: jaxclip.zclip(max_grad_norm=None),
        "skip_large_updates(5.0)": lambda: jaxclip.skip_large_updates(optax.identity(), 5.0),
    }


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(key, 3)
    q, _ = jnp.linalg.qr(jax.random.normal(k1, (HIDDEN, HIDDEN)))
    return {
        "W": 1.6 * q,  # spectral radius 1.6: gradients through time can explode
        "U": jax.random.normal(k2, (1, HIDDEN)),
        "b": jnp.zeros(HIDDEN),
        "V": jax.random.normal(k3, (HIDDEN, 1)) / math.sqrt(HIDDEN),
        "c": jnp.zeros(1),
    }


def loss_fn(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """MSE of predicting x[:, 0] from the final hidden state, after SEQ steps."""

    def cell(h, xt):
        return jnp.tanh(h @ params["W"] + xt[:, None] @ params["U"] + params["b"]), None

    h, _ = jax.lax.scan(cell, jnp.zeros((x.shape[0], HIDDEN)), x.T)
    pred = (h @ params["V"] + params["c"])[:, 0]
    return jnp.mean((pred - x[:, 0]) ** 2)


def make_chunk(clip: optax.GradientTransformation, chunk: int) -> Callable:
    opt = optax.sgd(LR)

    def one_step(carry: Any, key: jax.Array):
        params, clip_state, opt_state = carry
        x = jax.random.uniform(key, (BATCH, SEQ), minval=-1.0, maxval=1.0)
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        pre = jaxclip.global_norm(grads)
        clipped, clip_state = clip.update(grads, clip_state, params)
        post = jaxclip.global_norm(clipped)
        updates, opt_state = opt.update(clipped, opt_state, params)
        params = optax.apply_updates(params, updates)
        was_clipped = ~(post >= pre * (1 - 1e-5))  # also true for skipped / NaN steps
        return (params, clip_state, opt_state), (loss, pre, was_clipped)

    @jax.jit
    def run(carry: Any, keys: jax.Array):
        return jax.lax.scan(one_step, carry, keys)

    return run


def train(
    name: str,
    make: Callable[[], optax.GradientTransformation],
    steps: int,
    chunk: int,
    bar: Any = None,
) -> Trace:
    """Trains one mode for ``steps`` steps (``chunk`` steps per compiled scan)."""
    clip = make()
    params = init_params(jax.random.key(0))
    carry = (params, clip.init(params), optax.sgd(LR).init(params))
    run = make_chunk(clip, chunk)
    keys = jax.random.split(jax.random.key(1), steps).reshape(steps // chunk, chunk)
    out = []
    for k in keys:
        carry, metrics = run(carry, k)
        out.append(jax.tree.map(np.asarray, metrics))
        if bar is not None:
            bar.update(chunk)
    loss, pre, clipped = (np.concatenate(m) for m in zip(*out))
    return Trace(loss, pre, clipped)


class _Bar:
    """tqdm when installed, else a plain line per mode."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, unit="step")
        except ImportError:
            self._bar = None
        self.total, self.done = total, 0

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text)
        else:
            print(f"[{self.done}/{self.total}] {text}", flush=True)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def table(traces: dict[str, Trace]) -> str:
    rows = [
        "| mode | final loss | non-finite loss steps | largest pre-clip norm | steps clipped |",
        "|---|---|---|---|---|",
    ]
    for name, t in traces.items():
        tail = t.loss[-max(1, len(t.loss) // 10) :]
        final = float(np.mean(tail)) if np.all(np.isfinite(tail)) else float("nan")
        finite_pre = t.pre_norm[np.isfinite(t.pre_norm)]
        largest = f"{finite_pre.max():.3g}" if finite_pre.size else "nan"
        clipped = "—" if name == "none" else f"{np.mean(t.clipped):.0%}"
        bad = int(np.sum(~np.isfinite(t.loss)))
        rows.append(f"| {name} | {final:.4g} | {bad} | {largest} | {clipped} |")
    return "\n".join(rows)


def plot(traces: dict[str, Trace], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, t in traces.items():
        style = {"color": "black", "lw": 2} if name == "none" else {"lw": 1}
        ax_loss.plot(np.where(np.isfinite(t.loss), t.loss, np.nan), label=name, **style)
        ax_norm.plot(np.where(np.isfinite(t.pre_norm), t.pre_norm, np.nan), label=name, **style)
    ax_loss.set(
        yscale="log",
        ylim=(1e-2, 1e4),
        xlabel="step",
        ylabel="training loss (MSE)",
        title="loss (unclipped leaves the plot, then turns NaN)",
    )
    ax_norm.set(
        yscale="log",
        xlabel="step",
        ylabel="global gradient norm before clipping",
        title="gradient norm",
    )
    ax_loss.legend(fontsize=7)
    fig.suptitle(f"tanh RNN, sequence length {SEQ}, SGD lr {LR}: jaxclip modes vs no clipping")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Trace]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=600, help="training steps per mode (default 600)")
    ap.add_argument("--quick", action="store_true", help="100 steps per mode")
    ap.add_argument("--out", default="jaxclip_demo.png", help="where to write the plot (PNG)")
    ap.add_argument("--no-plot", action="store_true", help="skip the plot (no matplotlib needed)")
    args = ap.parse_args(argv)
    chunk = 25
    steps = 100 if args.quick else max(chunk, args.steps // chunk * chunk)
    all_modes = modes()
    bar = _Bar(steps * len(all_modes))
    t0 = time.perf_counter()
    traces = {}
    for name, make in all_modes.items():
        bar.describe(name)
        traces[name] = train(name, make, steps, chunk, bar)
    bar.close()
    print(table(traces))
    print(f"{len(all_modes)} modes x {steps} steps in {time.perf_counter() - t0:.0f} s")
    if not args.no_plot:
        plot(traces, args.out)
        print(f"wrote {args.out}")
    return traces


if __name__ == "__main__":
    main()
