"""The passes over the data: plain power sums, maxima, and Blue's single pass.

The common path of a p-norm is one plain power sum per slice, accumulated in float32
(float64 for 64-bit leaves) with the upcast fused into the reduction. ``p=inf`` is a
maximum, exact as it stands. On GPU/TPU a 2-norm is Blue's three accumulators in one
pass, exact with no rare path (``backend.one_pass``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip._norms.arith import (
    Norm,
    acc_dtype,
    from_root,
    halved,
    magnitude,
    power_abs,
    root_norm,
    special,
    where_norm,
)
from jaxclip._norms.backend import (
    Axes,
    Elem,
    from_magnitude_bits,
    magnitude_bits,
    reduce,
    variadic_sum,
)
from jaxclip._norms.devices import one_device

Array = jax.Array


def power_sum(x: Array, p: float, axes: Axes, fused: bool) -> Array:
    """``sum |x|^p`` over ``axes`` (keepdims), in ``x``'s accumulation dtype. Fractional
    powers are split into exact parts in library reductions (:func:`arith.power`),
    where that is faster than pow; inside the fused reduce it is slower, and pow runs."""
    acc = acc_dtype(x.dtype)
    return reduce(x, lambda v, _: power_abs(v, p, acc, not fused), axes, "sum", fused)


def max_abs(x: Array, axes: Axes, acc: np.dtype, fused: bool, parts: bool = False) -> Array:
    """``max |x|`` (keepdims), NaN where ``x`` holds one; with ``parts``, of a complex
    ``x`` its largest real or imaginary part instead, for the rare path's shift: finite
    wherever the parts are (``|x|`` overflows beyond the dtype's largest value) and within
    a factor ``sqrt(2)`` of ``max |x|``."""
    elem: Elem = lambda v, _: magnitude(v, acc)  # noqa: E731
    if parts and jnp.iscomplexobj(x):
        elem = lambda v, _: jnp.maximum(magnitude(v.real, acc), magnitude(v.imag, acc))  # noqa: E731
    if x.size and one_device(x):
        return reduce(x, elem, axes, "max", fused)
    # A sharded x is reduced across devices by XLA's float max, which can drop a NaN;
    # the maximum of the magnitudes' bits keeps it (and an empty x's 0 is placed as x).
    # In x's own width: a magnitude widened first would be a full-size temporary (the
    # bits drop a real x's sign themselves; a complex x's magnitude is in its parts' width).
    m = elem(x, None) if jnp.iscomplexobj(x) else x
    dims = tuple(range(x.ndim)) if axes is None else axes
    top = jnp.max(magnitude_bits(m), axis=dims, keepdims=True, initial=0)
    return from_magnitude_bits(top, m.dtype).astype(acc)


def inf_norms(
    xs: Sequence[Array], axes: Sequence[Axes], fused: Sequence[bool]
) -> tuple[list[Array], list[Array] | None]:
    """``max |x|`` of each array, and, where one is complex, also ``max |x / 2|`` of each
    (parts halved before the modulus: finite where the parts are, when ``|x|`` itself
    overflows), for :func:`inf_result`; None for real arrays only."""
    ms = [max_abs(x, a, acc_dtype(x.dtype), f) for x, a, f in zip(xs, axes, fused)]
    if not any(jnp.iscomplexobj(x) for x in xs):
        return ms, None
    halves = [
        max_abs(halved(x), a, acc_dtype(x.dtype), f) if jnp.iscomplexobj(x) else m * 0.5
        for x, a, f, m in zip(xs, axes, fused, ms)
    ]
    return ms, halves


def inf_result(m: Array, half: Array | None = None) -> Norm:
    """The inf-norm of largest magnitude ``m``: where ``m`` overflowed but ``half``
    (``max |x / 2|``, complex arrays) did not, ``half * 2`` kept as a :class:`Norm`."""
    n = special(m, from_root(m, jnp.zeros_like(m)))
    if half is None:
        return n
    h = from_root(half, jnp.ones_like(half))
    return where_norm((m == jnp.inf) & jnp.isfinite(half), h, n)


class Blue(NamedTuple):
    """Constants of the one-pass overflow-safe 2-norm (Blue 1978; Anderson 2017, as in
    LAPACK 3.10's ``nrm2``) for an accumulation dtype, as exponents of two: magnitudes in
    ``[2**small, 2**big]`` are squared as they are, larger ones times ``2**-down``, smaller
    ones times ``2**up``. Every square is normal and no sum of up to 2**31 of them
    overflows, so each accumulator is exact to rounding."""

    small: int
    big: int
    down: int
    up: int


@functools.cache
def blue(acc: np.dtype) -> Blue:
    """The constants of Blue's pass in ``acc``."""
    info = np.finfo(acc)
    big = (info.maxexp - 32) // 2  # 2**31 squares of 2**big stay finite
    small = -((-info.minexp) // 2)  # squares of 2**small are normal
    down = info.maxexp - big  # 2**maxexp shifted to 2**big
    lowest = info.minexp - info.nmant  # the smallest subnormal
    up = ((-lowest + small) + (big - small)) // 2  # smallest squares normal, no overflow
    return Blue(small, big, down, up)


def _blue_elem(acc: np.dtype) -> Elem:
    """The three accumulators' terms of ``v`` (a NaN lands in the medium one)."""
    b = blue(acc)
    big, small = 2.0**b.big, 2.0**b.small
    down, up = 2.0**-b.down, 2.0**b.up

    def elem(v: Array, _: Any) -> tuple[Array, Array, Array]:
        if jnp.iscomplexobj(v):  # |z|**2 = re**2 + im**2; |z| itself may overflow
            re, im = elem(jnp.real(v), None), elem(jnp.imag(v), None)
            return tuple(a + b for a, b in zip(re, im))  # type: ignore[return-value]
        a = magnitude(v, acc)
        hi, lo = a > big, a < small
        # The factor is selected per element, never a constant: XLA would rewrite
        # (a * c)**2 as a**2 * c**2, which overflows or underflows.
        y = a * jnp.where(hi, down, jnp.where(lo, up, 1.0)).astype(acc)
        sq, zero = y * y, jnp.zeros((), acc)
        return jnp.where(hi, sq, zero), jnp.where(hi | lo, zero, sq), jnp.where(lo, sq, zero)

    return elem


def blue_sums(x: Array, axes: Axes, fused: bool) -> tuple[Array, ...]:
    """The big, medium and small accumulators of ``x`` over ``axes`` (keepdims)."""
    return variadic_sum(x, _blue_elem(acc_dtype(x.dtype)), axes, fused)


def blue_norm(hi: Array, mid: Array, lo: Array) -> Norm:
    """The 2-norm from the three accumulators (combined over units and devices)."""
    b = blue(np.dtype(mid.dtype))
    down, up = 2.0**-b.down, 2.0**b.up
    # Big values present: the medium sum in their units (the small one is negligible).
    # Else medium: if tiny (below 2**-70), in the small values' units, else the small
    # sum in the medium units (< 2**-95 in all: its rounding is far below an ulp).
    # Each factor is applied twice and chosen at run time: XLA folds ``(v * c) * c`` of
    # a constant ``c`` into ``v * c**2``, which overflows.
    tiny_mid = mid < 2.0 ** (np.finfo(mid.dtype).minexp + 56)
    f_mid = jnp.where(hi > 0, down, jnp.where(tiny_mid, up, 1.0)).astype(mid.dtype)
    f_lo = jnp.where(hi > 0, 0.0, jnp.where(tiny_mid, 1.0, 1 / up)).astype(mid.dtype)
    s = hi + (mid * f_mid) * f_mid + (lo * f_lo) * f_lo
    e = jnp.where(hi > 0, b.down, jnp.where(tiny_mid, -b.up, 0)).astype(mid.dtype)
    n = root_norm(s, 2.0, e)
    good = jnp.isfinite(s) & (s > 0)
    # NaN anywhere is NaN (it sits in the medium sum), inf is inf, all zeros 0.
    frac = jnp.where(good, n.frac, jnp.where(s > 0, s, jnp.where(jnp.isnan(s), s, 0)))
    return Norm(frac, jnp.where(good, n.exp, 0))
