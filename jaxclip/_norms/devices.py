"""Combination across devices: over which mapped axes a partial norm is combined.

Inside ``shard_map`` (varying axes tracked) each leaf's partial sums are combined over
exactly the mesh axes its type says it varies across; under ``pmap`` or
``check_vma=False``, over the ``axis_name`` the caller gives. A combination is a
``psum`` of power sums or a NaN-keeping ``pmax`` of maxima, of per-slice vectors only:
no gradient bytes cross devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

Array = jax.Array
#: One leaf's axis names: mapped axis name(s), or the leaf's ``PartitionSpec`` (which mesh
#: axes split which of its dimensions).
LeafAxes = None | str | tuple[str, ...] | PartitionSpec
#: The mapped axes over which a partial norm is combined (see :func:`combine_axes`).
Combine = tuple[str, ...]
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PerLeaf:
    """Axis names leaf by leaf (a hashable static argument unlike any plain tuple, so a
    jitted function never confuses it with the axis names ``("a", "b")``)."""

    specs: tuple[LeafAxes, ...]


AxisName = LeafAxes | PerLeaf


def leaf_axes(axis_name: AxisName, i: int) -> LeafAxes:
    """The axis names of the ``i``-th leaf."""
    return axis_name.specs[i] if isinstance(axis_name, PerLeaf) else axis_name


def leaves_axes(axis_name: AxisName, indices: Sequence[int]) -> AxisName:
    """The axis names of the leaves at ``indices`` (a group of them)."""
    if isinstance(axis_name, PerLeaf):
        return PerLeaf(tuple(axis_name.specs[i] for i in indices))
    return axis_name


def _mapped(spec: PartitionSpec, ndim: int) -> bool:
    """Whether a leaf's spec names mapped axes here: inside ``shard_map`` (its unbound
    names are then errors) or ``pmap``; not under ``jit`` over a mesh, where the same
    transformation serves sharded arrays with no collectives of its own."""
    if manual_axes():
        return True
    try:
        for name in _spec_names(spec, None, ndim):
            lax.axis_size(name)
    except NameError:
        return False
    return True


def _spec_names(spec: PartitionSpec, dims: Sequence[int] | None, ndim: int) -> tuple[str, ...]:
    """The axes that split dimensions ``dims`` (all when None) of this device's block in
    ``spec``: a mesh axis that is not manual here (a ``shard_map`` over some of the mesh's
    axes leaves the others to XLA) splits no block, whatever the leaf's whole spec says."""
    mesh = jax.sharding.get_abstract_mesh()
    unsplit = set(getattr(mesh, "axis_names", ())) - set(getattr(mesh, "manual_axes", ()))
    names: list[str] = []
    for d, entry in enumerate(tuple(spec) + (None,) * (ndim - len(spec))):
        if entry is None or (dims is not None and d not in dims):
            continue
        entries = entry if isinstance(entry, tuple) else (entry,)
        names += [n for n in entries if n not in names and n not in unsplit]
    return tuple(names)


def global_shape(x: Any, spec: LeafAxes) -> tuple[int, ...]:
    """The shape of the array whose block ``x`` is, inside ``shard_map``: each dimension
    times the sizes of the manual mesh axes that split it in ``spec`` (a
    ``PartitionSpec``); ``x``'s own shape for any other ``spec``, and outside."""
    if not isinstance(spec, PartitionSpec):
        return tuple(x.shape)
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = dict(getattr(mesh, "shape", {}))
    out = []
    for d, n in enumerate(x.shape):
        for name in _spec_names(spec, (d,), x.ndim):
            n *= sizes[name] if name in manual else 1
        out.append(n)
    return tuple(out)


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


def manual_axes() -> tuple[str, ...]:
    """The mapped axes in scope: ``shard_map``'s or ``pmap``'s (not a named ``vmap``'s)."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


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


def _axis_names(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _check_names(names: tuple[str, ...], path: str = "") -> tuple[str, ...]:
    """``names``, each a mapped axis here, else a NameError that says which are."""
    for name in names:
        try:
            lax.axis_size(name)
        except NameError:
            manual = manual_axes()
            leaf = f" (for the leaf {path!r})" if path else ""
            raise NameError(
                f"jaxclip: axis_name {name!r}{leaf} is not a mapped axis here (unbound axis name). "
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
        "or axis_name=() if every slice is whole on each device; for a tree that mixes "
        "layouts, one entry per leaf (a tree, or a rule (path, leaf) -> axes), or the "
        "leaves' PartitionSpecs (shard_map's in_specs), which say it for every leaf."
        + (
            " Data parallel (the batch split across devices, each example whole "
            "on one device) is axis_name=(); naming the batch's axis would sum "
            "different examples' norms."
            if batch
            else ""
        )
    )


def combine_axes(
    x: Any, axis_name: LeafAxes, reduced: Sequence[int] | None, path: str = "", batch: bool = False
) -> Combine:
    """The mapped axes over which ``x``'s partial norms are summed (or maxed).

    ``reduced``: the dimensions a norm is taken over (None: the whole array).

    Inside ``shard_map`` (``check_vma=True``) a whole-array norm is combined over exactly
    the mesh axes ``x`` varies across: a replicated leaf counts once, a tensor-parallel
    shard over its axis; ``axis_name`` adds only axes that are not mesh axes (a named
    ``vmap``'s). Where JAX does not track varying axes (``pmap``, ``check_vma=False``)
    ``axis_name`` names the axes to combine over; ``axis_name=()`` combines nothing.

    A per-slice norm of a varying ``x`` needs ``axis_name``: the local block's shape does
    not say whether the reduced or the kept dimensions are split (``batch``: the kept
    dimension is a per-example batch, which the error then names). A ``PartitionSpec``
    says it: the axes that split the reduced dimensions are combined.
    """
    tracked = vma_tracked()
    axes = varying(x) if tracked else frozenset()
    whole = reduced is None or len(reduced) == x.ndim
    if isinstance(axis_name, PartitionSpec):
        if len(axis_name) > x.ndim:
            where = f"the leaf {path!r}" if path else "a leaf"
            raise ValueError(
                f"jaxclip: the PartitionSpec {axis_name} given for {where} has {len(axis_name)} "
                f"entries but the leaf has {x.ndim} dimensions. Pass each leaf its own spec "
                "(a tree of specs with an entry per leaf, e.g. shard_map's in_specs)."
            )
        if not _mapped(axis_name, x.ndim):
            return ()  # under jit (no mapped axes) XLA partitions the norm itself
        names = _check_names(_spec_names(axis_name, None if whole else reduced, x.ndim), path)
        unnamed = axes - set(_spec_names(axis_name, None, x.ndim))
        if unnamed:
            where = f"the leaf {path!r}" if path else "a leaf"
            raise ValueError(
                f"jaxclip: {where} varies across mesh axes {tuple(sorted(unnamed))} that its "
                f"PartitionSpec {axis_name} does not name: the spec does not describe this "
                "array. Pass the spec the leaf was split by (shard_map's in_specs entry), "
                "or reduce it over those axes first (pmean of the loss, not of the grads)."
            )
        return tuple(n for n in names if n in axes) if tracked else names
    if axis_name is None:
        if axes and not whole:
            raise _ambiguous(path, axes, batch)
        return tuple(sorted(axes))
    names = _check_names(_axis_names(axis_name), path)
    if not tracked:
        return names
    manual = set(manual_axes())
    if whole:  # a whole-array norm: every axis x varies across, unambiguously
        return tuple(sorted(axes)) + tuple(n for n in names if n not in manual)
    return tuple(n for n in names if n in axes or n not in manual)


def kept_axes(
    x: Any, axis_name: LeafAxes, reduced: Sequence[int] | None, combined: Combine
) -> Combine:
    """The mapped axes that split ``x``'s kept dimensions: per-slice results (a leaf's
    largest norm) differ across them, and a ``pmax`` over them makes them replicated.

    Tracked: the axes ``x`` varies across that its norms were not combined over. Under
    ``pmap`` or ``check_vma=False`` a ``PartitionSpec`` says which axes these are; without
    one, every mapped axis the norms were not combined over: across the others a maximum
    of equal values is that value, so it is right whichever split the kept dimensions.
    """
    if reduced is None or len(reduced) == x.ndim:
        return ()
    if vma_tracked():
        return tuple(sorted(varying(x) - set(combined)))
    if isinstance(axis_name, PartitionSpec) and _mapped(axis_name, x.ndim):
        kept = [d for d in range(x.ndim) if d not in reduced]
        return tuple(n for n in _spec_names(axis_name, kept, x.ndim) if n not in combined)
    return tuple(n for n in manual_axes() if n not in combined)


def has_unmapped(combines: Sequence[Combine]) -> bool:
    """Whether some combine axis is not a mesh axis (a named ``vmap``'s): the custom
    batching rules run outside the batching trace, where such a collective is unbound."""
    manual = set(manual_axes())
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
