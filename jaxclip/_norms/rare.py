"""The rare path: a second read with every term shifted by a power of two.

A plain power sum is exact unless it overflowed, is NaN, or is so small that terms may
have underflowed (``arith.in_exact_range``). Then, and only then, the data is read
again with each slice (or example) shifted by ``2**-e`` so that its terms are normal
and their sum finite, and the norm is ``root(t) * 2**e``. The shift comes from:

- for a 2-norm in one dtype, the plain sum itself (:func:`sum_shift`): no pass for the
  maxima;
- otherwise the largest magnitude ``m = f * 2**e`` (:func:`max_shift`), which makes
  the largest term 1 (times ``m``'s mantissa above ``POWER_OF_TWO_MAX_P``).

Every norm (global, per slice, per example) uses these functions; the callers decide
which units and slices are read again.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxclip._norms.arith import (
    POWER_OF_TWO_MAX_P,
    Norm,
    acc_dtype,
    frexp,
    ldexp,
    magnitude,
    pow2,
    power,
    power_abs,
    root_norm,
    special,
)
from jaxclip._norms.backend import Axes, Elem, reduce

Array = jax.Array

#: Sums of squares of up to 2**SQUARES_LOG2 elements are bounded in :func:`sum_shift`.
SQUARES_LOG2 = 40


def sum_shift(s: Array, ok: Array | bool) -> Array:
    """The shift ``e`` of a 2-norm's slice from its plain sum of squares ``s``, such that
    ``sum (|x| 2**-e)**2`` is exact (0 where ``ok``, the sum being exact already).

    ``s`` overflowed (inf; NaN stays NaN): every element is at most the dtype's largest,
    so ``e = (maxexp + SQUARES_LOG2 + 2) // 2`` (85 for float32) keeps a sum of
    ``2**SQUARES_LOG2`` squares finite, and elements that matter (squares above
    ``s * 2**-70``) stay normal. ``s`` too small (elements may have underflowed, or all
    are zero): every element is at most ``sqrt(max(s, tiny))``, and ``e`` lifts that to
    ``2**((maxexp - SQUARES_LOG2 - 1) / 2)``, so again nothing overflows, and every
    normal element squares to a normal number.
    """
    info = np.finfo(s.dtype)
    down = float((info.maxexp + SQUARES_LOG2 + 2) // 2)
    top = info.maxexp - SQUARES_LOG2 - 1
    log2 = frexp(jnp.maximum(s, info.tiny))[1]  # s < 2**log2
    up = jnp.floor((log2 - top) / 2)
    return jnp.where(ok, 0, jnp.where(s < jnp.inf, up, down)).astype(s.dtype)


def max_shift(m: Array, p: float) -> tuple[Array, Array | None]:
    """The shift of a p-norm's slice of largest magnitude ``m``: ``e``, the exponent of
    ``m``, and ``mant``: the terms are ``(|x| 2**-e / mant)^p``, so that the largest is 1
    (``mant`` is None, i.e. 1, up to :data:`POWER_OF_TWO_MAX_P`, else m's mantissa, at
    the cost of one rounding per term) and the norm is ``mant t**(1/p) 2**e``."""
    e = frexp(m)[1]
    if p <= POWER_OF_TWO_MAX_P:
        return e, None
    good = (m > 0) & jnp.isfinite(m)
    return e, jnp.where(good, ldexp(m, -e), 1)


def shift_factors(e: Array, mant: Array | None, dtype: Any, single: bool) -> tuple[Array, ...]:
    """``2**-e / mant`` as factors in ``dtype``: one factor for a :func:`sum_shift`
    (``single``; normal for every such ``e``), else two normal factors. The single one
    comes out of a division: XLA copies cheap scalar ops into each kernel that reads
    their result, but computes a division once."""
    if single:
        return (1 / pow2(e, dtype),)
    half = jnp.floor(-e / 2)
    rest = pow2(-e - half, dtype)
    return pow2(half, dtype), rest if mant is None else rest / mant.astype(dtype)


def _shifted_elem(p: float, acc: np.dtype) -> Elem:
    """``(|v| * f0 * f1 ...)^p``: a term of a power sum shifted by its factors."""

    def elem(v: Array, f: Any) -> Array:
        if jnp.iscomplexobj(v):  # parts shifted before the modulus, which may overflow
            re, im = (functools.reduce(jnp.multiply, f, w.astype(acc)) for w in (v.real, v.imag))
            return power_abs(lax.complex(re, im), p, acc)
        return power(functools.reduce(jnp.multiply, f, magnitude(v, acc)), p)

    return elem


def shifted_sum(x: Array, p: float, axes: Axes, fused: bool, factors: tuple[Array, ...]) -> Array:
    """``sum (|x| f0 f1 ...)^p`` over ``axes`` (keepdims; the factors of
    :func:`shift_factors` per slice). ``x`` and the factors pass one barrier together,
    so that XLA does not materialise the factors' broadcast."""
    x, factors = lax.optimization_barrier((x, factors))
    return reduce(x, _shifted_elem(p, acc_dtype(x.dtype)), axes, "sum", fused, factors)


def shifted_norm(t: Array, p: float, e: Array, mant: Array | None, m: Array | None) -> Norm:
    """The norm of a shifted sum ``t``: ``mant t**(1/p) 2**e``; with ``m`` (the shift came
    from the maxima), 0 for all-zero slices and ``m`` itself where it is inf or NaN."""
    n = root_norm(t, p, e, mant)
    return n if m is None else special(m, n)
