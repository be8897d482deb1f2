"""Pytree plumbing: leaf paths, ``need_clip`` resolution and leaf checks.

Every transformation resolves its ``need_clip`` here, once, at trace time, into a
:class:`Selection`: the flat leaves, their ``/``-joined paths and a static bool per leaf.
Unselected leaves are handed back as the very same objects.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import tree_util as jtu

from jaxclip._selectors import Selector, check_unmatched

PyTree = Any
NeedClip = None | bool | PyTree | Callable[[str, Any], bool] | Selector


def path_str(path: Sequence[Any]) -> str:
    """A key path joined with ``/``, e.g. ``"encoder/0/kernel"``; ``""`` for the root."""
    return jtu.keystr(tuple(path), simple=True, separator="/")


def _wrapper_types() -> tuple[type, ...]:
    """The variable wrappers whose ``value`` key is left out of paths.

    Flax NNX's ``Variable`` (``nnx.Param``...) flattens to its ``value`` attribute, so
    ``nnx.grad`` output and ``nnx.state`` have paths ``l1/kernel/value`` where the
    user's parameter is ``l1/kernel``; linen's boxed ``AxisMetadata``
    (``nn.with_partitioning``'s ``nn.Partitioned``) likewise. Looked up only if Flax is
    already imported, so jaxclip never imports it.
    """
    types: list[type] = []
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        # vars(): older Flax's separate VariableState, without touching the deprecated alias
        for name in ("Variable", "VariableState"):
            t = vars(nnx).get(name)
            if isinstance(t, type) and t not in types:
                types.append(t)
    meta = sys.modules.get("flax.core.meta")
    if meta is not None and isinstance(getattr(meta, "AxisMetadata", None), type):
        types.append(meta.AxisMetadata)
    return tuple(types)


def _is_value_key(key: Any) -> bool:
    return isinstance(key, jtu.GetAttrKey) and key.name == "value"


def flatten_with_paths(
    tree: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[tuple[Any, ...]], list[Any], Any]:
    """``(key_paths, leaves, treedef)`` of ``tree``, the paths as users name the leaves
    (``is_leaf`` as in ``jax.tree``: entries that are leaves, e.g. axis names).

    The one place where paths are built: the ``value`` key of a variable wrapper (see
    :func:`_wrapper_types`) is dropped, so a parameter has the same path in the params,
    in ``nnx.grad``'s output and inside ``nnx.Optimizer`` (``l1/kernel``). Plain dicts,
    linen's (Frozen)dicts and Equinox modules (attribute names) keep their keys.
    """
    flat, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)
    paths = [tuple(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    wrappers = _wrapper_types()
    if wrappers and any(_is_value_key(k) for p in paths for k in p):
        is_wrapper = lambda x: isinstance(x, wrappers)  # noqa: E731
        outer_leaf = lambda x: is_wrapper(x) or (is_leaf is not None and is_leaf(x))  # noqa: E731
        paths = []
        for outer, x in jtu.tree_flatten_with_path(tree, is_leaf=outer_leaf)[0]:
            if not is_wrapper(x):
                paths.append(tuple(outer))
                continue
            for q, _ in jtu.tree_flatten_with_path(x, is_leaf=is_leaf)[0]:
                q = tuple(q)
                paths.append(tuple(outer) + (q[1:] if q and _is_value_key(q[0]) else q))
    return paths, leaves, treedef


def user_paths(tree: PyTree) -> list[str]:
    """The ``/``-joined path of every leaf of ``tree`` as users name it (see
    :func:`flatten_with_paths`), in flat order.

    Example:
      >>> import jax.numpy as jnp
      >>> user_paths({"l1": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}})
      ['l1/bias', 'l1/kernel']
    """
    return [path_str(p) for p in flatten_with_paths(tree)[0]]


def shown(path: str) -> str:
    """A path as it appears in error messages."""
    return repr(path) if path else "the root of the tree"


def leaf_dtype(leaf: Any, path: str) -> Any:
    """The dtype of an array-like leaf, or a TypeError naming its path."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None:
        if not _array_like(leaf):
            raise TypeError(
                f"jaxclip: the gradient leaf at {shown(path)} is a {type(leaf).__name__} (a "
                "dtype and no values: from jax.eval_shape?), not an array. Pass the "
                "gradients themselves."
            )
        # A typed PRNG key's dtype (key<fry>) is JAX's own, not numpy's: not inexact, so
        # never selected by default, and a TypeError naming the leaf if asked for.
        return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)
    try:
        return np.dtype(jnp.result_type(leaf))
    except TypeError as e:
        raise TypeError(
            f"jaxclip: the gradient leaf at {shown(path)} is a {type(leaf).__name__}, "
            "not an array. Gradient pytrees may hold arrays, None and optax.MaskedNode; "
            "move other objects out of the tree (for example with eqx.partition)."
        ) from e


def _array_like(leaf: Any) -> bool:
    """Whether a leaf with a dtype holds values (arrays, and objects NumPy or JAX convert)."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return True
    return hasattr(leaf, "__jax_array__") or hasattr(leaf, "__array__")


@dataclasses.dataclass(frozen=True)
class Selection:
    """A flattened gradient tree with a static per-leaf ``need_clip`` decision."""

    treedef: Any
    leaves: list[Any]
    paths: list[str]
    selected: tuple[bool, ...]
    #: What ``need_clip`` and ``group`` rules are shown per leaf (see :func:`select`).
    views: list[Any]
    #: The structure of per-leaf results (see :meth:`per_leaf`).
    results_treedef: Any = None

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

    @property
    def chosen_views(self) -> list[Any]:
        """What rules are shown for the selected leaves, in flat order."""
        return [self.views[i] for i in self.indices]

    def rebuild(self, new_chosen: Sequence[Any]) -> PyTree:
        """The tree with the selected leaves replaced, the others untouched."""
        leaves = list(self.leaves)
        for i, new in zip(self.indices, new_chosen, strict=True):
            leaves[i] = new
        return self.treedef.unflatten(leaves)

    def per_leaf(self, values: Sequence[Any], fill: Any = None) -> PyTree:
        """A tree of the gradients' structure: ``values`` at selected leaves, ``fill``
        elsewhere (states use ``optax.MaskedNode()``, as ``optax.masked`` does). Variable
        wrappers (see :func:`_wrapper_types`) are left out: a per-leaf norm is a scalar,
        not a parameter, and a wrapper would give it the parameter's metadata (Flax NNX's
        sharding of a kernel, which no scalar can take)."""
        leaves: list[Any] = [fill] * len(self.leaves)
        for i, v in zip(self.indices, values, strict=True):
            leaves[i] = v
        return (self.results_treedef or self.treedef).unflatten(leaves)


def is_params_placeholder(params: Any) -> bool:
    """Whether ``params`` is the stand-in ``optax.tree_map_params`` passes to ``init`` to
    find which state fields are trees of parameters (it has no public name)."""
    return type(params).__name__ == "_ParamsPlaceholder"


def _mask_entries(mask: PyTree, tree: PyTree, gpaths: list[tuple[Any, ...]]) -> list[bool]:
    """For each leaf of ``tree``, the bool of the ``need_clip`` entry over it.

    ``mask`` is a prefix of ``tree``: ``jax.tree.broadcast`` does the matching. Where the
    two differ only in variable wrappers (a mask built from ``nnx.state(model, nnx.Param)``
    meets the bare arrays ``nnx.Optimizer`` passes, or a plain dict meets an
    ``nnx.State``), entries are matched by their paths as users name them (see
    :func:`flatten_with_paths`); otherwise the error names the first path that does not fit.
    """
    mkeys, mleaves, _ = flatten_with_paths(mask)
    for mpath, m in zip(mkeys, mleaves):
        if not _is_bool(m):
            raise TypeError(
                f"jaxclip: need_clip at {shown(path_str(mpath))} is {m!r} of type "
                f"{type(m).__name__}; a need_clip tree holds Python bools (one per leaf, or one "
                "for a whole subtree). Pass True or False there, or a function "
                "need_clip(path, leaf) -> bool such as jaxclip.exclude_names('bias')."
            )
    try:
        return [bool(m) for m in jax.tree.leaves(jax.tree.broadcast(mask, tree))]
    except ValueError:
        pass
    wanted = []
    for gpath in gpaths:
        over = [m for k, m in zip(mkeys, mleaves) if gpath[: len(k)] == k]
        if not over:
            raise ValueError(
                f"jaxclip: need_clip has no entry for the gradient leaf at "
                f"{shown(path_str(gpath))}. Give need_clip the structure of the gradients "
                "(or a prefix of it, one bool per subtree), or pass a callable "
                "need_clip(path, leaf) -> bool."
            ) from None
        wanted.append(bool(over[0]))
    # Entries over None or optax.MaskedNode gradients are fine; over nothing at all, not.
    is_empty = lambda x: x is None or isinstance(x, optax.MaskedNode)  # noqa: E731
    every = [tuple(p) for p, _ in jtu.tree_flatten_with_path(tree, is_leaf=is_empty)[0]]
    every += gpaths
    for k in mkeys:
        if not any(g[: len(k)] == k for g in every):
            raise ValueError(
                f"jaxclip: need_clip has an entry at {shown(path_str(k))} but the gradients "
                f"have no leaf there (their leaves: {_some(gpaths)}). Build need_clip from "
                "the gradients' (or the params') structure, e.g. "
                "jax.tree.map(lambda _: True, params)."
            ) from None
    return wanted


def _some(gpaths: Sequence[tuple[Any, ...]], n: int = 4) -> str:
    """A few gradient paths, for error messages."""
    names = [shown(path_str(g)) for g in gpaths[:n]]
    return ", ".join(names) + (", ..." if len(gpaths) > n else "") if names else "none"


#: What to do when init and update select different leaves (see :func:`check_same_selection`).
SAME_SELECTION_HINT = (
    "init and update must select the same leaves (the same paths) so that their states "
    "match: pass init params of the gradients' structure, or restore a state saved for this "
    "tree. Where need_clip is a callable, it is called on the params in init and on the "
    "gradients in update: select by path or shape, not by dtype or value (e.g. "
    "need_clip=lambda path, leaf: leaf.ndim > 1)."
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
    paths, leaves, _ = flatten_with_paths(tree)
    return {path_str(p): x for p, x in zip(paths, leaves)}


def _is_bool(m: Any) -> bool:
    return isinstance(m, (bool, np.bool_)) or (
        isinstance(m, (np.ndarray, jax.Array)) and m.shape == () and m.dtype == bool
    )


def call_rule(fn: Callable[[str, Any], Any], name: str, path: str, leaf: Any) -> Any:
    """``fn(path, leaf)`` for a user's ``need_clip`` or ``group`` rule; an exception it
    raises gets a note naming the leaf and how the rule is called."""
    try:
        return fn(path, leaf)
    except Exception as e:
        note = (
            f"jaxclip: raised by {name}({path!r}, leaf); {name} is called as "
            f"{name}(path, leaf) for every leaf, path a '/'-joined str."
        )
        if isinstance(e, TypeError) and _takes_one(fn):
            error = TypeError(
                f"jaxclip: {name} takes one argument, but jaxclip calls it as {name}(path, "
                "leaf) for every leaf. An optax-style mask function of the whole tree "
                f"(lambda params: mask) is passed as its result: {name}=mask_fn(params)."
            )
            error.add_note(note)
            raise error from e
        e.add_note(note)
        raise


def _takes_one(fn: Any) -> bool:
    """Whether ``fn`` takes exactly one positional argument (an optax-style mask fn)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1


def as_function(rule: Any) -> Any:
    """A ``need_clip`` or ``group`` rule as a plain function ``(path, leaf) -> value``
    (a :class:`~jaxclip.Selector` unwrapped; anything else as given)."""
    return rule.matches if isinstance(rule, Selector) else rule


def is_selector_function(need_clip: Any) -> TypeGuard[Callable[[str, Any], bool] | Selector]:
    """Whether ``need_clip`` is a function ``need_clip(path, leaf)`` rather than a mask tree.

    A callable that is a pytree leaf (a function, a lambda, a bound method) is a function. A
    callable pytree node is a mask when all its leaves are bools: an Equinox module built
    with ``jax.tree.map(lambda _: True, model)`` is callable but is a mask. Other callable
    nodes (``jax.tree_util.Partial``) are functions. A :class:`~jaxclip.Selector` (not
    callable, so that ``optax.inject_hyperparams`` passes it through) is a function too.
    """
    if isinstance(need_clip, Selector):
        return True
    if not callable(need_clip):
        return False
    leaves = jtu.tree_leaves(need_clip)
    if jtu.treedef_is_leaf(jtu.tree_structure(need_clip)) or not leaves:
        return True
    return not all(_is_bool(m) for m in leaves)


def one_example(leaf: Any) -> Any:
    """A per-example gradient leaf as a rule sees it: a ``jax.ShapeDtypeStruct`` of one
    example (the shape without the leading batch axis), so that ``min_rank(2)`` and
    ``leaf.ndim`` rules pick the same leaves as they do among the params. Scalars and
    non-array leaves are shown as they are."""
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if not shape or dtype is None:
        return leaf
    return jax.ShapeDtypeStruct(tuple(shape[1:]), dtype)


def select(
    tree: PyTree,
    need_clip: NeedClip,
    *,
    allow_complex: bool = True,
    what: str = "clipping",
    view: Callable[[Any], Any] | None = None,
    params: bool = False,
) -> Selection:
    """Flattens ``tree`` and decides, statically, which leaves take part.

    Args:
      tree: the gradients (or params, in ``init``).
      need_clip: None (every floating-point leaf), a bool pytree that is a prefix of
        ``tree`` (also a callable one, such as an Equinox module of bools), a function
        ``need_clip(path, leaf) -> bool`` or a :class:`~jaxclip.Selector` (see
        :func:`is_selector_function`); ``path`` is the leaf's path as users name it (see
        :func:`flatten_with_paths`). A bool may
        stand over a None, ``optax.MaskedNode`` or empty (``{}``) subtree of ``tree``.
      allow_complex: whether complex leaves may be selected (not for value clipping).
      what: the operation, for error messages.
      view: what a rule (``need_clip`` or ``group``) is shown of each leaf, e.g.
        :func:`one_example` for per-example gradients; the leaf itself by default.
      params: ``tree`` is the params (``init``): an integer or boolean parameter is never
        selected, as its gradient (``float0``) is not in ``update``, whatever the rule says.

    Returns:
      The :class:`Selection`.

    Raises:
      ValueError: a need_clip tree that does not fit ``tree``.
      TypeError: a callable returning a non-bool, or a selected integer/bool/complex leaf.
    """
    gpaths, leaves, treedef = flatten_with_paths(tree)
    paths = [path_str(p) for p in gpaths]
    dtypes = [leaf_dtype(x, p) for x, p in zip(leaves, paths)]
    views = leaves if view is None else [view(x) for x in leaves]

    if need_clip is None:
        wanted = [jnp.issubdtype(d, jnp.inexact) for d in dtypes]
    elif is_selector_function(need_clip):
        wanted, fn = [], as_function(need_clip)
        for x, p in zip(views, paths):
            w = call_rule(fn, "need_clip", p, x)
            if not isinstance(w, (bool, np.bool_)):
                raise TypeError(
                    f"jaxclip: need_clip({p!r}, leaf) returned {w!r} of type "
                    f"{type(w).__name__}; it must return a Python bool (True to clip the leaf)."
                )
            wanted.append(bool(w))
        if isinstance(need_clip, Selector):
            check_unmatched(need_clip, paths, lambda: _absent_paths(tree))
    else:
        wanted = _mask_entries(need_clip, tree, gpaths)

    selected = []
    for w, d, p in zip(wanted, dtypes, paths):
        if d == jax.dtypes.float0 or (params and not jnp.issubdtype(d, jnp.inexact)):
            # The gradient of an integer input, or (in init) the integer input itself:
            # nothing to clip, and update finds float0 there, which it leaves out too.
            selected.append(False)
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
    return Selection(treedef, leaves, paths, tuple(selected), views, _unwrapped(tree, treedef))


def _self_equal(label: Any) -> bool:
    """Whether ``label`` equals itself, part by part: a tuple compares its items by
    identity first, so ``("g", nan)`` equals itself but not the next leaf's."""
    if isinstance(label, tuple):
        return all(_self_equal(v) for v in label)
    return bool(label == label)


def _absent_paths(tree: PyTree) -> list[str]:
    """The paths of the None and ``optax.MaskedNode`` entries of ``tree``: parameters with
    no gradient (frozen, or masked out by ``optax.masked``)."""
    is_absent = lambda x: x is None or isinstance(x, optax.MaskedNode)  # noqa: E731
    keys, leaves, _ = flatten_with_paths(tree, is_leaf=is_absent)
    return [path_str(k) for k, x in zip(keys, leaves) if is_absent(x)]


def _unwrapped(tree: PyTree, treedef: Any) -> Any:
    """The structure of ``tree`` with each variable wrapper (of one leaf) as a leaf in
    its place; ``treedef`` where there are none, or a wrapper holds other than one leaf."""
    wrappers = _wrapper_types()
    if not wrappers:
        return treedef
    outer = jtu.tree_structure(tree, is_leaf=lambda x: isinstance(x, wrappers))
    return outer if outer.num_leaves == treedef.num_leaves else treedef


def group_labels(
    group: Callable[[str, Any], Hashable] | Selector, sel: Selection
) -> tuple[list[Hashable], list[Hashable]]:
    """The distinct labels (first-seen order) and the label of each selected leaf."""
    label_of = as_function(group)
    per_leaf = [
        call_rule(label_of, "group", path, x) for path, x in zip(sel.chosen_paths, sel.chosen_views)
    ]
    for path, label in zip(sel.chosen_paths, per_leaf):
        if label is None:
            raise TypeError(
                f"jaxclip: group({path!r}, leaf) returned None; return a label such as a str "
                "(exclude leaves with need_clip instead)."
            )
        try:
            hash(label)
        except TypeError:
            raise TypeError(
                f"jaxclip: group({path!r}, leaf) returned {label!r}, which is not hashable; "
                "return a str or int label (a tuple for a composite one)."
            ) from None
        if not _self_equal(label):  # NaN: each leaf a group of its own, never found
            raise TypeError(
                f"jaxclip: group({path!r}, leaf) returned {label!r}, which is not equal to "
                "itself, so it cannot name a group; return a str or int label."
            )
    labels = list(dict.fromkeys(per_leaf))
    try:  # the state keeps a dict label -> norm, whose keys JAX sorts
        sorted(labels)
    except TypeError:
        first = {type(label): (label, path) for path, label in zip(sel.chosen_paths, per_leaf)}
        shown = [f"group({path!r}, leaf) returned {label!r}" for label, path in first.values()]
        raise TypeError(
            "jaxclip: group labels must be of one kind that sorts (all str, or all int): "
            f"{' but '.join(shown[:2])}. Return str(label) for every leaf, for example."
        ) from None
    return labels, per_leaf
