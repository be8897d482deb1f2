"""The one layout of units: which arrays the reductions read.

A unit is a leaf reduced as it is, or a bucket of small whole leaves of one dtype and
mapped axes: concatenated flat for a joint (global) norm, or zero-padded into the rows
of a matrix for per-leaf norms (one row norm per leaf), so that a thousand small leaves
compile to a handful of reduction kernels. Per-example leaves are units of their own,
each flattened to ``(batch, elements)``. Only leaves that live whole on one device are
bucketed: concatenating sharded leaves would make XLA all-gather them. The layout is
static: it depends on shapes, dtypes and mapped axes only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jaxclip._norms.backend import Axes, concatenate, opaque, pick
from jaxclip._norms.devices import Combine, one_device

Array = jax.Array

#: Leaves at most this many bytes may be copied into a bucket.
BUCKET_MAX_BYTES = 64 * 1024
#: A bucket holds at most this many leaves: XLA's layout assignment is superlinear in a
#: concatenation's operands.
BUCKET_MAX_LEAVES = 256

ALONE = -1  # the width of a unit that is one leaf as it is
FLAT = 0  # the width of a bucket concatenated flat


class Unit(NamedTuple):
    """A unit: its leaves (indices), its row width (:data:`ALONE`, :data:`FLAT` or the
    padded row width of a bucket of rows) and the mapped axes it is combined over."""

    members: tuple[int, ...]
    width: int
    combine: Combine


def bucketable(x: Array) -> bool:
    """Whether ``x`` is small and whole on one device, so copying it costs no traffic."""
    return x.size * x.dtype.itemsize <= BUCKET_MAX_BYTES and one_device(x)


@functools.cache
def _has_zero(dtype: Any) -> bool:
    return bool(np.asarray(0, dtype) == 0)  # NaN for float8_e8m0fnu


def plan(
    leaves: Sequence[Array],
    axes: Sequence[Axes],
    combines: Sequence[Combine],
    bucket: bool,
    rows: bool,
) -> list[Unit]:
    """The units of ``leaves``: those alone first, in order, then the buckets. With
    ``rows`` every leaf gets a unit or a row (a norm of its own); without, the units
    serve one joint norm, and empty leaves, which add nothing, are left out."""
    alone: list[Unit] = []
    groups: dict[tuple[np.dtype, int, Combine], list[int]] = {}
    for i, (x, a, c) in enumerate(zip(leaves, axes, combines)):
        if x.size == 0 and not rows:
            continue
        # Bucket rows are zero-padded: not for a dtype with no zero (float8_e8m0fnu).
        if bucket and a is None and x.size and bucketable(x) and (not rows or _has_zero(x.dtype)):
            width = 1 << (x.size - 1).bit_length() if rows else FLAT
            groups.setdefault((np.dtype(x.dtype), width, c), []).append(i)
        else:
            alone.append(Unit((i,), ALONE, c))
    step = BUCKET_MAX_LEAVES
    return alone + [
        Unit(tuple(members[at : at + step]), width, c)
        for (_, width, c), members in groups.items()
        for at in range(0, len(members), step)
    ]


def build(
    leaves: Sequence[Array], axes: Sequence[Axes], units: Sequence[Unit], lead: int = 0
) -> tuple[list[Array], list[Axes], list[bool]]:
    """The arrays of ``units``, the axes each is reduced over, and which are buckets.
    With ``lead`` (per-example norms) a leaf alone is flattened to ``(batch, elements)``
    where that is a free reshape, and reduced over its second axis: XLA:CPU reduces
    one axis faster than several."""
    arrays, unit_axes, bucketed = [], [], []
    for unit in units:
        xs = [leaves[i] for i in unit.members]
        if unit.width == ALONE:
            x = xs[0]
            if lead and one_device(x) and x.ndim != 2:
                x = x.reshape(x.shape[0], math.prod(x.shape[1:]))
            arrays.append(x)
            unit_axes.append((1,) if lead else axes[unit.members[0]])
        elif unit.width == FLAT:
            arrays.append(xs[0] if len(xs) == 1 else concatenate([x.ravel() for x in xs]))
            unit_axes.append(None)
        else:
            arrays.append(concatenate([_padded_row(x, unit.width) for x in xs]))
            unit_axes.append((1,))
        bucketed.append(unit.width != ALONE)
    return arrays, unit_axes, bucketed


def _padded_row(x: Array, width: int) -> Array:
    # lax, not jnp (ravel, pad, x[None]): several times faster to trace, a thousand
    # leaves; and jnp.pad is a jitted function, one call per leaf in the program.
    r = lax.reshape(x, (1, x.size))
    return (
        r
        if x.size == width
        else lax.pad(r, np.zeros((), x.dtype), [(0, 0, 0), (0, width - x.size, 0)])
    )


def places(n: int, units: Sequence[Unit]) -> list[tuple[int, int]]:
    """Per leaf of ``n``, ``(unit, row)``: its unit, and its row there (-1: the whole
    unit)."""
    where = [(-1, -1)] * n
    for u, unit in enumerate(units):
        for r, i in enumerate(unit.members):
            where[i] = (u, -1 if unit.width == ALONE else r)
    return where


def per_leaf(
    leaves: Sequence[Array], per_unit: Sequence[Any], where: Sequence[tuple[int, int]]
) -> list[Any]:
    """Per leaf, its unit's tuple of arrays, or the row of a bucket (at an opaque index,
    see :func:`~jaxclip._norms.backend.opaque`), shaped to broadcast."""
    bucketed = [i for i, (_, r) in enumerate(where) if r >= 0]
    like = leaves[bucketed[0]] if bucketed else None
    rows = dict(zip(bucketed, opaque([where[i][1] for i in bucketed], like)))
    out = []
    for i, (x, (u, r)) in enumerate(zip(leaves, where)):
        v = per_unit[u]
        if r >= 0:
            kept = (1,) * x.ndim  # a single-device row: lax.reshape needs no sharding
            picked = [lax.reshape(pick(f, rows[i], 1), kept) for f in v]
            v = type(v)(*picked) if hasattr(v, "_fields") else tuple(picked)
        out.append(v)
    return out
