"""Scalar maths once for many leaves: per-slice vectors stacked, computed, split back.

The scalar maths of norms (roots, exponents, clipping factors) runs once over the
concatenation of every unit's per-slice vector, not once per leaf, which keeps the
number of kernels, and compile time, flat in the number of leaves.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxclip._norms.backend import (
    from_magnitude_bits,
    magnitude_bits,
    max_keeping_nan,
    opaque,
    pick,
)
from jaxclip._norms.devices import Shape, one_device, varying

if TYPE_CHECKING:
    from jaxclip._norms.units import Place

Array = jax.Array
Groups = list[list[int]]

#: :func:`largest` reduces a part of more elements than this alone: XLA:CPU's segment
#: maximum (a scatter) costs about 3 ns per element, a reduction of its own about 5 us.
SEGMENT_MAX_SIZE = 1024
#: :func:`groups_of` stacks no vector of more elements than this: such a vector (the
#: per-slice norms of short slices: a third of a conv kernel) would be copied into the
#: stacked one and out of it, beyond the cache (a (512, 512, 3, 3) kernel's norms over
#: its last axis took the step to 2.6x the naive formula's time). Alone, a vector costs
#: its own kernels' compile.
STACK_MAX_SIZE = 1 << 16


def all_of(flags: Sequence[Array]) -> Array:
    """The logical and of boolean arrays of one shape."""
    return functools.reduce(jnp.logical_and, flags)


def any_of(flags: Sequence[Array]) -> Array:
    """The logical or of boolean arrays of one shape."""
    return functools.reduce(jnp.logical_or, flags)


def every(ok: Array) -> Array:
    """Whether all of ``ok`` holds, as a scalar."""
    return ok.reshape(()) if ok.size == 1 else ~some(~ok)


def some(flags: Array) -> Array:
    """Whether any of ``flags`` holds, as a scalar: a float maximum, which XLA:CPU
    compiles to one kernel where a boolean reduction is a chain of several."""
    if flags.size == 1:
        return flags.reshape(())
    return jnp.max(flags.astype(jnp.float32), initial=0) > 0  # False for no flags


def groups_of(first: Sequence[Array]) -> Groups:
    """Which arrays :func:`stacked` concatenates together: per dtype and per set of
    varying mesh axes (inside ``shard_map``, a concatenation varies across all of its
    parts'), and only where they are whole on each device (concatenating a sharded
    vector would make XLA all-gather it) and of at most :data:`STACK_MAX_SIZE`
    elements."""
    groups: dict[tuple[np.dtype, frozenset[str], int], list[int]] = {}
    for i, v in enumerate(first):
        kind = (np.dtype(v.dtype), varying(v))
        alone = v.size > 1 and (not one_device(v) or v.size > STACK_MAX_SIZE)
        groups.setdefault((*kind, i if alone else -1), []).append(i)
    return list(groups.values())


def stack(groups: Groups, *lists: Sequence[Array]) -> list[list[Array]]:
    """Per group, each list's arrays raveled and concatenated; an array alone in its
    group as it is where the first list's is sharded (on an Explicit mesh, raveling one
    split over several axes is an error; the maths on it is elementwise). One decision
    per group for every list: the others' arrays may be placed otherwise (AGC's params
    replicated beside sharded gradients), and a raveled vector beside a shaped one
    would broadcast into a matrix."""
    out = []
    for members in groups:
        if len(members) > 1:
            parts = [[_placed(a[i], PartitionSpec()) for i in members] for a in lists]
            out.append([jnp.concatenate([jnp.ravel(v) for v in vs]) for vs in parts])
        else:
            first = lists[0][members[0]]
            flat = one_device(first)
            spec = PartitionSpec() if flat else getattr(jax.typeof(first).sharding, "spec", None)
            vs = [_placed(a[members[0]], spec) for a in lists]
            out.append([jnp.ravel(v) if flat else v for v in vs])
    return out


def _placed(v: Array, spec: PartitionSpec | None) -> Array:
    """``v`` resharded to ``spec`` where an Explicit mesh types it otherwise: a group's
    maths is elementwise (or a concatenation) over operands of one placement."""
    sharding = jax.typeof(v).sharding
    kinds = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if spec is None or AxisType.Explicit not in kinds or getattr(sharding, "spec", None) == spec:
        return v
    return jax.sharding.reshard(v, NamedSharding(sharding.mesh, spec))


Piece = tuple[int, int, int, Shape, bool]  # group, offset, size, shape, whether sliced


def pieces(groups: Groups, shapes: Sequence[Shape], where: Sequence[Place] | None) -> list[Piece]:
    """Per array (per leaf with ``where``), where its part of its group's vectors is."""
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    at: dict[int, int] = {}  # each array's offset in its group's vectors
    for members in groups:
        sizes = [math.prod(shapes[i]) for i in members]
        at.update(zip(members, itertools.accumulate(sizes, initial=0)))
    out: list[Piece] = []
    for u, r, count, shape in where or [(i, -1, 0, ()) for i in range(len(shapes))]:
        g = group_of[u]
        if r < 0:
            out.append((g, at[u], math.prod(shapes[u]), shapes[u], len(groups[g]) > 1))
        else:
            out.append((g, at[u] + r, count, shape, True))
    return out


def unstack(
    results: Sequence[Any], groups: Groups, shapes: Sequence[Shape], static: bool
) -> list[Any]:
    """Per array, its part of its group's result (a pytree of stacked vectors), sliced at
    offsets XLA cannot see as constants (:func:`~jaxclip._norms.backend.opaque`;
    constants with ``static``)."""
    return _split(results, pieces(groups, shapes, None), static, False)


def _split(results: Sequence[Any], parts: Sequence[Piece], static: bool, raw: bool) -> list[Any]:
    """Per piece (:func:`pieces`), its part of its group's result, as :func:`unstack`; a
    leaf's rows of a bucket at one opaque offset too. With ``raw``, a single value sliced
    out stays a vector of one element (a consumer that broadcasts it needs no reshape)."""
    flat = [jax.tree.flatten(r) for r in results]
    sliced = [i for i, piece in enumerate(parts) if piece[4]]
    like = flat[parts[sliced[0]][0]][0][0] if sliced and not static else None
    offsets = dict(zip(sliced, opaque([parts[i][1] for i in sliced], like)))
    out = []
    for i, (g, _, size, shape, _) in enumerate(parts):
        vs, tree = flat[g]
        if i in offsets:  # a slice of a single-device vector: lax.reshape traces faster
            vs = [pick(v, offsets[i], size) for v in vs]
            if not (raw and size == 1):
                vs = [v if v.shape == shape else lax.reshape(v, shape) for v in vs]
        else:
            vs = [v if v.shape == shape else v.reshape(shape) for v in vs]
        out.append(tree.unflatten(vs))
    return out


def largest(
    vectors: Sequence[Array], parts: Sequence[Piece], picked: Sequence[Array]
) -> list[Array]:
    """Per piece, the maximum of its part of its group's vector (non-negative values;
    NaN where the part holds one, 0 where it is empty), given each piece's part as
    ``picked``: a piece of one value is its maximum, a large one (or a whole vector) is
    reduced alone, and the other pieces of a group take one segment maximum, not a
    reduction each (a kernel per distinct size). Over
    :func:`~jaxclip._norms.backend.magnitude_bits`, as ``max_keeping_nan``."""
    tops: dict[int, Array] = {}
    many: dict[int, list[int]] = {}
    for i, (g, _, size, _, _) in enumerate(parts):
        if size == 1:  # no derivative, as the maxima below (taken over bits)
            tops[i] = lax.stop_gradient(lax.reshape(picked[i], ()))
        elif size == vectors[g].size or size > SEGMENT_MAX_SIZE:
            tops[i] = max_keeping_nan(picked[i])
        else:
            many.setdefault(g, []).append(i)
    for g, members in many.items():
        members = sorted(members, key=lambda i: parts[i][1])
        # Only the elements of these pieces are read (not a large piece's between them),
        # as runs of adjacent pieces laid end to end.
        runs: list[list[int]] = []
        for i in members:
            at, size = parts[i][1], parts[i][2]
            if runs and runs[-1][1] == at:
                runs[-1][1] = at + size
            else:
                runs.append([at, at + size])
        v = magnitude_bits(vectors[g])
        if runs != [[0, v.size]]:
            v = jnp.concatenate([lax.slice(v, (a,), (b,)) for a, b in runs])
        ids = np.repeat(np.arange(len(members), dtype=np.int32), [parts[i][2] for i in members])
        seg = jax.ops.segment_max(v, ids, len(members), indices_are_sorted=True)
        seg = from_magnitude_bits(seg, vectors[g].dtype)
        # One slice per leaf, at offsets XLA cannot fold: alike kernels compile once.
        for i, at in zip(members, opaque(list(range(len(members))), seg)):
            tops[i] = lax.reshape(pick(seg, at, 1), ())
    return [tops[i] for i in range(len(parts))]


def stacked(
    fn: Callable[..., Any],
    *lists: Sequence[Array],
    where: Sequence[Place] | None = None,
    raw: bool = False,
    top: int | None = None,
) -> list[Any]:
    """``fn`` applied once to the concatenation of each list's arrays (raveled), the
    results split back to each array's shape (or, with ``where``, per leaf its
    :class:`~jaxclip._norms.units.Place`: its rows of a bucket; see :func:`_split`).
    With ``top``, also per array (leaf) the maximum of its part of ``fn``'s flattened
    output ``top`` (:func:`largest`): ``(result, maximum)``."""
    groups = groups_of(lists[0])
    results = [fn(*flat) for flat in stack(groups, *lists)]
    parts = pieces(groups, [v.shape for v in lists[0]], where)
    out = _split(results, parts, False, raw)
    if top is None:
        return out
    vectors = [jax.tree.leaves(r)[top] for r in results]
    picked = [jax.tree.leaves(r)[top] for r in out]
    return list(zip(out, largest(vectors, parts, picked)))
