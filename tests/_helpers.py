"""A jitted training loop shared by the tests (a module, not a fixture: import it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest

#: For tests of XLA:CPU's kernels and buffers (HLO kernel counts, ``memory_analysis()``):
#: GPU and TPU compile to other kernels, and jaxclip takes another strategy there (see
#: ``jaxclip/_norms.py``); their figures are in ``benchmarks/last_run.md``.
ON_XLA_CPU = jax.default_backend() == "cpu"
xla_cpu_only = pytest.mark.skipif(
    not ON_XLA_CPU, reason="a mechanism of XLA:CPU's compiled program"
)


@functools.cache
def train_step(tx: optax.GradientTransformation, loss: Callable[[Any], jax.Array]) -> Callable:
    """``step(params, state, scale) -> (params, state, loss)``: one jitted step of ``tx`` on
    ``loss``'s gradient times ``scale`` (built once per ``(tx, loss)``, so a second run of
    the same pair does not compile again)."""

    @jax.jit
    def step(params, state, scale):
        value, grads = jax.value_and_grad(loss)(params)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def train(
    tx: optax.GradientTransformation,
    loss: Callable[[Any], jax.Array],
    params: Any,
    steps: int,
    grad_scale: Callable[[int], float] | None = None,
) -> tuple[Any, Any, list[float]]:
    """``steps`` steps of ``tx`` from ``tx.init(params)``; step ``i``'s gradient is scaled by
    ``grad_scale(i)`` (1 by default; a spike, or NaN). Returns (params, state, losses), where
    ``losses[i]`` is the loss before step ``i``."""
    step = train_step(tx, loss)
    state = tx.init(params)
    losses = []
    for i in range(steps):
        scale = 1.0 if grad_scale is None else grad_scale(i)
        params, state, value = step(params, state, np.float32(scale))
        losses.append(float(value))
    return params, state, losses
