"""Clipping lets a language model train at a learning rate that breaks it unclipped:
``python -m jaxclip.demo``.

A character-level GRU language model (hidden size 64) learns fourteen of Shakespeare's
sonnets (built in, nothing is downloaded) with plain SGD. Without clipping, a small sweep
finds the best learning rate; at the next one up (``HIGH_LR``) training blows up. Each
jaxclip mode is then trained at that high learning rate. Every configuration runs with
several seeds (initialisation and batches; a seed's batches are the same for every
configuration), all in one compiled program.

Prints a table (training loss at the end in bits per character, mean ± half the range over
the seeds, against the do-nothing baseline: predicting each character by its frequency in the
text) and writes a plot of the loss curves (``--out``; needs matplotlib, the ``demo``
extra). The progress bar uses tqdm when it is installed.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxclip
from jaxclip._demo_text import SONNETS

HIDDEN, SEQ, BATCH = 64, 32, 16
SWEEP = (1.0, 2.0, 4.0, 8.0)  # unclipped learning rates; the last is HIGH_LR
HIGH_LR = SWEEP[-1]
STEPS, QUICK_STEPS, CHUNK, SEEDS = 300, 150, 25, 3
TAIL = 0.1  # the final loss is the mean over this fraction of the last steps
BITS = 1.0 / math.log(2.0)  # nats -> bits

CHARS = sorted(set(SONNETS))
DATA = np.array([CHARS.index(c) for c in SONNETS], np.int32)


class Config(NamedTuple):
    name: str
    lr: float
    make: Callable[[], optax.GradientTransformation]


class Result(NamedTuple):
    """Per step and seed (shape (seeds, steps)): training loss in bits/char, the global
    gradient norm before clipping, and whether the step was clipped (or skipped)."""

    config: Config
    loss: np.ndarray
    pre_norm: np.ndarray
    clipped: np.ndarray

    def final(self) -> np.ndarray:
        """Per seed: mean loss over the last ``TAIL`` of the steps (inf if it went NaN)."""
        tail = self.loss[:, -max(1, round(self.loss.shape[1] * TAIL)) :]
        return np.where(np.all(np.isfinite(tail), axis=1), tail.mean(axis=1), np.inf)


def configs() -> list[Config]:
    """The unclipped sweep, then every jaxclip mode at ``HIGH_LR`` (thresholds set once by
    hand, from the unclipped runs' gradient norms: a median of about 0.3)."""
    unclipped = [Config(f"none, lr {lr:g}", lr, optax.identity) for lr in SWEEP]
    modes: list[tuple[str, Callable[[], optax.GradientTransformation]]] = [
        ("clip_by_global_norm(0.3)", lambda: jaxclip.clip_by_global_norm(0.3)),
        ("clip_by_norm(0.2)", lambda: jaxclip.clip_by_norm(0.2)),
        ("clip_by_value(0.01)", lambda: jaxclip.clip_by_value(0.01)),
        ("adaptive_clip(0.01)", lambda: jaxclip.adaptive_clip(0.01)),
        ("auto_clip(10)", lambda: jaxclip.auto_clip(10.0)),
        ("zclip(max_grad_norm=None)", lambda: jaxclip.zclip(max_grad_norm=None)),
        (
            "skip_large_updates(1.0)",
            lambda: jaxclip.skip_large_updates(optax.identity(), 1.0),
        ),
    ]
    return unclipped + [Config(f"{name}, lr {HIGH_LR:g}", HIGH_LR, make) for name, make in modes]


def baseline_bits() -> float:
    """The do-nothing model's loss: the entropy of the character frequencies, in bits."""
    p = np.bincount(DATA, minlength=len(CHARS)) / DATA.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k_emb, k_h, k_out = jax.random.split(key, 3)
    v = len(CHARS)
    return {
        "embed": jax.random.normal(k_emb, (v, 3 * HIDDEN)) * 0.5,  # input -> z, r, n gates
        "recur": jax.random.normal(k_h, (HIDDEN, 3 * HIDDEN)) / math.sqrt(HIDDEN),
        "bias": jnp.zeros(3 * HIDDEN),
        "out": jax.random.normal(k_out, (HIDDEN, v)) / math.sqrt(HIDDEN),
        "out_bias": jnp.zeros(v),
    }


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (nats) of a GRU over ``x`` (batch, SEQ)."""
    h_ = HIDDEN

    def cell(h: jax.Array, xt: jax.Array) -> tuple[jax.Array, jax.Array]:
        gx = params["embed"][xt] + params["bias"]
        gh = h @ params["recur"]
        z = jax.nn.sigmoid(gx[:, :h_] + gh[:, :h_])
        r = jax.nn.sigmoid(gx[:, h_ : 2 * h_] + gh[:, h_ : 2 * h_])
        n = jnp.tanh(gx[:, 2 * h_ :] + r * gh[:, 2 * h_ :])
        h = (1 - z) * n + z * h
        return h, h

    _, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], h_)), x.T)
    logits = hs @ params["out"] + params["out_bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y.T).mean()


def batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    start = jax.random.randint(key, (BATCH,), 0, DATA.size - SEQ - 1)
    window = jnp.asarray(DATA)[start[:, None] + jnp.arange(SEQ + 1)]
    return window[:, :-1], window[:, 1:]


def make_chunk(cfgs: Sequence[Config], seeds: int) -> tuple[Callable, Any]:
    """One compiled program for all configurations x seeds: returns ``(run, carry)``, where
    ``run(carry, step_keys)`` does ``len(step_keys)`` steps (keys of shape (steps, seeds))."""
    clips = [c.make() for c in cfgs]
    lrs = jnp.repeat(jnp.asarray([c.lr for c in cfgs], jnp.float32), seeds)
    n = len(cfgs)
    # Seed s starts from the same parameters in every configuration.
    params = jax.vmap(init_params)(jax.random.split(jax.random.key(0), seeds))
    params = jax.tree.map(lambda p: jnp.tile(p, (n,) + (1,) * (p.ndim - 1)), params)
    states = tuple(jax.vmap(clip.init)(_part(params, i, seeds)) for i, clip in enumerate(clips))
    grad_fn = jax.vmap(jax.value_and_grad(loss_fn))

    def one_step(carry: Any, keys: jax.Array) -> tuple[Any, tuple[jax.Array, jax.Array, jax.Array]]:
        params, states = carry
        x, y = jax.vmap(batch)(keys)  # (seeds, BATCH, SEQ): the same for every config
        x, y = (jnp.tile(a, (n, 1, 1)) for a in (x, y))
        loss, grads = grad_fn(params, x, y)  # every run in one batched computation
        pre = jax.vmap(optax.tree.norm)(grads)  # for the plot only: optax's plain norm
        parts, new_states = [], []
        for i, clip in enumerate(clips):
            u, s = jax.vmap(clip.update)(_part(grads, i, seeds), states[i], _part(params, i, seeds))
            parts.append(u)
            new_states.append(s)
        updates = jax.tree.map(lambda *u: jnp.concatenate(u), *parts)
        post = jax.vmap(optax.tree.norm)(updates)
        clipped = ~(post >= pre * (1 - 1e-5))  # also true for skipped and NaN steps
        params = jax.tree.map(
            lambda p, u: p - lrs.reshape((-1,) + (1,) * (p.ndim - 1)) * u, params, updates
        )
        return (params, tuple(new_states)), (loss * BITS, pre, clipped)

    @jax.jit
    def run(carry: Any, keys: jax.Array) -> tuple[Any, tuple[jax.Array, jax.Array, jax.Array]]:
        return jax.lax.scan(one_step, carry, keys)

    return run, (params, states)


def _part(tree: Any, i: int, seeds: int) -> Any:
    return jax.tree.map(lambda a: a[i * seeds : (i + 1) * seeds], tree)


def train(
    cfgs: Sequence[Config] | None = None,
    steps: int = STEPS,
    seeds: int = SEEDS,
    progress: bool = True,
) -> list[Result]:
    """Trains every configuration for ``steps`` steps with ``seeds`` seeds each."""
    cfgs = list(configs() if cfgs is None else cfgs)
    steps = max(CHUNK, steps // CHUNK * CHUNK)
    run, carry = make_chunk(cfgs, seeds)
    keys = jax.vmap(lambda s: jax.random.split(jax.random.key(1000 + s), steps))(jnp.arange(seeds))
    keys = keys.T.reshape(steps // CHUNK, CHUNK, seeds)
    bar = _Bar(steps, f"{len(cfgs)} configurations x {seeds} seeds", progress)
    out = []
    for k in keys:
        carry, metrics = run(carry, k)
        out.append([np.asarray(m) for m in metrics])
        bar.update(CHUNK)
    bar.close()
    loss, pre, clipped = (np.concatenate(m).T for m in zip(*out))  # (runs, steps)
    return [
        Result(c, *(a[i * seeds : (i + 1) * seeds] for a in (loss, pre, clipped)))
        for i, c in enumerate(cfgs)
    ]


class _Bar:
    """tqdm when installed, else a plain line every 20%."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar: Any = None
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        if not enabled:
            return
        try:
            from tqdm import tqdm  # pyright: ignore[reportMissingModuleSource]

            self._bar = tqdm(total=total, unit="step", desc=desc, postfix="compiling")
        except ImportError:
            print(f"{desc}: compiling, then {total} steps", flush=True)

    def update(self, n: int) -> None:
        before, self.done = self.done, self.done + n
        if self._bar is not None:
            if before == 0:
                self._bar.set_postfix_str("")  # compiled: the first chunk has run
            self._bar.update(n)
        elif self.enabled and before * 5 // self.total != self.done * 5 // self.total:
            print(f"  step {self.done}/{self.total}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """The numbers the claims of the README and the docs' demo page rest on (checked by
    ``tests/test_demo.py``)."""
    unclipped = [r for r in results if r.config.make is optax.identity]
    finals = {r.config.name: r.final() for r in results}
    best = min(unclipped, key=lambda r: float(np.mean(r.final())))
    return {
        "baseline": baseline_bits(),
        "final": finals,
        "best_unclipped": best.config.name,
        "best_unclipped_lr": best.config.lr,
    }


def _fmt(finals: np.ndarray, baseline: float) -> str:
    """Mean ± half the range over seeds, or how many seeds ended above the baseline."""
    bad = ~np.isfinite(finals) | (finals > baseline)
    if bad.all():
        return "above the baseline (every seed)"
    ok = finals[~bad]
    text = f"{ok.mean():.2f} ± {(ok.max() - ok.min()) / 2:.2f}"
    return text + (
        f" ({int(bad.sum())}/{finals.size} seeds above the baseline)" if bad.any() else ""
    )


def table(results: Sequence[Result]) -> str:
    """A Markdown table: per configuration, the final loss (mean ± half the range over
    seeds), the largest gradient norm seen and the fraction of steps clipped (or skipped)."""
    base = baseline_bits()
    seeds = results[0].loss.shape[0] if results else 0
    rows = [
        f"| configuration | final loss, bits/char (mean ± half-range, {seeds} seeds) "
        "| largest pre-clip norm | steps clipped |",
        "|---|---|---|---|",
        f"| baseline: character frequencies | {base:.2f} | — | — |",
    ]
    for r in results:
        largest = float(np.max(r.pre_norm, initial=0.0, where=np.isfinite(r.pre_norm)))
        # Past 100 a run has blown up, and how far is chaotic: it differs between CPUs.
        largest = f"{largest:.2g}" if largest < 100 else "> 100 (blew up)"
        unclipped = r.config.make is optax.identity
        clipped = "—" if unclipped else f"{np.mean(r.clipped):.0%}"
        rows.append(f"| {r.config.name} | {_fmt(r.final(), base)} | {largest} | {clipped} |")
    return "\n".join(rows)


def plot(results: Sequence[Result], path: str) -> None:
    """Left: loss curves (mean over seeds, band = min..max) of the unclipped sweep and of
    ``clip_by_global_norm`` at the high learning rate. Right: every configuration's final
    loss, one dot per seed on an axis from zero, against the baseline; a run that ended
    above the baseline (it diverged) is marked so at the right edge instead of a value.
    Each configuration has its own colour in both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = baseline_bits()
    right = 6.0  # the right panel's edge; diverged runs are drawn there, marked
    # Ten Tableau colours, then black and gold: twelve configurations, no two alike.
    palette = [*plt.get_cmap("tab10").colors, "black", "#e6ab02"]  # pyright: ignore
    colour = {r.config.name: palette[i % len(palette)] for i, r in enumerate(results)}
    fig, (ax, ax_dots) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.3, 1]})
    for r in results:
        unclipped = r.config.make is optax.identity
        if not (unclipped or r.config.name.startswith("clip_by_global_norm")):
            continue
        style: dict[str, Any] = {"color": colour[r.config.name], "lw": 1.8}
        if unclipped and r.config.lr == HIGH_LR:
            style["ls"] = "--"
        loss = np.where(np.isfinite(r.loss), r.loss, np.nan)
        steps = np.arange(1, loss.shape[1] + 1)
        ax.plot(steps, np.nanmean(loss, axis=0), label=r.config.name, **style)
        ax.fill_between(
            steps, np.nanmin(loss, 0), np.nanmax(loss, 0), color=style["color"], alpha=0.15
        )
    ax.axhline(base, color="gray", ls=":", lw=1.5, label="baseline: character frequencies")
    ax.set(ylim=(0, 7.0), xlabel="SGD step", ylabel="training loss, bits per character")
    ax.set_title("loss curves (line: mean over seeds, band: range; above 7 not shown)", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")

    for y, r in enumerate(results[::-1]):
        f = r.final()
        diverged = ~np.isfinite(f) | (f > base)
        c = colour[r.config.name]
        ax_dots.plot(f[~diverged], np.full((~diverged).sum(), y), "o", color=c, alpha=0.8)
        if (~diverged).any():
            ax_dots.plot(np.mean(f[~diverged]), y, "|", color=c, ms=14, mew=2)
        if diverged.any():
            ax_dots.plot(right, y, ">", color=c, ms=8)
            label = "diverged" + ("" if diverged.all() else f" ({diverged.sum()}/{f.size} seeds)")
            ax_dots.text(right - 0.12, y, label, ha="right", va="center", fontsize=8, color=c)
    ax_dots.axvline(base, color="gray", ls=":", lw=1.5)
    ax_dots.text(base, len(results) - 0.4, " baseline", color="gray", fontsize=8, va="bottom")
    ax_dots.set_yticks(range(len(results)), [r.config.name for r in results][::-1], fontsize=8)
    for tick, r in zip(ax_dots.get_yticklabels(), results[::-1]):
        tick.set_color(colour[r.config.name])
    ax_dots.set(
        xlim=(0, right + 0.2),
        ylim=(-0.6, len(results) - 0.1),
        xlabel="final loss, bits per character (dots: seeds, bar: their mean)",
    )
    ax_dots.set_title("every configuration: lower is better, axis from 0", fontsize=10)
    n = results[0].loss.shape
    fig.suptitle(
        f"Character-level GRU on Shakespeare's sonnets, SGD, {n[1]} steps, {n[0]} seeds: "
        f"unclipped at lr {HIGH_LR:g} diverges, clipped at lr {HIGH_LR:g} beats the best "
        "unclipped lr"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help=f"SGD steps, a multiple of {CHUNK} (rounded down; default {STEPS})",
    )
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds (default {SEEDS})")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, for tests")
    ap.add_argument("--out", default="jaxclip_demo.png", help="where to write the plot (PNG)")
    ap.add_argument("--no-plot", action="store_true", help="skip the plot")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = train(steps=QUICK_STEPS if args.quick else args.steps, seeds=args.seeds)
    print(table(results))
    s = summary(results)
    print(
        f"best unclipped learning rate: {s['best_unclipped_lr']:g}; "
        f"trained in {time.perf_counter() - t0:.0f} s"
    )
    if args.no_plot:
        return results
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "no plot: matplotlib is not installed "
            "(pip install -e '.[demo]' in the checkout, or --no-plot to silence this)"
        )
        return results
    plot(results, args.out)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
