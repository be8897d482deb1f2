"""Combination across devices: over which mapped axes a partial norm is combined.

Inside ``shard_map`` (varying axes tracked) each leaf's partial sums are combined over
exactly the mesh axes its type says it varies across; under ``pmap`` or
``check_vma=False``, over the ``axis_name`` the caller gives. A combination is a
``psum`` of power sums or a NaN-keeping ``pmax`` of maxima, of per-slice vectors only:
no gradient bytes cross devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
AxisName = None | str | tuple[str, ...]
#: The mapped axes over which a partial norm is combined (see :func:`combine_axes`).
Combine = tuple[str, ...]
Shape = tuple[int, ...]


def varying(x: Any) -> frozenset[str]:
    """The mesh axes ``x`` varies across inside ``shard_map`` (its type records them)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    if kind is not None:
        return frozenset(kind.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX


def vma_tracked() -> bool:
    """Whether JAX tracks varying axes here (``shard_map`` with ``check_vma=True``, its
    default); under ``pmap`` or ``check_vma=False`` every value looks replicated."""
    try:
        from jax._src import config  # no public accessor

        return bool(config._check_vma.value)
    except (ImportError, AttributeError):
        return False


def one_device(x: Any) -> bool:
    """Whether ``x`` lives whole on each device that holds it (single device, replicated,
    or a local block inside ``shard_map``), so reducing it needs no collective."""
    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # numpy arrays, Python scalars
        return True
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return True
    spec_axes: set[str] = set()
    for entry in getattr(sharding, "spec", ()):
        if entry is not None:
            spec_axes.update(entry if isinstance(entry, tuple) else (entry,))
    single = getattr(mesh, "size", 0) <= 1
    kinds = jax.sharding.AxisType
    for name, kind in zip(mesh.axis_names, mesh.axis_types):
        if kind == kinds.Manual:
            continue  # inside shard_map: x is this device's local block
        if kind == kinds.Explicit and name not in spec_axes:
            continue  # replicated along this axis
        if kind != kinds.Explicit and single:
            continue  # one device: nothing to partition
        # Sharded, or Auto (placement decided later by XLA); an Explicit sharding is
        # part of the type even on one device, where reshapes and concatenations with
        # replicated arrays are type errors.
        return False
    return True


def _axis_names(axis_name: AxisName) -> tuple[str, ...]:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
    for name in names:
        try:
            lax.axis_size(name)
        except NameError:
            manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
            raise NameError(
                f"jaxclip: axis_name {name!r} is not a mapped axis here (unbound axis name). "
                + (
                    f"Inside this shard_map the axes are {manual}; "
                    if manual
                    else "Use axis_name only inside shard_map, pmap or a named vmap; "
                )
                + "inside shard_map jaxclip combines each leaf over the axes it varies "
                "across without axis_name."
            ) from None
    return names


def _ambiguous(path: str, axes: frozenset[str], batch: bool) -> ValueError:
    where = f"leaf {path!r}" if path else "a leaf"
    return ValueError(
        f"jaxclip: {where} varies across mesh axes {tuple(sorted(axes))} inside "
        "shard_map, and its norms are per slice: jaxclip cannot tell whether the "
        "reduced dimensions are split across devices. Pass axis_name= the mesh "
        "axes that split the reduced dimensions (their partial norms are summed), "
        "or axis_name=() if every slice is whole on each device."
        + (
            " Data parallel (the batch split across devices, each example whole "
            "on one device) is axis_name=(); naming the batch's axis would sum "
            "different examples' norms."
            if batch
            else ""
        )
    )


def combine_axes(
    x: Any, axis_name: AxisName, whole: bool, path: str = "", batch: bool = False
) -> Combine:
    """The mapped axes over which ``x``'s partial norms are summed (or maxed).

    Inside ``shard_map`` (``check_vma=True``) a whole-array norm is combined over exactly
    the mesh axes ``x`` varies across: a replicated leaf counts once, a tensor-parallel
    shard over its axis; ``axis_name`` adds only axes that are not mesh axes (a named
    ``vmap``'s). Where JAX does not track varying axes (``pmap``, ``check_vma=False``)
    ``axis_name`` names the axes to combine over; ``axis_name=()`` combines nothing.

    A per-slice norm (``whole=False``) of a varying ``x`` needs ``axis_name``: the local
    block's shape does not say whether the reduced or the kept dimensions are split
    (``batch``: the kept dimension is a per-example batch, which the error then names).
    """
    tracked = vma_tracked()
    axes = varying(x) if tracked else frozenset()
    if axis_name is None:
        if axes and not whole:
            raise _ambiguous(path, axes, batch)
        return tuple(sorted(axes))
    names = _axis_names(axis_name)
    if not tracked:
        return names
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if whole:  # a whole-array norm: every axis x varies across, unambiguously
        return tuple(sorted(axes)) + tuple(n for n in names if n not in manual)
    return tuple(n for n in names if n in axes or n not in manual)


def has_unmapped(combines: Sequence[Combine]) -> bool:
    """Whether some combine axis is not a mesh axis (a named ``vmap``'s): the custom
    batching rules run outside the batching trace, where such a collective is unbound."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return any(n not in manual for c in combines for n in c)


def psum(x: Any, axes: Combine) -> Any:
    """``lax.psum`` over ``axes`` (none: ``x`` itself)."""
    return lax.psum(x, axes) if axes else x


def pmax(x: Array, axes: Combine) -> Array:
    """``lax.pmax`` over ``axes`` that keeps NaN (XLA:CPU's cross-device max drops it)."""
    if not axes:
        return x
    nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), axes) > 0
    return jnp.where(nan, jnp.nan, lax.pmax(x, axes))


def combine(
    values: Sequence[Array], combines: Sequence[Combine], acc: Any, op: str, shape: Shape = ()
) -> Array:
    """The sum (``op="sum"``) or NaN-keeping max (``"max"``) of partial results, each of
    ``shape``, over the values and their mapped axes: one collective per set of axes."""
    local, across = (jnp.add, psum) if op == "sum" else (jnp.maximum, pmax)  # NaN kept
    groups: dict[Combine, Array] = {}
    for v, c in zip(values, combines):
        v = v.reshape(shape).astype(acc)
        groups[c] = local(groups[c], v) if c in groups else v
    total = jnp.zeros(shape, acc)
    for c, v in groups.items():
        total = local(total, across(v, c))
    return total
