"""Exact arithmetic: norms as ``(frac, exp)``, powers of two, powers and roots.

A norm is carried as :class:`Norm` ``frac * 2**exp`` so that the clipping factor
``c / n`` is exact where the norm or the factor lies outside the dtype's normal range.
Powers and roots split off exponents exactly, so their error does not grow with the
magnitude of their argument. Nothing here reduces or knows about devices.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

#: Up to this p the rare path shifts by a power of two (exact); above it, also by the
#: mantissa of the largest magnitude: the largest term, in [0.5, 1)^p, would underflow.
POWER_OF_TWO_MAX_P = 64.0
#: Power sums at or above ``tiny * 2**EXACT_LO_LOG2`` are exact as they stand: the terms
#: lost to underflow add up to less than an ulp of them.
EXACT_LO_LOG2 = 64


def acc_dtype(dtype: Any) -> np.dtype:
    """The accumulation dtype of a leaf: float64 for 64-bit leaves, else float32."""
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(np.float64), np.dtype(np.complex128)):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def result_dtype(leaves: Any) -> np.dtype:
    """The dtype of a norm over ``leaves``: the widest accumulation dtype among them."""
    if any(acc_dtype(x.dtype) == np.float64 for x in leaves):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def magnitude(x: Array, acc: np.dtype) -> Array:
    """|x| in the accumulation dtype (the convert fuses into the consumer)."""
    if jnp.iscomplexobj(x):
        return jnp.abs(x).astype(acc)
    return jnp.abs(x.astype(acc))


def halved(x: Array) -> Array:
    """A complex ``x / 2``, its parts halved: its modulus is finite wherever the parts
    are (``|x|`` overflows above the dtype's largest value)."""
    return lax.complex(x.real * 0.5, x.imag * 0.5)


def power(a: Array, p: float, split: bool = False) -> Array:
    """a**p for a >= 0; NaN stays NaN for every p.

    With ``split``, a fractional ``p`` takes :func:`power_by_parts`, exact at any
    magnitude: for the common path's unshifted sums. The rare path's data is shifted
    near 1, where pow's error is small; the caller decides, as the parts' speed
    depends on the reduction that consumes them (see ``backend.native``).
    """
    if p == 1.0:
        return a
    if p == 2.0:
        return a * a
    if p == int(p) and p <= 8:
        return lax.integer_pow(a, int(p))
    if p == 0.5:
        return jnp.sqrt(a)  # correctly rounded
    if split and p <= POWER_OF_TWO_MAX_P:  # above, f**p in [0.5, 1)**p would underflow
        return power_by_parts(a, p)
    pos = a > 0
    return jnp.where(pos, jnp.power(jnp.where(pos, a, 1), p), a)


def power_by_parts(a: Array, p: float) -> Array:
    """``a**p`` for ``a >= 0`` to about an ulp at any magnitude.

    ``pow(a, p) = exp(p ln a)`` rounds ``p ln a`` first, which costs ``|p ln a| / 2``
    ulps. Here ``a = f 2**k`` and ``p = hi + mid + lo`` with ``hi = H 2**-S`` of 12 bits:
    the integer part of ``k hi`` comes from integer arithmetic, exactly, and is added to
    the exponent bits of ``2**(frac(k hi) + k mid + k lo + p log2 f)``, whose argument is
    below ``p + 1`` in size. (Adding to the bits, not multiplying by a built power of two,
    keeps XLA:CPU's vectorised loop fast.)
    """
    info = np.finfo(a.dtype)
    itype = np.int32 if a.dtype.itemsize == 4 else np.int64
    nm, bias = info.nmant, info.maxexp - 1
    f, k = frexp(a)
    hi, mid, lo = split_exact(Fraction(p), a.dtype)
    shift = 12 - math.frexp(hi)[1]
    steps = k.astype(itype) * round(math.ldexp(hi, shift))  # k hi = steps 2**-shift
    whole = steps >> shift  # floor
    frac = (steps & ((1 << shift) - 1)).astype(a.dtype) * math.ldexp(1.0, -shift)
    r = jnp.exp2(frac + (k * mid + k * lo) + p * jnp.log2(f))
    bits = lax.bitcast_convert_type(r, itype)
    e = ((bits >> nm) & (2 * bias + 1)) + whole  # the result's biased exponent
    out = lax.bitcast_convert_type(bits + (whole << nm), a.dtype)
    out = jnp.where(e <= 0, 0, jnp.where(e > 2 * bias, jnp.inf, out))
    return jnp.where(jnp.isnan(r), r, out)


def split_exact(c: Fraction, dtype: Any) -> tuple[float, float, float]:
    """``c = hi + mid + lo`` (to ``dtype``'s precision squared) with ``hi`` of 12 bits,
    so that ``k * hi`` is exact for any exponent ``k`` of ``dtype``, and ``mid``, ``lo``
    in ``dtype``. ``c`` is exact: ``1/p`` rounded to a double would be magnified by the
    exponent it multiplies."""
    top = math.frexp(float(c))[1]
    hi = math.ldexp(round(math.ldexp(float(c), 12 - top)), top - 12)
    mid = float(np.asarray(float(c - Fraction(hi)), dtype))
    return hi, mid, float(np.asarray(float(c - Fraction(hi) - Fraction(mid)), dtype))


def power_abs(x: Array, p: float, acc: np.dtype, split: bool = False) -> Array:
    """``|x|**p`` in ``acc``; a complex 2-norm term is ``re**2 + im**2``."""
    if p == 2.0 and jnp.iscomplexobj(x):
        re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
        return re * re + im * im
    return power(magnitude(x, acc), p, split)


def pow2(k: Any, dtype: Any) -> Array:
    """Exactly ``2**k`` for integer-valued ``k``, clamped to ``dtype``'s normal range."""
    dtype = np.dtype(dtype)
    info = np.finfo(dtype)
    itype = np.int32 if dtype.itemsize == 4 else np.int64
    k = jnp.clip(jnp.asarray(k), info.minexp, info.maxexp - 1).astype(itype)
    return lax.bitcast_convert_type((k + (info.maxexp - 1)) << info.nmant, dtype)


def ldexp(x: Array, e: Any, *, divide_last: bool = False) -> Array:
    """``x * 2**e`` in ``x``'s dtype, exact unless the result is outside the normal range;
    ``e`` may exceed the exponent range (applied as three normal factors).

    With ``divide_last`` the third factor is applied as a division by its reciprocal (the
    same value): XLA copies a chain of cheap scalar ops into every kernel that reads its
    result, but computes a division once. Not for elementwise use over large arrays,
    where a division costs more than a product.
    """
    dtype = x.real.dtype if jnp.iscomplexobj(x) else x.dtype
    info = np.finfo(dtype)
    lo, hi = info.minexp, info.maxexp - 1
    e = jnp.asarray(e, dtype)
    e1 = jnp.clip(e, lo, hi)
    e2 = jnp.clip(e - e1, lo, hi)
    e3 = e - e1 - e2
    y = x * pow2(e1, dtype) * pow2(e2, dtype)
    return y / pow2(-e3, dtype) if divide_last else y * pow2(e3, dtype)


class Norm(NamedTuple):
    """A norm as ``frac * 2**exp``, ``exp`` an integer held in ``frac``'s dtype: the value
    itself with ``exp == 0`` where it is a normal number (or 0, inf, NaN), else a normal
    ``frac`` (see :func:`from_root`), so that a norm beyond the dtype's range (four
    float32 values of 3e38) still clips exactly."""

    frac: Array
    exp: Array

    @property
    def value(self) -> Array:
        """The norm as a number (inf where it exceeds the dtype's range)."""
        return ldexp(self.frac, self.exp, divide_last=True)


def as_norm(value: Array) -> Norm:
    """A :class:`Norm` from a norm given as a number (``use_norm``)."""
    return Norm(value, jnp.zeros_like(value))


def narrow_norm(n: Norm, dtype: Any) -> Norm:
    """``n`` held in ``dtype``. A wider ``frac`` (a float64 norm under x64 beside float32
    ones) gives its exponent to ``exp`` first: past ``dtype``'s range its value stays
    finite and exact to ``dtype``'s precision, where a cast would make it inf."""
    dtype = np.dtype(dtype)
    if np.dtype(n.frac.dtype).itemsize <= dtype.itemsize:
        return Norm(n.frac.astype(dtype), n.exp.astype(dtype))
    # Only the exponent past half of dtype's range moves to ``exp``: the frac keeps the
    # rest, so that a limit formed from it (``clipping * frac``) and the tangents, which
    # scale by ``2**exp`` both ways, stay inside dtype's range (moving all of it, a float64
    # norm of 5e39 had derivatives NaN: 2**133 over float32's range). The frac is scaled
    # by a stopped exponent: frexp's bit operations carry no tangent.
    half = np.finfo(dtype).maxexp // 2
    e = frexp(lax.stop_gradient(n.frac))[1]
    e = e - jnp.clip(e, -half, half)
    return Norm(ldexp(n.frac, -e).astype(dtype), (n.exp + e).astype(dtype))


def where_norm(pred: Array, a: Norm, b: Norm) -> Norm:
    """``a`` where ``pred``, else ``b``, part by part."""
    return Norm(jnp.where(pred, a.frac, b.frac), jnp.where(pred, a.exp, b.exp))


def frexp(x: Array) -> tuple[Array, Array]:
    """``(f, e)`` with ``x = f * 2**e``, ``f`` in [0.5, 1), ``e`` an integer held in
    ``x``'s dtype, for ``x >= 0``; ``(x, 0)`` where ``x`` is 0, inf or NaN. A few bit
    operations: ``jnp.frexp`` traces several times more ops, which adds up over many
    leaves."""
    info = np.finfo(x.dtype)
    itype = np.int32 if x.dtype.itemsize == 4 else np.int64
    nm, bias = info.nmant, info.maxexp - 1
    sub = x < info.tiny  # subnormal (or zero): normalise first
    xs = jnp.where(sub, x * pow2(jnp.asarray(nm + 1), x.dtype), x)
    bits = lax.bitcast_convert_type(xs, itype)
    e = (bits >> nm) - (bias - 1)
    mant = (bits & ((1 << nm) - 1)) | ((bias - 1) << nm)
    f = lax.bitcast_convert_type(mant.astype(itype), x.dtype)
    e = e.astype(x.dtype) - jnp.where(sub, nm + 1, 0).astype(x.dtype)
    # A subnormal that the normalising product flushed (XLA:CPU) counts as 0, as it does
    # in the sums; its bits would read as 0.5 * 2**-150.
    flushed = sub & (xs == 0)
    special = (x == 0) | ~jnp.isfinite(x) | flushed
    f = jnp.where(flushed, 0, jnp.where(special, x, f))
    return f, jnp.where(special, 0, e).astype(x.dtype)


def root(s: Array, p: float) -> Array:
    """s**(1/p) for s >= 0; NaN and inf pass through."""
    if p == 1.0:
        return s
    zero = s == 0
    safe = jnp.where(zero, 1, s)
    if p == 2.0:
        r = jnp.sqrt(safe)
    elif p == int(p) and p <= 64:
        # 1/p is inexact and pow magnifies that by ln(s); take out 2^(p*q) exactly
        # first, so that ln of the rest is below p ln 2.
        k = int(p)
        q = jnp.floor_divide(jnp.frexp(safe)[1], k)
        q = jnp.where(jnp.isfinite(safe), q, 0)
        r = jnp.ldexp(jnp.power(jnp.ldexp(safe, -k * q), 1.0 / p), q)
    else:
        r = jnp.power(safe, 1.0 / p)
    return jnp.where(zero, 0, r)


def exact_lo(acc: Any) -> float:
    """The smallest power sum that is exact as it stands: ``tiny * 2**EXACT_LO_LOG2``."""
    return float(np.finfo(acc).tiny) * 2.0**EXACT_LO_LOG2


def in_exact_range(s: Array, acc: Any) -> Array:
    """Whether a power sum accumulated in ``acc`` is exact as it stands: not overflowed
    nor NaN, and at least :func:`exact_lo` (the ``n * tiny`` at most lost to underflow
    is then far below an ulp of it for any realistic ``n``)."""
    return (s >= exact_lo(acc)) & (s < jnp.inf)


#: The most terms a power sum adds in :func:`always_exact` (256 TiB of 16-bit data).
MAX_TERMS = 2.0**47


def always_exact(dtype: Any, p: float) -> bool:
    """Whether every plain power sum of ``dtype`` data is exact as it stands, whatever
    the data: each nonzero term ``|x|**p`` is a normal number of the accumulation dtype
    (none underflows) and no sum of up to :data:`MAX_TERMS` of the largest overflows.
    True for float16 and the float8 types at moderate ``p`` (``p=2``: terms from 2**-48
    to 2**32 in float32), whose norms then need no rare path; never for complex data,
    bfloat16 or float32, whose exponent range squares beyond float32's."""
    info, acc = jnp.finfo(dtype), np.finfo(acc_dtype(dtype))
    if info.bits >= acc.bits:  # complex64's parts are float32: never
        return False
    smallest = math.log2(float(info.smallest_subnormal)) * p
    largest = math.log2(float(info.max)) * p + math.log2(MAX_TERMS)
    return smallest >= acc.minexp and largest < acc.maxexp - 1


def floor_bound(acc: Any, p: float) -> float:
    """An upper bound of the norm of a slice whose power sum is below :func:`exact_lo`:
    the sum is below ``lo``, and underflow lost less than ``n * tiny < lo`` of it, so the
    norm is below ``(2 lo)**(1/p)``; twice that, and at least ``tiny``."""
    return max((4 * exact_lo(acc)) ** (1 / p), float(np.finfo(acc).tiny))


def from_root(r: Array, e: Any) -> Norm:
    """The norm ``r * 2**e`` as a :class:`Norm`: ``(value, 0)`` where the value is a
    normal number (so derivatives are carried unscaled), else with ``frac`` in
    ``[2**(g-1), 2**g)`` above the range and ``[2**(-g-1), 2**-g)`` below it, ``g`` half
    the exponent range: the tangent ``dn * 2**-exp`` of ``frac`` then stays normal for
    any realistic ``dn``, where a fraction in [0.5, 1) would underflow or overflow it."""
    e = jnp.asarray(e, r.dtype)
    v = ldexp(r, e)
    frac, k = frexp(r)
    g = np.finfo(r.dtype).maxexp // 2
    shift = jnp.where(k + e > 0, g, -g).astype(r.dtype)
    normal = jnp.isfinite(v) & ((v >= np.finfo(r.dtype).tiny) | (v == 0))
    return Norm(jnp.where(normal, v, ldexp(frac, shift)), jnp.where(normal, 0, k + e - shift))


def root_norm(s: Array, p: float, e: Any = 0, mant: Array | None = None) -> Norm:
    """The norm ``mant * s**(1/p) * 2**e`` of a power sum ``s >= 0`` (``mant`` in
    [0.5, 1] for ``p`` above :data:`POWER_OF_TWO_MAX_P`).

    Integer ``p`` use :func:`root`. Otherwise ``s = f * 2**k`` and the root is
    ``f**(1/p) * 2**(k/p)``: ``pow`` sees only ``f`` in [0.5, 1) (``pow(s, 1/p)`` would
    magnify the rounding of ``1/p`` by ``ln s``), ``k/p`` is formed with ``1/p`` split
    into exact parts, and its integer part stays in the exponent, so a root beyond the
    dtype's range (``p < 1``) is still exact; below ``p = 1/64`` the exponent of
    ``f**(1/p)`` joins it too (``f**(1/p)`` itself would underflow).
    """
    e = jnp.asarray(e, s.dtype)
    if p == int(p) and p <= POWER_OF_TWO_MAX_P:
        return from_root(root(s, p), e)
    if mant is not None:  # the largest term is 1 but for rounding, raised to a huge p
        s = jnp.where(s < 1, 1, s)
    inv = 1.0 / p
    hi, mid, lo = split_exact(1 / Fraction(p), s.dtype)
    f, k = frexp(s)
    q = k * hi
    whole = jnp.floor(q)
    if inv <= POWER_OF_TWO_MAX_P:
        r = jnp.power(f, inv) * jnp.exp2((q - whole) + (k * mid + k * lo))
    else:  # f**(1/p) as 2**(log2(f) / p), its integer part in the exponent
        a = jnp.log2(f) * inv
        whole_a = jnp.floor(a)
        r = jnp.exp2((q - whole) + (k * mid + k * lo) + (a - whole_a))
        whole = whole + whole_a
    if mant is not None:
        r = r * mant
    n = from_root(r, e + whole)
    good = jnp.isfinite(s) & (s > 0)
    return Norm(jnp.where(good, n.frac, s), jnp.where(good, n.exp, 0))


def in_range_norm(s: Array, p: float) -> Norm:
    """:func:`root_norm` of a sum in the exact range: for ``p`` of 1 or 2 the root is a
    normal number, held as it is (a fraction of the scalar code)."""
    if p == 1.0:
        return Norm(s, jnp.zeros_like(s))
    if p == 2.0:
        return Norm(jnp.sqrt(s), jnp.zeros_like(s))
    return root_norm(s, p)


def special(m: Array, norm: Norm) -> Norm:
    """``norm`` where the largest magnitude ``m`` is positive and finite; else the norm is
    0 (all zeros) or ``m`` itself (inf, or NaN: PyTorch's propagation)."""
    good = (m > 0) & jnp.isfinite(m)
    frac = jnp.where(good, norm.frac, jnp.where(m == 0, 0, m)).astype(norm.frac.dtype)
    return Norm(frac, jnp.where(good, norm.exp, 0).astype(norm.frac.dtype))
