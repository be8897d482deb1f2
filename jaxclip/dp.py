"""DP-SGD from a loss function: :func:`clipped_grad`, and adaptive clip norms.

:func:`clipped_grad` computes per-example gradients of a loss a microbatch at a time
(``lax.scan`` over microbatches of a ``vmap(value_and_grad)``), clips each with the
per-example norms of :mod:`jaxclip.per_example` (one numerics core: ``_norms``), and sums
them, so memory is bounded by the microbatch rather than the batch.

:func:`adaptive_clip_per_example` is DP-SGD's aggregation with a clip norm that follows a
quantile of the per-example norms, estimated privately (Andrew et al. 2021, TF-Privacy's
``QuantileAdaptiveClipSumQuery``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxclip import _axes, _checks, _norms, _tree, per_example
from jaxclip._checks import NormType
from jaxclip.per_example import Group, Reduce

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PyTree = Any


class ClippedGradAux(NamedTuple):
    """The per-example outputs of :func:`clipped_grad` (jax-privacy's ``AuxiliaryOutput``).

    Attributes:
      values: the loss of each example, shape ``(B,)``; None unless ``return_values``.
      norms: the pre-clip gradient norm of each example, float32 of shape ``(B,)`` (a dict
        label -> such an array with ``group``); None unless ``return_norms``. Padding
        examples have their norms computed too (they are left out of the sum only).
      aux: the loss's auxiliary output per example (leading axis ``B``); None unless
        ``has_aux``.

    These are per-example values, not private: aggregate them with a DP mechanism (as
    :func:`adaptive_clip_per_example` does with the norms) before releasing them.
    """

    values: Array | None
    norms: Array | dict[Hashable, Array] | None
    aux: Any


def _argnums(value: Any, name: str, fn: str) -> tuple[int, ...]:
    nums = (value,) if isinstance(value, int) else tuple(value)
    if not nums or not all(isinstance(i, int) and i >= 0 for i in nums):
        raise ValueError(
            f"jaxclip.{fn}: {name}={value!r}; pass an int >= 0 or a tuple of them (positions "
            "of the loss function's arguments)."
        )
    return nums


def clipped_grad(
    loss_fn: Callable[..., Any],
    clip_norm: ArrayLike | dict[Hashable, ArrayLike],
    *,
    microbatch_size: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    keep_batch_dim: bool = False,
    reduce: Reduce = "sum",
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    group: Group = None,
    return_norms: bool = False,
    return_values: bool = False,
    unroll: int | bool = 1,
    batch_axis_name: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
    """The sum (or mean) of the clipped per-example gradients of ``loss_fn``, in microbatches.

    The returned function takes ``loss_fn``'s arguments; those at ``batch_argnums`` carry
    a leading batch axis of one length ``B``. For each example ``b`` it takes the gradient
    of ``loss_fn`` with respect to the arguments at ``argnums``, clips it to norm
    ``clip_norm`` exactly as :func:`clip_tree_per_example` does (same norms, same factors,
    no epsilon; an example within the limit is kept bit for bit), and sums over the batch.
    With ``microbatch_size=m`` the gradients of ``m`` examples at a time are computed
    (``vmap``), clipped and added to a float32 accumulator (the accumulation dtype of
    each leaf) in a ``lax.scan``, so only ``m`` examples' gradients are ever in memory; the
    result equals the whole-batch one up to float32 rounding of the sum, and is rounded
    once into each leaf's dtype at the end. A batch that ``m`` does not divide is padded
    with copies of its last example, weighted 0.

    Padding (jax-privacy's convention): call the function with
    ``is_padding_example=mask``, a bool array of shape ``(B,)``, True for the rows that
    are not real examples (a Poisson-sampled batch padded to a fixed size, so one compiled
    step serves every batch). Those rows add nothing to the sum (weight 0; their gradients
    must be finite, as they are for copies of real examples or for zeros in most models)
    and are not counted as clipped.

    On a mesh that splits the batch: inside ``shard_map`` each device returns the clipped
    sum of its own examples (``lax.psum`` them over the batch's axes, ``batch_axis_name``);
    the axes a param varies across split its features (tensor parallel; params sharded
    over the batch's axes, FSDP, are an error). This needs ``check_vma=True``: under
    ``pmap`` and ``check_vma=False`` only replicated params are supported.
    Under ``jit`` microbatch ``k`` holds rows ``k, k + steps, ...``, so each device keeps
    its own rows where ``microbatch_size`` is a multiple of the batch's devices that
    divides the batch (on an Explicit mesh, any other size is an error).

    The sum's L2 sensitivity (add/remove one example) is ``clip_norm``, or
    ``sqrt(sum_g c_g**2)`` with a dict of per-group clip norms, for ``norm_type <= 2``
    and finite per-example gradients (a non-finite one makes the sum NaN). With
    ``norm_type=p > 2`` an example's L2 norm can reach ``clip_norm * d**(1/2 - 1/p)``
    (``d`` its number of entries; ``clip_norm * sqrt(d)`` for ``inf``). Add the noise yourself
    (``std = noise_multiplier * sensitivity``) or with :func:`adaptive_clip_per_example`,
    and divide by the expected batch size, which, unlike the count of real examples, is
    not private.

    Args:
      loss_fn: the loss of ONE example (``keep_batch_dim=False``, the default: the
        function you would ``jax.vmap(jax.grad(...))``), or of a batch of one example
        (``keep_batch_dim=True``, jax-privacy's default). Returns a scalar, or
        ``(scalar, aux)`` with ``has_aux``.
      clip_norm: the largest per-example norm, > 0 (may be traced, e.g. an adaptive clip
        norm from a state); with ``group``, also a dict label -> clip norm.
      microbatch_size: how many examples' gradients to compute at once; None for the
        whole batch in one ``vmap``. Larger is faster, smaller needs less memory.
      argnums: which arguments to differentiate (as ``jax.grad``): an int gives one
        gradient tree, a tuple a tuple of them.
      batch_argnums: which arguments carry the batch axis (the data and the labels); all
        others are shared by every example. Must not overlap ``argnums``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is returned per example.
      keep_batch_dim: pass each example to ``loss_fn`` with a leading axis of size 1.
      reduce: ``"sum"`` (jax-privacy's default) or ``"mean"``: the sum divided by ``B``,
        the number of rows passed, padding included (a number that is not private).
      norm_type: ``p >= 2**-10`` or ``float('inf')``.
      need_clip: which gradient leaves are clipped (see :func:`clip_tree_per_example`);
        the others are summed unclipped (and are not private).
      group: per-label clipping (see :func:`clip_tree_per_example`).
      return_norms: also return each example's pre-clip norm.
      return_values: also return each example's loss.
      unroll: passed to the microbatches' ``lax.scan``. On XLA:CPU the per-example
        weight gradients of convolutions run several times slower inside a loop than
        outside it (a plain ``scan`` over ``vmap(grad)`` too, and jax-privacy's
        microbatches alike); ``unroll=True`` removes the loop, at the cost of compile
        time and of more memory than one microbatch (still less than the whole batch).
      batch_axis_name: inside ``shard_map``, the mesh axes that split the batch (data
        parallel); None: those the batch arguments vary across and no param does, a
        ValueError where that is ambiguous (an axis a per-device key or a frozen sharded
        argument varies across too). Given, each name must be an axis the batch varies
        across, and every axis only the batch varies across must be named.

    Returns:
      A function of ``loss_fn``'s arguments (and the keyword ``is_padding_example``) that
      returns the clipped sum, a tree of the params' structure and dtypes; with
      ``has_aux``, ``return_norms`` or ``return_values``, the pair
      ``(sum, ClippedGradAux(values, norms, aux))``. It can be jitted, and ``clip_norm``
      may be a traced value from the enclosing function.

    Example:
      >>> import jax.numpy as jnp, jaxclip
      >>> loss = lambda w, x: 0.5 * jnp.sum((w - x) ** 2)  # one example; gradient w - x
      >>> xs = jnp.array([[3.0, 4.0], [0.3, 0.4], [-6.0, 8.0]])
      >>> grad_fn = jaxclip.clipped_grad(loss, 1.0, microbatch_size=2, return_norms=True)
      >>> total, aux = grad_fn(jnp.zeros(2), xs)  # norms 5, 0.5, 10: two are clipped
      >>> total
      Array([-0.3, -2. ], dtype=float32)
      >>> aux.norms
      Array([ 5. ,  0.5, 10. ], dtype=float32)
      >>> grad_fn(jnp.zeros(2), xs, is_padding_example=jnp.array([False, False, True]))[0]
      Array([-0.90000004, -1.2       ], dtype=float32)

    References:
      Abadi et al., `Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>`_, 2016; jax-privacy's ``clipped_grad``
      (``l2_clip_norm``, ``microbatch_size``, ``is_padding_example``).
    """
    fn = "clipped_grad"
    if not callable(loss_fn):
        raise TypeError(f"jaxclip.{fn}: loss_fn={loss_fn!r} is not callable; pass the loss.")
    p = per_example.check_common(clip_norm, norm_type, reduce, group, fn)
    if reduce is None:
        raise ValueError(
            f'jaxclip.{fn}: reduce=None; pass "sum" or "mean". For the clipped examples '
            "themselves, use jaxclip.clip_tree_per_example(..., reduce=None) on "
            "jax.vmap(jax.grad(loss)) (the whole batch's gradients are then in memory)."
        )
    for name, flag in (
        ("has_aux", has_aux),
        ("keep_batch_dim", keep_batch_dim),
        ("return_norms", return_norms),
        ("return_values", return_values),
    ):
        _checks.check_flag(flag, name, fn)
    _checks.check_need_clip(need_clip, fn)
    size = None
    if microbatch_size is not None:
        size = _checks.static_size(microbatch_size, "microbatch_size", fn, "each microbatch")
    batch_names = None if batch_axis_name is None else _axis_names(batch_axis_name, fn)
    grad_nums = _argnums(argnums, "argnums", fn)
    batch_nums = _argnums(batch_argnums, "batch_argnums", fn)
    if set(grad_nums) & set(batch_nums):
        raise ValueError(
            f"jaxclip.{fn}: argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap; "
            "the gradient is taken with respect to arguments shared by the batch (the "
            "params), not the batched data."
        )
    value_and_grad = jax.value_and_grad(loss_fn, argnums, has_aux=has_aux)

    def one_example(*args: Any) -> tuple[PyTree, Array, Any]:
        if keep_batch_dim:
            args = tuple(
                jax.tree.map(lambda x: x[None], a) if i in batch_nums else a
                for i, a in enumerate(args)
            )
        out, grads = value_and_grad(*args)
        value, aux = out if has_aux else (out, None)
        return grads, value, aux

    def clipped(*args: Any, is_padding_example: ArrayLike | None = None) -> Any:
        if len(args) <= max(batch_nums):
            raise ValueError(
                f"jaxclip.{fn}: batch_argnums={batch_argnums!r}, but the function got "
                f"{len(args)} positional arguments. Pass the batch (data, labels) at those "
                "positions, or set batch_argnums."
            )
        batch = _batch_of(args, batch_nums, fn)
        valid = jnp.ones((batch,), bool)
        if is_padding_example is not None:
            mask = jnp.asarray(is_padding_example)
            if mask.shape != (batch,) or mask.dtype != jnp.bool_:
                raise ValueError(
                    f"jaxclip.{fn}: is_padding_example has shape {mask.shape} and dtype "
                    f"{mask.dtype}; pass a bool array of shape ({batch},), True for the "
                    "padding rows."
                )
            valid = ~mask
        one = np.ndim(argnums) == 0
        args, axes = _data_parallel(args, grad_nums, batch_nums, one, batch_names, fn)
        m = max(batch if size is None else min(size, batch), 1)  # an empty batch: one padding row
        steps = max(-(-batch // m), 1)
        rows = steps * m
        if steps > 1:
            _check_explicit_split(args, batch_nums, m, batch, fn)
        in_axes = tuple(0 if i in batch_nums else None for i in range(len(args)))
        per_grads = jax.vmap(one_example, in_axes=in_axes)

        def micro(batched: list[Any], ok: Array) -> tuple[list[Array], tuple[Any, ...]]:
            call = list(args)
            for i, b in zip(batch_nums, batched):
                call[i] = b
            grads, value, aux = per_grads(*call)
            sums, norms, _, _ = per_example.clip_examples(
                grads, clip_norm, p, need_clip, group, "sum", None, None, fn, axes,
                weights=ok, keep_acc=True,
            )  # fmt: skip
            return sums, (norms if group is not None else norms[None], value, aux)

        batched = [_pad_rows(args[i], rows) for i in batch_nums]
        ok = jnp.concatenate([valid, jnp.zeros((rows - batch,), bool)]) if rows > batch else valid
        if steps == 1:
            sums, (norms, values, aux) = micro(batched, ok)
        else:
            # Microbatch k holds rows k, k + steps, ...: on a mesh that splits the batch,
            # each device keeps its rows in every microbatch (contiguous microbatches
            # would each live on a few devices, gathered to all of them). Read in the
            # loop from the rows as (m, steps): no transposed copy of the batch.
            split = jax.tree.map(lambda x: x.reshape(m, steps, *x.shape[1:]), (batched, ok))
            first = jax.tree.map(lambda x: lax.index_in_dim(x, 0, 1, False), split)
            shapes = jax.eval_shape(micro, *first)[0]
            leaves, treedef = jax.tree.flatten(shapes)
            acc = [i for i, s in enumerate(leaves) if jnp.issubdtype(s.dtype, jnp.inexact)]

            def body(carry: list[Array], k: Array) -> tuple[list[Array], Any]:
                xs = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, k, 1, False), split)
                s, ys = micro(*xs)
                flat = jax.tree.leaves(s)
                return [c + flat[i] for c, i in zip(carry, acc)], ys

            zeros = [_norms.carry(s.shape, s.dtype, s) for s in (leaves[i] for i in acc)]
            carry, ys = lax.scan(body, zeros, jnp.arange(steps), unroll=unroll)
            out: list[Any] = [np.zeros(s.shape, s.dtype) for s in leaves]  # float0 leaves
            for i, c in zip(acc, carry):
                out[i] = c
            sums = jax.tree.unflatten(treedef, out)
            norms, values, aux = jax.tree.map(lambda y: _unstrided(y, rows), ys)
        dtypes = jax.eval_shape(per_grads, *_first_rows(args, batch_nums))[0]
        total = jax.tree.map(lambda s, d: _finish(s, d.dtype, reduce, batch), sums, dtypes)
        if not (has_aux or return_norms or return_values):
            return total
        cut = (lambda t: jax.tree.map(lambda y: y[:batch], t)) if rows > batch else (lambda t: t)
        return total, ClippedGradAux(
            values=cut(values) if return_values else None,
            norms=cut(norms) if return_norms else None,
            aux=cut(aux) if has_aux else None,
        )

    return clipped


def _data_parallel(
    args: tuple[Any, ...],
    grad_nums: tuple[int, ...],
    batch_nums: tuple[int, ...],
    one: bool,
    batch_axes: tuple[str, ...] | None,
    fn: str,
) -> tuple[tuple[Any, ...], Any]:
    """Inside ``shard_map`` (``check_vma=True``): the differentiated arguments cast to vary
    across the mesh axes that split the batch, and the axis names of each gradient leaf
    (the axes its param varies across, which split its features: tensor parallel).

    A param that does not vary across an axis that splits the batch is broadcast to the
    batch implicitly, and JAX transposes that broadcast into a ``psum``: each example's
    gradient would be the sum of that example's row of every device. Cast, each device's
    gradients are its own examples'; the caller ``psum``s the clipped sums.

    The batch's axes (unless ``batch_axes`` names them): those the batch arguments vary
    across and no param does (a param's axes split its features). An axis every batch
    leaf and some param vary across (FSDP params, or the data's features split like the
    params'), or one the batch and another argument vary across and no param does (a
    per-device key, or a frozen sharded part of the model), is ambiguous: a ValueError
    asks which. Elsewhere (``pmap``, ``check_vma=False``) nothing changes."""
    if not _norms.vma_tracked():
        return args, None

    def axes_of(nums: Sequence[int]) -> list[frozenset[str]]:
        return [_norms.varying(x) for i in nums for x in jax.tree.leaves(args[i])]

    each = axes_of(batch_nums)
    batch = set().union(*each)
    params = set().union(*axes_of(grad_nums))
    rest = [i for i in range(len(args)) if i not in batch_nums and i not in grad_nums]
    others = set().union(*axes_of(rest)) - params
    if batch_axes is None:
        # Ambiguous: an axis every batch leaf and a param vary across (FSDP, or the
        # data's features split like the params'), or one the batch and another argument
        # vary across and no param does (a per-device key, or a frozen sharded part).
        both = (set(frozenset.intersection(*each)) & params if each else set()) | (batch & others)
        if both:
            raise ValueError(
                f"jaxclip.{fn}: inside shard_map the batch arguments vary across the mesh "
                f"axes {tuple(sorted(both))}, and so does a param or another argument: "
                "jaxclip cannot tell whether they split the batch or the features. Pass "
                "batch_axis_name= (the axes that split the batch; e.g. 'data'). Params "
                "sharded over the batch's axes (FSDP) are not supported: per-example "
                "gradients through their all_gather mix the devices' examples."
            )
        split = batch - params
    else:
        split = set(batch_axes)
        unknown = split - set(_norms.manual_axes())
        unnamed = batch - params - others - split
        if unknown or unnamed or split - batch:
            raise ValueError(
                f"jaxclip.{fn}: batch_axis_name={batch_axes!r}, but inside this shard_map "
                f"the batch arguments vary across {tuple(sorted(batch))} (the mesh axes "
                f"{tuple(_norms.manual_axes())}); no param varies across "
                f"{tuple(sorted(batch - params))}. Name the axes that split the batch."
            )
        sharded = split & params
        if sharded:
            raise ValueError(
                f"jaxclip.{fn}: a param varies across {tuple(sorted(sharded))}, which "
                f"batch_axis_name={batch_axes!r} says split the batch. Params sharded over "
                "the batch's axes (FSDP) are not supported: per-example gradients through "
                "their all_gather mix the devices' examples. Pass them replicated there."
            )

    def cast(x: Any) -> Any:
        missing = tuple(sorted(split - _norms.varying(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    def own(x: Any) -> tuple[str, ...]:
        return tuple(sorted(_norms.varying(x)))

    grads_axes = [jax.tree.map(own, args[i]) for i in grad_nums]
    cast_args = tuple(jax.tree.map(cast, a) if i in grad_nums else a for i, a in enumerate(args))
    entries = set(jax.tree.leaves(grads_axes, is_leaf=lambda v: isinstance(v, tuple)))
    if len(entries) <= 1:  # one entry for every leaf: no per-leaf resolution to trace
        return cast_args, min(entries, default=())
    return cast_args, grads_axes[0] if one else tuple(grads_axes)


def _check_explicit_split(
    args: Sequence[Any], batch_nums: tuple[int, ...], m: int, batch: int, fn: str
) -> None:
    """A ValueError for microbatches an Explicit mesh cannot hold: with the batch split
    over ``n`` devices, each microbatch keeps ``m / n`` rows on each device, so ``m`` must
    be a multiple of ``n`` and divide the batch (no padding rows to place)."""
    for i in batch_nums:
        for x in jax.tree.leaves(args[i]):
            sharding = getattr(jax.typeof(x), "sharding", None)
            spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
            if not spec or mesh is None or spec[0] is None:
                continue
            names = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
            kinds = dict(zip(mesh.axis_names, mesh.axis_types))
            split = [a for a in names if kinds.get(a) == jax.sharding.AxisType.Explicit]
            n = math.prod(mesh.shape[a] for a in split)
            if n > 1 and (m % n or batch % m):
                fits = [k for k in range(n, batch + 1, n) if batch % k == 0]
                raise ValueError(
                    f"jaxclip.{fn}: the batch of {batch} rows is split over the Explicit "
                    f"mesh axes {tuple(split)} ({n} devices), so microbatch_size={m} must be "
                    f"a multiple of {n} that divides {batch} (one of {fits}), or None."
                )


def _unstrided(y: Array, rows: int) -> Array:
    """Per-example results of strided microbatches (``(steps, m, ...)``, microbatch k of
    rows ``k, k + steps, ...``) back in the rows' order."""
    return jnp.swapaxes(y, 0, 1).reshape(rows, *y.shape[2:])


def _axis_names(value: Any, fn: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"jaxclip.{fn}: batch_axis_name={value!r}; pass a mesh axis name (str) or a "
            "tuple of them."
        )
    return tuple(names)


def _batch_of(args: Sequence[Any], batch_nums: tuple[int, ...], fn: str) -> int:
    """The common leading length of every leaf of the batch arguments."""
    batch, first = None, ""
    for i in batch_nums:
        for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
            where = f"argument {i}" + (f" at {_tree.path_str(path)!r}" if path else "")
            shape = np.shape(x)
            if not shape:
                raise ValueError(
                    f"jaxclip.{fn}: {where} is a scalar, but batch_argnums names it: every "
                    "leaf of a batch argument needs a leading batch axis. Set "
                    "batch_argnums to the data's positions."
                )
            if batch is None:
                batch, first = shape[0], where
            elif shape[0] != batch:
                raise ValueError(
                    f"jaxclip.{fn}: {where} has {shape[0]} rows, but {first} has {batch}; "
                    "every batch argument needs the same leading batch size."
                )
    if batch is None:
        raise ValueError(f"jaxclip.{fn}: the batch arguments {batch_nums} hold no arrays.")
    return batch


def _pad_rows(tree: Any, rows: int) -> Any:
    """Every leaf padded to ``rows`` rows with copies of its last row (whose gradients
    are finite wherever the real examples' are); weighted 0 by the caller."""

    def pad(x: Any) -> Any:
        x = jnp.asarray(x)
        if x.shape[0] == rows:
            return x
        if x.shape[0] == 0:
            return jnp.zeros((rows, *x.shape[1:]), x.dtype)
        return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), mode="edge")

    return jax.tree.map(pad, tree)


def _first_rows(args: Sequence[Any], batch_nums: tuple[int, ...]) -> list[Any]:
    """The arguments with one row of each batch argument, for shapes."""
    return [
        jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *np.shape(x)[1:]), x.dtype), a)
        if i in batch_nums
        else a
        for i, a in enumerate(args)
    ]


def _finish(total: Any, dtype: Any, reduce: Reduce, batch: int) -> Any:
    if dtype == jax.dtypes.float0 or not jnp.issubdtype(dtype, jnp.inexact):
        return total
    if reduce == "mean":
        total = total / jnp.asarray(max(batch, 1), total.real.dtype)
    return total.astype(dtype)


# --------------------------------------------------------------------------------------
# Adaptive clip norms (Andrew, Thakkar, McMahan, Ramaswamy 2021)


class AdaptiveClipPerExampleState(NamedTuple):
    """State of :func:`adaptive_clip_per_example`.

    Attributes:
      clip_norm: the clip norm the next update uses, a float32 scalar.
      unclipped_fraction: the last update's private estimate of the fraction of examples
        whose norm was at most its clip norm (the paper's noised ``b_t``, clamped to
        ``[0, 1]``), a float32 scalar; ``target_unclipped_quantile`` before the first.
      key: the PRNG key of the next update's noise.
    """

    clip_norm: Array
    unclipped_fraction: Array
    key: Array


def adaptive_clip_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """The noise multiplier of the gradient sum that, together with the clipped count's
    noise, gives the privacy of one Gaussian mechanism with ``noise_multiplier``.

    The count of unclipped examples, shifted by -1/2 per example, has sensitivity 1/2, so
    its noise ``clipped_count_stddev`` is a noise multiplier ``2 * clipped_count_stddev``;
    two Gaussian mechanisms compose as one with ``z**-2 = z1**-2 + z2**-2`` (Andrew et al.,
    Theorem 1), so the sum gets ``(z**-2 - (2 * clipped_count_stddev)**-2)**-0.5``. Account
    for the training with ``noise_multiplier`` and give the result to
    :func:`adaptive_clip_per_example`. As TensorFlow Federated's
    ``adaptive_clip_noise_params``.

    Example:
      >>> import jaxclip
      >>> round(jaxclip.adaptive_clip_noise_multiplier(1.0, 256 / 20), 6)
      1.000764
    """
    fn = "adaptive_clip_noise_multiplier"
    values = []
    for name, value in (
        ("noise_multiplier", noise_multiplier),
        ("clipped_count_stddev", clipped_count_stddev),
    ):
        v = _checks.real(value, name, fn, "a finite real number > 0")
        if v is None:  # traced: the budget is split once, before training
            raise TypeError(f"jaxclip.{fn}: {name} must be a concrete number, not traced.")
        if not (0 < v < math.inf):
            raise ValueError(f"jaxclip.{fn}: {name}={value!r} must be finite and > 0.")
        values.append(float(v))
    z, s = values
    if 2 * s <= z:
        raise ValueError(
            f"jaxclip.{fn}: clipped_count_stddev={clipped_count_stddev!r} is too small for "
            f"noise_multiplier={noise_multiplier!r}: the count alone would use the whole "
            "budget (it needs 2 * clipped_count_stddev > noise_multiplier). Andrew et al. "
            "suggest clipped_count_stddev = expected_num_records / 20."
        )
    return (z**-2 - (2 * s) ** -2) ** -0.5


def adaptive_clip_per_example(
    initial_clip_norm: float,
    *,
    target_unclipped_quantile: float = 0.5,
    learning_rate: float = 0.2,
    noise_multiplier: float = 0.0,
    clipped_count_stddev: float | None = None,
    expected_num_records: float | None = None,
    geometric_update: bool = True,
    reduce: Reduce = "mean",
    seed: int | Array = 0,
    norm_type: NormType = _checks.L2,
    need_clip: _tree.NeedClip = None,
    axis_name: _axes.AxisNames = None,
) -> optax.GradientTransformationExtraArgs:
    """DP-SGD's aggregation with a clip norm that follows a quantile of the norms, privately.

    Each update clips every example to the state's clip norm ``C``, sums, and adds
    Gaussian noise of standard deviation ``noise_multiplier * C`` (as
    :func:`clip_per_example`); then it moves ``C`` towards the
    ``target_unclipped_quantile`` of the per-example norms (Andrew et al. 2021,
    Algorithm 1, with TF-Privacy's ``QuantileAdaptiveClipSumQuery`` conventions):

    - ``b = (sum_i ([norm_i <= C] - 1/2) + N(0, clipped_count_stddev**2)) /
      expected_num_records + 1/2``, clamped to ``[0, 1]``: the noised fraction of
      unclipped examples (the -1/2 shift halves the count's sensitivity);
    - ``C <- C * exp(-learning_rate * (b - target_unclipped_quantile))``
      (``geometric_update``, recommended), else ``C <- max(C - learning_rate * (b -
      target), 0)``.

    The new ``C`` applies from the next update on. ``update`` takes either per-example
    gradients (leading batch axis, as :func:`clip_per_example`), or, with the keyword
    ``norms=``, the clipped SUM from :func:`clipped_grad` (``reduce="sum"``, computed with
    ``clip_norm=state.clip_norm`` and ``return_norms=True``) and its per-example norms:
    the memory-bounded way. ``is_padding_example=`` (bool, shape ``(B,)``) leaves padding
    rows out of the count. In ``optax.chain`` both keywords reach this transformation.
    Data parallel inside ``shard_map``, pass each device's sum (then ``psum`` the update
    for ``reduce="sum"``, ``pmean`` it for ``"mean"``, as for :func:`clip_per_example`:
    each device draws its share of the noise) or the sum over the devices (the update is
    then the same on every device; not under ``pmap`` or ``check_vma=False``, where the
    sums must be each device's).

    Privacy: the count and the sum are two Gaussian mechanisms; with the noise multiplier
    ``z`` of your accounting, pass
    ``noise_multiplier=adaptive_clip_noise_multiplier(z, clipped_count_stddev)``.
    Unselected leaves (``need_clip``) get no noise and are not private.

    Args:
      initial_clip_norm: the first update's clip norm, >= 0; 0 only with
        ``geometric_update=False`` (TF-Privacy's tests start there; a geometric update
        would keep it at 0).
      target_unclipped_quantile: the fraction of examples to leave unclipped, in
        ``[0, 1]`` (0.5: the median, as the paper recommends).
      learning_rate: the step ``eta`` of the update of ``C`` (0.2 for geometric updates,
        as the paper recommends), >= 0.
      noise_multiplier: the sum's noise standard deviation over ``C``, >= 0.
      clipped_count_stddev: the noise standard deviation of the unclipped count, >= 0;
        None: ``expected_num_records / 20`` when ``noise_multiplier > 0`` (the paper's
        suggestion), else 0.
      expected_num_records: the expected number of examples per batch, > 0 (the count's
        denominator, not private); None: the number of rows of each update.
      geometric_update: update ``C`` geometrically (True) or arithmetically.
      reduce: ``"mean"`` (divide by the number of rows, padding included) or ``"sum"``.
      seed: an int (kept as a raw ``uint32`` key, which checkpoints as it is), or a
        ``jax.random`` key, for the noise.
      norm_type: ``p >= 2**-10`` or ``float('inf')``; with noise, ``p <= 2`` (see
        :func:`clip_per_example`).
      need_clip: which leaves are clipped and noised (see :func:`clip_tree_per_example`).
      axis_name: inside ``shard_map``, the mesh axes that split the leaves' non-batch
        dimensions (see :func:`clip_tree_per_example`). Where the batch is split across
        devices (data parallel) the unclipped count is summed over them, so every
        device updates ``C`` alike.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is
      :class:`AdaptiveClipPerExampleState`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxclip
      >>> tx = jaxclip.adaptive_clip_per_example(
      ...     16.0, target_unclipped_quantile=0.0, learning_rate=float(jnp.log(2.0)),
      ...     reduce="sum")
      >>> grads = {"w": jnp.array([[5.0], [-2.5]])}  # norms 5 and 2.5, nothing clipped
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> update, state = jax.jit(tx.update)(grads, state)
      >>> update["w"], state.clip_norm  # the clip norm halves while nothing is clipped
      (Array([2.5], dtype=float32), Array(8., dtype=float32))

    References:
      Andrew, Thakkar, McMahan, Ramaswamy, `Differentially Private Learning with Adaptive
      Clipping <https://arxiv.org/abs/1905.03871>`_, NeurIPS 2021, Algorithm 1;
      TF-Privacy's ``QuantileAdaptiveClipSumQuery`` and ``QuantileEstimatorQuery``.
    """
    fn = "adaptive_clip_per_example"
    _checks.check_clip_norm(initial_clip_norm, fn, "initial_clip_norm", zero=True)
    # The clip norm is a float32 state whatever the gradients' dtype.
    _checks.check_norm_range(
        initial_clip_norm,
        "initial_clip_norm",
        np.float32,
        fn,
        effect="the clip norm (a float32 state) would start, and stay, inf: nothing clipped",
        off="",
    )
    p = per_example.check_common(1.0, norm_type, reduce, None, fn)  # the norm checked above
    if reduce is None:
        raise ValueError(f'jaxclip.{fn}: reduce=None; pass "mean" or "sum".')
    _in_range(target_unclipped_quantile, "target_unclipped_quantile", fn, 0.0, 1.0)
    _checks.check_finite_nonneg(
        learning_rate, "learning_rate", fn, "the step of the clip norm's update"
    )
    _checks.check_finite_nonneg(
        noise_multiplier, "noise_multiplier", fn, "the sum's noise over the clip norm"
    )
    _checks.check_flag(geometric_update, "geometric_update", fn)
    if geometric_update and _checks.concrete(initial_clip_norm) == 0:
        raise ValueError(
            f"jaxclip.{fn}: initial_clip_norm=0 with geometric_update=True: a geometric "
            "update multiplies the clip norm, so it would stay 0 and every update would be "
            "0. Start above 0, or pass geometric_update=False (TF-Privacy's arithmetic "
            "update, which moves it from 0)."
        )
    _checks.check_seed(seed, fn)
    _checks.check_need_clip(need_clip, fn)
    _axes.check(axis_name, fn)
    if clipped_count_stddev is not None:
        _in_range(clipped_count_stddev, "clipped_count_stddev", fn, 0.0, math.inf)
    if expected_num_records is not None:
        _in_range(expected_num_records, "expected_num_records", fn, 0.0, math.inf, open_low=True)
    noisy_sum = per_example.draws_noise(noise_multiplier)
    per_example.check_noise_norm(p, noisy_sum, norm_type, fn)
    traced_noise = _checks.concrete(noise_multiplier) is None

    def init_fn(params: PyTree) -> AdaptiveClipPerExampleState:
        del params
        return AdaptiveClipPerExampleState(
            jnp.asarray(initial_clip_norm, jnp.float32),
            jnp.asarray(target_unclipped_quantile, jnp.float32),
            per_example.initial_key(seed),
        )

    def update_fn(
        updates: PyTree,
        state: AdaptiveClipPerExampleState,
        params: Any = None,
        *,
        norms: Array | None = None,
        is_padding_example: Array | None = None,
        **extra: Any,
    ) -> tuple[PyTree, AdaptiveClipPerExampleState]:
        del extra
        c = state.clip_norm
        key, k_sum, k_count = jax.random.split(state.key, 3)
        valid = None if is_padding_example is None else ~jnp.asarray(is_padding_example, bool)
        std = noise_multiplier * c
        if norms is None:
            per_example.check_against_params(updates, params, fn)
            tree, n, _, rows = per_example.clip_examples(
                updates, c, p, need_clip, None, reduce, std, k_sum if noisy_sum else None, fn,
                axis_name, weights=valid,
            )  # fmt: skip
            norms = n[None]
            split = per_example.batch_device_axes(norms)
        else:
            norms = jnp.asarray(norms)
            if norms.ndim != 1:
                raise ValueError(
                    f"jaxclip.{fn}: norms has shape {norms.shape}; pass the per-example norms "
                    "from clipped_grad(..., return_norms=True), shape (batch,)."
                )
            rows = norms.shape[0]
            split = per_example.batch_device_axes(norms)
            std_sum = std if noisy_sum else None
            tree = _noised_sum(updates, std_sum, k_sum, reduce, rows, need_clip, split)
        # Data parallel: the examples of every device count (the norms vary across the
        # axes that split the batch, ``split``), and the count's noise is drawn once.
        if rows:
            rows *= math.prod(jax.lax.axis_size(a) for a in split)
        # rows: a static shape; expected_num_records may be traced (a schedule).
        expected = float(rows or 1) if expected_num_records is None else expected_num_records
        count_std = clipped_count_stddev
        if count_std is None and traced_noise:  # TF-Privacy's default where noised
            count_std = jnp.where(jnp.asarray(noise_multiplier) > 0, expected / 20, 0.0)
        elif count_std is None:
            count_std = expected / 20 if noisy_sum else 0.0
        untracked = per_example.untracked_batch_axes()
        noised = not isinstance(count_std, (int, float)) or count_std > 0
        if untracked and (expected_num_records is not None or noised):
            # Every mapped axis counts: exact for the count over its own expected size,
            # not for a given expected size or noise (axes with the same examples).
            raise ValueError(
                f"jaxclip.{fn}: under pmap or shard_map(check_vma=False) (axes {untracked}) "
                "jaxclip cannot tell which devices hold different examples, so it cannot "
                "count the unclipped examples against expected_num_records or noise the "
                "count once. Use shard_map's default check_vma=True, or leave "
                "expected_num_records=None and set clipped_count_stddev=0."
            )
        fraction = _noised_unclipped_fraction(norms, c, valid, count_std, expected, k_count, split)
        new_c = _next_clip_norm(
            c, fraction, target_unclipped_quantile, learning_rate, geometric_update
        )
        return tree, AdaptiveClipPerExampleState(new_c, fraction, key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _in_range(
    value: Any, name: str, fn: str, low: float, high: float, *, open_low: bool = False
) -> None:
    v = _checks.real(value, name, fn, f"a real number in [{low}, {high}]")
    if v is None:
        return
    ok = (v > low if open_low else v >= low) and v <= high
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        raise ValueError(
            f"jaxclip.{fn}: {name}={value!r} is out of range; it must be {bound}"
            + (f" and <= {high}" if math.isfinite(high) else "")
            + "."
        )


def _noised_unclipped_fraction(
    norms: Array,
    clip_norm: Array,
    valid: Array | None,
    count_std: Any,
    expected: Any,
    key: Array,
    split: tuple[str, ...] = (),
) -> Array:
    """TF-Privacy's ``QuantileEstimatorQuery``: the count of examples with
    ``norm <= clip_norm``, each shifted by -1/2, plus noise, over the expected count, plus
    1/2, clamped to [0, 1]."""
    below = jnp.where(norms <= clip_norm, 0.5, -0.5).astype(jnp.float32)
    if valid is not None:
        below = jnp.where(valid, below, 0)
    total = jax.lax.psum(jnp.sum(below), split) if split else jnp.sum(below)
    total = total + count_std * jax.random.normal(key, (), jnp.float32)
    return jnp.clip(total / expected + 0.5, 0.0, 1.0)


def _next_clip_norm(
    clip_norm: Array, fraction: Array, target: Any, rate: Any, geometric: bool
) -> Array:
    """Andrew et al.'s update of the clip norm from the estimated unclipped fraction."""
    step = rate * (fraction - target)
    if geometric:
        return (clip_norm * jnp.exp(-step)).astype(jnp.float32)
    return jnp.maximum(clip_norm - step, 0.0).astype(jnp.float32)


def _noised_sum(
    tree: PyTree,
    std: Any,
    key: Array,
    reduce: Reduce,
    rows: int,
    need_clip: _tree.NeedClip,
    split: tuple[str, ...] = (),
) -> PyTree:
    """A clipped sum with Gaussian noise of standard deviation ``std`` on every selected
    leaf (an independent draw per leaf, added in float32 before rounding), divided by
    ``rows`` for the mean.

    Data parallel (the batch split over the mesh axes ``split``, which the norms vary
    across): a leaf that is this device's partial sum (it varies across them too) draws
    its share of the noise with a key of its own, and its mean is over this device's rows
    (the caller's ``psum`` or ``pmean`` completes both, as for :func:`clip_per_example`);
    a leaf already summed over the devices draws the whole noise, the same on every
    device that holds the same block, and its mean is over every device's rows."""
    sel = _tree.select(tree, need_clip, what="the noise of adaptive_clip_per_example")
    keys = jax.random.split(key, max(len(sel.leaves), 1))
    chosen = set(sel.indices)
    leaves = list(sel.leaves)
    for i, x in enumerate(sel.leaves):
        if not per_example.is_float(x):
            continue
        x = jnp.asarray(x)
        total = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        if std is not None and i in chosen:
            k, share = keys[i], 1.0
            if per_example.check_noise_tracked():
                k = per_example.own_key(k, total)
                partial = [a for a in split if a in _norms.varying(total)]
                share = 1 / math.sqrt(math.prod(jax.lax.axis_size(a) for a in partial))
            total = total + per_example.normal(k, total, std * share)
        if reduce == "mean":
            # Untracked (pmap, check_vma=False): each device's sum, as documented.
            summed = [a for a in split if a not in _norms.varying(total)]
            summed = summed if _norms.vma_tracked() else []
            count = rows * math.prod(jax.lax.axis_size(a) for a in summed)
            total = total / jnp.asarray(count, total.real.dtype)
        leaves[i] = total.astype(x.dtype)
    return sel.treedef.unflatten(leaves)
