"""Derivative and batching rules shared by every norm.

One tangent formula serves every norm, ``d||x||_p = sum sign(x) (|x|/n)^(p-1) dx``,
evaluated overflow-free from ``(frac, exp)``, so the rare path's branch points never
leak into gradients. Under ``vmap`` a norm's ``lax.cond`` would run both branches; the
batching rule instead makes the batch one more kept axis, so the cond stays unbatched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxclip._norms.arith import Norm, frexp, halved, ldexp, magnitude
from jaxclip._norms.backend import Axes

Array = jax.Array


def over_norm(v: Array, norm: Norm) -> Array:
    """``v / n`` (1 in place of a zero norm), divided by the norm's mantissa only: XLA:CPU
    divides by a broadcast scalar as a product with its reciprocal, which is 0 for a
    divisor above 2**126. The mantissa comes from ``ldexp``, not ``frexp``'s bits, so
    that second derivatives flow through it."""
    safe = jnp.where(norm.frac > 0, norm.frac, 1)
    k = frexp(lax.stop_gradient(safe))[1]
    return ldexp(v, -(norm.exp + k)) / ldexp(safe, -k)


def tangent(x: Array, dx: Array, norm: Norm, p: float, axes: Axes) -> Array:
    """``sum sign(x) (|x|/n)^(p-1) dx`` over ``axes`` (keepdims); for ``p=inf`` the
    derivative of the max, shared among ties. 0 where the norm is 0."""
    acc = norm.frac.dtype
    a = magnitude(x, acc)
    if jnp.iscomplexobj(x):
        h = halved(x)  # |x| may overflow
        ah = magnitude(h, acc)
        unit = jnp.conj(h) / jnp.where(ah > 0, ah, 1).astype(x.dtype)
        d = jnp.real(unit * dx.astype(x.dtype)).astype(acc)
        ratio = over_norm(ah, norm) * 2  # |x| / n <= 1
    else:
        d = (jnp.sign(x).astype(acc) * dx.astype(acc)).astype(acc)
        ratio = over_norm(a, norm)  # |x| / n <= 1
    dims = tuple(range(x.ndim)) if axes is None else axes
    if p == math.inf:
        top = a == norm.value
        w = top.astype(acc) / jnp.maximum(jnp.sum(top, axis=dims, keepdims=True), 1).astype(acc)
    elif p == 1.0:
        w = jnp.ones_like(ratio)
    else:
        pos = ratio > 0
        w = jnp.where(pos, jnp.power(jnp.where(pos, ratio, 1), p - 1), 0)
    return jnp.sum(w * d, axis=dims, keepdims=True)


def norm_tangent(norm: Norm, dn: Array) -> Norm:
    """The tangent of ``(frac, exp)`` from the tangent ``dn`` of the norm's value; NaN
    where the norm is not finite, 0 where it is 0."""
    finite = jnp.isfinite(norm.frac)
    dfrac = jnp.where(finite, ldexp(dn, -norm.exp), jnp.nan)
    dfrac = jnp.where(norm.frac == 0, 0, dfrac)
    return Norm(dfrac, jnp.zeros_like(norm.exp))


def _broadcast_unbatched(
    size: int, batched: Sequence[bool], units: tuple[Array, ...]
) -> tuple[Array, ...]:
    """A custom batching rule's operands, each with the batch axis leading (an unbatched
    unit is broadcast: rare, e.g. ``in_axes=None`` for some leaves)."""
    return tuple(u if b else jnp.broadcast_to(u, (size, *u.shape)) for u, b in zip(units, batched))


def batchable(
    body: Callable[[tuple[Array, ...], Any], Any],
    batched_body: Callable[[int, tuple[Array, ...], Any], Any],
) -> Callable[[tuple[Array, ...], Any], Any]:
    """``body(units, floor)`` with a ``vmap`` rule: ``batched_body(size, units, floor)``
    computes every example's norms at once, the batch axis leading each unit. A batched
    floor (a scalar lower bound of the clip norms) is its smallest value.

    ``body`` is staged as a ``jit`` of its own: ``custom_vmap`` is lowered by evaluating
    its traced body again, which re-binds one equation for a call where it would re-bind
    every one of an inline body (thousands on a large tree)."""
    staged = jax.jit(body)

    @jax.custom_batching.custom_vmap
    def norms(units: tuple[Array, ...], floor: Any) -> Any:
        return staged(units, floor)

    @norms.def_vmap
    def rule(size: int, in_batched: Any, units: tuple[Array, ...], floor: Any) -> tuple[Any, Any]:
        units = _broadcast_unbatched(size, in_batched[0], units)
        if floor is not None and in_batched[1]:
            floor = jnp.min(floor)
        out = batched_body(size, units, floor)
        return out, jax.tree.map(lambda _: True, out)

    return norms
