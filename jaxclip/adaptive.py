"""Adaptive clipping: AGC, AutoClip, ZClip and spike skipping.

Every mode takes its selection from ``_tree`` and its norms from ``_norms``, and keeps
its statistics in a ``NamedTuple`` state whose fields ``optax.tree.get`` finds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxclip import _axes, _checks, _norms, _tree
from jaxclip._checks import Axes, NormType, StaticInt

Array = jax.Array
PyTree = Any

# Static defaults (see _checks.StaticDefault): inject_hyperparams leaves them Python ints.
_WINDOW = _checks.StaticDefault(1000)
_WARMUP = _checks.StaticDefault(25)


def _unit_axes(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """NFNets' units (``unitwise_norm`` in deepmind-research ``nfnets/optim.py``, as
    ``optax.adaptive_grad_clip``): a leaf whose squeezed rank is <= 1 (scalars, vectors,
    ``(1, n)``) is one unit; rank 2 (IO) and 3 (multi-head IO) reduce axis 0; rank 4 (HWIO)
    axes (0, 1, 2); rank 5 (DHWIO, optax) and beyond every axis but the last."""
    if sum(d != 1 for d in shape) <= 1:
        return None
    return (0,) if len(shape) in (2, 3) else tuple(range(len(shape) - 1))


def _default_units(g: Array, spec: _norms.LeafAxes, path: str) -> tuple[int, ...] | None:
    """:func:`_unit_axes` of the array whose block ``g`` is. Inside ``shard_map`` or
    ``pmap`` the block's own shape says them only where no dimension of size 1 in it may
    be split: a ``(1, n)`` block is one unit, but a row of a split ``(k, n)`` kernel is
    not. A ``PartitionSpec`` says the whole shape; without one such a block is an error."""
    units = _unit_axes(_norms.global_shape(g, spec))
    if units is None and g.ndim >= 2 and not isinstance(spec, PartitionSpec):
        split = _norms.combine_axes(g, spec, None, path)
        if split:
            raise ValueError(
                f"jaxclip.adaptive_clip: the leaf {_tree.shown(path)} is a block {g.shape} "
                f"of an array split across mapped axes {split}. Its units (one, or one per "
                "slice) depend on the whole array's shape, which a block with a dimension "
                "of size 1 does not say. Pass axis_name= the leaves' PartitionSpecs "
                "(shard_map's in_specs), or axes= the axes of the units' norms."
            )
    return units


def adaptive_clip(
    clipping: float,
    eps: float = 1e-3,
    *,
    axes: Axes = None,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformation:
    """Adaptive Gradient Clipping: each unit's gradient norm is clipped to
    ``clipping * max(||param unit||, eps)``.

    Units are those of the NFNets reference (``unitwise_norm``) and of
    ``optax.adaptive_grad_clip``: a leaf whose squeezed rank is <= 1 (a scalar, a vector, a
    ``(1, n)`` or ``(n, 1)`` matrix) is one unit; a rank-2 ``(in, out)`` kernel and a
    rank-3 multi-head kernel reduce axis 0 (one unit per index of the other axes); a
    rank-4 HWIO conv kernel reduces axes (0, 1, 2); rank 5 (DHWIO) and higher reduce every
    axis but the last (optax stops at 5, NFNets at 4). ``axes`` overrides that for every
    selected leaf (optax's ``axis``). Equal to ``optax.adaptive_grad_clip`` to rounding:
    a unit is left unchanged where ``||g|| <= limit`` (optax: ``<``) and is otherwise
    scaled by ``limit / ||g||`` (optax: ``limit / max(||g||, 1e-6)``, which differs only
    for units of norm below 1e-6 -- which the limit, at least ``clipping * eps``, rarely
    clips).

    Args:
      clipping: the largest allowed ratio of gradient norm to parameter norm, > 0.
      eps: the smallest parameter norm used, so zero-initialised units still move;
        finite and > 0.
      axes: the axes a unit's norm is taken over, for every leaf; None for the reference's
        units (above).
      need_clip: which leaves are clipped (see :func:`jaxclip.clip_by_value`).
      axis_name: inside ``shard_map``, for units of a leaf split across devices: the
        mesh axes that split the reduced dimensions (see :func:`jaxclip.clip_by_norm`);
        a leaf that is one unit needs none. A block with a dimension of size 1 (a row of
        a kernel split by rows) needs its ``PartitionSpec``, which says the whole array's
        shape and so its units; without one it is a ValueError naming the leaf.

    Returns:
      An ``optax.GradientTransformation`` (``optax.EmptyState``) whose ``update`` needs
      ``params``, of the updates' structure and shapes (a ValueError names a parameter
      whose shape differs from its gradient's).

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> tx = jaxclip.adaptive_clip(0.5)
      >>> params = {"w": jnp.array([[0.0, 3.0], [4.0, 4.0]])}   # units: columns, norms 4, 5
      >>> grads = {"w": jnp.array([[0.0, 0.3], [16.0, 0.4]])}   # norms 16 > 0.5 * 4, 0.5
      >>> tx.update(grads, tx.init(params), params)[0]["w"]
      Array([[0. , 0.3],
             [2. , 0.4]], dtype=float32)

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without
      Normalization <https://arxiv.org/abs/2102.06171>`_, 2021; ``unitwise_norm`` and
      ``SGD_AGC`` in google-deepmind/deepmind-research ``nfnets/optim.py``
    """
    _checks.check_clipping(clipping, "adaptive_clip")
    _checks.check_eps(eps, "adaptive_clip")
    _checks.check_axes_range(axes, "adaptive_clip")
    _checks.check_need_clip(need_clip, "adaptive_clip")
    _axes.check(axis_name, "adaptive_clip")

    def clip(updates: PyTree, params: PyTree | None = None) -> PyTree:
        if params is None:
            raise ValueError(
                "jaxclip.adaptive_clip needs the parameters: call update(grads, state, params)."
            )
        return clip_tree_adaptive(
            updates, params, clipping, eps, axes=axes, need_clip=need_clip, axis_name=axis_name
        )

    return optax.stateless(clip)


def clip_tree_adaptive(
    tree: PyTree,
    params: PyTree,
    clipping: Any,
    eps: Any = 1e-3,
    *,
    axes: Axes = None,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> PyTree:
    """Clips each unit of ``tree`` to ``clipping * max(||unit of params||, eps)`` (AGC).

    The function behind :func:`adaptive_clip`, for custom loops.

    Args:
      tree: the gradients.
      params: the parameters, of the gradients' structure and shapes.
      clipping: the largest allowed ratio of gradient norm to parameter norm, > 0.
      eps: the smallest parameter norm used; finite and > 0.
      axes: the axes a unit's norm is taken over, for every leaf; None for the defaults
        of :func:`adaptive_clip`.
      need_clip: which leaves are clipped (see :func:`jaxclip.clip_by_value`).
      axis_name: inside ``shard_map``, for units of a leaf split across devices: the
        mesh axes that split the reduced dimensions (see :func:`jaxclip.clip_by_norm`),
        or the leaves' ``PartitionSpec`` (see :func:`adaptive_clip`).

    Returns:
      The clipped tree; unselected leaves are the very same objects.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> jaxclip.clip_tree_adaptive(jnp.array([3.0, 4.0]), jnp.array([0.0, 2.0]), 0.5)
      Array([0.6, 0.8], dtype=float32)
    """
    _checks.check_clipping(clipping, "clip_tree_adaptive")
    _checks.check_eps(eps, "clip_tree_adaptive")
    axes_t = _checks.check_axes(axes, "clip_tree_adaptive")
    sel = _tree.select(tree, need_clip, what="adaptive clipping")
    pleaves = _tree.leaves_by_path(params)
    gs = [jnp.asarray(g) for g in sel.chosen]
    missing = [p for p in sel.chosen_paths if p not in pleaves]
    if missing:
        raise ValueError(
            f"jaxclip: adaptive_clip found no parameter at {_tree.shown(missing[0])}; "
            "params must have the structure of the updates."
        )
    ps = [jnp.asarray(pleaves[p]) for p in sel.chosen_paths]
    for g, p, path in zip(gs, ps, sel.chosen_paths):
        if p.shape != g.shape:
            raise ValueError(
                f"jaxclip.adaptive_clip: the parameter at {_tree.shown(path)} has shape "
                f"{p.shape} but its gradient has shape {g.shape}; pass update the params "
                "the gradients were taken of (the same structure and shapes)."
            )
        if not jnp.issubdtype(p.dtype, jnp.inexact):
            raise TypeError(
                f"jaxclip.adaptive_clip: the parameter at {_tree.shown(path)} has dtype "
                f"{p.dtype} but its gradient is {g.dtype}; pass update the params the "
                "gradients were taken of (a float parameter; an integer one has float0 "
                "gradients), or exclude the leaf with need_clip."
            )
    names = _axes.resolve(axis_name, sel, "adaptive_clip")
    leaf_axes = [
        _checks.leaf_axes(axes_t, g, path)
        if axes_t is not None
        else _default_units(g, _norms.leaf_axes(names, i), path)
        for i, (g, path) in enumerate(zip(gs, sel.chosen_paths))
    ]
    paths = tuple(sel.chosen_paths)
    return sel.rebuild(_agc(gs, ps, tuple(leaf_axes), clipping, eps, names, paths))


@functools.partial(jax.jit, static_argnames=("axes", "axis_name", "paths"))
def _agc(
    gs: list[Array],
    ps: list[Array],
    axes: tuple[tuple[int, ...] | None, ...],
    clipping: Any,
    eps: Any,
    axis_name: _norms.AxisName,
    paths: tuple[str, ...],
) -> list[Array]:
    """Each unit of ``gs`` clipped to ``clipping * max(||unit of ps||, eps)`` (one compiled
    call, so an eager update costs one dispatch)."""
    kw = {"axis_name": axis_name, "paths": paths}
    return _norms.clip_slices_relative(gs, ps, axes, clipping, eps, **kw)


class AutoClipState(NamedTuple):
    """State of :func:`auto_clip`.

    Attributes:
      history: the last ``window`` finite global norms (a ring buffer; NaN where empty).
      finite_count: how many finite norms were recorded in all.
      threshold: the clipping threshold used at the last update.
      global_norm: the pre-clip global norm of the last update.
    """

    history: Array
    finite_count: Array
    threshold: Array
    global_norm: Array


def _alias(value: Any, default: Any, name: str, alias: Any, alias_name: str) -> Any:
    """``value``, or the reference's spelling ``alias`` of it where given (not both)."""
    if alias is None:
        return value
    if value is not default:
        raise TypeError(
            f"jaxclip.auto_clip: both {name}= and {alias_name}= (its reference name) were "
            "given; pass one."
        )
    return alias


def auto_clip(
    percentile: float = 10.0,
    *,
    window: StaticInt = _WINDOW,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
    clip_percentile: float | None = None,
    history_size: StaticInt | None = None,
) -> optax.GradientTransformation:
    """AutoClip: clips the global norm to a percentile of the global norms seen so far.

    The current norm is recorded first, then the threshold is the ``percentile``-th
    percentile (linear interpolation, as ``numpy.percentile``) of the recorded norms. The
    paper keeps the whole history; here it is a ring buffer of the last ``window``
    norms, so the state has a fixed size and the cost per step is ``O(window)``.
    A finite norm beyond float32's range cannot be recorded: it is clipped at the
    percentile of the earlier norms, or, as the first step, passes unchanged (the paper's
    percentile of one norm is that norm). Non-finite norms are not recorded (they propagate as in
    :func:`jaxclip.clip_by_global_norm`: an inf norm scales the step by 0, a NaN one
    makes it NaN); before any finite norm has been recorded the threshold is 0. This is
    the paper's algorithm (its listing records first, then takes the percentile); the
    autoclip package's ``QuantileClip`` (per parameter, threshold from the earlier norms
    only) is :func:`quantile_clip`.

    Args:
      percentile: in ``(0, 100]``; 10 is the paper's default.
      window: how many past norms are kept.
      need_clip: which leaves take part (see :func:`jaxclip.clip_by_value`).
      axis_name: the mapped axes the global norm is combined over: not needed under
        ``jit`` nor inside ``shard_map`` (each leaf over the mesh axes it varies
        across); under ``pmap`` or ``shard_map(check_vma=False)`` the axes the leaves
        are split over, per leaf where they differ (see :func:`jaxclip.clip_by_norm`).
        Every device then holds the same state.
      clip_percentile: the reference implementation's name of ``percentile``.
      history_size: the TensorFlow port's name of ``window``.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`AutoClipState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxclip
      >>> tx = jaxclip.auto_clip(50.0, window=4)
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in [1.0, 3.0, 100.0]:
      ...     out, state = tx.update(jnp.array([g]), state)
      >>> out, optax.tree.get(state, "threshold")
      (Array([3.], dtype=float32), Array(3., dtype=float32))

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source Separation
      Networks <https://arxiv.org/abs/2007.14469>`_, 2020
    """
    percentile = _alias(percentile, 10.0, "percentile", clip_percentile, "clip_percentile")
    window = _alias(window, _WINDOW, "window", history_size, "history_size")
    _checks.check_percentile(
        percentile, "auto_clip", "percentile" if clip_percentile is None else "clip_percentile"
    )
    window = _checks.static_size(
        window, "window" if history_size is None else "history_size", "auto_clip"
    )
    _checks.check_need_clip(need_clip, "auto_clip")
    _axes.check(axis_name, "auto_clip")

    def init_fn(params: PyTree) -> AutoClipState:
        del params
        f32 = jnp.float32
        return AutoClipState(
            jnp.full((window,), jnp.nan, f32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), f32),
            jnp.zeros((), f32),
        )

    def update_fn(updates: PyTree, state: AutoClipState, params: Any = None):
        del params
        sel, xs, norm, parts = _selected(updates, need_clip, axis_name, "auto_clip")
        finite = jnp.isfinite(norm)
        # jnp.asarray: a state restored from a checkpoint (NumPy arrays) has no ``.at``.
        history = jnp.asarray(state.history)
        history = jnp.where(finite, history.at[state.finite_count % window].set(norm), history)
        count = state.finite_count + finite.astype(jnp.int32)
        # With no finite norm recorded yet (a non-finite first step) the threshold is 0, so
        # an inf norm scales by 0 and a NaN norm gives NaN, as in clip_by_global_norm; but
        # a finite norm beyond float32's range (not recordable) is its own percentile, as
        # in the paper: inf, the step passes unchanged (it was zeroed).
        first = jnp.where(jnp.isfinite(parts.frac), jnp.inf, 0.0)
        threshold = jnp.where(count > 0, jnp.nanpercentile(history, percentile), first)
        return sel.rebuild(_norms.clip_joint(xs, parts, threshold)), AutoClipState(
            history, count, threshold, norm
        )

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


class HistoryClipState(NamedTuple):
    """State of :func:`quantile_clip` and :func:`standard_clip`.

    With ``global_threshold=True`` every field is about the global norm (``history`` of
    shape ``(history_length,)``, the others scalars); otherwise each has a leading axis
    with one row per selected leaf, in the order of ``jax.tree.leaves``.

    Attributes:
      history: the last ``history_length`` finite norms (a ring buffer; NaN where empty).
      finite_count: how many finite norms were recorded in all.
      threshold: the threshold of the last update (inf before any norm was recorded).
      norm: the pre-clip norm of the last update (the global norm, or each leaf's).
      paths: which leaves the rows belong to (``global_threshold=False``): a dict with
        one key, the selected leaves' paths in order, each ending in a newline, whose value is
        ``optax.EmptyState()``; ``{}`` with ``global_threshold=True``. The key is static
        under ``jit`` and saved with the state, and the field holds no arrays
        (``optax.tree_map_params`` hands it to ``transform_non_params`` as one subtree).
        ``update`` raises a ValueError naming the leaf when the updates' selected paths,
        or their order, are not those ``init`` saw, so that a renamed tree (or a dict
        reordered, an ``OrderedDict``) never takes another leaf's history. Leaves with
        the same paths in another order (a list reordered) cannot be told apart.
    """

    history: Array
    finite_count: Array
    threshold: Array
    norm: Array
    paths: dict[str, optax.EmptyState] | Array


def _history_clip(
    fn: str,
    statistic: Any,
    level: Any,
    history_length: int,
    global_threshold: bool,
    need_clip: _tree.NeedClip,
    axis_name: _axes.AxisNames,
) -> optax.GradientTransformation:
    """The autoclip package's clippers: each norm (the global one, or each leaf's) clipped
    at ``statistic(history, level)`` of its earlier finite norms, then recorded."""

    def init_fn(params: PyTree) -> HistoryClipState:
        f32, lead, paths = jnp.float32, (), {}
        if not global_threshold:
            sel = _tree.select(params, need_clip, what="adaptive clipping", params=True)
            lead = (len(sel.chosen),)
            # One node (cheap to flatten); each path ends in a newline, so that a tree
            # that is one array (path "") differs from a tree of no selected leaves.
            paths = {"".join(f"{p}\n" for p in sel.chosen_paths): optax.EmptyState()}
            if _tree.is_params_placeholder(params):
                # optax.tree_map_params' stand-in: a leaf, so that the real record (whose
                # keys it cannot know) reaches transform_non_params whole.
                paths = jnp.zeros((), jnp.int8)
        return HistoryClipState(
            jnp.full((*lead, history_length), jnp.nan, f32),
            jnp.zeros(lead, jnp.int32),
            jnp.full(lead, jnp.inf, f32),
            jnp.zeros(lead, f32),
            paths,
        )

    def update_fn(updates: PyTree, state: HistoryClipState, params: Any = None):
        del params
        sel = _tree.select(updates, need_clip, what="adaptive clipping")
        xs = [jnp.asarray(x) for x in sel.chosen]
        _check_history_state(state, sel.chosen_paths, global_threshold, fn)
        names = _axes.resolve(axis_name, sel, fn)
        paths = tuple(sel.chosen_paths)
        out, state = _history_step(xs, state, level, statistic, global_threshold, names, paths)
        return sel.rebuild(out), state

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _check_history_state(
    state: HistoryClipState, paths: Sequence[str], global_threshold: bool, fn: str
) -> None:
    """A ValueError where ``state`` was made for other leaves than ``paths``, in another
    order, or for the other kind of threshold: its rows would go to the wrong leaves."""
    if global_threshold != (np.ndim(state.norm) == 0 and np.ndim(state.history) == 1):
        kind = "one global history" if global_threshold else "per-leaf histories"
        raise ValueError(
            f"jaxclip.{fn}: this transformation keeps {kind}, but the state passed to update "
            f"was made by one with global_threshold={not global_threshold}. Initialise the "
            "state with this transformation's init."
        )
    if global_threshold:
        return
    if not isinstance(state.paths, dict) or len(state.paths) != 1:
        raise TypeError(
            f"jaxclip.{fn}: the state's paths field is not the one-key dict init makes; "
            "initialise the state with this transformation's init."
        )
    (key,) = state.paths
    saved = key.split("\n")[:-1]
    _tree.check_same_selection(saved, paths, fn)
    if len(saved) != len(paths):  # paths that join alike ("a/b" and "a" -> "b")
        raise ValueError(
            f"jaxclip.{fn}: the state has histories for {len(saved)} leaves, but update "
            f"selects {len(paths)}. {_tree.SAME_SELECTION_HINT}"
        )
    if saved != list(paths):
        at = next(i for i, (a, b) in enumerate(zip(saved, paths)) if a != b)
        raise ValueError(
            f"jaxclip.{fn}: update selects the leaf at {_tree.shown(paths[at])} in place "
            f"{at}, where init had the leaf at {_tree.shown(saved[at])}: the same leaves in "
            "another order (an OrderedDict, say) would take each other's histories. Pass "
            "the gradients in the order of the params given to init."
        )


@functools.partial(jax.jit, static_argnames=("statistic", "global_threshold", "axis_name", "paths"))
def _history_step(
    xs: list[Array],
    state: HistoryClipState,
    level: Any,
    statistic: Any,
    global_threshold: bool,
    axis_name: _norms.AxisName,
    paths: tuple[str, ...],
) -> tuple[list[Array], HistoryClipState]:
    """One step of :func:`_history_clip` (one compiled call, so an eager update costs one
    dispatch)."""
    count, history_length = state.finite_count, state.history.shape[-1]
    # The threshold comes from the earlier norms only; none yet: no clipping.
    threshold = jnp.where(count > 0, statistic(state.history, count, level), jnp.inf)
    if global_threshold:
        parts = _norms.global_norm_parts(xs, 2.0, axis_name=axis_name, paths=paths)
        norm = parts.value.astype(jnp.float32)
        out = _norms.clip_joint(xs, parts, threshold)
    else:
        kw = {"axis_name": axis_name, "paths": paths}
        out, norm = _norms.clip_leaves(xs, threshold, jnp.float32, **kw)
    finite = jnp.isfinite(norm)
    slot = jax.nn.one_hot(count % history_length, history_length, dtype=bool)
    history = jnp.where(finite[..., None] & slot, norm[..., None], state.history)
    count = count + finite.astype(jnp.int32)
    # float32 state whatever the hyperparameters' dtype (NumPy float64 under x64): scan
    # carries need init's dtypes.
    threshold = threshold.astype(state.threshold.dtype)
    return out, HistoryClipState(history, count, threshold, norm, state.paths)


def _quantile(history: Array, count: Array, q: Any) -> Array:
    del count
    return jnp.nanquantile(history, q, axis=-1)  # linear, as torch.quantile


def _scale_exponent(top: Array) -> Array:
    """``e`` with ``top * 2**-e`` in [0.5, 4) (0 for ``top = 0``), kept where ``2**e`` and
    ``2**-e`` are normal (XLA:CPU flushes subnormals)."""
    info = np.finfo(top.dtype)
    return jnp.where(top > 0, jnp.clip(_norms.frexp(top)[1], info.minexp + 2, info.maxexp - 2), 0)


def _moments(history: Array, n: Array, ddof: int) -> tuple[Array, Array]:
    """Mean and std (divisor ``n - ddof``) of the ``n`` non-NaN entries along the last
    axis, at any magnitude.

    The entries are scaled by a power of two near the largest (exactly), so that squares
    neither overflow nor underflow, and the mean's rounding is taken back out (the
    corrected two-pass sum of squares), so that close values do not lose the std to
    cancellation. The scale 2**e and its inverse stay normal (XLA:CPU flushes
    subnormals), so the largest entry is scaled to at most 4.
    """
    top = jnp.max(jnp.where(jnp.isnan(history), 0, history), axis=-1, keepdims=True)
    e = _scale_exponent(top)
    u = history * _norms.pow2(-e, history.dtype)
    mu = jnp.nanmean(u, axis=-1, keepdims=True)
    d = u - mu
    n = jnp.maximum(n, 1)
    sd = jnp.nansum(d, axis=-1)
    ss = jnp.nansum(d * d, axis=-1) - sd**2 / n
    scale = _norms.pow2(e[..., 0], history.dtype)
    mean = scale * (mu[..., 0] + sd / n)
    std = scale * jnp.sqrt(jnp.maximum(ss, 0) / jnp.maximum(n - ddof, 1))
    return mean, std


def _std_threshold(history: Array, count: Array, deviations: Any) -> Array:
    # torch.std (Bessel's n - 1); one recorded norm: the reference's std is NaN and
    # its step NaN; here no clipping until there are two.
    n = jnp.minimum(count, history.shape[-1]).astype(history.dtype)
    std = _moments(history, n, ddof=1)[1]
    return jnp.where(n >= 2, deviations * std, jnp.inf)


def quantile_clip(
    quantile: float = 0.9,
    history_length: StaticInt = _WINDOW,
    *,
    global_threshold: bool = False,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformation:
    """The autoclip package's ``QuantileClip``: each parameter's gradient (or, with
    ``global_threshold=True``, all of them together) clipped at a quantile of its own
    earlier norms.

    Per step, for each selected leaf (or the global norm): the threshold is the
    ``quantile`` (linear interpolation, as ``torch.quantile``) of the last
    ``history_length`` recorded norms (none yet: inf, the first step is never clipped);
    the gradient is scaled to at most the threshold; then its pre-clip norm is recorded.
    Unlike :func:`auto_clip` (the paper's), the current norm does not enter its own
    threshold. Deliberate difference from the reference: a non-finite norm is not
    recorded (the reference records it, and its threshold is NaN, so every step is NaN,
    until it leaves the history); the step itself is NaN (inf: scaled by 0) as in the
    reference. The scale is ``threshold / norm`` without torch's ``+ 1e-6``.

    Args:
      quantile: in ``[0, 1]``; 0.9 as in the reference.
      history_length: how many past norms are kept (per leaf), a Python int >= 1.
      global_threshold: clip the global norm at a quantile of the global norms' history
        (the reference's option of that name); False (the default) clips each leaf.
      need_clip: which leaves take part (see :func:`jaxclip.clip_by_value`).
      axis_name: the mapped axes the global norm is combined over: not needed under
        ``jit`` nor inside ``shard_map`` (each leaf over the mesh axes it varies
        across); under ``pmap`` or ``shard_map(check_vma=False)`` the axes the leaves
        are split over, per leaf where they differ (see :func:`jaxclip.clip_by_norm`).
        Every device then holds the same state.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`HistoryClipState`.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> tx = jaxclip.quantile_clip(0.5)
      >>> grads = {"a": jnp.array([1.0]), "b": jnp.array([10.0])}
      >>> state = tx.init(grads)
      >>> _, state = tx.update(grads, state)   # recorded: a 1, b 10
      >>> out, state = tx.update({"a": jnp.array([3.0]), "b": jnp.array([5.0])}, state)
      >>> out["a"], out["b"], state.threshold
      (Array([1.], dtype=float32), Array([5.], dtype=float32), Array([ 1., 10.], dtype=float32))

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source Separation
      Networks <https://arxiv.org/abs/2007.14469>`_, 2020; the ``autoclip`` package 0.2.1
      (HesitantlyHuman/autoclip ``autoclip/torch/quantile.py``, commit 34badefb)
    """
    _checks.check_quantile(quantile, "quantile_clip")
    n = _checks.static_size(history_length, "history_length", "quantile_clip")
    global_threshold = _checks.check_flag(global_threshold, "global_threshold", "quantile_clip")
    _checks.check_need_clip(need_clip, "quantile_clip")
    _axes.check(axis_name, "quantile_clip")
    return _history_clip(
        "quantile_clip", _quantile, quantile, n, global_threshold, need_clip, axis_name
    )


def standard_clip(
    deviations: float = 2.0,
    history_length: StaticInt = _WINDOW,
    *,
    global_threshold: bool = False,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformation:
    """The autoclip package's ``StandardClip``: each parameter's gradient (or, with
    ``global_threshold=True``, all of them together) clipped at ``deviations`` times the
    standard deviation of its own earlier norms.

    As :func:`quantile_clip`, with the threshold ``deviations * std`` of the last
    ``history_length`` recorded norms (``torch.std``: Bessel's ``n - 1``). Note that the
    reference's threshold is ``deviations * std``, not ``mean + deviations * std``; it is
    followed here, so that where every recorded norm is equal (constant gradients) the
    threshold is 0 and the update is zeroed, as the reference's is. Deliberate differences
    from the reference: with a single recorded norm
    the reference's ``std`` is NaN and so is its second step; here a step is not clipped
    until two norms are recorded; non-finite norms are not recorded; no ``+ 1e-6`` in the
    scale.

    Args:
      deviations: finite and >= 0; 2.0 as in the reference.
      history_length: how many past norms are kept (per leaf), a Python int >= 1.
      global_threshold: clip the global norm against the global norms' history; False
        (the default) clips each leaf.
      need_clip: which leaves take part (see :func:`jaxclip.clip_by_value`).
      axis_name: the mapped axes the global norm is combined over: not needed under
        ``jit`` nor inside ``shard_map`` (each leaf over the mesh axes it varies
        across); under ``pmap`` or ``shard_map(check_vma=False)`` the axes the leaves
        are split over, per leaf where they differ (see :func:`jaxclip.clip_by_norm`).
        Every device then holds the same state.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`HistoryClipState`.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> tx = jaxclip.standard_clip(1.0, global_threshold=True)
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in [1.0, 3.0, 10.0]:       # std of (1, 3) is 1.414
      ...     out, state = tx.update(jnp.array([g]), state)
      >>> round(float(out[0]), 4), round(float(state.threshold), 4)
      (1.4142, 1.4142)

    References:
      the ``autoclip`` package 0.2.1 (HesitantlyHuman/autoclip ``autoclip/torch/std.py``,
      commit 34badefb)
    """
    _checks.check_deviations(deviations, "standard_clip")
    n = _checks.static_size(history_length, "history_length", "standard_clip")
    global_threshold = _checks.check_flag(global_threshold, "global_threshold", "standard_clip")
    _checks.check_need_clip(need_clip, "standard_clip")
    _axes.check(axis_name, "standard_clip")
    return _history_clip(
        "standard_clip", _std_threshold, deviations, n, global_threshold, need_clip, axis_name
    )


def _selected(
    updates: PyTree, need_clip: _tree.NeedClip, axis_name: _axes.AxisNames, fn: str
) -> tuple[_tree.Selection, list[Array], Array, _norms.Norm]:
    """The selection, its leaves as arrays, and their global p-norm: as a float32 value
    (for the statistics) and exactly (for the scaling: a finite tree whose norm overflows
    float32 is still clipped, not zeroed)."""
    sel = _tree.select(updates, need_clip, what="adaptive clipping")
    xs = [jnp.asarray(x) for x in sel.chosen]
    names, paths = _axes.resolve(axis_name, sel, fn), tuple(sel.chosen_paths)
    parts = _norms.global_norm_parts(xs, 2.0, axis_name=names, paths=paths)
    return sel, xs, parts.value.astype(jnp.float32), parts


class ZClipState(NamedTuple):
    """State of :func:`zclip`.

    Attributes:
      mean: exponential moving mean of the (clipped) global norm.
      var: exponential moving variance of the (clipped) global norm, the reference's
        ``var``; ``std**2`` as float32 rounds it (inf beyond norms of ~1.8e19, 0 below
        ~1e-19).
      warmup: the finite norms seen during warm-up (NaN where not yet seen).
      finite_count: how many finite norms were seen in all.
      threshold: the norm the last update was clipped to (its pre-clip norm if none).
      global_norm: the pre-clip global norm of the last update.
      std: the moving standard deviation, exact where ``var`` cannot hold its square.
        The update uses it while ``var == std**2`` (as the update leaves them), and
        ``sqrt(var)`` otherwise: to start from given statistics, past the warm-up, set
        ``mean``, ``var`` and ``finite_count`` (``state._replace(mean=1.0, var=0.25,
        finite_count=warmup_steps)``, as the reference's tests set ``zclip.mean``,
        ``zclip.var`` and ``zclip.initialized``); ``None`` (a state built without it,
        which the update keeps so) is ``sqrt(var)``.
    """

    mean: Array
    var: Array
    warmup: Array
    finite_count: Array
    threshold: Array
    global_norm: Array
    std: Array | None = None


def _ema_std(std: Array, d: Array, alpha: Any) -> Array:
    """``sqrt(alpha std**2 + (1 - alpha) d**2)`` without squaring: a hypot of the terms
    scaled by a power of two near the larger, so that neither they nor their products
    leave float32's normal range at any magnitude."""
    e = _scale_exponent(jnp.maximum(std, jnp.abs(d)).astype(jnp.float32))
    down, up = _norms.pow2(-e, jnp.float32), _norms.pow2(e, jnp.float32)
    return up * jnp.hypot(jnp.sqrt(alpha) * (std * down), jnp.sqrt(1 - alpha) * (d * down))


def _zclip_std(state: ZClipState) -> Array:
    """The std the update starts from: ``state.std`` while ``var`` is its square."""
    root = jnp.sqrt(state.var)
    if state.std is None:
        return root
    return jnp.where(jnp.square(state.std) == state.var, state.std, root)


_UNSET: Any = object()  # max_norm, the old name of max_grad_norm, not given


def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: StaticInt = _WARMUP,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    *,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
    max_norm: Any = _UNSET,
) -> optax.GradientTransformation:
    """ZClip: clips global-norm spikes detected against moving statistics of the norm.

    The reference package's algorithm (``ZClip`` in bluorion-com/ZClip ``zclip/zclip.py``),
    with its options under its names, in its positional order (``zclip(0.97, 2.5, 2.0)``
    caps at 2.0, as ``ZClip(0.97, 2.5, 2.0)``), and its defaults. During the first ``warmup_steps``
    finite norms only statistics are gathered (each step capped at ``max_grad_norm``); then
    ``mean`` and ``var`` start as their mean and population variance. After that, with
    ``std = sqrt(var)`` and the global norm ``n``:

    - ``mode="zscore"``: ``z = (n - mean) / (std + eps)``; where ``z > z_thresh`` the
      norm is a spike and is clipped to

      - ``clip_option="adaptive_scaling"``: ``clip_factor * (mean + z_thresh**2 * std / z)``
        (the further out, the harder the clip; the reference multiplies the whole
        threshold by ``clip_factor``, so we do too);
      - ``clip_option="mean"``: ``mean``;

    - ``mode="percentile"``: where ``n > mean + z_thresh * std`` (no ``eps``) the norm is
      a spike and is clipped to ``mean + z_thresh * std`` (``clip_option`` and
      ``clip_factor`` unused, as in the reference).

    Every step is also capped at ``max_grad_norm`` (None: no cap). The statistics then take
    the spike's threshold in place of the norm (``max_grad_norm`` left out), unless
    ``skip_update_on_spike``: ``mean <- alpha mean + (1 - alpha) n'`` and
    ``var <- alpha var + (1 - alpha) (n' - mean)**2`` with the new mean, computed on the
    std (``hypot``) so that norms of any magnitude keep it (see :class:`ZClipState`).

    Deliberate differences from the reference: non-finite norms never enter the
    statistics nor count as warm-up steps (the reference records a NaN, after which every
    statistic is NaN for good; an inf norm is scaled by 0 like the reference does, but
    leaves its variance alone), the scale is ``threshold / n`` without the reference's
    ``+ 1e-6`` in the denominator (as every jaxclip mode), and ``warmup_steps`` must be
    >= 1 (the reference's 0 behaves as 1). ``max_grad_norm`` was called ``max_norm``
    (default None) before; ``max_norm=`` still works.

    Args:
      alpha: the moving-average factor, in ``[0, 1)``.
      z_thresh: the z-score above which a norm is a spike, > 0.
      warmup_steps: finite norms gathered before clipping starts, >= 1.
      max_grad_norm: a fixed cap on the global norm of every step, > 0, or None; 1.0 as in
        the reference.
      eps: added to ``std`` in the z-score; finite and >= 0.
      mode: ``"zscore"`` or ``"percentile"`` (above).
      clip_option: ``"adaptive_scaling"`` or ``"mean"``, for ``mode="zscore"``.
      clip_factor: multiplies the adaptive-scaling threshold, > 0.
      skip_update_on_spike: leave the statistics as they are on a spike.
      need_clip: which leaves take part (see :func:`jaxclip.clip_by_value`).
      axis_name: the mapped axes the global norm is combined over: not needed under
        ``jit`` nor inside ``shard_map`` (each leaf over the mesh axes it varies
        across); under ``pmap`` or ``shard_map(check_vma=False)`` the axes the leaves
        are split over, per leaf where they differ (see :func:`jaxclip.clip_by_norm`).
        Every device then holds the same state.
      max_norm: the former name of ``max_grad_norm``.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`ZClipState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxclip
      >>> tx = jaxclip.zclip(warmup_steps=2, max_grad_norm=None)
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in [1.0, 3.0, 30.0]:   # warm-up: mean 2, var 1; then z = 28
      ...     out, state = tx.update(jnp.array([g]), state)
      >>> round(float(out[0]), 4)      # clipped to 2 + 2.5**2 * 1 / 28
      2.2232

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025; the ``zclip`` package 1.0.0
      (bluorion-com/ZClip ``zclip/zclip.py``, commit 584ce4f5)
    """
    cap_name = "max_grad_norm"
    if max_norm is not _UNSET:
        if not (isinstance(max_grad_norm, float) and max_grad_norm == 1.0):
            raise ValueError(
                "jaxclip.zclip: pass max_grad_norm only (max_norm is its former name)."
            )
        max_grad_norm, cap_name = max_norm, "max_norm"
    _checks.check_alpha(alpha, "zclip")
    _checks.check_z_thresh(z_thresh, "zclip")
    _checks.check_zclip_eps(eps, "zclip")
    warmup_steps = _checks.static_size(warmup_steps, "warmup_steps", "zclip")
    skip_update_on_spike = _checks.check_flag(skip_update_on_spike, "skip_update_on_spike", "zclip")
    _checks.check_need_clip(need_clip, "zclip")
    _axes.check(axis_name, "zclip")
    mode = _checks.check_choice(mode, "mode", ("zscore", "percentile"), "zclip")
    clip_option = _checks.check_choice(
        clip_option, "clip_option", ("adaptive_scaling", "mean"), "zclip"
    )
    _checks.check_positive(
        clip_factor, "clip_factor", "zclip", "it multiplies the adaptive threshold; 1.0 leaves it"
    )
    if max_grad_norm is not None:
        _checks.check_cap(max_grad_norm, cap_name, "zclip")
    cap = jnp.inf if max_grad_norm is None else max_grad_norm

    def init_fn(params: PyTree) -> ZClipState:
        del params

        # A new buffer per field (never one array in two fields), so that the state can be
        # donated: jax.jit(tx.update, donate_argnums=(1,)).
        def zero() -> Array:
            return jnp.zeros((), jnp.float32)

        nan = jnp.full((warmup_steps,), jnp.nan, jnp.float32)
        count = jnp.zeros((), jnp.int32)
        return ZClipState(zero(), zero(), nan, count, zero(), zero(), zero())

    def update_fn(updates: PyTree, state: ZClipState, params: Any = None):
        del params
        sel, xs, norm, parts = _selected(updates, need_clip, axis_name, "zclip")
        if max_grad_norm is not None:
            _checks.check_joint_norm_range(max_grad_norm, cap_name, xs, "zclip")
        finite = jnp.isfinite(norm)
        # An array even where a state was edited with a Python int (the docstring's recipe):
        # `~` of a Python bool is not a logical not.
        seen = jnp.asarray(state.finite_count)
        warming = seen < warmup_steps
        std = _zclip_std(state)
        if mode == "percentile":
            limit = state.mean + z_thresh * std
            spike = norm > limit
        else:
            z = (norm - state.mean) / (std + eps)
            spike = z > z_thresh
            if clip_option == "mean":
                limit = state.mean
            else:
                # std * (z_thresh / z) first: z_thresh**2 * std overflows near float32's
                # top, where the limit itself (below the norm) does not.
                safe_z = jnp.where(spike, z, 1.0)
                limit = clip_factor * (state.mean + std * (z_thresh / safe_z) * z_thresh)
        spike = ~warming & spike
        adaptive = jnp.where(spike, limit, norm)
        threshold = jnp.minimum(adaptive, cap)
        clipped = sel.rebuild(_norms.clip_joint(xs, parts, threshold))

        old = jnp.asarray(state.warmup)  # a NumPy array in a state restored from a checkpoint
        warmup = jnp.where(warming & finite, old.at[seen % warmup_steps].set(norm), old)
        ready = warming & finite & (seen + 1 == warmup_steps)
        mean0, std0 = _moments(warmup, jnp.asarray(warmup_steps, warmup.dtype), ddof=0)
        mean1 = alpha * state.mean + (1 - alpha) * adaptive
        std1 = _ema_std(std, adaptive - mean1, alpha)
        tracking = ~warming & finite
        if skip_update_on_spike:
            tracking = tracking & ~spike
        mean = jnp.where(ready, mean0, jnp.where(tracking, mean1, state.mean))
        std = jnp.where(ready, std0, jnp.where(tracking, std1, std))
        count = seen + finite.astype(jnp.int32)
        # float32 state whatever the hyperparameters' dtype (NumPy float64 under x64):
        # scan carries need init's dtypes.
        mean, std, threshold = (v.astype(jnp.float32) for v in (mean, std, threshold))
        # A state built without std (six fields) stays so: loop carries keep their structure.
        kept = None if state.std is None else std
        return clipped, ZClipState(mean, jnp.square(std), warmup, count, threshold, norm, kept)

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


class SkipLargeUpdatesState(NamedTuple):
    """State of :func:`skip_large_updates`.

    Attributes:
      inner_state: the wrapped transformation's state (untouched on skipped steps).
      skipped: how many steps were skipped in all.
      consecutive: how many steps in a row, up to now, were over the threshold or
        non-finite (skipped, or applied past ``max_consecutive_errors``); 0 after a good
        step. ``optax.apply_if_finite``'s ``notfinite_count``.
      global_norm: the incoming global norm of the last update.
    """

    inner_state: Any
    skipped: Array
    consecutive: Array
    global_norm: Array


def skip_large_updates(
    inner: optax.GradientTransformation,
    threshold: float = math.inf,
    *,
    max_consecutive_errors: int | None = None,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformation:
    """Skips steps whose incoming global norm is above ``threshold`` or non-finite.

    A step whose norm is inf or NaN is always skipped; with the default
    ``threshold=inf`` only those are, which is ``optax.apply_if_finite``. On a skipped
    step the updates are zeros and ``inner``'s state is left as it was, so (unlike
    zeroing the gradients) Adam's moments do not decay and its step count does not
    advance.

    ``max_consecutive_errors`` is ``optax.apply_if_finite``'s: once more than that many
    bad steps (over the threshold or non-finite) come in a row, the step is applied after
    all (and so is every further bad step, until a good one resets the count). Giving up
    by applying, rather than raising, is apply_if_finite's choice and works inside
    ``jit`` without a host callback; watch ``consecutive`` in the state to stop a run
    instead. ``None`` (the default) skips for ever. With ``threshold=inf`` the updates,
    the inner state and ``consecutive`` equal ``optax.apply_if_finite``'s (its
    ``notfinite_count``) step for step; ``skipped`` counts the steps actually skipped,
    where apply_if_finite's ``total_notfinite`` also counts bad steps applied past
    ``max_consecutive_errors``.

    Args:
      inner: the transformation to wrap (e.g. ``optax.adamw(1e-3)``).
      threshold: the largest global norm of a step that is applied, > 0; ``inf`` (the
        default) skips only non-finite steps.
      max_consecutive_errors: how many bad steps in a row are skipped before one is
        applied, an int >= 0 (may be traced), or None to never apply a bad step.
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which leaves count towards the norm (see :func:`jaxclip.clip_by_value`).
      axis_name: the mapped axes the global norm is combined over: not needed under
        ``jit`` nor inside ``shard_map`` (each leaf over the mesh axes it varies
        across); under ``pmap`` or ``shard_map(check_vma=False)`` the axes the leaves
        are split over, per leaf where they differ (see :func:`jaxclip.clip_by_norm`).
        Every device then holds the same state.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`SkipLargeUpdatesState`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxclip
      >>> tx = jaxclip.skip_large_updates(optax.sgd(1.0), threshold=10.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> out, state = tx.update(jnp.array([30.0, 40.0]), state)
      >>> out, int(state.skipped)
      (Array([0., 0.], dtype=float32), 1)

    References:
      ``optax.apply_if_finite`` (``optax/transforms/_conditionality.py``)
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        what = getattr(inner, "__name__", type(inner).__name__)
        hint = f" Call it: {what}(...) builds one." if callable(inner) else ""
        raise TypeError(
            f"jaxclip.skip_large_updates: inner={what} is not an optax.GradientTransformation "
            f"(it has no init and update).{hint} E.g. skip_large_updates(optax.adam(1e-3), 10.0)."
        )
    _checks.check_threshold(threshold, "skip_large_updates")
    _checks.check_need_clip(need_clip, "skip_large_updates")
    _axes.check(axis_name, "skip_large_updates")
    p = _checks.check_norm_type(norm_type)
    if max_consecutive_errors is not None:
        _checks.check_count(max_consecutive_errors, "max_consecutive_errors", "skip_large_updates")
    limit = max_consecutive_errors

    def init_fn(params: PyTree) -> SkipLargeUpdatesState:
        # A new buffer per field, so that the state can be donated.
        return SkipLargeUpdatesState(
            inner.init(params),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.float32),
        )

    def update_fn(updates: PyTree, state: SkipLargeUpdatesState, params: Any = None, **extra: Any):
        sel = _tree.select(updates, need_clip, what="spike skipping")
        names = _axes.resolve(axis_name, sel, "skip_large_updates")
        xs, paths = [jnp.asarray(x) for x in sel.chosen], tuple(sel.chosen_paths)
        _checks.check_joint_norm_range(threshold, "threshold", xs, "skip_large_updates")
        parts = _norms.global_norm_parts(xs, p, axis_name=names, paths=paths)
        norm = parts.value.astype(jnp.float32)
        # Finite from frac: a finite norm beyond float32's range is inf as a value but is
        # not an error (it is over any finite threshold, and applied with threshold=inf).
        bad = ~(jnp.isfinite(parts.frac) & (parts.value <= threshold))
        consecutive = jnp.where(bad, state.consecutive + 1, 0)
        skip = bad if limit is None else bad & (consecutive <= limit)
        new_updates, new_inner = optax.with_extra_args_support(inner).update(
            updates, state.inner_state, params, **extra
        )
        out = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
        inner_state = jax.tree.map(
            lambda old, new: jnp.where(skip, old, new), state.inner_state, new_inner
        )
        skipped = state.skipped + skip.astype(jnp.int32)
        return out, SkipLargeUpdatesState(inner_state, skipped, consecutive, norm)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
