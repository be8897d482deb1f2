"""``clip_stats``: every norm and threshold of the jaxclip modes in an optimizer state."""

from __future__ import annotations

from typing import Any

import jax
from jax import tree_util as jtu

from jaxclip import _registry, _tree

#: Keys of wrapper states that name no position and are left out of the keys.
_WRAPPER_KEYS = frozenset({"inner_state", "inner_opt_state"})


def _is_jaxclip_state(x: Any) -> bool:
    return (
        isinstance(x, tuple) and hasattr(x, "_fields") and type(x).__module__.startswith("jaxclip")
    )


def _is_injected(x: Any) -> bool:
    """An ``optax.inject_hyperparams`` state (matched by its fields, as optax has renamed it)."""
    fields = getattr(x, "_fields", ())
    return isinstance(x, tuple) and "hyperparams" in fields and "inner_state" in fields


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _key(path: tuple[Any, ...]) -> str:
    kept = tuple(
        k for k in path if getattr(k, "name", getattr(k, "key", None)) not in _WRAPPER_KEYS
    )
    return _tree.path_str(kept)


def _leaves(prefix: str, value: Any, out: dict[str, jax.Array]) -> None:
    paths, leaves, _ = _tree.flatten_with_paths(value)
    for p, x in zip(paths, leaves):
        out[_join(prefix, _tree.path_str(p))] = x


def _is_stop(x: Any) -> bool:
    return _is_jaxclip_state(x) or _is_injected(x)


def _visit(state: Any, where: str, out: dict[str, jax.Array]) -> None:
    """Reports a jaxclip (or injected-hyperparameter) state found at ``where``."""
    if _is_injected(state):
        inner: dict[str, jax.Array] = {}
        _walk(state.inner_state, where, inner)
        if _is_jaxclip_state(state.inner_state):  # a jaxclip mode's injected hyperparameters
            for name, value in state.hyperparams.items():
                key = _join(where, name)  # (under hyperparams/ where a state field has it)
                _leaves(key if key not in inner else _join(where, "hyperparams", name), value, out)
        out.update(inner)
        return
    for name in _registry.logged_fields(state):
        _leaves(_join(where, name), getattr(state, name), out)
    if "inner_state" in state._fields:  # skip_large_updates wraps a whole optimizer
        # A mode wrapped alone logs fields of the same names: under "inner/".
        inner = state.inner_state
        _walk(inner, _join(where, "inner") if _is_stop(inner) else where, out)


def _walk(node: Any, prefix: str, out: dict[str, jax.Array]) -> None:
    """Reports every state below ``node`` (whose path is ``prefix``)."""
    if _is_stop(node):
        _visit(node, prefix, out)
        return
    for path, x in jtu.tree_flatten_with_path(node, is_leaf=_is_stop)[0]:
        if _is_stop(x):
            _visit(x, _join(prefix, _key(tuple(path))), out)


def clip_stats(opt_state: Any) -> dict[str, jax.Array]:
    """Every norm and threshold that the jaxclip modes in ``opt_state`` hold, for logging.

    Walks any optimizer state (an ``optax.chain``, ``inject_hyperparams``, ``MultiSteps``,
    ``masked``, ``apply_if_finite``, ``skip_large_updates``, a Flax NNX
    ``Optimizer.opt_state``) and returns one scalar per entry, keyed by where the mode
    sits and what the value is: ``"0/global_norm"`` for the first transformation of a
    chain, ``"1/norms/l1/kernel"`` for a per-leaf norm of :func:`clip_by_norm`,
    ``"2/threshold"`` for an adaptive threshold, a group's norm under
    ``"global_norm/<label>"``, the fields of a mode that :func:`jaxclip.skip_large_updates`
    wraps alone (not in a chain) under ``"inner/"``, and the current value of every
    hyperparameter that ``optax.inject_hyperparams`` injects into a jaxclip mode with a state
    (``"0/clip_norm"``; the stateless :func:`jaxclip.clip_by_value` and
    :func:`jaxclip.adaptive_clip` keep ``optax.EmptyState``, which names no mode, so their
    injected values are left to the wrapper's ``state.hyperparams``).
    Unlike ``optax.tree.get(state, "global_norm")``, it works with several jaxclip
    modes in one chain and with injected hyperparameters. Works under ``jit`` too.

    Args:
      opt_state: an optimizer state holding jaxclip states anywhere.

    Returns:
      A dict from ``/``-joined keys to arrays (the values as stored: float32 scalars for
      norms and thresholds); ``{}`` when the state holds no jaxclip mode.

    Example:
      >>> import jax.numpy as jnp, optax, jaxclip
      >>> tx = optax.chain(
      ...     optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=1.0),
      ...     jaxclip.clip_by_norm(0.5),
      ...     optax.sgd(0.1),
      ... )
      >>> grads = {"w": jnp.array([3.0, 4.0])}
      >>> _, state = tx.update(grads, tx.init(grads))
      >>> {k: float(v) for k, v in jaxclip.clip_stats(state).items()}
      {'0/clip_norm': 1.0, '0/global_norm': 5.0, '1/norms/w': 1.0}
    """
    out: dict[str, jax.Array] = {}
    _walk(opt_state, "", out)
    return out
