"""The one layout of units: which arrays the reductions read.

A unit is a leaf reduced as it is, or a bucket of small whole leaves of one dtype and
mapped axes: concatenated flat for a joint (global) norm, or zero-padded into the rows
of a matrix for per-leaf norms (one row norm per leaf), so that a thousand small leaves
compile to a handful of reduction kernels. Small leaves reduced over their trailing or
leading axes bucket too, by the length of their slices: each leaf's slices become rows
of one matrix (a leading-axes leaf transposed), one row norm per slice. Per-example
leaves are units of their own, each flattened to ``(batch, elements)``, on the path every
step runs; their rare paths bucket them per example (flat buckets with ``lead``). Only leaves
that live whole on one device are bucketed: concatenating sharded leaves would make XLA
all-gather them. The layout is static: it depends on shapes, dtypes and mapped axes.
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
from jaxclip._norms.devices import Combine, one_device, varying

Array = jax.Array

#: Leaves at most this many bytes may be copied into a bucket.
BUCKET_MAX_BYTES = 64 * 1024
#: Leaves reduced per slice, at most this many bytes: above it, on XLA:CPU, the copy into
#: the bucket (transposed for leading axes) costs more run time than a leaf's own kernel.
SLICE_BUCKET_MAX_BYTES = 16 * 1024
#: A bucket holds at most this many leaves: XLA's layout assignment is superlinear in a
#: concatenation's operands.
BUCKET_MAX_LEAVES = 256

ALONE = -1  # the width of a unit that is one leaf as it is
FLAT = 0  # the width of a bucket concatenated flat
SLICES = -2  # the width of a bucket whose rows are its leaves' slices

#: Per unit, what its rows are: ``False`` (a leaf alone), ``True`` (a bucket, a leaf per
#: row) or, for a bucket of slices, the number of rows of each of its leaves.
Bucketed = bool | tuple[int, ...]


class Unit(NamedTuple):
    """A unit: its leaves (indices), its row width (:data:`ALONE`, :data:`FLAT`,
    :data:`SLICES` or the padded row width of a bucket of whole leaves) and the mapped
    axes it is combined over."""

    members: tuple[int, ...]
    width: int
    combine: Combine


def bucketable(x: Array, limit: int | None = None) -> bool:
    """Whether ``x`` is small (at most ``limit`` bytes, :data:`BUCKET_MAX_BYTES` by
    default) and whole on one device, so copying it costs little traffic."""
    top = BUCKET_MAX_BYTES if limit is None else limit
    return x.size * x.dtype.itemsize <= top and one_device(x)


@functools.cache
def _has_zero(dtype: Any) -> bool:
    return bool(np.asarray(0, dtype) == 0)  # NaN for float8_e8m0fnu


#: A second tree laid out with the first (AGC's params beside the gradients): its leaves
#: (of the first's shapes) and their combines.
Partner = tuple[Sequence[Array], Sequence[Combine]]


def plan(
    leaves: Sequence[Array],
    axes: Sequence[Axes],
    combines: Sequence[Combine],
    bucket: bool,
    rows: bool,
    partner: Partner | None = None,
) -> list[Unit]:
    """The units of ``leaves``: those alone first, in order, then the buckets. With
    ``rows`` every leaf gets a unit or a row (a norm of its own); without, the units
    serve one joint norm, and empty leaves, which add nothing, are left out.

    With a ``partner``, a leaf is bucketed only where its partner may be too, and only
    with leaves whose partners share a bucket as well: planned from either side, the two
    trees get the same members, rows and places (each unit with its own combine), so
    that their norms line up unit by unit whatever their dtypes."""
    alone: list[Unit] = []
    groups: dict[tuple[Any, ...], list[int]] = {}
    pairs = [(x, c) for x, c in zip(leaves, combines)]
    sides = [pairs] if partner is None else [pairs, list(zip(*partner))]
    for i, (x, a, c) in enumerate(zip(leaves, axes, combines)):
        if x.size == 0 and not rows:
            continue
        whole = a is None or len(a) == x.ndim
        # In side order: a bfloat16 gradient of a float32 param must not share a bucket
        # with a float32 gradient of a bfloat16 param (one concatenation would hold two
        # dtypes). Each side's key is the other's reversed: the same groups.
        own = tuple((np.dtype(y.dtype), cy) for y, cy in (side[i] for side in sides))
        ys = [side[i][0] for side in sides]
        if bucket and whole and x.size and all(_whole_bucketable(y, rows) for y in ys):
            width = 1 << (x.size - 1).bit_length() if rows else FLAT
            groups.setdefault((width, *own), []).append(i)
        elif (
            bucket and rows and a and not whole and _outer(x, a)
            and x.size and all(bucketable(y, SLICE_BUCKET_MAX_BYTES) for y in ys)
        ):  # fmt: skip
            # Slices of one length, whatever the leaves' shapes: one row each.
            length = math.prod(x.shape[d] for d in a)
            spread = tuple(varying(y) for y in ys)
            groups.setdefault((SLICES, length, *own, *spread), []).append(i)
        else:
            alone.append(Unit((i,), ALONE, c))
    buckets = []
    for (width, *_), members in groups.items():
        c = combines[members[0]]
        for at in range(0, len(members), BUCKET_MAX_LEAVES):
            part = tuple(members[at : at + BUCKET_MAX_LEAVES])
            if width == SLICES and len(part) == 1:  # a leaf's slices alone need no copy
                alone.append(Unit(part, ALONE, c))
            else:
                buckets.append(Unit(part, width, c))
    return alone + buckets


def _whole_bucketable(x: Array, rows: bool) -> bool:
    """Whether ``x`` may be a bucket's row or part (rows are zero-padded: not for a dtype
    with no zero, float8_e8m0fnu)."""
    return bucketable(x) and (not rows or _has_zero(x.dtype))


def _outer(x: Array, a: tuple[int, ...]) -> bool:
    """Whether ``a`` (sorted) are the trailing or the leading axes of ``x``."""
    return a in (tuple(range(len(a))), tuple(range(x.ndim - len(a), x.ndim)))


def _slices(x: Array, a: tuple[int, ...]) -> Array:
    """``x``'s slices over ``a`` (its trailing or leading axes) as the rows of a matrix,
    in the order of its kept axes."""
    kept = math.prod(x.shape[d] for d in range(x.ndim) if d not in a)
    if a[0] == 0:  # leading: a transposed copy, which the bucket's copy holds anyway
        return lax.reshape(x, (x.size // kept, kept)).T
    return lax.reshape(x, (kept, x.size // kept))


def build(
    leaves: Sequence[Array], axes: Sequence[Axes], units: Sequence[Unit], lead: int = 0
) -> tuple[list[Array], list[Axes], list[Bucketed]]:
    """The arrays of ``units``, the axes each is reduced over, and which are buckets
    (:data:`Bucketed`).
    With ``lead`` (per-example norms) a leaf alone is flattened to ``(batch, elements)``
    where that is a free reshape, and reduced over its second axis: XLA:CPU reduces
    one axis faster than several; a flat bucket of several leaves is ``(batch, elements)``
    too."""
    arrays: list[Array] = []
    unit_axes: list[Axes] = []
    bucketed: list[Bucketed] = []
    for unit in units:
        xs = [leaves[i] for i in unit.members]
        kind: Bucketed = unit.width != ALONE
        if unit.width == ALONE:
            x = xs[0]
            if lead and one_device(x) and x.ndim != 2:
                x = x.reshape(x.shape[0], math.prod(x.shape[1:]))
            arrays.append(x)
            unit_axes.append((1,) if lead else axes[unit.members[0]])
        elif unit.width == FLAT and len(xs) == 1:  # one leaf: as it is
            arrays.append(xs[0])
            unit_axes.append(None)
        elif unit.width == FLAT:  # with ``lead``, each example's parts side by side
            flat = [lax.reshape(x, (*x.shape[:lead], math.prod(x.shape[lead:]))) for x in xs]
            arrays.append(concatenate(flat, lead))
            unit_axes.append(None)
        elif unit.width == SLICES:
            parts = [_slices(leaves[i], axes[i] or ()) for i in unit.members]
            arrays.append(concatenate(parts))
            unit_axes.append((1,))
            kind = tuple(part.shape[0] for part in parts)
        else:
            arrays.append(concatenate([_padded_row(x, unit.width) for x in xs]))
            unit_axes.append((1,))
        bucketed.append(kind)
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


class Place(NamedTuple):
    """Where a leaf's norms are: its unit, and where that is a bucket, the first of its
    ``rows`` rows there (``row`` -1: the whole unit), with ``shape`` the leaf's norms'
    shape (keepdims)."""

    unit: int
    row: int
    rows: int
    shape: tuple[int, ...]


def places(leaves: Sequence[Array], axes: Sequence[Axes], units: Sequence[Unit]) -> list[Place]:
    """Per leaf, its :class:`Place`."""
    where: list[Place] = [Place(-1, -1, 0, ())] * len(leaves)
    for u, unit in enumerate(units):
        row = 0
        for i in unit.members:
            x, a = leaves[i], axes[i]
            shape = tuple(1 if a is None or d in a else n for d, n in enumerate(x.shape))
            count = math.prod(shape) if unit.width == SLICES else 1
            where[i] = Place(u, -1 if unit.width == ALONE else row, count, shape)
            row += count
    return where


def per_leaf(leaves: Sequence[Array], per_unit: Sequence[Any], where: Sequence[Place]) -> list[Any]:
    """Per leaf, its unit's tuple of arrays, or its rows of a bucket (at an opaque index,
    see :func:`~jaxclip._norms.backend.opaque`), shaped to broadcast."""
    bucketed = [i for i, w in enumerate(where) if w.row >= 0]
    like = leaves[bucketed[0]] if bucketed else None
    starts = dict(zip(bucketed, opaque([where[i].row for i in bucketed], like)))
    out = []
    for i, w in enumerate(where):
        v = per_unit[w.unit]
        if w.row >= 0:  # single-device rows: lax.reshape needs no sharding
            picked = [
                lax.reshape(pick(lax.reshape(f, (f.size,)), starts[i], w.rows), w.shape) for f in v
            ]
            v = type(v)(*picked) if hasattr(v, "_fields") else tuple(picked)
        out.append(v)
    return out
