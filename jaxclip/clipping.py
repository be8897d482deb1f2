"""Value, norm and global-norm clipping: the ``clip_tree_*`` functions and their transforms.

Each transformation is a thin wrapper: it validates its hyperparameters, closes over
them, and delegates to the ``clip_tree_*`` function, which takes its selection from
``_tree`` and its norms from ``_norms``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.core import Tracer

from jaxclip import _axes, _checks, _errors, _norms, _tree
from jaxclip._checks import Axes, NormType

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PyTree = Any


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      global_norm: the pre-clip global norm of the last update (float32 scalar), or a
        dict label -> norm when the transformation has a ``group``.
    """

    global_norm: Array | dict[Hashable, Array]


class ClipByNormState(NamedTuple):
    """State of :func:`clip_by_norm`.

    Attributes:
      norms: a tree of the updates' structure: per selected leaf, the largest pre-clip
        norm of its slices (float32 scalar, the same on every device); ``optax.MaskedNode()``
        at leaves that are not selected, as in ``optax.masked``'s states.
        Exact at any magnitude: a leaf whose every slice is all zeros or tiny (a frozen
        leaf) is read once more to tell 0 from underflow; zero slices beside a larger
        one (unused embedding rows) are not.

    Each slice's own norm (with ``axes=``) is not kept here: it would make the state as
    large as the slices. :func:`clip_tree_by_norm` returns it as its second output, an
    array of the slices' shape per leaf (``tf.clip_by_norm``'s kept dimensions):

    >>> import jax.numpy as jnp, jaxclip
    >>> g = {"emb": jnp.array([[3.0, 4.0], [0.3, 0.4]])}
    >>> clipped, norms = jaxclip.clip_tree_by_norm(g, 1.0, axes=1)
    >>> norms["emb"]  # one norm per row
    Array([5. , 0.5], dtype=float32)
    """

    norms: PyTree


# ----------------------------------------------------------------------------------------
# The functions.


def global_norm(
    tree: PyTree,
    norm_type: NormType = _checks.L2,
    *,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> Array:
    """The p-norm of all selected leaves of ``tree`` together.

    Overflow- and underflow-safe: accumulated in float32 (float64 for float64 leaves),
    with a scaled second pass only when the plain sum is out of exact range.

    Args:
      tree: a pytree of arrays.
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which leaves count (see :func:`clip_by_global_norm`).
      axis_name: not needed under ``jit`` (sharded arrays) nor inside ``shard_map``,
        where each leaf's partial norm is combined over exactly the mesh axes it varies
        across; give it under ``pmap`` (or ``shard_map(check_vma=False)``) to name the
        mapped axes the leaves are split over, or ``()`` to combine nothing. Per leaf
        (a tree that mixes split and replicated leaves under ``pmap``): a tree of them,
        a rule ``axis_name(path, leaf)``, or the leaves' ``PartitionSpec``.

    Returns:
      A scalar (float32, or float64 when a leaf is float64).

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> jaxclip.global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])})
      Array(5., dtype=float32)
      >>> jaxclip.global_norm([jnp.array([1e20, 1e20, 1e20, 1e20])])
      Array(2.e+20, dtype=float32)
    """
    p = _checks.check_norm_type(norm_type)
    sel = _tree.select(tree, need_clip, what="a global norm")
    names = _axes.resolve(axis_name, sel, "global_norm")
    xs, paths = [jnp.asarray(x) for x in sel.chosen], tuple(sel.chosen_paths)
    return _norms.global_norm(xs, p, axis_name=names, paths=paths)


def clip_tree_by_value(
    tree: PyTree, max: ArrayLike, min: ArrayLike | None = None, *, need_clip: _tree.NeedClip = None
) -> PyTree:
    """Clips every selected element into ``[min, max]`` (``[-max, max]`` when min is None).

    Args:
      tree: a pytree of real floating-point arrays.
      max: the upper bound: a number, or an array that broadcasts to every clipped leaf
        (see :func:`clip_by_value`).
      min: the lower bound, likewise; None means ``-max`` (then ``max`` must be > 0).
      need_clip: which leaves are clipped (see :func:`clip_by_value`).

    Returns:
      The clipped tree; unselected leaves are the very same objects.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> jaxclip.clip_tree_by_value({"w": jnp.array([-3.0, 0.5, 2.0])}, 1.0)
      {'w': Array([-1. ,  0.5,  1. ], dtype=float32)}
      >>> jaxclip.clip_tree_by_value(jnp.array([-3.0, 0.5, 2.0]), jnp.array([1.0, 0.2, 3.0]))
      Array([-1. ,  0.2,  2. ], dtype=float32)
    """
    lo, hi = _checks.value_bounds(max, min, "clip_tree_by_value")
    sel = _tree.select(tree, need_clip, allow_complex=False, what="value clipping")
    for x, path in zip(sel.chosen, sel.chosen_paths):
        for name, bound in (("max", hi), ("min", lo)):
            _checks.check_bound_shape(bound, name, x, path, "clip_tree_by_value")

    per_dtype: dict[Any, tuple[Array, Array, str]] = {}  # the bounds and kernel, per dtype

    def plan(x: Array) -> tuple[Array, Array, str]:
        if x.dtype not in per_dtype:
            # A bound past the dtype's range rounds to +-inf, as torch.clamp and
            # tf.clip_by_value take it (1e5 for float16): no NumPy overflow warning.
            with np.errstate(over="ignore"):
                b = (jnp.asarray(lo, x.dtype), jnp.asarray(hi, x.dtype))
                normal = all(_normal_bound(v, x.dtype) for v in (lo, hi))
            per_dtype[x.dtype] = (
                *b,
                "keys" if not normal else "float16" if x.dtype == jnp.float16 else "",
            )
        lo_d, hi_d, kind = per_dtype[x.dtype]
        if not kind and x.dtype == jnp.bfloat16 and x.size >= _KEYS_MIN_SIZE:
            kind = "keys"
        return lo_d, hi_d, kind

    xs = [jnp.asarray(x) for x in sel.chosen]
    plans = [plan(x) for x in xs]
    bounds = [(lo_d, hi_d) for lo_d, hi_d, _ in plans]
    kinds = tuple(kind for _, _, kind in plans)
    if any(isinstance(v, Tracer) for v in jax.tree.leaves((xs, bounds))):
        return sel.rebuild(_clip_values(xs, bounds, kinds))
    # Eager: one compiled dispatch for the tree (op by op, the clamp, compare and select
    # were three passes and three dispatches per leaf: 3.8x optax.clip's eager call).
    return sel.rebuild(_clip_values_jit(xs, bounds, kinds))


def _clip_values(
    xs: list[Array], bounds: list[tuple[Array, Array]], kinds: tuple[str, ...]
) -> list[Array]:
    """Each leaf clipped by its kernel: ``"keys"`` (integer keys), ``"float16"`` (one clamp)
    or ``""`` (clamp, compare and select)."""
    return [_clip_value(x, lo_d, hi_d, kind) for x, (lo_d, hi_d), kind in zip(xs, bounds, kinds)]


_clip_values_jit = jax.jit(_clip_values, static_argnames=("kinds",))


def _clip_value(x: Array, lo_d: Array, hi_d: Array, kind: str) -> Array:
    # lax, not jnp.where and jnp.clip: jitted functions, two calls per leaf in the
    # program. Values inside the bounds come back bit for bit, NaN stays NaN.
    if kind == "keys":
        # XLA:CPU's float compares treat subnormals as 0, which against a zero,
        # subnormal or traced bound changes the answer (min=0 let -1e-40 through).
        # Large bfloat16 leaves take this path always: their integer keys clamp
        # natively, where XLA:CPU computes bfloat16 in float32 (small ones keep the
        # float kernel, which compiles faster and runs as fast there).
        return _clip_by_keys(x, lo_d, hi_d)
    # Bounds of normal magnitude: XLA:CPU's clamp flushes an inside subnormal x to 0,
    # which compares equal to x (the compare flushes too), so x is kept; an outside x
    # differs from its bound, and NaN from itself. One clamp (scalar bounds need no
    # broadcast), a compare and a select: the kernel compiles nearly as fast as
    # optax.clip's, which flushes subnormals.
    if lo_d.ndim or hi_d.ndim:
        lo_d, hi_d = _norms.spread(lo_d, x), _norms.spread(hi_d, x)
    if kind == "float16":
        # The clamp alone keeps every float16 inside bit for bit (XLA:CPU widens it to
        # a normal float32 first, subnormals included; ±0 lie strictly inside normal
        # bounds), and runs fastest: over a 3x3 conv kernel's short last axis the
        # select and the integer keys ran 1.6-3x optax.clip.
        return _clamp(lo_d, x, hi_d)
    c = lax.clamp(lo_d, x, hi_d)
    return lax.select(lax.ne(x, c), c, x)


#: 16-bit leaves of at least this many elements are value-clipped by integer keys.
_KEYS_MIN_SIZE = 1 << 16


def _normal_bound(bound: ArrayLike, dtype: Any) -> bool:
    """Whether a value bound is concrete and, in ``dtype``, of normal (or infinite)
    magnitude everywhere (not traced, e.g. by ``optax.inject_hyperparams``)."""
    v = _checks.concrete(bound)
    if v is None:
        return False
    mag = np.abs(v.astype(dtype).astype(np.float64))
    return bool(np.all(mag >= float(jnp.finfo(dtype).tiny)))


@jax.custom_jvp
def _clamp(lo: Array, x: Array, hi: Array) -> Array:
    """``lax.clamp``, whose derivative is 1 at the bounds too, as the other kernels' (and
    ``torch.clamp``'s): ``lax.clamp``'s own is 0 there."""
    return lax.clamp(lo, x, hi)


@_clamp.defjvp
def _clamp_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    (lo, x, hi), (_, dx, _) = primals, tangents  # the bounds are constants here
    inside = lax.bitwise_and(lax.ge(x, lo), lax.le(x, hi))
    return lax.clamp(lo, x, hi), lax.select(inside, dx, lax.full_like(dx, 0))


def _as_bits(x: Array) -> Array:
    """``x``'s bits as signed integers of its width."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"int{x.dtype.itemsize * 8}"))


def _order_key(x: Array) -> tuple[Array, Array]:
    """Integers in the order of the float values of ``x`` (-0 and +0 alike; NaN at the
    ends), and whether each is NaN.

    Sign and magnitude bits become a signed integer, so the comparison is exact on every
    backend, subnormals included.
    """
    bits = _as_bits(x)
    mag = lax.bitwise_and(bits, jnp.asarray(jnp.iinfo(bits.dtype).max, bits.dtype))
    inf = lax.bitcast_convert_type(jnp.asarray(jnp.inf, x.dtype), bits.dtype)
    return lax.select(lax.lt(bits, jnp.zeros((), bits.dtype)), lax.neg(mag), mag), mag > inf


def _clip_by_keys(x: Array, lo: Array, hi: Array) -> Array:
    """``x`` clipped into ``[lo, hi]`` (bounds that broadcast to ``x``) by integer keys:
    values inside come back bit for bit, NaN stays NaN, and where ``lo > hi`` (traced
    bounds that cross) the result is ``hi``, as clamp, ``jnp.clip`` and torch give."""
    (k, nan), (klo, _), (khi, _) = _order_key(x), _order_key(lo), _order_key(hi)
    if klo.ndim or khi.ndim:  # lax ops take scalar bounds or bounds of x's shape
        klo, khi = _norms.spread(klo, x), _norms.spread(khi, x)
    below = lax.bitwise_and(lax.lt(k, klo), lax.le(klo, khi))
    keep = lax.bitwise_or(lax.eq(lax.clamp(klo, k, khi), k), nan)
    return _select_bits(keep, below, x, _norms.spread(lo, x), _norms.spread(hi, x))


@jax.custom_jvp
def _select_bits(keep: Array, below: Array, x: Array, lo: Array, hi: Array) -> Array:
    """``x`` where ``keep``, else ``lo`` where ``below``, else ``hi``: selected as integer
    bits (XLA:CPU may compute a 16-bit select in float32, whose conversions flush a
    subnormal bound or ``x`` to 0), differentiated as the float select."""
    b, blo, bhi = (_as_bits(v) for v in (x, lo, hi))
    return lax.bitcast_convert_type(lax.select(keep, b, lax.select(below, blo, bhi)), x.dtype)


@_select_bits.defjvp
def _select_bits_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    keep, below, _, _, _ = primals
    _, _, dx, dlo, dhi = tangents
    return _select_bits(*primals), lax.select(keep, dx, lax.select(below, dlo, dhi))


def clip_tree_by_norm(
    tree: PyTree,
    clip_norm: ArrayLike,
    *,
    axes: Axes = None,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    error_if_nonfinite: bool = False,
    axis_name: _axes.AxisNames = None,
) -> tuple[PyTree, PyTree]:
    """Scales each selected leaf (or each slice over ``axes``) to norm at most ``clip_norm``.

    Args:
      tree: a pytree of floating-point (or complex) arrays.
      clip_norm: the largest norm allowed, > 0.
      axes: the axes a norm is taken over, as ``tf.clip_by_norm``; None for the whole
        leaf. Negative axes count from the end.
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which leaves are clipped (see :func:`clip_by_norm`).
      error_if_nonfinite: raise if a norm is inf or NaN (a host sync per call).
      axis_name: see :func:`clip_by_norm`.

    Returns:
      ``(clipped, norms)``: ``norms`` has the tree's structure with, per selected leaf,
      its pre-clip norms with the ``axes`` dimensions removed (a scalar when
      ``axes=None``), and None at unselected leaves. Under ``jit``, leave ``norms``
      unused when you do not need them: all-zero slices (unused embedding rows) then
      cost no second read, which their exact norms need.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> g = jnp.array([[3.0, 4.0], [0.3, 0.4]])
      >>> clipped, norms = jaxclip.clip_tree_by_norm(g, 1.0, axes=1)
      >>> clipped
      Array([[0.6, 0.8],
             [0.3, 0.4]], dtype=float32)
      >>> norms
      Array([5. , 0.5], dtype=float32)
    """
    return _clip_tree_by_norm(
        tree, clip_norm, axes, norm_type, need_clip, error_if_nonfinite, axis_name, "exact"
    )


def _clip_tree_by_norm(
    tree: PyTree,
    clip_norm: ArrayLike,
    axes: Axes,
    norm_type: NormType,
    need_clip: _tree.NeedClip,
    error_if_nonfinite: bool,
    axis_name: _axes.AxisNames,
    report: str,
) -> tuple[PyTree, PyTree]:
    """:func:`clip_tree_by_norm`; with ``report="largest"`` the norms are exact only as
    far as each leaf's largest (:func:`_norms.clip_slices`)."""
    _checks.check_clip_norm(clip_norm, "clip_tree_by_norm")
    p = _checks.check_norm_type(norm_type)
    axes_t = _checks.check_axes(axes, "clip_tree_by_norm")
    error_if_nonfinite = _checks.check_flag(
        error_if_nonfinite, "error_if_nonfinite", "clip_tree_by_norm"
    )
    sel = _tree.select(tree, need_clip, what="norm clipping")
    xs = [jnp.asarray(x) for x in sel.chosen]
    leaf_axes = [_checks.leaf_axes(axes_t, x, path) for x, path in zip(xs, sel.chosen_paths)]
    for dtype in {_norms.acc_dtype(x.dtype) for x in xs}:  # each leaf's norm has its own
        _checks.check_norm_range(clip_norm, "clip_norm", dtype, "clip_tree_by_norm")
    names = _axes.resolve(axis_name, sel, "clip_tree_by_norm")
    paths = tuple(sel.chosen_paths)
    clipped, norms = _norms.clip_slices(
        xs, p, tuple(leaf_axes), clip_norm, axis_name=names, paths=paths, report=report
    )
    if error_if_nonfinite:
        _errors.raise_if_nonfinite(
            norms, [f"norm of the leaf at {_tree.shown(path)}" for path in sel.chosen_paths]
        )
    if report == "largest":  # the transform's state: one replicated value per leaf
        norms = [n.astype(jnp.float32) for n in norms]
        return sel.rebuild(clipped), sel.per_leaf(norms, optax.MaskedNode())
    return sel.rebuild(clipped), sel.per_leaf(norms)


def clip_tree_by_global_norm(
    tree: PyTree,
    clip_norm: ArrayLike,
    *,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
    use_norm: ArrayLike | None = None,
    error_if_nonfinite: bool = False,
    group: Callable[[str, Any], Hashable] | _tree.Selector | None = None,
) -> tuple[PyTree, Any]:
    """Scales all selected leaves together so that their joint norm is at most ``clip_norm``.

    The counterpart of ``torch.nn.utils.clip_grad_norm_`` (which returns the total
    norm) and ``tf.clip_by_global_norm`` (which returns ``(list, global_norm)``).

    Args:
      tree: a pytree of floating-point (or complex) arrays.
      clip_norm: the largest global norm allowed, > 0.
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which leaves take part (see :func:`clip_by_global_norm`).
      axis_name: not needed under ``jit`` (sharded arrays) nor inside ``shard_map``,
        where each leaf's partial norm is combined over exactly the mesh axes it varies
        across; give it under ``pmap`` (or ``shard_map(check_vma=False)``) to name the
        mapped axes the leaves are split over, or ``()`` to combine nothing. Per leaf
        (a tree that mixes split and replicated leaves under ``pmap``): a tree of them,
        a rule ``axis_name(path, leaf)``, or the leaves' ``PartitionSpec``.
      use_norm: a global norm computed already (as in TensorFlow); it is used as is.
      error_if_nonfinite: raise if the global norm is inf or NaN (a host sync per call).
      group: a callable ``group(path, leaf) -> label``: each label's leaves are clipped
        by their own global norm (what Paddle's ``group_name`` did in static graphs; its
        dygraph mode ignores it).

    Returns:
      ``(clipped, global_norm)``, the norm before clipping (float32, or float64 when a
      leaf is float64; ``use_norm`` when given); with ``group``, a dict label -> norm.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = [jnp.array([3.0, 0.0]), jnp.array([0.0, 4.0])]
      >>> clipped, norm = jaxclip.clip_tree_by_global_norm(grads, 1.0)
      >>> norm
      Array(5., dtype=float32)
      >>> clipped
      [Array([0.6, 0. ], dtype=float32), Array([0. , 0.8], dtype=float32)]
    """
    _checks.check_clip_norm(clip_norm, "clip_tree_by_global_norm")
    p = _checks.check_norm_type(norm_type)
    _checks.check_callable(group, "group", "clip_tree_by_global_norm", "group(path, leaf) -> label")
    error_if_nonfinite = _checks.check_flag(
        error_if_nonfinite, "error_if_nonfinite", "clip_tree_by_global_norm"
    )
    sel = _tree.select(tree, need_clip, what="global-norm clipping")
    xs = [jnp.asarray(x) for x in sel.chosen]
    names = _axes.resolve(axis_name, sel, "clip_tree_by_global_norm")
    if group is not None:
        if use_norm is not None:
            raise ValueError(
                "jaxclip: use_norm and group cannot be combined: pass one norm per call."
            )
        labels, per_leaf = _tree.group_labels(group, sel)
        norms, clipped = {}, list(xs)
        for label in labels:
            members = [i for i, lab in enumerate(per_leaf) if lab == label]
            group_names = _norms.leaves_axes(names, members)
            group_paths = tuple(sel.chosen_paths[i] for i in members)
            group_xs = [xs[i] for i in members]
            _checks.check_joint_norm_range(
                clip_norm, "clip_norm", group_xs, "clip_tree_by_global_norm"
            )
            n = _norms.global_norm_parts(group_xs, p, axis_name=group_names, paths=group_paths)
            if error_if_nonfinite:
                _errors.raise_if_nonfinite([n.value], [f"global norm of group {label!r}"])
            for i, x in zip(members, _norms.clip_joint([xs[i] for i in members], n, clip_norm)):
                clipped[i] = x
            norms[label] = n.value
        return sel.rebuild(clipped), norms
    _checks.check_joint_norm_range(clip_norm, "clip_norm", xs, "clip_tree_by_global_norm")
    if use_norm is None:
        parts = _norms.global_norm_parts(xs, p, axis_name=names, paths=tuple(sel.chosen_paths))
    else:
        _checks.check_use_norm(use_norm, "clip_tree_by_global_norm")
        _checks.check_joint_norm_range(
            use_norm,
            "use_norm",
            xs,
            "clip_tree_by_global_norm",
            effect="every selected leaf would be scaled by 0",
            off="",
        )
        parts = _norms.as_norm(jnp.asarray(use_norm, _norms.result_dtype(xs)))
    if error_if_nonfinite:
        _errors.raise_if_nonfinite([parts.value], ["global norm"])
    return sel.rebuild(_norms.clip_joint(xs, parts, clip_norm)), parts.value


def _check_same_groups(
    init_norms: Any, norms: dict, updates: PyTree, group: Callable | _tree.Selector
) -> None:
    """A ValueError naming a group (and a leaf of it) when ``update``'s groups differ from
    the ones in the state ``init`` built, so that the states would not match."""
    if not isinstance(init_norms, dict) or set(init_norms) == set(norms):
        return
    missing = [label for label in init_norms if label not in norms]
    if not missing:
        new = [label for label in norms if label not in init_norms]
        raise ValueError(
            f"jaxclip.clip_by_global_norm: update finds group {new[0]!r} among the selected "
            "gradients, but the state passed to update has no norm for it (init did not "
            f"find it among the params). {_tree.SAME_SELECTION_HINT}"
        )
    label, example = missing[0], ""
    for path, leaf in _tree.leaves_by_path(updates).items():
        try:
            if _tree.as_function(group)(path, leaf) == label:
                example = f" (e.g. the leaf at {_tree.shown(path)})"
                break
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):
            # a group callable that only handles the leaves it is meant for
            continue
    raise ValueError(
        f"jaxclip.clip_by_global_norm: the state passed to update has a norm for group "
        f"{label!r} (init selected leaves of it among the params), but update selects no "
        f"gradient leaf of that group{example}. {_tree.SAME_SELECTION_HINT}"
    )


# ----------------------------------------------------------------------------------------
# The transformations.


def clip_by_value(
    max: ArrayLike, min: ArrayLike | None = None, *, need_clip: _tree.NeedClip = None
) -> optax.GradientTransformation:
    """Clips updates element-wise into ``[min, max]``.

    The counterpart of Paddle's ``ClipGradByValue(max, min, need_clip)``, PyTorch's
    ``clip_grad_value_`` (``min=None``), ``tf.clip_by_value`` and ``optax.clip``.

    Bounds may be arrays, as in ``tf.clip_by_value``: each must broadcast to every
    clipped leaf without enlarging it (a per-column ``max`` of shape ``(n,)`` for
    ``(m, n)`` leaves), else a ValueError names the leaf. Concrete bounds are checked
    elementwise (``min <= max``; ``max > 0`` when ``min`` is None); traced ones, e.g.
    from ``optax.inject_hyperparams``, are not. Each leaf is clipped to the bounds as its
    dtype holds them (rounded to nearest, as ``optax.clip`` and ``torch.clamp``).

    Args:
      max: the upper bound: a real number, or an array (NumPy, JAX or nested lists).
      min: the lower bound, likewise; None means ``-max``, and then ``max`` must be > 0.
      need_clip: which leaves are clipped: None (every floating-point leaf), a pytree
        of bools with the updates' structure or a prefix of it (Paddle's
        ``ParamAttr(need_clip=...)``; a bool may also stand over an empty ``{}``,
        ``None`` or ``optax.MaskedNode`` subtree), or a function
        ``need_clip(path, leaf) -> bool`` where ``path`` is ``"/"``-joined, e.g.
        ``"linear/bias"``, as users name the leaf (Flax NNX's ``l1/bias``, without the
        ``value`` of its Variables), or a rule such as
        :func:`~jaxclip.exclude_biases_and_norms`, :func:`~jaxclip.exclude_names` or
        :func:`~jaxclip.min_rank` (a :class:`~jaxclip.Selector`, which also passes
        through ``optax.inject_hyperparams`` untouched; a plain function there needs
        ``static_args=("need_clip",)``). A callable pytree whose leaves are all bools,
        such as an Equinox module built with ``jax.tree.map(lambda _: True, model)``, is a mask,
        not a function. A function is called on the params in ``init`` and on the
        updates in ``update``: select by path or shape, not by dtype or value, so that
        both select the same leaves (where the states would then differ,
        :func:`clip_by_norm` and grouped :func:`clip_by_global_norm` raise a ValueError
        naming the leaf).

    Returns:
      An ``optax.GradientTransformation`` with ``optax.EmptyState``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxclip
      >>> tx = optax.chain(jaxclip.clip_by_value(1.0), optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2)}
      >>> updates, _ = tx.update({"w": jnp.array([5.0, -0.5])}, tx.init(params))
      >>> updates
      {'w': Array([-0.1 ,  0.05], dtype=float32)}
    """
    _checks.value_bounds(max, min, "clip_by_value")
    _checks.check_need_clip(need_clip, "clip_by_value")

    def clip(updates: PyTree, params: Any = None) -> PyTree:
        del params
        return clip_tree_by_value(updates, max, min, need_clip=need_clip)

    return optax.stateless(clip)


def clip_by_norm(
    clip_norm: ArrayLike,
    *,
    axes: Axes = None,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    error_if_nonfinite: bool = False,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformation:
    """Scales each update leaf (or each slice over ``axes``) to norm at most ``clip_norm``.

    A leaf (slice) with norm ``n <= clip_norm`` is returned bit for bit; otherwise it
    is multiplied by ``clip_norm / n``. The counterpart of Paddle's
    ``ClipGradByNorm(clip_norm, need_clip)`` and ``tf.clip_by_norm(t, clip_norm, axes)``.

    Args:
      clip_norm: the largest norm allowed, > 0 (a Python number or a JAX array).
      axes: the axes a norm is taken over; None (default) for the whole leaf,
        ``axes=1`` for per-row norms of a matrix, as ``tf.clip_by_norm``.
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which leaves are clipped (see :func:`clip_by_value`). The state has an
        entry per selected leaf, so ``init`` (on the params) and ``update`` (on the
        updates) must select the same leaves; ``update`` raises a ValueError naming the
        first leaf where the state it is given says otherwise.
      error_if_nonfinite: raise, also under ``jit``, when a norm is inf or NaN; costs a
        device-to-host transfer and a sync per step. Catch ``jax.errors.JaxRuntimeError``
        (see :class:`~jaxclip.NonFiniteNormError`).
      axis_name: not needed under ``jit`` (sharded arrays). Inside ``shard_map`` a whole
        leaf's norm is combined over the mesh axes the leaf varies across; a per-slice
        norm (``axes``) of a leaf split across devices needs the mesh axes that split
        its *reduced* dimensions (``()`` if every slice is whole on each device), else a
        ValueError naming the leaf. Under ``pmap``: the mapped axis name(s). For a tree
        that mixes layouts, one entry per leaf: a tree of them (a prefix of the
        updates), a rule ``axis_name(path, leaf)``, or the leaves' ``PartitionSpec``
        (shard_map's ``in_specs``), which says which axes split the reduced and which
        the kept dimensions; the state's largest norms are the same on every device.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`ClipByNormState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxclip
      >>> tx = jaxclip.clip_by_norm(1.0)
      >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.5])}
      >>> updates, state = tx.update(grads, tx.init(grads))
      >>> updates["w"], updates["b"]
      (Array([0.6, 0.8], dtype=float32), Array([0.5], dtype=float32))
      >>> float(state.norms["w"])
      5.0

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2013
    """
    _checks.check_clip_norm(clip_norm, "clip_by_norm")
    _checks.check_norm_type(norm_type)
    _checks.check_axes_range(axes, "clip_by_norm")
    _checks.check_flag(error_if_nonfinite, "error_if_nonfinite", "clip_by_norm")
    _checks.check_need_clip(need_clip, "clip_by_norm")
    _axes.check(axis_name, "clip_by_norm")

    def init_fn(params: PyTree) -> ClipByNormState:
        if _tree.is_params_placeholder(params):
            # A scalar per leaf, not a tree of parameters: optax.tree_map_params then
            # maps the field with transform_non_params (a replicated sharding), not f.
            return ClipByNormState(jnp.zeros((), jnp.float32))
        sel = _tree.select(params, need_clip, what="norm clipping", params=True)
        zeros = [jnp.zeros((), jnp.float32) for _ in sel.indices]
        return ClipByNormState(sel.per_leaf(zeros, optax.MaskedNode()))

    def update_fn(updates: PyTree, state: ClipByNormState, params: Any = None):
        del params
        # The state keeps each leaf's largest norm: small slices (unused rows) need no
        # exact norm beside a large one.
        clipped, norms = _clip_tree_by_norm(
            updates, clip_norm, axes, norm_type, need_clip, error_if_nonfinite, axis_name, "largest"
        )
        largest = norms
        if isinstance(state, ClipByNormState):
            _tree.check_same_selection(
                list(_tree.leaves_by_path(state.norms)),
                list(_tree.leaves_by_path(largest)),
                "clip_by_norm",
            )
        return clipped, ClipByNormState(largest)

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def clip_by_global_norm(
    clip_norm: ArrayLike,
    *,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
    error_if_nonfinite: bool = False,
    group: Callable[[str, Any], Hashable] | _tree.Selector | None = None,
) -> optax.GradientTransformation:
    """Scales all selected updates together so that their joint norm is at most ``clip_norm``.

    With ``n`` the norm of all selected leaves as one vector: if ``n <= clip_norm`` the
    updates are returned bit for bit, else multiplied by ``clip_norm / n`` (no epsilon:
    Paddle and TensorFlow agree to 1-2 ulp, rounding theirs differently, PyTorch to within
    its ``1e-6``). The pre-clip norm is kept in the state: :func:`~jaxclip.clip_stats` (or,
    with a single jaxclip mode in the chain, ``optax.tree.get(state, "global_norm")``) logs
    it.

    The counterpart of Paddle's ``ClipGradByGlobalNorm``, PyTorch's
    ``clip_grad_norm_(params, max_norm, norm_type)``, ``tf.clip_by_global_norm`` and
    ``optax.clip_by_global_norm``.

    Args:
      clip_norm: the largest global norm allowed, > 0 (a number or a JAX array, traced
        ones included, so ``optax.inject_hyperparams`` can schedule it).
      norm_type: ``p >= 2**-10`` or ``float('inf')``, as PyTorch's ``norm_type``.
      need_clip: which leaves take part (see :func:`clip_by_value`); the others are
        left out of the norm and returned untouched.
      axis_name: not needed under ``jit`` (sharded arrays) nor inside ``shard_map``,
        where each leaf's partial norm is combined over exactly the mesh axes it varies
        across; give it under ``pmap`` (or ``shard_map(check_vma=False)``) to name the
        mapped axes the leaves are split over, or ``()`` to combine nothing. Per leaf
        (a tree that mixes split and replicated leaves under ``pmap``): a tree of them,
        a rule ``axis_name(path, leaf)``, or the leaves' ``PartitionSpec``.
      error_if_nonfinite: raise, also under ``jit``, when the global norm is inf or NaN;
        costs a device-to-host transfer and a sync per step. Catch
        ``jax.errors.JaxRuntimeError`` (see :class:`~jaxclip.NonFiniteNormError`).
      group: a callable ``group(path, leaf) -> label`` (Paddle's static-graph ``group_name``): each
        label's leaves are clipped by their own global norm, and the state holds a dict
        label -> norm. ``init`` (on the params) and ``update`` (on the updates) must find
        the same labels among the selected leaves; ``update`` raises a ValueError naming
        the group where the state it is given has other labels.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`ClipByGlobalNormState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxclip
      >>> tx = optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(1.0))
      >>> params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}
      >>> updates, state = jax.jit(tx.update)(grads, state)
      >>> updates["w"], updates["b"]
      (Array([-0.6, -0. ], dtype=float32), Array([-0.8], dtype=float32))
      >>> optax.tree.get(state, "global_norm")
      Array(5., dtype=float32)

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2013
    """
    _checks.check_clip_norm(clip_norm, "clip_by_global_norm")
    _checks.check_norm_type(norm_type)
    _checks.check_callable(group, "group", "clip_by_global_norm", "group(path, leaf) -> label")
    _checks.check_flag(error_if_nonfinite, "error_if_nonfinite", "clip_by_global_norm")
    _checks.check_need_clip(need_clip, "clip_by_global_norm")
    _axes.check(axis_name, "clip_by_global_norm")

    def init_fn(params: PyTree) -> ClipByGlobalNormState:
        if group is None or _tree.is_params_placeholder(params):
            # optax.tree_map_params' stand-in has no paths to group: the field is one
            # subtree (a dict of scalars) that transform_non_params maps whole.
            return ClipByGlobalNormState(jnp.zeros((), jnp.float32))
        labels, _ = _tree.group_labels(
            group, _tree.select(params, need_clip, what="global-norm clipping", params=True)
        )
        return ClipByGlobalNormState({label: jnp.zeros((), jnp.float32) for label in labels})

    def update_fn(updates: PyTree, state: ClipByGlobalNormState, params: Any = None):
        del params
        clipped, norm = clip_tree_by_global_norm(
            updates,
            clip_norm,
            norm_type=norm_type,
            need_clip=need_clip,
            axis_name=axis_name,
            error_if_nonfinite=error_if_nonfinite,
            group=group,
        )
        if group is not None and isinstance(state, ClipByGlobalNormState):
            _check_same_groups(state.global_norm, norm, updates, group)
        return clipped, ClipByGlobalNormState(jax.tree.map(lambda n: n.astype(jnp.float32), norm))

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
