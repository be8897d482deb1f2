"""Joint norms: one norm over many leaves together (global), or one per example.

The plain power sums of all units are added (per example, for per-example norms, whose
leaves lead with the batch axis) and combined over devices; one ``lax.cond`` takes the
rare path only when that total is out of its exact range. Per-example norms read again
only the rows of the examples out of range, one at a time, where those are few
(``backend.rows_apart_limit``): a padding (all-zero) example costs its row, not a pass
over the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxclip._norms.arith import (
    Norm,
    acc_dtype,
    always_exact,
    in_exact_range,
    in_range_norm,
    result_dtype,
    where_norm,
)
from jaxclip._norms.backend import (
    native,
    one_pass,
    rare_native,
    reduction_view,
    row,
    rows_apart,
    rows_apart_limit,
)
from jaxclip._norms.devices import (
    AxisName,
    Combine,
    Shape,
    combine,
    combine_axes,
    has_unmapped,
    leaf_axes,
)
from jaxclip._norms.passes import blue_norm, blue_sums, inf_norms, inf_result, max_abs, power_sum
from jaxclip._norms.rare import max_shift, shift_factors, shifted_norm, shifted_sum, sum_shift
from jaxclip._norms.rules import batchable, norm_tangent, tangent
from jaxclip._norms.units import Bucketed, build, plan

Array = jax.Array


class _Joint(NamedTuple):
    p: float
    bucketed: tuple[Bucketed, ...]
    combines: tuple[Combine, ...]
    acc: Any  # the result's dtype
    by_sum: bool  # a 2-norm in one accumulation dtype: the shift comes from the plain sum


def _shifted(j: _Joint, us: Sequence[Array], s: Array, ok: Any, shape: Shape) -> Norm:
    """The rare path over ``us`` (all examples, or one example's rows with ``shape``
    ``()``) whose plain sums are ``s``: one shift per example for all units."""
    axes = [tuple(range(len(shape), u.ndim)) if shape else None for u in us]
    fused = [
        rare_native(u, b, j.p, a) if j.by_sum else native(u, j.p, rare=True)
        for u, b, a in zip(us, j.bucketed, axes)
    ]
    if j.by_sum:
        m, e, mant = None, sum_shift(s, ok), None
    else:
        ms = [max_abs(u, a, acc_dtype(u.dtype), f, parts=True) for u, a, f in zip(us, axes, fused)]
        m = combine(ms, j.combines, j.acc, "max", shape)
        e, mant = max_shift(m, j.p)
    # Per accumulation dtype (clamped: parts out of its range are negligible).
    factors = {d: shift_factors(e, mant, d, j.by_sum) for d in {acc_dtype(u.dtype) for u in us}}
    ts = []
    for u, a, f in zip(us, axes, fused):
        per_example = tuple(
            v.reshape(shape + (1,) * (u.ndim - len(shape))) for v in factors[acc_dtype(u.dtype)]
        )
        ts.append(shifted_sum(u, j.p, a, f, per_example))
    t = combine(ts, j.combines, j.acc, "sum", shape)
    return shifted_norm(t, j.p, e, mant, m)


def _bucketed(j: _Joint, us: Sequence[Array], lead: int) -> tuple[_Joint, list[Array]]:
    """Per-example units (``lead`` 1) or one example's rows (``lead`` 0) with the small
    ones concatenated, per example, into buckets (``units.plan``'s rule): the rare path
    of a thousand small leaves is then a few kernels to compile, not one per leaf. The
    buckets are temporaries whether the branch runs or not (XLA allocates its buffers):
    over the batch, the small leaves' size; in the loop, one example's small rows."""
    whole = [None] * len(us)
    layout = plan(us, whole, j.combines, bucket=True, rows=False)
    out, _, _ = build(us, whole, layout, lead)
    # Each unit is read whole per example, as a leaf alone: the library reduction may
    # read it (a flat bucket marked as one took the fused reduce, 1.2-2.2x slower).
    combines = tuple(u.combine for u in layout)
    return j._replace(bucketed=(False,) * len(out), combines=combines), out


def _batch_rare(j: _Joint, units: Sequence[Array], s: Array, ok: Array, shape: Shape) -> Norm:
    """The rare path over the whole batch; examples in range keep the plain result, so
    each example's norm does not depend on the others in the batch."""
    j, units = _bucketed(j, units, len(shape))
    return where_norm(ok, in_range_norm(s, j.p), _shifted(j, units, s, ok, shape))


def _rows_rare(j: _Joint, units: Sequence[Array], s: Array, ok: Array, count: Array) -> Norm:
    """The rare path reading only the rows of the examples out of range, one at a time."""
    idx = jnp.nonzero(~ok, size=s.shape[0], fill_value=0)[0]

    def one(i: Array, n: Norm) -> Norm:
        b = idx[i]
        jr, rows = _bucketed(j, [row(u, b) for u in units], 0)
        r = _shifted(jr, rows, s[b], False, ())
        return Norm(n.frac.at[b].set(r.frac), n.exp.at[b].set(r.exp))

    return lax.fori_loop(0, count, one, in_range_norm(s, j.p))


def joint_norm_body(
    units: tuple[Array, ...],
    p: float,
    bucketed: tuple[Bucketed, ...],
    combines: tuple[Combine, ...],
    lead: int,
) -> Norm:
    """The norm over all of ``units`` but their ``lead`` leading (batch) axes."""
    acc = result_dtype(units)
    shape = units[0].shape[:lead]
    axes = [tuple(range(lead, u.ndim)) if lead else None for u in units]
    if p == math.inf:
        ms, halves = inf_norms(units, axes, [native(u, p) for u in units])
        m = combine(ms, combines, acc, "max", shape)
        half = None if halves is None else combine(halves, combines, acc, "max", shape)
        return inf_result(m, half)
    by_sum = p == 2.0 and len({acc_dtype(u.dtype) for u in units}) == 1
    # float16, float8: no plain sum leaves the exact range, whatever the data.
    exact = all(always_exact(u.dtype, p) for u in units)
    # Per-example norms keep the two paths on every backend: one pass runs no faster on
    # their rows, with several times the temporaries.
    if by_sum and one_pass() and not lead and not exact:
        parts = [blue_sums(u, a, native(u, p, rare=True)) for u, a in zip(units, axes)]
        return blue_norm(*(combine(q, combines, acc, "sum", shape) for q in zip(*parts)))
    sums = [power_sum(u, p, a, native(u, p)) for u, a in zip(units, axes)]
    s = combine(sums, combines, acc, "sum", shape)
    if exact:
        return in_range_norm(s, p)
    # The narrowest accumulation dtype decides: its underflow is what may be lost.
    narrow = min((acc_dtype(u.dtype) for u in units), key=lambda d: d.itemsize)
    ok = in_exact_range(s, narrow)
    j = _Joint(p, bucketed, combines, acc, by_sum)
    if not shape:  # inside the branch, the sum is known to be out of range
        return lax.cond(ok, lambda: in_range_norm(s, p), lambda: _shifted(j, units, s, False, ()))

    def rare_path() -> Norm:
        if not rows_apart(units, combines, shape):
            return _batch_rare(j, units, s, ok, shape)
        count = jnp.sum(~ok)  # examples out of range: the loop's limit and trip count
        return lax.cond(
            count <= rows_apart_limit(units, shape[0]),
            lambda: _rows_rare(j, units, s, ok, count),
            lambda: _batch_rare(j, units, s, ok, shape),
        )

    return lax.cond(jnp.all(ok), lambda: in_range_norm(s, p), rare_path)


def _joint_norm_impl(
    units: tuple[Array, ...],
    p: float,
    bucketed: tuple[Bucketed, ...],
    combines: tuple[Combine, ...],
    lead: int,
) -> Norm:
    if lead or has_unmapped(combines):
        return joint_norm_body(units, p, bucketed, combines, lead)
    return _batchable_joint_norm(p, bucketed, combines)(units, None)


@functools.cache
def _batchable_joint_norm(
    p: float, bucketed: tuple[Bucketed, ...], combines: tuple[Combine, ...]
) -> Callable[[tuple[Array, ...], None], Norm]:
    """The global norm with a ``vmap`` rule: every example's norm with one unbatched
    cond (the rare path only where some example needs it)."""

    def batched(size: int, units: tuple[Array, ...], _: None) -> Norm:
        return joint_norm_body(units, p, bucketed, combines, 1)

    def joint_norm(units: tuple[Array, ...], _: None) -> Norm:  # the name profiles show
        return joint_norm_body(units, p, bucketed, combines, 0)

    return batchable(joint_norm, batched)


joint_norm = jax.custom_jvp(_joint_norm_impl, nondiff_argnums=(1, 2, 3, 4))


@joint_norm.defjvp
def _joint_norm_jvp(
    p: float, bucketed: tuple, combines: tuple, lead: int, primals: tuple, tangents: tuple
) -> tuple[Norm, Norm]:
    (units,), (dunits,) = primals, tangents
    norm = joint_norm(units, p, bucketed, combines, lead)
    shape = norm.frac.shape
    parts = []
    for u, du in zip(units, dunits):
        kept = shape + (1,) * (u.ndim - lead)
        n = Norm(norm.frac.reshape(kept), norm.exp.reshape(kept))
        parts.append(tangent(u, du, n, p, tuple(range(lead, u.ndim)) if lead else None))
    dn = combine(parts, combines, norm.frac.dtype, "sum", shape)
    return norm, norm_tangent(norm, dn)


@functools.partial(jax.jit, static_argnames=("p", "axis_name", "bucket", "paths"))
def global_norm_parts(
    leaves: Sequence[Array],
    p: float,
    *,
    axis_name: AxisName = None,
    bucket: bool = True,
    paths: tuple[str, ...] | None = None,
) -> Norm:
    """The p-norm of all ``leaves`` together, as if concatenated into one vector.

    Args:
      leaves: floating or complex arrays (already selected by ``need_clip``).
      p: the norm type (> 0, or inf).
      axis_name: mapped axis name(s) over which partial norms are combined (see
        :func:`~jaxclip._norms.devices.combine_axes`; by default, inside ``shard_map``,
        the axes each leaf varies across): partial sums are ``psum``-ed, maxima
        ``pmax``-ed.
      bucket: concatenate small single-device leaves before reducing.
      paths: the leaves' paths, for error messages.

    Returns:
      A scalar :class:`Norm` in the widest accumulation dtype of the leaves.
    """
    names = paths or ("",) * len(leaves)
    combines = [
        combine_axes(x, leaf_axes(axis_name, i), None, names[i]) for i, x in enumerate(leaves)
    ]
    leaves = reduction_view([jnp.asarray(x) for x in leaves])
    layout = plan(leaves, [None] * len(leaves), combines, bucket, rows=False)
    if not layout:
        zero = jnp.zeros((), result_dtype(leaves))
        return Norm(zero, zero)
    units, _, bucketed = build(leaves, [None] * len(leaves), layout)
    return joint_norm(tuple(units), p, tuple(bucketed), tuple(u.combine for u in layout), 0)


def global_norm(
    leaves: Sequence[Array],
    p: float,
    *,
    axis_name: AxisName = None,
    bucket: bool = True,
    paths: tuple[str, ...] | None = None,
) -> Array:
    """:func:`global_norm_parts` as a number (inf where it exceeds the dtype's range)."""
    return global_norm_parts(leaves, p, axis_name=axis_name, bucket=bucket, paths=paths).value


@functools.partial(jax.jit, static_argnames=("p", "axis_name", "paths"))
def per_example_norm_parts(
    leaves: Sequence[Array],
    p: float,
    *,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> Norm:
    """Per example ``b``, the p-norm of all ``leaves[i][b]`` together (axis 0 is the batch).

    Args:
      leaves: floating or complex arrays, each of shape ``(batch, ...)``, one batch size.
      p: the norm type (> 0, or inf).
      axis_name: inside ``shard_map``, the mesh axes that split the leaves' non-batch
        dimensions (``()`` when only the batch is split): see
        :func:`~jaxclip._norms.devices.combine_axes`, the batch axis being the kept one.
      paths: the leaves' paths, for error messages.

    Returns:
      A :class:`Norm` of shape ``(batch,)`` in the widest accumulation dtype of the leaves.
    """
    leaves = [jnp.asarray(x) for x in leaves]
    names = paths or ("",) * len(leaves)
    combines = [
        combine_axes(x, leaf_axes(axis_name, i), range(1, x.ndim), n, batch=True)
        for i, (x, n) in enumerate(zip(leaves, names))
    ]
    layout = plan(leaves, [None] * len(leaves), combines, bucket=False, rows=True)
    units, _, bucketed = build(leaves, [None] * len(leaves), layout, lead=1)
    return joint_norm(
        tuple(reduction_view(units)), p, tuple(bucketed), tuple(u.combine for u in layout), 1
    )
