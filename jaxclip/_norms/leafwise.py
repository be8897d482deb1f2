"""Norms and clipping per leaf, or per slice of a leaf: ``clip_by_norm``, AGC.

Each leaf's norms come from its unit (a leaf alone, or its row of a bucket), and the
clipping factors of all units are one set of kernels (``stacking.stacked``); each leaf
reads its values back at an opaque offset, so alike leaves share one scaling kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxclip._norms.arith import Norm, narrow_norm
from jaxclip._norms.backend import Axes, reduction_view
from jaxclip._norms.clip import Factor, apply_factors, as_acc, clip_factor
from jaxclip._norms.devices import (
    AxisName,
    Combine,
    combine_axes,
    kept_axes,
    leaf_axes,
    one_device,
    pmax,
)
from jaxclip._norms.slices import unit_norms
from jaxclip._norms.stacking import stacked
from jaxclip._norms.units import Place, Unit, build, per_leaf, places, plan

Array = jax.Array


def _combines(
    leaves: Sequence[Array], axes: tuple[Axes, ...], axis_name: AxisName, paths: Any
) -> list[Combine]:
    names = paths or ("",) * len(leaves)
    return [
        combine_axes(x, leaf_axes(axis_name, i), a, path)
        for i, (x, a, path) in enumerate(zip(leaves, axes, names))
    ]


def _layout(
    leaves: Sequence[Array],
    axes: tuple[Axes, ...],
    bucket: bool,
    axis_name: AxisName,
    paths: Any,
    partner: Sequence[Array] | None = None,
) -> tuple[Unit, ...]:
    """The units of ``leaves``; with a ``partner`` tree, those both trees share (see
    :func:`~jaxclip._norms.units.plan`)."""
    combines = _combines(leaves, axes, axis_name, paths)
    pair = None if partner is None else (partner, _combines(partner, axes, axis_name, paths))
    return tuple(plan(leaves, axes, combines, bucket, rows=True, partner=pair))


@functools.partial(jax.jit, static_argnames=("p", "axes", "layout", "static_split", "report"))
def _layout_norms(
    leaves: Sequence[Array],
    floor: Array | None,
    p: float,
    axes: tuple[Axes, ...],
    layout: tuple[Unit, ...],
    static_split: bool,
    report: str,
) -> Any:
    """The norms of the units of ``leaves``: jitted, so that two alike trees (AGC's
    gradients and params) trace it once."""
    if not layout:
        return [] if floor is None else ([], [])
    units, unit_axes, bucketed = build(reduction_view(leaves), axes, layout)
    combines = tuple(u.combine for u in layout)
    args = (p, tuple(unit_axes), tuple(bucketed), combines, static_split, report)
    return unit_norms(tuple(units), floor, *args)


def _unit_norms(
    leaves: Sequence[Array],
    p: float,
    axes: tuple[Axes, ...],
    bucket: bool,
    axis_name: AxisName,
    paths: tuple[str, ...] | None,
    static_split: bool = False,
    floor: Array | None = None,
    report: str = "exact",
    partner: Sequence[Array] | None = None,
) -> tuple[Any, list[Place]]:
    """The norms of the units, and per leaf its ``units.Place``. With a
    ``floor``, two lists of norms (see ``slices.unit_norms_body``); with a ``partner``,
    in the units both trees share."""
    layout = _layout(leaves, axes, bucket, axis_name, paths, partner)
    norms = _layout_norms(leaves, floor, p, axes, layout, static_split, report)
    return norms, places(leaves, axes, layout)


@functools.partial(jax.jit, static_argnames=("p", "axes", "bucket", "axis_name", "paths"))
def slice_norms(
    leaves: Sequence[Array],
    p: float,
    axes: tuple[Axes, ...],
    *,
    bucket: bool = True,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> list[Norm]:
    """Norms of each leaf over its ``axes`` (all axes when None), with ``keepdims``.

    Args:
      leaves: floating or complex arrays.
      p: the norm type (> 0, or inf).
      axes: per leaf, the axes to reduce (normalised, non-negative), or None for all.
      bucket: bucket small single-device leaves whose ``axes`` is None.
      axis_name: mapped axes over which partial norms are combined (see
        :func:`~jaxclip._norms.devices.combine_axes`).
      paths: the leaves' paths, for error messages.

    Returns:
      Per leaf, a :class:`Norm` broadcastable against it, in its accumulation dtype.
    """
    norms, where = _unit_norms(leaves, p, axes, bucket, axis_name, paths)
    return per_leaf(leaves, norms, where)


@functools.partial(jax.jit, static_argnames=("p", "axes", "bucket", "axis_name", "paths", "report"))
def clip_slices(
    leaves: Sequence[Array],
    p: float,
    axes: tuple[Axes, ...],
    clip_norm: Any,
    *,
    bucket: bool = True,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
    report: str = "exact",
) -> tuple[list[Array], list[Array]]:
    """Each leaf (each slice over its ``axes``) scaled to norm at most ``clip_norm``.

    The factors need no exact norm of slices too small to reach ``clip_norm`` (all-zero
    rows): the norms returned do (``report="exact"``: the units holding such slices are
    read again, in the one rare pass), or only as far as each leaf's largest
    (``"largest"``: read again only where that largest may be small).

    Returns:
      ``(clipped, norms)``: the scaled leaves, and per leaf its norms with the ``axes``
      dimensions removed (a scalar for a whole leaf); with ``report="largest"``, per leaf
      its largest norm (NaN if one is), the same on every device.
    """
    # The unit norms are split at constant offsets and stacked again right here, which
    # XLA folds away.
    floor = jnp.min(jnp.asarray(clip_norm))
    (norms, reported), where = _unit_norms(
        leaves, p, axes, bucket, axis_name, paths, True, floor, report
    )

    def factors(frac: Array, exp: Array, rfrac: Array, rexp: Array) -> tuple[Array, ...]:
        # The reported value last: the opaque offsets are read off the first output,
        # which would keep the reported norms' pass alive when they are unused.
        return (*clip_factor(Norm(frac, exp), clip_norm), frac, exp, Norm(rfrac, rexp).value)

    fracs, exps = [n.frac for n in norms], [n.exp for n in norms]
    rfracs, rexps = [n.frac for n in reported], [n.exp for n in reported]
    # The transform's state: each leaf's largest reported norm, one segment maximum per
    # group of stacked vectors (its output 5) instead of a reduction per leaf.
    top = 5 if report == "largest" else None
    per = stacked(factors, fracs, exps, rfracs, rexps, where=where, raw=True, top=top)
    tops = [t for _, t in per] if top is not None else []
    per = [r for r, _ in per] if top is not None else per
    leaf_norms = [Norm(*f[3:5]) for f in per]  # read only by the derivative rule
    cs = {n.frac.dtype: as_acc(clip_norm, n) for n in norms}
    out = apply_factors(
        leaves, [Factor(*f[:3]) for f in per], leaf_norms, [cs[n.frac.dtype] for n in leaf_norms]
    )
    if top is not None:
        return out, _replicated(leaves, tops, axes, axis_name, paths)
    values = []
    for x, a, (*_, value) in zip(leaves, axes, per):
        kept = () if a is None else tuple(d for i, d in enumerate(x.shape) if i not in a)
        if value.shape != kept:  # a single value: lax.reshape; else the slices' norms
            # A stacked whole-leaf norm comes back as (1,), not with the leaf's rank: no
            # axes of it to squeeze (axes that name every dimension, on an Auto mesh).
            one = value.size == 1 and (one_device(value) or value.ndim != x.ndim)
            value = lax.reshape(value, kept) if one else jnp.squeeze(value, axis=a)
        values.append(value)
    return out, values


@functools.partial(jax.jit, static_argnames=("axes", "axis_name", "paths"))
def clip_slices_relative(
    leaves: Sequence[Array],
    refs: Sequence[Array],
    axes: tuple[Axes, ...],
    clipping: Any,
    eps: Any,
    *,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> list[Array]:
    """Each slice of ``leaves`` scaled to 2-norm at most ``clipping * max(n, eps)``, ``n``
    the 2-norm of the same slice of ``refs`` (AGC: the gradients against the params).

    As :func:`clip_slices`, the limits and factors of all units are one set of kernels:
    both trees are laid out in the units they share, whatever their dtypes (bfloat16
    gradients of float32 params bucket alike).
    """
    # Floors: a limit is at least clipping * eps, and a reference norm below eps counts
    # as eps, so all-zero rows of either need no second pass.
    eps_floor = jnp.min(jnp.asarray(eps))
    floor = jnp.min(clipping * eps_floor)
    args = (True, axis_name, paths, True)
    (norms, _), where = _unit_norms(leaves, 2.0, axes, *args, floor, "none", refs)
    (rnorms, _), _ = _unit_norms(refs, 2.0, axes, *args, eps_floor, "none", leaves)

    def factors(frac: Array, exp: Array, rfrac: Array, rexp: Array) -> tuple[Array, ...]:
        norm, limit = relative_limit(Norm(frac, exp), Norm(rfrac, rexp), clipping, eps)
        return (*clip_factor(norm, limit), norm.frac, norm.exp, limit)

    rnorms = [narrow_norm(r, n.frac.dtype) for r, n in zip(rnorms, norms)]
    per = stacked(
        factors,
        [n.frac for n in norms],
        [n.exp for n in norms],
        [r.frac for r in rnorms],
        [r.exp for r in rnorms],
        where=where,
        raw=True,
    )
    return _apply_stacked(leaves, per)


@functools.partial(jax.jit, static_argnames=("dtype", "axis_name", "paths"))
def clip_leaves(
    leaves: Sequence[Array],
    limits: Array,
    dtype: Any,
    *,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> tuple[list[Array], Array]:
    """Each whole leaf scaled to 2-norm at most its own limit, ``limits[i]``.

    As :func:`clip_slices` with a limit per leaf: the limits are laid out as the units'
    norms (a gather per unit), so the factors of all units are one set of kernels.

    Returns:
      ``(clipped, norms)``: the scaled leaves, and their exact norms as one vector of
      ``dtype``.
    """
    if not leaves:
        return [], jnp.zeros((0,), dtype)
    whole = (None,) * len(leaves)
    floor = jnp.min(limits)
    (norms, reported), where = _unit_norms(
        leaves, 2.0, whole, True, axis_name, paths, True, floor, "exact"
    )
    rows: list[list[tuple[int, int]]] = [[] for _ in norms]
    for i, w in enumerate(where):
        rows[w.unit].append((w.row, i))
    lims = [
        limits[np.array([i for _, i in sorted(r)])].reshape(n.frac.shape).astype(n.frac.dtype)
        for r, n in zip(rows, norms)
    ]

    def factors(*v: Array) -> tuple[Array, ...]:
        frac, exp, rfrac, rexp, lim = v
        return (*clip_factor(Norm(frac, exp), lim), frac, exp, lim, Norm(rfrac, rexp).value)

    per = stacked(
        factors,
        [n.frac for n in norms],
        [n.exp for n in norms],
        [n.frac for n in reported],
        [n.exp for n in reported],
        lims,
        where=where,
        raw=True,
    )
    out = _apply_stacked(leaves, per)
    return out, jnp.concatenate([jnp.ravel(f[6]).astype(dtype) for f in per])


def relative_limit(norm: Norm, ref: Norm, clipping: Any, eps: Any) -> tuple[Norm, Array]:
    """``(norm', limit)`` with ``limit / norm' = clipping * max(ref, eps) / norm``: where
    ``ref`` is held with an exponent (beyond the dtype's range), both drop it, so that
    the limit is a finite number and the factor stays exact (``clipping * ref.value``
    would be inf, and the unit left unclipped). NaN in ``ref`` gives a NaN limit."""
    big = ~(ref.value <= eps)  # NaN too
    shift = jnp.where(big, ref.exp, 0)
    limit = clipping * jnp.where(big, ref.frac, eps)
    return Norm(norm.frac, norm.exp - shift), limit


def _apply_stacked(leaves: Sequence[Array], per: Sequence[Any]) -> list[Array]:
    """Each leaf scaled by its part of a stacked factors' result ``(keep, f0, f1, frac,
    exp, limit, ...)``: the factor, the norm and the limit of the derivative rule."""
    return apply_factors(
        leaves, [Factor(*f[:3]) for f in per], [Norm(*f[3:5]) for f in per], [f[5] for f in per]
    )


def _replicated(
    leaves: Sequence[Array],
    tops: Sequence[Array],
    axes: tuple[Axes, ...],
    axis_name: AxisName,
    paths: tuple[str, ...] | None,
) -> list[Array]:
    """Each leaf's largest slice norm, the same on every device: a ``pmax`` over the
    mapped axes that split the leaf's kept dimensions."""
    out = []
    for i, (x, top, a) in enumerate(zip(leaves, tops, axes)):
        spec, path = leaf_axes(axis_name, i), paths[i] if paths else ""
        kept = kept_axes(x, spec, a, combine_axes(x, spec, a, path))
        out.append(pmax(top, kept))
    return out
