"""Pytree plumbing: leaf paths, ``need_clip`` resolution and leaf checks.

Every transformation resolves its ``need_clip`` here, once, at trace time, into a
:class:`Selection`: the flat leaves, their ``/``-joined paths and a static bool per leaf.
Unselected leaves are handed back as the very same objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util as jtu

PyTree = Any
NeedClip = None | bool | PyTree | Callable[[str, Any], bool]


def path_str(path: Sequence[Any]) -> str:
    """A key path joined with ``/``, e.g. ``"encoder/0/kernel"``; ``""`` for the root."""
    return jtu.keystr(tuple(path), simple=True, separator="/")


def shown(path: str) -> str:
    """A path as it appears in error messages."""
    return repr(path) if path else "the root of the tree"


def leaf_dtype(leaf: Any, path: str) -> np.dtype:
    """The dtype of an array-like leaf, or a TypeError naming its path."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None:
        return np.dtype(dtype)
    try:
        return np.dtype(jnp.result_type(leaf))
    except TypeError as e:
        raise TypeError(
            f"jaxclip: the gradient leaf at {shown(path)} is a {type(leaf).__name__}, "
            "not an array. Gradient pytrees may hold arrays, None and optax.MaskedNode; "
            "move other objects out of the tree (for example with eqx.partition)."
        ) from e


@dataclasses.dataclass(frozen=True)
class Selection:
    """A flattened gradient tree with a static per-leaf ``need_clip`` decision."""

    treedef: Any
    leaves: list[Any]
    paths: list[str]
    selected: tuple[bool, ...]

    @property
    def indices(self) -> list[int]:
        return [i for i, s in enumerate(self.selected) if s]

    @property
    def chosen(self) -> list[Any]:
        """The selected leaves, in flat order."""
        return [self.leaves[i] for i in self.indices]

    @property
    def chosen_paths(self) -> list[str]:
        return [self.paths[i] for i in self.indices]

    def rebuild(self, new_chosen: Sequence[Any]) -> PyTree:
        """The tree with the selected leaves replaced, the others untouched."""
        leaves = list(self.leaves)
        for i, new in zip(self.indices, new_chosen, strict=True):
            leaves[i] = new
        return self.treedef.unflatten(leaves)

    def per_leaf(self, values: Sequence[Any]) -> PyTree:
        """A tree of the gradients' structure: ``values`` at selected leaves, None elsewhere."""
        leaves: list[Any] = [None] * len(self.leaves)
        for i, v in zip(self.indices, values, strict=True):
            leaves[i] = v
        return self.treedef.unflatten(leaves)


def _mask_entries(mask: PyTree, tree: PyTree, gpaths: list[tuple[Any, ...]]) -> list[bool]:
    """For each leaf of ``tree``, the bool of the ``need_clip`` entry over it (``mask`` is
    a prefix of ``tree``; ``jax.tree.broadcast`` does the matching, this names the path
    where it fails)."""
    mflat, _ = jtu.tree_flatten_with_path(mask)
    for mpath, m in mflat:
        if not _is_bool(m):
            raise TypeError(
                f"jaxclip: need_clip at {shown(path_str(mpath))} is {m!r} of type "
                f"{type(m).__name__}; a need_clip tree holds Python bools (one per leaf, or one "
                "for a whole subtree)."
            )
    try:
        return [bool(m) for m in jax.tree.leaves(jax.tree.broadcast(mask, tree))]
    except ValueError:
        pass
    mpaths = [tuple(p) for p, _ in mflat]
    for gpath in gpaths:
        if not any(gpath[: len(m)] == m for m in mpaths):
            raise ValueError(
                f"jaxclip: need_clip has no entry for the gradient leaf at "
                f"{shown(path_str(gpath))}. Give need_clip the structure of the gradients "
                "(or a prefix of it, one bool per subtree), or pass a callable "
                "need_clip(path, leaf) -> bool."
            ) from None
    extra = next((m for m in mpaths if not any(g[: len(m)] == m for g in gpaths)), ())
    raise ValueError(
        f"jaxclip: need_clip has an entry at {shown(path_str(extra))} but the "
        "gradients have no leaf there. Build need_clip from the gradients' (or the "
        "params') structure, e.g. jax.tree.map(lambda _: True, params)."
    ) from None


#: What to do when init and update select different leaves (see :func:`check_same_selection`).
SAME_SELECTION_HINT = (
    "init and update must select the same leaves so that their states match. A callable "
    "need_clip is called on the params in init and on the gradients in update: select by "
    "path or shape, not by dtype or value (e.g. need_clip=lambda path, leaf: leaf.ndim > 1), "
    "or pass init a tree like the gradients."
)


def check_same_selection(init_paths: Sequence[str], update_paths: Sequence[str], fn: str) -> None:
    """A ValueError naming a leaf that ``init`` selected (on the params) and ``update`` did
    not (on the gradients), or the reverse: their states would not match."""
    if list(init_paths) == list(update_paths):
        return
    in_init, in_update = set(init_paths), set(update_paths)
    only_update = [p for p in update_paths if p not in in_init]
    only_init = [p for p in init_paths if p not in in_update]
    if only_init:
        raise ValueError(
            f"jaxclip.{fn}: the state passed to update has an entry for the leaf at "
            f"{shown(only_init[0])} (init selected it among the params), but update does not "
            f"select it among the gradients. {SAME_SELECTION_HINT}"
        )
    if only_update:
        raise ValueError(
            f"jaxclip.{fn}: update selects the leaf at {shown(only_update[0])} among the "
            "gradients, but the state passed to update has no entry for it (init did not "
            f"select it among the params). {SAME_SELECTION_HINT}"
        )


def leaves_by_path(tree: PyTree) -> dict[str, Any]:
    """Every leaf of ``tree`` keyed by its ``/``-joined path, with no selection or checks."""
    flat, _ = jtu.tree_flatten_with_path(tree)
    return {path_str(p): x for p, x in flat}


def _is_bool(m: Any) -> bool:
    return isinstance(m, (bool, np.bool_)) or (
        isinstance(m, (np.ndarray, jax.Array)) and m.shape == () and m.dtype == bool
    )


def is_selector_function(need_clip: Any) -> TypeGuard[Callable[[str, Any], bool]]:
    """Whether ``need_clip`` is a function ``need_clip(path, leaf)`` rather than a mask tree.

    A callable that is a pytree leaf (a function, a lambda, a bound method) is a function. A
    callable pytree node is a mask when all its leaves are bools: an Equinox module built
    with ``jax.tree.map(lambda _: True, model)`` is callable but is a mask. Other callable
    nodes (``jax.tree_util.Partial``) are functions.
    """
    if not callable(need_clip):
        return False
    leaves = jtu.tree_leaves(need_clip)
    if jtu.treedef_is_leaf(jtu.tree_structure(need_clip)) or not leaves:
        return True
    return not all(_is_bool(m) for m in leaves)


def select(
    tree: PyTree,
    need_clip: NeedClip,
    *,
    allow_complex: bool = True,
    what: str = "clipping",
) -> Selection:
    """Flattens ``tree`` and decides, statically, which leaves take part.

    Args:
      tree: the gradients (or params, in ``init``).
      need_clip: None (every floating-point leaf), a bool pytree that is a prefix of
        ``tree`` (also a callable one, such as an Equinox module of bools), or a function
        ``need_clip(path, leaf) -> bool`` (see :func:`is_selector_function`). A bool may
        stand over a None, ``optax.MaskedNode`` or empty (``{}``) subtree of ``tree``.
      allow_complex: whether complex leaves may be selected (not for value clipping).
      what: the operation, for error messages.

    Returns:
      The :class:`Selection`.

    Raises:
      ValueError: a need_clip tree that does not fit ``tree``.
      TypeError: a callable returning a non-bool, or a selected integer/bool/complex leaf.
    """
    flat, treedef = jtu.tree_flatten_with_path(tree)
    gpaths = [tuple(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    paths = [path_str(p) for p in gpaths]
    dtypes = [leaf_dtype(x, p) for x, p in zip(leaves, paths)]

    if need_clip is None:
        wanted = [jnp.issubdtype(d, jnp.inexact) for d in dtypes]
    elif is_selector_function(need_clip):
        wanted = []
        for x, p in zip(leaves, paths):
            w = need_clip(p, x)
            if not isinstance(w, (bool, np.bool_)):
                raise TypeError(
                    f"jaxclip: need_clip({p!r}, leaf) returned {w!r} of type "
                    f"{type(w).__name__}; it must return a Python bool (True to clip the leaf)."
                )
            wanted.append(bool(w))
    else:
        wanted = _mask_entries(need_clip, tree, gpaths)

    selected = []
    for w, d, p in zip(wanted, dtypes, paths):
        if d == jax.dtypes.float0:
            selected.append(False)  # gradient of an integer input: nothing to clip
            continue
        if w and not jnp.issubdtype(d, jnp.inexact):
            raise TypeError(
                f"jaxclip: the leaf at {shown(p)} has dtype {d} and is selected for {what}; "
                "only floating-point (or complex) gradients can be clipped. Exclude it with "
                "need_clip, or cast it to a float dtype."
            )
        if w and not allow_complex and jnp.issubdtype(d, jnp.complexfloating):
            raise TypeError(
                f"jaxclip: the leaf at {shown(p)} is complex ({d}); {what} has no order on "
                "complex numbers. Use clip_by_norm (which uses |x|), or exclude the leaf "
                "with need_clip."
            )
        selected.append(bool(w))
    return Selection(treedef, leaves, paths, tuple(selected))
