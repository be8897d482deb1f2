"""Per-example clipping (DP-SGD): :func:`clip_tree_per_example` and :func:`clip_per_example`.

Each example's gradient (a slice along a leading batch axis of every selected leaf) is
clipped to ``clip_norm``, then the examples are summed or averaged. The clipped examples
are never materialised when reducing: each leaf is contracted with the vector of
per-example factors (a matrix-vector product), so the only pass over the gradients
besides the norm is the product itself. Norms come from ``_norms.per_example_norm_parts``
and factors from ``_norms.clip_factor``, as for every other mode.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxclip import _axes, _checks, _norms, _tree
from jaxclip._checks import NormType

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PyTree = Any
Reduce = Literal["sum", "mean"] | None
Group = Callable[[str, Any], Hashable] | None


class ClipPerExampleState(NamedTuple):
    """State of :func:`clip_per_example`.

    Attributes:
      norms: the pre-clip norm of each example of the last update, float32 of shape
        ``(batch_size,)`` (a dict label -> such an array with ``group``); None when the
        transformation was built without ``batch_size``.
      clipped_fraction: the fraction of the last update's examples that were clipped,
        a float32 scalar (a dict label -> scalar with ``group``); inside ``shard_map``
        with the batch split across devices, of the whole batch on every device.
      key: the PRNG key of the next update's noise.
    """

    norms: Array | dict[Hashable, Array] | None
    clipped_fraction: Array | dict[Hashable, Array]
    key: Array


def check_common(clip_norm: Any, norm_type: Any, reduce: Any, group: Any, fn: str) -> float:
    """The checks both entry points share; returns the norm type as a float."""
    if isinstance(clip_norm, Mapping):
        if group is None:
            raise ValueError(
                f"jaxclip.{fn}: clip_norm is a dict ({list(clip_norm)!r}), which maps group "
                "labels to clip norms, but group is None. Pass group=... (a callable "
                "group(path, leaf) -> label), or one clip_norm for every example."
            )
        for label, value in clip_norm.items():
            _checks.check_clip_norm(value, fn, f"clip_norm[{label!r}]")
    else:
        _checks.check_clip_norm(clip_norm, fn)
    p = _checks.check_norm_type(norm_type)
    _check_reduce(reduce, fn)
    _checks.check_callable(group, "group", fn, "group(path, leaf) -> label")
    return p


def _check_reduce(reduce: Any, fn: str) -> None:
    if reduce not in ("sum", "mean", None):
        raise ValueError(
            f'jaxclip.{fn}: reduce={reduce!r}; pass "sum", "mean" or None (keep the batch axis).'
        )


def per_label_clip_norms(clip_norm: Any, labels: Sequence[Hashable], fn: str) -> list[Any]:
    """The clip norm of each label, in the order of ``labels``: ``clip_norm`` for every
    label, or, for a dict, its value per label (a ValueError naming a label that the dict
    misses or one that no selected leaf has)."""
    if not isinstance(clip_norm, Mapping):
        return [clip_norm] * len(labels)
    missing = [label for label in labels if label not in clip_norm]
    if missing:
        raise ValueError(
            f"jaxclip.{fn}: clip_norm has no value for the group label {missing[0]!r} "
            f"(the labels of the selected leaves are {list(labels)!r}, clip_norm's keys "
            f"{list(clip_norm)!r}). Add clip_norm[{missing[0]!r}]."
        )
    extra = [label for label in clip_norm if label not in labels]
    if extra:
        raise ValueError(
            f"jaxclip.{fn}: clip_norm has a value for the label {extra[0]!r}, but no selected "
            f"leaf has that label (group gives {list(labels)!r}). Remove it, or check group "
            "and need_clip."
        )
    return [clip_norm[label] for label in labels]


def sensitivity(clip_norm: Any) -> Any:
    """The L2 sensitivity of a sum of clipped examples: ``clip_norm``, or with a dict of
    per-group clip norms ``sqrt(sum_g c_g**2)`` (each group of an example is clipped to
    its own ``c_g``, so the example's joint norm is at most that)."""
    if not isinstance(clip_norm, Mapping):
        return clip_norm
    values = list(clip_norm.values())
    if all(_checks.concrete(v) is not None for v in values):
        return math.sqrt(sum(float(v) ** 2 for v in values))
    return jnp.sqrt(sum(jnp.square(jnp.asarray(v, jnp.float32)) for v in values))


def check_noise_norm(p: float, noisy: bool, norm_type: Any, fn: str) -> None:
    """Gaussian noise of ``noise_multiplier * clip_norm`` is calibrated to an L2
    sensitivity of ``clip_norm``: true for p-norms with ``p <= 2`` (an example's L2 norm
    is at most its p-norm), not above, where an example clipped to p-norm ``c`` can have
    L2 norm ``c * d**(1/2 - 1/p)`` (``d`` its entries; ``c * sqrt(d)`` for ``inf``)."""
    if noisy and p > 2:
        raise ValueError(
            f"jaxclip.{fn}: norm_type={norm_type!r} with noise: the noise's standard "
            "deviation noise_multiplier * clip_norm assumes each clipped example has L2 "
            "norm <= clip_norm, but an example clipped to a p-norm of clip_norm with p > 2 "
            "can have L2 norm clip_norm * d**(1/2 - 1/p) (d: its number of entries), so "
            "the noise would buy less privacy than accounted. Use norm_type=2 (or any "
            "p <= 2), or noise_multiplier=0 and add noise for that sensitivity yourself."
        )


def _batch_size(leaves: Sequence[Any], paths: Sequence[str], fn: str) -> int | None:
    """The common leading-axis length of ``leaves``, or a ValueError naming the leaf path
    where there is no batch axis or where it differs."""
    batch, first = None, ""
    for x, path in zip(leaves, paths):
        shape = np.shape(x)
        if not shape:
            raise ValueError(
                f"jaxclip.{fn}: the leaf at {_tree.shown(path)} is a scalar, but per-example "
                "gradients need a leading batch axis on every leaf that is reduced. Compute "
                "them with jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch), or "
                "exclude the leaf with need_clip."
            )
        if batch is None:
            batch, first = shape[0], path
        elif shape[0] != batch:
            raise ValueError(
                f"jaxclip.{fn}: the leaf at {_tree.shown(path)} has batch size {shape[0]} (its "
                f"leading axis), but the leaf at {_tree.shown(first)} has {batch}. Every "
                "reduced leaf needs the same leading batch axis (per-example gradients from "
                "jax.vmap have it)."
            )
    return batch


def draws_noise(noise_multiplier: Any) -> bool:
    """Whether a noised mode draws noise: where its multiplier is above 0, or traced
    (``optax.inject_hyperparams``), where the noise is drawn times its value (0 adds
    exactly 0)."""
    value = _checks.concrete(noise_multiplier)
    return value is None or float(value) > 0


def _weights(scale: _norms.Factor, clip_norm: Any, batch: int) -> tuple[Array, Array]:
    """Per example, 1 where it is kept, else its factor ``c / n`` (rounded once), all times
    ``2**k``, and ``2**-k``. ``k`` is 0 unless some factor is below the normal range (a
    norm above ``c * 2**126`` in float32: formed as a number, XLA:CPU would flush it to
    0, and the example with it); then every weight is lifted by ``2**k``, as far as the
    sum allows and while ``2**-k`` stays normal (``k <= 126`` in float32): each term
    ``w x`` is at most ``c`` in magnitude (a p-norm bounds every element), so
    ``batch * c * 2**k`` must stay finite. A factor still below the normal range after
    the lift (``c / n < 2**(-126 - k)``) is flushed, as XLA:CPU flushes subnormals."""
    w = jnp.where(scale.keep, jnp.ones_like(scale.f0), scale.f0 * scale.f1)
    low = ~scale.keep & (w < np.finfo(w.dtype).tiny)  # false for NaN, which propagates
    c = jnp.maximum(jnp.asarray(clip_norm, w.dtype), np.finfo(w.dtype).tiny)
    room = np.finfo(w.dtype).maxexp - 2 - max(batch, 1).bit_length() - _norms.frexp(c)[1]
    k = jnp.where(jnp.any(low), jnp.clip(room, 0, -np.finfo(w.dtype).minexp), 0)
    lift = _norms.pow2(k, w.dtype)
    lifted = jnp.where(low, scale.f0 * (scale.f1 * lift), w * lift)
    return lifted, 1 / lift


def _clipped_contract(
    xs: Sequence[Array], scale: _norms.Factor, clip_norm: Array, mask: Array | None
) -> list[Array]:
    """Per ``x`` of ``xs``, ``sum_b x[b]`` clipped by example ``b``'s factor (weight 0
    where ``mask`` is False), in the accumulation dtype: the weights, lifted where some
    factor is below the normal range (:func:`_weights`), contracted with each ``x``."""
    w, unlift = _weights(scale, clip_norm, xs[0].shape[0])
    w = w if mask is None else jnp.where(mask, w, 0)
    return [total * unlift for total in _contract(w, xs)]  # exact: a power of two


def _contract(w: Array, xs: Sequence[Array]) -> list[Array]:
    """``sum_b w[b] * x[b]`` for each ``x`` of ``xs``, as one matrix-vector product each,
    accumulated and returned in the accumulation dtype of ``x`` (float32 for 16-bit
    leaves) with no widened copy of ``x``; the bfloat16 ones share one split of ``w``.
    ``HIGHEST`` keeps float32 dots in float32 on GPU/TPU (no TF32/bf16 passes).
    """
    out: list[Any] = [None] * len(xs)
    split = []
    for i, x in enumerate(xs):
        acc = _norms.acc_dtype(x.dtype)
        if not _norms.one_device(x):
            # A sharded batch axis (Explicit mesh axes): a contraction over it needs an
            # output sharding; a weighted sum over it (fused, no copy) is reduced across
            # devices. A complex x stays complex (acc is its parts' dtype).
            kept = (x.shape[0],) + (1,) * (x.ndim - 1)
            wide = jnp.promote_types(acc, x.dtype)
            out[i] = jnp.sum(w.astype(acc).reshape(kept) * x.astype(wide), axis=0)
        elif jnp.iscomplexobj(x):
            high = lax.Precision.HIGHEST
            out[i] = lax.dot_general(w.astype(x.dtype), x, _BATCH, precision=high)
        elif x.dtype == jnp.bfloat16:
            split.append(i)
        elif x.dtype.itemsize < 4 and x.ndim > 1:  # float16, float8
            out[i] = lax.platform_dependent(w, x, cpu=_contract_looped, default=_dot)
        else:
            out[i] = _dot(w, x)
    if split:
        # Chosen per platform when lowering, like the reductions in _norms.
        parts = [xs[i] for i in split]
        done = lax.platform_dependent(w, *parts, cpu=_contract_split, default=_contract_wide)
        for i, total in zip(split, done):
            out[i] = total
    return out


_BATCH = (((0,), (0,)), ((), ()))


def _dot(w: Array, x: Array) -> Array:
    """The contraction as one dot accumulating in ``x``'s accumulation dtype."""
    acc = _norms.acc_dtype(x.dtype)
    high = lax.Precision.HIGHEST
    return lax.dot_general(w.astype(acc), x, _BATCH, precision=high, preferred_element_type=acc)


#: :func:`_contract_looped` upcasts blocks of about this many elements (64 KiB in float32)...
LOOP_BLOCK = 1 << 14
#: ... of at least this many columns: narrower blocks (batches of thousands) loop slower
#: than the widened copy is written.
LOOP_MIN_COLUMNS = 256


def _contract_looped(w: Array, x: Array) -> Array:
    """The contraction of a float16 (or 8-bit) ``x`` on XLA:CPU, which widens such an
    operand of a dot (of any operand dtype) into a float32 copy of the whole leaf: the
    same dot over blocks of ``x``'s columns (:data:`LOOP_BLOCK`, :data:`LOOP_MIN_COLUMNS`),
    each block upcast on its own. The blocks are ``lax.map``'s outputs, not a carry, so
    that inside ``shard_map`` they vary over the devices as ``x`` does."""
    batch = x.shape[0]
    flat = x.reshape(batch, math.prod(x.shape[1:]))  # not -1: a batch may be empty
    size = flat.shape[1]
    width = max(LOOP_MIN_COLUMNS, LOOP_BLOCK // max(batch, 1))
    blocks = size // width
    if blocks < 2 or batch == 0:
        return _dot(w, x)

    def block(i: Array) -> Array:
        return _dot(w, lax.dynamic_slice_in_dim(flat, i * width, width, axis=1))

    out = lax.map(block, jnp.arange(blocks)).reshape(-1)
    if blocks * width < size:
        out = jnp.concatenate([out, _dot(w, flat[:, blocks * width :])])
    return out.reshape(x.shape[1:])


def _contract_wide(w: Array, *xs: Array) -> list[Array]:
    """The bfloat16 contractions off CPU: in float32, each ``x`` converted inside the dot,
    which XLA:GPU fuses. On an H100 the per-example bfloat16 MLP gradients of
    ``benchmarks/bench_per_example.py`` (batch 64) then need 0.2 MB of temporaries, against
    3.2 MB for :func:`_contract_split` (its three float32 outputs)."""
    return [_dot(w, x.astype(_norms.acc_dtype(x.dtype))) for x in xs]


def _contract_split(w: Array, *xs: Array) -> list[Array]:
    """The bfloat16 contractions for XLA:CPU, which widens a bfloat16 operand of a
    mixed-precision dot into a float32 copy; a bfloat16 dot accumulating in float32 does
    not, so ``w`` is split (once for all ``xs``) into three bfloat16 parts whose sum is
    ``w`` to 2**-26 (each part's product with ``x`` is exact in float32), summed after the
    dot. Factors below 2**-100 (norms over ~1e30 times ``clip_norm``) are split as ``w *
    2**24``, the sum divided back: XLA:CPU flushes the float32 subnormals that their parts
    would be. Every term ``w[b] * x[b]`` is at most ``clip_norm`` in norm, so the scaled
    ones stay finite."""
    w = w.astype(jnp.float32)
    tiny = jnp.min(jnp.where(w > 0, w, 1), initial=1.0) < 2.0**-100  # initial: no examples
    scale = jnp.where(tiny, jnp.float32(2.0**24), jnp.float32(1))
    w = w * scale
    hi = w.astype(jnp.bfloat16)
    r = w - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    lo = (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    parts = jnp.stack([hi, mid, lo])
    dims = (((1,), (0,)), ((), ()))
    high = lax.Precision.HIGHEST
    return [
        jnp.sum(
            lax.dot_general(parts, x, dims, precision=high, preferred_element_type=jnp.float32),
            0,
        )
        * (1 / scale)  # exact: a power of two, one division
        for x in xs
    ]


def clip_examples(
    grads: PyTree,
    clip_norm: Any,
    p: float,
    need_clip: _tree.NeedClip,
    group: Group,
    reduce: Reduce,
    noise_std: Any,
    key: Array | None,
    fn: str,
    axis_name: _axes.AxisNames = None,
    *,
    weights: Array | None = None,
    keep_acc: bool = False,
) -> tuple[PyTree, dict[Hashable, Array], dict[Hashable, Array], int | None]:
    """The work of both public functions: ``(tree, norms, clipped_fractions, batch)``, with
    per-label norms and fractions (one label, None, without ``group``). Noise of standard
    deviation ``noise_std`` is added to the selected leaves' sums when ``key`` is given.

    For :func:`jaxclip.clipped_grad`'s microbatches: ``weights`` (a bool per example)
    leaves out the examples where it is False (padding: weight 0 in the sums, not counted
    in the clipped fraction); ``keep_acc`` returns the sums unrounded, in the
    accumulation dtype (float32 for 16-bit leaves), and unaveraged."""
    sel = _tree.select(grads, need_clip, what="per-example clipping", view=_tree.one_example)
    xs = [jnp.asarray(x) for x in sel.chosen]
    # Unselected floating leaves are reduced too (not clipped): they need the batch axis.
    rest = [
        i
        for i, (x, s) in enumerate(zip(sel.leaves, sel.selected))
        if not s and reduce is not None and is_float(x)
    ]
    batch = _batch_size(
        [*xs, *(sel.leaves[i] for i in rest)],
        [*sel.chosen_paths, *(sel.paths[i] for i in rest)],
        fn,
    )
    if batch == 0 and reduce == "mean":
        raise ValueError(
            f"jaxclip.{fn}: the per-example gradients have batch size 0, and the mean over "
            "no examples is undefined (NaN, or inf with noise). Do not skip the step (with "
            "Poisson sampling, skipping reveals that the batch was empty): use "
            'reduce="sum" and divide by the expected batch size (Opacus\' '
            "expected_batch_size), which still adds the noise."
        )
    if group is None:
        labels, per_leaf = [None], [None] * len(xs)
    else:
        labels, per_leaf = _tree.group_labels(group, sel)
    members = tuple(tuple(i for i, lab in enumerate(per_leaf) if lab == label) for label in labels)
    clip_norms = per_label_clip_norms(clip_norm, labels, fn)
    for group_members, label, c in zip(members, labels, clip_norms):
        name = "clip_norm" if group is None else f"clip_norm[{label!r}]"
        _checks.check_joint_norm_range(c, name, [xs[i] for i in group_members], fn)
    rest_xs = [jnp.asarray(sel.leaves[i]) for i in rest]
    outs, rest_outs, norms, fractions = _arrays(
        xs,
        rest_xs,
        clip_norms,
        noise_std,
        key,
        weights,
        keep_acc=keep_acc,
        p=p,
        members=members,
        reduce=reduce,
        batch=batch,
        axis_name=_axes.resolve(axis_name, sel, fn),
        paths=tuple(sel.chosen_paths),
    )
    leaves = list(sel.leaves)
    for i, y in zip([*sel.indices, *rest], [*outs, *rest_outs]):
        leaves[i] = y
    if reduce is not None:
        done = {*sel.indices, *rest}
        for i, x in enumerate(sel.leaves):
            if i not in done:
                leaves[i] = _reduce_other(x, sel.paths[i], fn)
    return (
        sel.treedef.unflatten(leaves),
        dict(zip(labels, norms)),
        dict(zip(labels, fractions)),
        batch,
    )


@functools.partial(
    jax.jit, static_argnames=("p", "members", "reduce", "batch", "axis_name", "paths", "keep_acc")
)
def _arrays(
    xs: list[Array],
    rest: list[Array],
    clip_norms: list[Any],
    noise_std: Any,
    key: Array | None,
    weights: Array | None = None,
    *,
    keep_acc: bool = False,
    p: float,
    members: tuple[tuple[int, ...], ...],
    reduce: Reduce,
    batch: int | None,
    axis_name: _norms.AxisName,
    paths: tuple[str, ...],
) -> tuple[list[Array], list[Array], list[Array], list[Array]]:
    """The array work, one compiled call (so eager use is one dispatch): per group of
    ``members`` (indices into ``xs``), with that group's entry of ``clip_norms``, the
    per-example norms, factors and clipped fraction; then each selected leaf scaled
    (``reduce=None``) or contracted with its factors, plus noise when ``key`` is given;
    the unselected ``rest`` summed unclipped. Examples whose ``weights`` are False get
    weight 0 (see :func:`clip_examples`)."""
    norms, fractions = [], []
    scales: list[Any] = [None] * len(xs)
    parts: list[Any] = [None] * len(xs)
    limits: list[Any] = [None] * len(xs)
    for group, clip_norm in zip(members, clip_norms):
        if group:
            n = _norms.per_example_norm_parts(
                [xs[i] for i in group],
                p,
                axis_name=_norms.leaves_axes(axis_name, group),
                paths=tuple(paths[i] for i in group),
            )
        else:  # nothing selected: every example has norm 0
            n = _norms.as_norm(jnp.zeros((batch or 0,), jnp.float32))
        scale = _norms.clip_factor(n, clip_norm)
        if weights is None:
            # An empty batch (Poisson sampling) clips nothing: 0, not the mean's NaN.
            count = jnp.sum(~scale.keep, dtype=jnp.float32)
            fraction = count / max(scale.keep.shape[0], 1)
        else:  # the fraction of the real examples (a sum here, see clipped_grad)
            fraction = jnp.sum(~scale.keep & weights, dtype=jnp.float32)
        # Everything read from the norm is computed before the contractions, so that only
        # the factors stay live while they run.
        scale, value, fraction, n = lax.optimization_barrier((scale, n.value, fraction, n))
        norms.append(value)
        fractions.append(fraction)
        for i in group:
            scales[i], parts[i], limits[i] = scale, n, clip_norm
    if reduce is None:
        shaped: list[tuple[Any, Any]] = []
        for x, s, n in zip(xs, scales, parts):
            kept = (x.shape[0],) + (1,) * (x.ndim - 1)
            shaped.append(tuple(type(v)(*(f.reshape(kept) for f in v)) for v in (s, n)))
        outs = _norms.apply_factors(xs, [s for s, _ in shaped], [n for _, n in shaped], limits)
        return outs, list(rest), norms, fractions
    keys = [None] * len(xs) if key is None else list(jax.random.split(key, len(xs)))
    # Per group of ``members``, its weights and its leaves' contractions, once for all.
    contracted: list[Any] = [None] * len(xs)
    for group in filter(None, members):
        first = group[0]
        c = jnp.asarray(limits[first], parts[first].frac.dtype)
        group_xs = tuple(xs[i] for i in group)
        totals = _norms.summed_clipped(
            _clipped_contract, group_xs, scales[first], parts[first], c, weights
        )
        for i, total in zip(group, totals):
            contracted[i] = total
    outs = []
    for i, (x, k, path) in enumerate(zip(xs, keys, paths)):
        total = contracted[i]
        if k is not None:  # one independent draw per leaf (and per step: a fresh key)
            k, share = _device_noise(k, x, _norms.leaf_axes(axis_name, i), path)
            total = total + normal(k, total, noise_std * share)
        outs.append(total if keep_acc else _finish(total, x.dtype, reduce, batch))
    rest_outs = []
    for x in rest:
        ones = jnp.ones((x.shape[0],), _norms.acc_dtype(x.dtype))
        (total,) = _contract(ones if weights is None else jnp.where(weights, ones, 0), [x])
        rest_outs.append(total if keep_acc else _finish(total, x.dtype, reduce, batch))
    return outs, rest_outs, norms, fractions


def normal(key: Array, like: Array, std: Any) -> Array:
    """Gaussian noise of standard deviation ``std`` shaped like ``like``; for a complex
    leaf, ``std`` on the real and on the imaginary part, each drawn independently (the
    noise a real leaf stored as two real parts would get)."""
    real = like.real.dtype
    std = jnp.asarray(std, real)
    if not jnp.iscomplexobj(like):
        return std * jax.random.normal(key, like.shape, real)
    re, im = jax.random.normal(key, (2, *like.shape), real)
    return lax.complex(std * re, std * im)


def _device_noise(key: Array, x: Array, axis_name: _norms.LeafAxes, path: str) -> tuple[Array, Any]:
    """Inside ``shard_map``, the key of this device's noise for its block of the leaf ``x``
    and the share of the standard deviation it draws.

    Devices that hold different blocks (different features, or different examples) draw
    independent noise: the key is folded with the device's index on every axis ``x``
    varies across. The axes that split the batch (those ``x`` varies across and
    ``axis_name`` does not name) hold partial sums that the caller adds up, so each
    draws ``1/sqrt(devices)`` of the standard deviation and the total has the full one.
    Outside ``shard_map`` the key is used as it is.
    """
    if not check_noise_tracked():
        return key, 1.0
    features = set(_norms.combine_axes(x, axis_name, range(1, x.ndim), path))
    batch = [a for a in _norms.varying(x) if a not in features]
    return own_key(key, x), 1 / math.sqrt(math.prod(lax.axis_size(a) for a in batch))


def check_noise_tracked() -> bool:
    """Whether JAX tracks which mapped axes values vary across here (False outside
    ``shard_map`` and ``pmap``); a ValueError where it does not, under mapped axes: which
    devices hold different examples is then unknown, and noise cannot be drawn once."""
    if _norms.vma_tracked():
        return True
    manual = untracked_batch_axes()
    if manual:
        raise ValueError(
            f"jaxclip: per-example noise under pmap or shard_map(check_vma=False) (axes "
            f"{manual}): jaxclip cannot tell which devices hold different examples, so it "
            "cannot draw the noise once. Use shard_map with its default check_vma=True."
        )
    return False


def own_key(key: Array, x: Array) -> Array:
    """``key`` folded with this device's index on every mesh axis ``x`` varies across:
    devices that hold different blocks of ``x`` draw independent noise."""
    for axis in sorted(_norms.varying(x)):
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


def batch_device_axes(v: Array) -> tuple[str, ...]:
    """Inside ``shard_map``, the axes that split the batch, for a statistic of this
    device's examples (the axes it varies across). Where JAX does not track them (``pmap``,
    ``check_vma=False``), every mapped axis: a statistic over equal shares of the batch,
    averaged or counted over axes that hold the same examples, is unchanged (a count with
    its expected size scaled alike); see :func:`untracked_batch_axes`."""
    if _norms.vma_tracked():
        return tuple(sorted(_norms.varying(v)))
    return untracked_batch_axes()


def untracked_batch_axes() -> tuple[str, ...]:
    """Every mapped axis in scope where JAX does not track which hold different examples
    (none where it does, or outside ``shard_map`` and ``pmap``)."""
    return () if _norms.vma_tracked() else _norms.manual_axes()


def _mean_over_batch_devices(v: Array) -> Array:
    """The mean of a per-device statistic over the axes that split the batch (equal
    shares of the batch)."""
    axes = batch_device_axes(v)
    return lax.pmean(v, axes) if axes else v


def is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _reduce_other(x: Any, path: str, fn: str) -> Any:
    """A leaf that is neither clipped nor summed, when the batch is reduced: a ``float0``
    gradient (of an integer input, ``jax.grad(..., allow_int=True)``) loses its batch axis,
    as the summed leaves do; an integer or boolean array is an error (passed through it
    would keep the batch axis, and an optimizer would broadcast its param against it)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or is_key(x):
        return x
    if dtype == jax.dtypes.float0:
        return np.zeros(np.shape(x)[1:], dtype) if np.ndim(x) else x
    raise ValueError(
        f"jaxclip.{fn}: the leaf at {_tree.shown(path)} has dtype {dtype}; per-example "
        "gradients are summed over the batch, which an integer or boolean leaf cannot be, "
        "and passed through it would keep its batch axis. Take gradients with respect to "
        "floating-point params only (with jax.grad(..., allow_int=True) an integer param's "
        "gradient is float0, which is reduced), or leave the leaf out of the tree."
    )


def _finish(total: Array, dtype: Any, reduce: Reduce, batch: int | None) -> Array:
    """The accumulated sum as the mean when asked, rounded once into the leaf's dtype."""
    if reduce == "mean":
        total = total / jnp.asarray(batch, total.real.dtype)
    return total.astype(dtype)


def clip_tree_per_example(
    grads: PyTree,
    clip_norm: ArrayLike,
    *,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    group: Group = None,
    reduce: Reduce = "sum",
    axis_name: _axes.AxisNames = None,
) -> tuple[PyTree, Array | dict[Hashable, Array]]:
    """Clips each example's gradient to norm ``clip_norm``, then sums (or averages) them.

    Every selected leaf has a leading batch axis of one length ``B``; example ``b`` is the
    slice ``[b]`` of every selected leaf, and its norm is the p-norm of those slices
    together (per ``group`` label: the per-layer variant). An example of norm
    ``n <= clip_norm`` is kept as it is, bit for bit; otherwise it is multiplied by
    ``clip_norm / n`` (no epsilon). Norms are exact in bfloat16/float16 and safe from
    overflow, as in :func:`clip_tree_by_global_norm`.

    The reduction contracts the per-example factors with each leaf (no clipped copy of the
    gradients), accumulating in float32 for 16-bit leaves; each output leaf keeps its
    dtype. A factor ``clip_norm / n`` below float32's normal range (an example norm over
    ``8.5e37 * clip_norm``) is not formed as a number: the batch's weights are contracted
    lifted by a power of two and the sum scaled back, so such an example still counts;
    ``reduce=None`` scales each example exactly at any magnitude.

    Args:
      grads: per-example gradients: a pytree whose selected leaves have shape
        ``(B, *param_shape)``.
      clip_norm: the largest per-example norm, > 0; with ``group``, also a dict that maps
        each label to its own clip norm (per-layer clipping with a norm per layer, as
        Opacus' list of ``max_grad_norm`` and jax-privacy's clip norm tree). An example's
        clipped gradient then has norm at most ``sqrt(sum_g c_g**2)``, the sum's
        sensitivity. A label missing from the dict, or a key no selected leaf has, is a
        ValueError naming it.
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which leaves are clipped (see :func:`clip_by_value`). A rule
        (``need_clip`` or ``group``) is shown each leaf as one example, a
        ``jax.ShapeDtypeStruct`` without the batch axis, so ``min_rank(2)`` picks the
        same leaves as among the params. Unselected
        floating-point leaves are summed (averaged) without clipping, ``float0`` leaves
        lose their batch axis, and an integer leaf is a ValueError when ``reduce`` is set
        (with ``reduce=None`` other leaves pass through).
      group: a callable ``group(path, leaf) -> label``: each example is clipped per
        label, by the norm of that label's slices. ``group=lambda path, leaf: path``
        clips each layer on its own (``optax.per_example_layer_norm_clip`` with
        ``clip_norm = its_clip / sqrt(number of leaves)``).
      reduce: ``"sum"``, ``"mean"``, or None to return the clipped examples.
      axis_name: inside ``shard_map``, for leaves split across devices: the mesh axes that
        split their non-batch dimensions, ``()`` when only the batch is split (data
        parallel: each device's examples are whole; sum the results over the data axis
        yourself, as any data-parallel gradient). A split leaf without it is a
        ValueError naming the leaf.

    Returns:
      ``(tree, norms)``: the reduced (or per-example clipped) tree, and the pre-clip
      norm of each example, shape ``(B,)`` (float32, float64 with float64 leaves); with
      ``group``, a dict label -> norms.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> grads = {"w": jnp.array([[3.0, 0.0], [0.3, 0.0]]), "b": jnp.array([[4.0], [0.4]])}
      >>> total, norms = jaxclip.clip_tree_per_example(grads, 2.5)  # example 0 halved
      >>> norms
      Array([5. , 0.5], dtype=float32)
      >>> total["w"], total["b"]
      (Array([1.8, 0. ], dtype=float32), Array([2.4], dtype=float32))

    References:
      Abadi et al., `Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>`_, 2016
    """
    fn = "clip_tree_per_example"
    p = check_common(clip_norm, norm_type, reduce, group, fn)
    tree, norms, _, _ = clip_examples(
        grads, clip_norm, p, need_clip, group, reduce, None, None, fn, axis_name
    )
    return tree, (norms[None] if group is None else norms)


def clip_per_example(
    clip_norm: ArrayLike,
    *,
    reduce: Reduce = "mean",
    noise_multiplier: ArrayLike = 0.0,
    seed: int | Array = 0,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    group: Group = None,
    batch_size: int | None = None,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformation:
    """DP-SGD's aggregation: clips each example's gradient, sums them, adds noise, averages.

    ``update`` takes per-example gradients (each selected leaf of shape
    ``(B, *param_shape)``, e.g. from ``jax.vmap(jax.grad(loss), in_axes=(None, 0))``) and
    returns one update of the params' shapes: per leaf, ``(sum_b clip(g_b) + noise) / B``
    for ``reduce="mean"``, with Gaussian noise of standard deviation
    ``noise_multiplier * clip_norm`` (float32 for 16-bit leaves, added before rounding)
    drawn afresh for every leaf and every step; a complex leaf gets that standard deviation
    on its real and on its imaginary part (it is clipped as the pair of them). Clipping is as in
    :func:`clip_tree_per_example`. Put it first in a chain; ``optax.MultiSteps`` and
    other gradient accumulation would average noise that DP-SGD accounts once per step.

    Noise goes to the selected leaves only: unselected leaves are averaged unclipped and
    are not private. With ``group`` and one ``clip_norm``, each label is clipped to
    ``clip_norm``, so an example's joint norm is at most ``clip_norm * sqrt(labels)``,
    while the noise stays ``noise_multiplier * clip_norm``; scale ``clip_norm`` or
    ``noise_multiplier`` for that in the privacy accounting (which is not done here: use
    ``dp_accounting`` from Google, or Opacus' accountant with PyTorch). With a dict of
    per-label clip norms ``c_g``, the sensitivity is ``sqrt(sum_g c_g**2)`` and the noise's
    standard deviation is ``noise_multiplier * sqrt(sum_g c_g**2)``, so
    ``noise_multiplier`` is the noise multiplier of the accounting as it is.

    ``init`` sees the params, which have no batch axis: the state keeps per-example norms
    only when ``batch_size`` fixes their shape (``update`` then raises for another batch
    size); without it ``norms`` is None and only the clipped fraction is kept. A fixed
    batch size is what DP-SGD implementations compile for anyway (Poisson-sampled batches
    are padded to one size).

    Args:
      clip_norm: the largest per-example norm, > 0 (may be traced, so
        ``optax.inject_hyperparams`` can schedule it); with ``group``, also a dict
        label -> clip norm (see :func:`clip_tree_per_example`).
      reduce: ``"mean"`` (DP-SGD), ``"sum"``, or None (no noise; clipped examples).
      noise_multiplier: the noise's standard deviation over ``clip_norm``, >= 0.
      seed: an int (kept as a raw ``uint32`` key, which checkpoints as it is), or a
        ``jax.random`` key, for the noise.
      norm_type: ``p >= 2**-10`` or ``float('inf')``; with noise, ``p <= 2`` (a larger p
        bounds an example's L2 norm by more than ``clip_norm``: a ValueError).
      need_clip: which leaves are clipped (see :func:`clip_tree_per_example`: a rule
        sees one example's shape, so ``init`` on the params and ``update`` select alike).
      group: per-label clipping (see :func:`clip_tree_per_example`).
      batch_size: the batch size, to keep every example's norm in the state.
      axis_name: inside ``shard_map`` (see :func:`clip_tree_per_example`). Data parallel
        (the batch split over "data", ``axis_name=()``), each device returns its
        examples' clipped sum plus its share of the noise: the sum of the devices' results
        (``lax.psum`` for ``reduce="sum"``, ``lax.pmean`` for ``"mean"``) has the noise
        of one draw, and devices holding different feature blocks draw independently.
        This needs shard_map's default ``check_vma=True`` (a ValueError otherwise).

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`ClipPerExampleState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxclip
      >>> params = {"w": jnp.zeros(2)}
      >>> loss = lambda p, x: jnp.sum((p["w"] - x) ** 2)
      >>> xs = jnp.array([[3.0, 4.0], [0.75, 1.0]])
      >>> grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, xs)
      >>> tx = optax.chain(jaxclip.clip_per_example(5.0, batch_size=2), optax.sgd(1.0))
      >>> updates, state = jax.jit(tx.update)(grads, tx.init(params))
      >>> updates["w"]
      Array([2.25, 3.  ], dtype=float32)
      >>> state[0].norms, state[0].clipped_fraction
      (Array([10. ,  2.5], dtype=float32), Array(0.5, dtype=float32))

    References:
      Abadi et al., `Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>`_, 2016
    """
    fn = "clip_per_example"
    p = check_common(clip_norm, norm_type, reduce, group, fn)
    _checks.check_finite_nonneg(
        noise_multiplier,
        "noise_multiplier",
        fn,
        "the noise's standard deviation over clip_norm; 0 for no noise",
    )
    _checks.check_seed(seed, fn)
    _checks.check_need_clip(need_clip, fn)
    noisy = draws_noise(noise_multiplier)
    check_noise_norm(p, noisy, norm_type, fn)
    if reduce is None and noisy:
        raise ValueError(
            f"jaxclip.{fn}: noise_multiplier > 0 needs reduce='mean' or 'sum' (noise is added "
            "to the sum over the batch, not to each example)."
        )
    size = None if batch_size is None else _checks.static_size(batch_size, "batch_size", fn)

    def labels_of(params: PyTree) -> list[Hashable]:
        if group is None or _tree.is_params_placeholder(params):
            # optax.tree_map_params' stand-in has no paths to group: each field is one
            # subtree that transform_non_params maps whole.
            return [None]
        return _tree.group_labels(
            group, _tree.select(params, need_clip, what="per-example clipping", params=True)
        )[0]

    def pack(values: dict[Hashable, Array]) -> Any:
        return values[None] if None in values else values

    def init_fn(params: PyTree) -> ClipPerExampleState:
        labels = labels_of(params)
        norms = None
        if size is not None:
            norms = pack({label: jnp.zeros((size,), jnp.float32) for label in labels})
        fraction = pack({label: jnp.zeros((), jnp.float32) for label in labels})
        return ClipPerExampleState(norms, fraction, initial_key(seed))

    def update_fn(updates: PyTree, state: ClipPerExampleState, params: Any = None):
        check_against_params(updates, params, fn)
        key, sub = jax.random.split(state.key) if noisy else (state.key, None)
        std = noise_multiplier * jnp.asarray(sensitivity(clip_norm), jnp.float32)
        tree, norms, fractions, batch = clip_examples(
            updates, clip_norm, p, need_clip, group, reduce, std, sub, fn, axis_name
        )
        if size is not None and batch != size:
            raise ValueError(
                f"jaxclip.{fn}: the per-example gradients have batch size {batch}, but the "
                f"transformation was built with batch_size={size} (the state's norms have "
                "that shape). Pass the batch size you train with, or batch_size=None."
            )
        if group is not None and set(norms) != set(state.clipped_fraction):
            raise ValueError(
                f"jaxclip.{fn}: update finds the groups {list(norms)} among the selected "
                f"gradients, init found {list(state.clipped_fraction)} among the params. "
                f"{_tree.SAME_SELECTION_HINT}"
            )
        kept = None
        if size is not None:
            kept = pack({k: v.astype(jnp.float32) for k, v in norms.items()})
        # Data parallel: the fraction of the whole batch, the same on every device.
        fractions = {k: _mean_over_batch_devices(v) for k, v in fractions.items()}
        return tree, ClipPerExampleState(kept, pack(fractions), key)

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def check_against_params(updates: PyTree, params: Any, fn: str) -> None:
    """Where ``params`` are given with the same structure, every update must be a params
    leaf with a leading batch axis: already averaged gradients whose leaves happen to
    share a leading size would otherwise pass as a batch."""
    if params is None:
        return
    paths, ups, tree = _tree.flatten_with_paths(updates)
    _, ps, ptree = _tree.flatten_with_paths(params)
    if tree != ptree:
        return
    for path, u, p in zip(paths, ups, ps):
        if not hasattr(u, "shape") or not hasattr(p, "shape") or is_key(u):
            continue
        if tuple(u.shape[1:]) != tuple(p.shape) or len(u.shape) != len(p.shape) + 1:
            where = _tree.shown(_tree.path_str(path))
            want = ", ".join(map(str, ("batch", *p.shape))) + ("," if not p.shape else "")
            raise ValueError(
                f"jaxclip.{fn}: the update at {where} has shape {tuple(u.shape)}, but its "
                f"param has shape {tuple(p.shape)}: per-example gradients have shape "
                f"({want}). Compute them with "
                "jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch), not an "
                "averaged gradient."
            )


def initial_key(seed: Any) -> Array:
    """The state's PRNG key: for an int seed a raw ``uint32[2]`` key (as ``optax.add_noise``
    keeps; the same draws as ``jax.random.key(seed)``), which every checkpointer saves
    (``flax.serialization`` and ``np.asarray`` refuse typed keys); a key as given."""
    return jnp.asarray(
        jax.random.PRNGKey(seed) if np.ndim(seed) == 0 and not is_key(seed) else seed
    )


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
