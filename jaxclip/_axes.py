"""``axis_name`` resolution: which mapped axes each selected leaf's norm is combined over.

Every norm-based transformation resolves its ``axis_name`` here, once per call, at trace
time, into what the core takes (:class:`jaxclip._norms.PerLeaf` when leaves differ).
A leaf's entry is one of:

- ``None``: inside ``shard_map``, the mesh axes the leaf varies across (a whole-leaf
  norm); nothing under ``pmap`` or ``check_vma=False``;
- an axis name or a tuple of them (``()``: combine nothing);
- the leaf's ``PartitionSpec`` (shard_map's ``in_specs`` entry), which says which mesh
  axes split which dimensions: a per-slice norm is combined over the axes of its reduced
  dimensions, and per-slice summaries in states over those of its kept ones.

``axis_name`` itself is an entry for every leaf, a tree of entries that is a prefix of
the gradients (``in_specs`` itself), or a rule ``axis_name(path, leaf) -> entry``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
from jax import tree_util as jtu
from jax.sharding import PartitionSpec

from jaxclip import _norms, _tree

PyTree = Any
AxisNames = _norms.LeafAxes | PyTree | Callable[[str, Any], _norms.LeafAxes]


def is_entry(v: Any) -> bool:
    """Whether ``v`` is one leaf's axis names (not a tree of them)."""
    if v is None or isinstance(v, (str, PartitionSpec)):
        return True
    return isinstance(v, tuple) and all(isinstance(e, str) for e in v)


def _is_rule(v: Any) -> bool:
    """A callable that is not itself a tree of entries (an Equinox module of specs is)."""
    return callable(v) and jax.tree.leaves(v, is_leaf=is_entry) == [v]


def _entry(v: Any, where: str, fn: str) -> _norms.LeafAxes:
    if not is_entry(v):
        raise TypeError(
            f"jaxclip.{fn}: axis_name {where} is {v!r} of type {type(v).__name__}; a leaf's "
            "axis_name is None, a mapped axis name (str), a tuple of them, or the leaf's "
            "PartitionSpec."
        )
    return v


def check(axis_name: Any, fn: str) -> None:
    """A TypeError, when the transformation is built, for an ``axis_name`` that is none
    of an entry, a tree of entries or a rule."""
    if is_entry(axis_name) or _is_rule(axis_name):
        return
    for path, v in jtu.tree_flatten_with_path(axis_name, is_leaf=is_entry)[0]:
        _entry(v, f"at {_tree.shown(_tree.path_str(path))}", fn)


def resolve(axis_name: AxisNames, sel: _tree.Selection, fn: str) -> _norms.AxisName:
    """The selected leaves' axis names, in ``sel.chosen`` order: one value when they
    agree (the common case: no new compile per layout), else a ``PerLeaf``."""
    if is_entry(axis_name):
        return cast(_norms.LeafAxes, axis_name)
    paths = sel.chosen_paths
    if _is_rule(axis_name):
        rule = _tree.as_function(axis_name)
        specs = [
            _entry(_tree.call_rule(rule, "axis_name", p, x), f"({p!r}, leaf)", fn)
            for p, x in zip(paths, sel.chosen)
        ]
    else:
        specs = _by_prefix(axis_name, paths, fn)
    if len(set(specs)) <= 1:
        return specs[0] if specs else None
    return _norms.PerLeaf(tuple(specs))


def _by_prefix(tree: PyTree, paths: list[str], fn: str) -> list[_norms.LeafAxes]:
    """Each path's entry in ``tree``, a prefix of the gradients: the entry whose path is
    the longest prefix of the leaf's (paths as users name them, ``/``-joined)."""
    keys, values, _ = _tree.flatten_with_paths(tree, is_leaf=is_entry)  # nnx specs too
    entries = [
        (tuple(_tree.path_str(k).split("/")) if k else (), _entry(v, _where(k), fn))
        for k, v in zip(keys, values)
    ]
    out = []
    for path in paths:
        parts = tuple(path.split("/")) if path else ()
        over = [(len(k), v) for k, v in entries if parts[: len(k)] == k]
        if not over:
            raise ValueError(
                f"jaxclip.{fn}: axis_name has no entry for the leaf at {_tree.shown(path)}. "
                "Give axis_name the structure of the gradients (or a prefix of it, e.g. "
                "shard_map's in_specs for the params), or a rule axis_name(path, leaf)."
            )
        out.append(max(over, key=lambda t: t[0])[1])
    return out


def _where(key: Any) -> str:
    return f"at {_tree.shown(_tree.path_str(key))}"
