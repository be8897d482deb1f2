"""Clipping factors and their application, with derivative rules.

The factor of a norm ``n`` and a clip norm ``c`` is ``c / n`` rounded once (Paddle's
and TensorFlow's result; no epsilon), held as two normal factors so that it is exact
at any magnitude; where ``n <= c`` the array is kept bit for bit. One ``custom_jvp``
differentiates the clipping of many arrays at once, with each part well scaled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxclip._norms.arith import Norm, acc_dtype, as_norm, frexp, ldexp, pow2
from jaxclip._norms.backend import quotient_first, unless_flushed
from jaxclip._norms.rules import over_norm
from jaxclip._norms.stacking import every

Array = jax.Array


class Factor(NamedTuple):
    """The clipping factor of a norm: ``x`` is kept as it is where ``keep``, else
    multiplied by ``f0`` then ``f1``: ``f0`` carries the mantissa of ``c / n`` and as much
    of its exponent as stays normal, ``f1`` (a power of two, 1 unless ``c / n`` is below
    the normal range) the rest, so that no factor is ever subnormal. ``keep`` is
    ``f1 == 0``: :func:`clip_factor` sets ``f1`` to 0 where the norm is within the limit."""

    keep: Array
    f0: Array
    f1: Array


def clip_factor(norm: Norm | Array, clip_norm: Any) -> Factor:
    """Keep where ``norm <= clip_norm``, else the factor ``clip_norm / norm`` (0 for an
    inf norm, NaN for NaN), exact at any magnitude.

    A ``clip_norm`` at or below 0 (a traced schedule that decays to 0) means "updates
    of norm 0": the factor is 0, never negative.
    """
    if not isinstance(norm, Norm):
        norm = as_norm(jnp.asarray(norm))
    acc = norm.frac.dtype
    c = jnp.maximum(jnp.asarray(clip_norm, acc), 0)
    if not quotient_first(norm.frac):
        return _exact_factor(norm, c)
    # Where every norm is its value (exp 0) and every quotient kept or normal, the split
    # below gives the same keep and f1, and f0 = c / n rounded once: the quotient itself.
    keep = norm.frac <= c
    f0 = c / jnp.where(keep, 1, norm.frac)  # finite where kept, as the split's
    plain = (norm.exp == 0) & (keep | (f0 >= np.finfo(acc).tiny))  # False for NaN

    def quotients() -> Factor:
        return Factor(keep, f0, jnp.where(keep, 0, 1).astype(acc))

    return lax.cond(every(plain), quotients, lambda: _exact_factor(norm, c))


def _exact_factor(norm: Norm, c: Array) -> Factor:
    """:func:`clip_factor` for a clip norm ``c >= 0`` of the norm's dtype."""
    acc = norm.frac.dtype
    keep = norm.value <= c
    ce = frexp(lax.stop_gradient(c))[1]
    cf = ldexp(c, -ce)  # in [0.5, 1), differentiable in c
    k = frexp(lax.stop_gradient(norm.frac))[1]
    frac = ldexp(norm.frac, -k)  # in [0.5, 1)
    shift = ce - norm.exp - k
    info = np.finfo(acc)
    s0 = jnp.clip(shift, info.minexp + 1, info.maxexp - 2)  # (c / n) * 2**s0 is normal
    # Both factors come out of a division: XLA copies cheap scalar ops into every kernel
    # that reads their result (each leaf would redo this maths), but not a division,
    # which it computes once. The rest goes in one more normal factor; f1 == 0 marks
    # "keep". Where c / n is below what two normal factors reach (a norm beyond the
    # dtype's range, or c near its smallest normal), every output is below 4 * tiny and
    # f0 flushes it to 0. Selected before the division, which stays the factor's last op.
    rest = s0 - shift
    f0 = jnp.where(rest > -info.minexp, 0, cf * pow2(s0, acc)) / jnp.where(keep, 1, frac)
    f1 = 1 / jnp.where(keep, jnp.inf, pow2(jnp.minimum(rest, -info.minexp), acc))
    return Factor(f1 == 0, f0, f1)


def spread(v: Array, like: Array) -> Array:
    """``v`` broadcast (numpy's rules) to the shape and sharding of ``like``."""
    if v.shape == like.shape:
        return v
    if v.ndim and v.size == 1 and (v.ndim > 1 or not like.ndim):
        v = lax.reshape(v, ())  # one value (a whole leaf's): one broadcast, not three ops
    dims = tuple(range(like.ndim - v.ndim, like.ndim))
    return lax.broadcast_in_dim(v, like.shape, dims, out_sharding=jax.typeof(like).sharding)


def apply_factor(x: Array, factor: Factor) -> Array:
    """``x`` where the factor keeps it (bit for bit, subnormals included), else
    ``x * c / n`` with one rounding into ``x.dtype``."""
    acc = acc_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        f0, f1 = factor.f0.astype(acc), factor.f1.astype(acc)
        return jnp.where(factor.keep, x, (x * f0 * f1).astype(x.dtype))
    # lax, not jnp: this runs once per leaf, and jnp's wrappers cost far more tracing
    # (a thousand-leaf tree's trace is mostly such calls).
    f0, f1 = (operand(lax.convert_element_type(f, acc), x) for f in factor[1:])
    y = lax.mul(lax.mul(lax.convert_element_type(x, acc), f0), f1)
    keep = operand(jnp.asarray(factor.keep), x)
    return lax.select(keep, x, narrowed(y, x.dtype))


def operand(v: Array, like: Array) -> Array:
    """``v`` as an operand of an elementwise ``lax`` op on ``like``: one value as a scalar,
    which ``lax`` broadcasts itself (no broadcast traced per leaf), else :func:`spread`."""
    if v.size == 1:
        return v if v.ndim == 0 else lax.reshape(v, ())
    return spread(v, like)


def narrowed(y: Array, dtype: Any) -> Array:
    """``y`` (of a wider accumulation dtype) rounded into ``dtype``: to nearest, but
    toward zero where the result is subnormal in ``dtype``. There a rounding is an
    absolute error of up to half a subnormal step, which rounded up would take a
    clipped norm past ``c * (1 + k eps)`` (one float16 element clipped to 1e-7 became
    1.19e-7); toward zero it stays within one step of ``y`` and never grows the norm."""
    dtype = np.dtype(dtype)
    if dtype.itemsize >= np.dtype(y.dtype).itemsize:
        return lax.convert_element_type(y, dtype)
    info = jnp.finfo(dtype)
    step = float(info.smallest_subnormal)
    tiny = jnp.asarray(float(info.tiny), y.dtype)

    def plain(y: Array) -> Array:
        return lax.convert_element_type(y, dtype)

    def toward_zero(down: Callable[[Array], Array]) -> Callable[[Array], Array]:
        """``plain``, with ``down(y)`` where ``y`` is subnormal in ``dtype``."""
        return lambda y: plain(lax.select(lax.lt(lax.abs(y), tiny), down(y), y))

    def bits_down(y: Array) -> Array:  # bfloat16: truncating float32's bits
        bits = lax.bitcast_convert_type(y, np.int32)
        return lax.bitcast_convert_type(lax.bitwise_and(bits, np.int32(-65536)), y.dtype)

    def steps_down(y: Array) -> Array:  # a whole number of steps, exactly (powers of two)
        steps = jnp.trunc(lax.mul(y, jnp.asarray(1 / step, y.dtype)))
        return lax.mul(steps, jnp.asarray(step, y.dtype))

    if np.log2(step) < np.finfo(y.dtype).minexp:  # bfloat16: y's own subnormals
        return unless_flushed(y, toward_zero(bits_down), plain)
    return toward_zero(steps_down)(y)  # float16, float8


@jax.custom_jvp
def _clipped(
    xs: tuple[Array, ...],
    keeps: tuple[Array, ...],
    f0s: tuple[Array, ...],
    f1s: tuple[Array, ...],
    fracs: tuple[Array, ...],
    exps: tuple[Array, ...],
    cs: tuple[Array, ...],
) -> list[Array]:
    """:func:`apply_factor` of each array by the factor of its norm ``frac * 2**exp`` and
    clip norm ``c``, differentiated as one step (see :func:`apply_factors`)."""
    return [apply_factor(x, Factor(k, a, b)) for x, k, a, b in zip(xs, keeps, f0s, f1s)]


@_clipped.defjvp
def _clipped_jvp(primals: tuple, tangents: tuple) -> tuple[list[Array], list[Array]]:
    outs, ts = [], []
    for x, keep, f0, f1, frac, exp, c, dx, dfrac, dc in zip(
        *primals, tangents[0], tangents[4], tangents[6]
    ):
        outs.append(apply_factor(x, Factor(keep, f0, f1)))
        ts.append(_clipped_tangent(x, Factor(keep, f0, f1), Norm(frac, exp), c, dx, dfrac, dc))
    return outs, ts


def _clipped_tangent(
    x: Array, factor: Factor, n: Norm, c: Array, dx: Array, dfrac: Array, dc: Array
) -> Array:
    """``d(x c/n) = (c/n) (dx - (x/n) dn) + (x/n) dc``, each part well scaled (``|x/n| <=
    1``, ``dn`` unscaled): the chain rule through the factor would form ``sum(x * ct)``,
    which overflows for large ``x``, and ``dn/n``, which underflows. Where ``x`` is kept
    the factors are replaced by 1, so that no ``inf * 0`` reaches the transpose
    (``c = inf``: ``f0 = inf``, ``f1 = 0``)."""
    acc = acc_dtype(x.dtype)

    def wide(v: Array) -> Array:
        return v if jnp.iscomplexobj(v) else v.astype(acc)

    # Each per-slice value broadcast as x is placed (a single value may come as a vector
    # of one: stacking._split's raw): the clip norms may come placed as another tree
    # (AGC's params), which an Explicit mesh does not broadcast against x.
    factor = Factor(*(spread(jnp.asarray(v), x) for v in factor))
    n = Norm(spread(n.frac, x), spread(n.exp, x))
    c, dfrac, dc = (spread(jnp.asarray(v), x) for v in (c, dfrac, dc))
    keep = factor.keep
    x_n = over_norm(wide(x), n)
    f0s = jnp.where(keep, 1, factor.f0).astype(acc)
    f1s = jnp.where(keep, 1, factor.f1).astype(acc)
    dn = jnp.where(keep, 0, ldexp(dfrac, n.exp))
    dcs = jnp.where(keep | (c < 0), 0, dc)
    t = (wide(dx) - x_n * dn) * f0s * f1s + x_n * dcs
    return jnp.where(keep, dx, t.astype(x.dtype))


def as_acc(clip_norm: Any, norm: Norm) -> Array:
    """``clip_norm`` as an array of the norm's dtype; as it is when it already is one
    (callers convert once for many leaves: ``jnp.asarray`` costs tracing time)."""
    dtype = norm.frac.dtype
    if isinstance(clip_norm, jax.Array) and clip_norm.dtype == dtype and not clip_norm.weak_type:
        return clip_norm
    return jnp.asarray(clip_norm, dtype)


def apply_factors(
    xs: Sequence[Array], factors: Sequence[Factor], norms: Sequence[Norm], clip_norms: Sequence[Any]
) -> list[Array]:
    """``apply_factor(x, factor)`` of each array, for ``factor = clip_factor(norm, c)``,
    with derivatives that stay finite where ``x`` or the norm are near the dtype's largest
    value and where ``c`` is infinite. One ``custom_jvp`` for all the arrays: one per
    array costs tracing time per leaf."""
    if not xs:
        return []
    return _clipped(
        tuple(xs),
        tuple(f.keep for f in factors),
        tuple(f.f0 for f in factors),
        tuple(f.f1 for f in factors),
        tuple(n.frac for n in norms),
        tuple(n.exp for n in norms),
        tuple(as_acc(c, n) for c, n in zip(clip_norms, norms)),
    )


@jax.jit
def clip_joint(xs: Sequence[Array], norm: Norm | Array, clip_norm: Any) -> list[Array]:
    """Every array of ``xs`` (of joint norm ``norm``) scaled by one factor so that the
    norm is at most ``clip_norm``; one compiled call, so eager use costs one dispatch."""
    if not isinstance(norm, Norm):
        norm = as_norm(jnp.asarray(norm))
    factor = clip_factor(norm, clip_norm)
    c = as_acc(clip_norm, norm)
    n = len(xs)
    return apply_factors(xs, [factor] * n, [norm] * n, [c] * n)


#: ``contract(xs, factor, c, mask)``: per x of ``xs``, the sum over its leading (example)
#: axis of ``x`` clipped by its example's entry of ``factor`` (``mask`` False: weight 0).
Contract = Callable[[Sequence[Array], Factor, Array, Any], list[Array]]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def summed_clipped(
    contract: Contract,
    xs: tuple[Array, ...],
    factor: Factor,
    norm: Norm,
    c: Array,
    mask: Array | None,
) -> list[Array]:
    """``contract(xs, factor, c, mask)``, differentiated as the sum over the examples of
    :func:`apply_factors`' rule (each example's factor ``c / n_b``, norm ``n_b`` and clip
    norm ``c``). The contraction's own derivative would form ``<ct, x_b>`` for each
    example's factor: it overflows where ``x`` is large (16 elements near 1e38 gave an
    inf gradient) and flushes to 0 where ``x`` is tiny (dropping the norm's part of the
    derivative); the rule's parts are scaled by ``1 / n_b``."""
    del norm
    return contract(xs, factor, c, mask)


@summed_clipped.defjvp
def _summed_clipped_jvp(contract: Contract, primals: tuple, tangents: tuple) -> tuple:
    xs, factor, norm, c, mask = primals
    dxs, _, dnorm, dc, _ = tangents
    outs = contract(xs, factor, c, mask)
    ts = []
    for x, dx, out in zip(xs, dxs, outs):
        kept = (x.shape[0],) + (1,) * (x.ndim - 1)  # one value per example, as x is laid out
        per = Factor(*(jnp.reshape(v, kept) for v in factor))
        n = Norm(norm.frac.reshape(kept), norm.exp.reshape(kept))
        t = _clipped_tangent(x, per, n, c, dx, dnorm.frac.reshape(kept), dc).astype(out.dtype)
        if mask is not None:
            t = jnp.where(mask.reshape(kept), t, 0)
        ts.append(jnp.sum(t, axis=0))
    return outs, ts
