"""The one numerics core: every norm jaxclip computes comes from here.

A p-norm ``(sum |x|^p)^(1/p)`` (``max |x|`` for ``p=inf``) is computed in one pass in
the common case: the plain power sum, accumulated in float32 (float64 for float64
leaves) with the upcast fused into the reduction, so no widened copy of the gradients
exists. Only when that sum is outside the range where it is exact -- it overflowed,
is non-finite, or is so small that elements may have underflowed -- does a
``lax.cond`` take the scaled path: divide by the largest magnitude (as BLAS ``nrm2``
does), sum, and multiply back. Roots and divisions are guarded so that ``jax.grad``
and ``jax.jvp`` stay finite at zero.

Many small leaves are concatenated into one buffer per dtype ("bucketing") before a
global reduction, so a thousand-leaf tree compiles to a handful of reduction kernels.
Only leaves that live whole on one device are bucketed: concatenating sharded leaves
would make XLA all-gather them.

XLA:CPU needs three measures to keep widened copies of bf16/f16 gradients out of memory
(each guarded by a ``memory_analysis()`` test): reductions read the leaves through an
optimisation barrier (:func:`_reduction_view`), f16 leaves, 16-bit buckets and the rare
path use a reduce XLA fuses itself (:func:`_reduce`), and bf16 buckets are concatenated as
16-bit words (:func:`_concatenate`). On GPU/TPU they cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
AxisName = Union[None, str, tuple[str, ...]]

#: Leaves at most this many bytes may be copied into a bucket before a global reduction.
BUCKET_MAX_BYTES = 64 * 1024


def acc_dtype(dtype: Any) -> np.dtype:
    """The accumulation dtype of a leaf: float64 for 64-bit leaves, else float32."""
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(np.float64), np.dtype(np.complex128)):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def result_dtype(leaves: Sequence[Any]) -> np.dtype:
    """The dtype of a norm over ``leaves``: the widest accumulation dtype among them."""
    if any(acc_dtype(x.dtype) == np.float64 for x in leaves):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


class StaticDefault:
    """A default hyperparameter that ``optax.inject_hyperparams`` leaves static.

    ``inject_hyperparams`` turns every numeric argument, defaults included, into an
    array; shapes and code paths (``norm_type``, buffer sizes) must stay Python numbers.
    This stands for its value (``float``, ``int``, ``repr``) without being a number.
    """

    def __init__(self, value: Union[int, float]) -> None:
        self.value = value

    def __float__(self) -> float:
        return float(self.value)

    def __index__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


#: Default ``norm_type`` of every norm-based mode (the Euclidean norm).
L2: Any = StaticDefault(2.0)


def check_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float, or a ValueError saying what is accepted."""
    if isinstance(norm_type, jax.core.Tracer):
        raise ValueError(
            "jaxclip: norm_type must be a static Python number, not a traced array (it "
            "decides the computation). With optax.inject_hyperparams, pass "
            "static_args=('norm_type',)."
        )
    try:
        p = float(norm_type)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"jaxclip: norm_type={norm_type!r} is not a number; use a float p > 0 "
            "(2.0 for the Euclidean norm) or float('inf')."
        ) from e
    if not p > 0:  # also catches NaN
        raise ValueError(
            f"jaxclip: norm_type={norm_type!r} is not a valid norm; use p > 0 "
            "(2.0 for the Euclidean norm, 1.0, any positive float) or float('inf')."
        )
    return p


def _abs(x: Array, acc: np.dtype) -> Array:
    """|x| in the accumulation dtype (the convert fuses into the consumer)."""
    if jnp.iscomplexobj(x):
        return jnp.abs(x).astype(acc)
    return jnp.abs(x.astype(acc))


def _power(a: Array, p: float) -> Array:
    """a**p for a >= 0, with a zero derivative at a == 0 for every p."""
    if p == 1.0:
        return a
    if p == 2.0:
        return a * a
    if p == int(p) and p <= 8:
        return lax.integer_pow(a, int(p))
    pos = a > 0
    return jnp.where(pos, jnp.power(jnp.where(pos, a, 1), p), 0)


def _power_abs(x: Array, p: float, acc: np.dtype) -> Array:
    if p == 2.0 and jnp.iscomplexobj(x):
        re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
        return re * re + im * im
    return _power(_abs(x, acc), p)


def _native(x: Array, bucketed: bool, rare: bool = False) -> bool:
    """Whether ``x`` is reduced by XLA's own fused reduce (see :func:`_reduce`): f16 leaves,
    16-bit buckets, and everything on the rare path; never a sharded leaf, whose variadic
    reduce XLA would partition with an all-gather."""
    wanted = rare or x.dtype == np.float16 or (bucketed and x.dtype.itemsize < 4)
    return wanted and _one_device(x)


def _reduce(x: Array, v: Array, axes: Optional[tuple[int, ...]], op: str, native: bool) -> Array:
    """Sum or max of ``v`` (computed from ``x``) over ``axes`` with keepdims, in one pass.

    XLA:CPU's library reduction kernels cannot fuse an f16 -> f32 convert, nor a
    concatenation, and then materialise a widened copy of the leaf (or bucket); XLA
    fuses both into a variadic reduce of its own. With ``native`` the reduce
    therefore also takes ``min |x|``, tied into the result (``min >= 0`` unless NaN,
    when the result is NaN anyway) so that it is not simplified back into a plain one.
    """
    if not native:
        return (jnp.sum if op == "sum" else jnp.max)(v, axis=axes, keepdims=True)
    dims = tuple(range(x.ndim)) if axes is None else axes
    zero = jnp.zeros((), v.dtype)
    combine = jnp.add if op == "sum" else jnp.maximum
    r, low = lax.reduce(
        (v, _abs(x, v.dtype)),
        (zero, jnp.asarray(jnp.inf, v.dtype)),
        lambda a, b: (combine(a[0], b[0]), jnp.minimum(a[1], b[1])),
        dims,
    )
    r = jnp.where(low >= 0, r, jnp.nan)
    return r.reshape(tuple(1 if i in dims else d for i, d in enumerate(x.shape)))


def _power_sum(
    x: Array, p: float, axes: Optional[tuple[int, ...]], acc: np.dtype, native: bool
) -> Array:
    """``sum |x|^p`` over ``axes`` (keepdims), accumulated in ``acc``."""
    return _reduce(x, _power_abs(x, p, acc), axes, "sum", native)


def root(s: Array, p: float) -> Array:
    """s**(1/p) with finite derivatives at s == 0; NaN and inf pass through."""
    if p == 1.0:
        return s
    zero = s == 0
    safe = jnp.where(zero, 1, s)
    if p == 2.0:
        r = jnp.sqrt(safe)
    elif p == int(p) and p <= 64:
        # 1/p is inexact in float32 and pow magnifies that by ln(s) (up to ~15 ulps at
        # s ~ 1e38); take out 2^(p*q) exactly first, so that ln of the rest is < p ln 2.
        k = int(p)
        q = jnp.floor_divide(lax.stop_gradient(jnp.frexp(safe)[1]), k)
        q = jnp.where(jnp.isfinite(safe), q, 0)
        r = jnp.ldexp(jnp.power(jnp.ldexp(safe, -k * q), 1.0 / p), q)
    else:
        r = jnp.power(safe, 1.0 / p)
    return jnp.where(zero, 0, r)


def _exact_range(s: Array) -> Array:
    """Whether a power sum is exact as it stands (no overflow, no lost underflow).

    Elements whose power underflowed lose at most ``n * tiny`` in all; above
    ``tiny * 2**64`` that is far below an ulp of the sum for any realistic ``n``.
    """
    lo = float(jnp.finfo(s.dtype).tiny) * 2.0**64
    return (s >= lo) & (s < jnp.inf)


def _safe_divisor(m: Array) -> tuple[Array, Array]:
    """(m where it is positive and finite else 1, that mask)."""
    good = (m > 0) & jnp.isfinite(m)
    return jnp.where(good, m, 1), good


def _reduction_view(arrays: Sequence[Array]) -> list[Array]:
    """The arrays behind an optimisation barrier, for the reductions to read.

    When a leaf feeds both a reduction and the scaling pass, XLA:CPU materialises its
    float32 upcast once for both (a full widened copy of bf16/f16 gradients). Reading
    the reductions through a barrier (a no-op alias) keeps each upcast fused into its
    own consumer, so no temporary exists.
    """
    return list(lax.optimization_barrier(list(arrays))) if arrays else []


def _axis_size_known(axis_name: AxisName) -> bool:
    return axis_name is not None and axis_name != ()


def _psum(x: Array, axis_name: AxisName) -> Array:
    return lax.psum(x, axis_name) if _axis_size_known(axis_name) else x


def _pmax(x: Array, axis_name: AxisName) -> Array:
    return lax.pmax(x, axis_name) if _axis_size_known(axis_name) else x


# ----------------------------------------------------------------------------------------
# Per-slice norms (clip_by_norm): one norm per leaf, or per slice over `axes`.


def slice_norms(
    leaves: Sequence[Array],
    p: float,
    axes: Sequence[Optional[tuple[int, ...]]],
    *,
    bucket: bool = True,
) -> list[Array]:
    """Norms of each leaf over its ``axes`` (all axes when None), with ``keepdims``.

    Small whole-leaf norms are computed in buckets: leaves of one dtype and size class
    (the next power of two) are zero-padded into the rows of one matrix, whose row norms
    are one reduction, so a thousand small leaves compile to a few kernels.

    Args:
      leaves: floating or complex arrays.
      p: the norm type (> 0, or inf).
      axes: per leaf, the axes to reduce (normalised, non-negative), or None for all.
      bucket: bucket small single-device leaves whose ``axes`` is None.

    Returns:
      Per leaf, an array broadcastable against it, in its accumulation dtype.
    """
    units: list[Array] = []
    unit_axes: list[Optional[tuple[int, ...]]] = []
    where: list[tuple[int, int]] = []  # per leaf: (unit, row), row -1 for a whole unit
    groups: dict[tuple[np.dtype, int], list[int]] = {}
    leaves = _reduction_view(leaves)
    for i, (x, a) in enumerate(zip(leaves, axes)):
        if bucket and a is None and 0 < x.size and _bucketable(x):
            groups.setdefault((np.dtype(x.dtype), 1 << (x.size - 1).bit_length()), []).append(i)
            where.append((-1, -1))
        else:
            where.append((len(units), -1))
            units.append(x)
            unit_axes.append(a)
    for (_, width), members in groups.items():
        rows = []
        for row, i in enumerate(members):
            x = leaves[i].ravel()
            rows.append(x if x.size == width else jnp.pad(x, (0, width - x.size)))
            where[i] = (len(units), row)
        units.append(_concatenate([r[None] for r in rows]))
        unit_axes.append((1,))
    bucketed = [False] * (len(units) - len(groups)) + [True] * len(groups)
    norms = _unit_norms(units, p, unit_axes, bucketed)
    out = []
    for x, (u, row) in zip(leaves, where):
        out.append(norms[u] if row < 0 else norms[u][row].reshape((1,) * x.ndim))
    return out


def _unit_norms(
    leaves: Sequence[Array],
    p: float,
    axes: Sequence[Optional[tuple[int, ...]]],
    bucketed: Sequence[bool],
) -> list[Array]:
    """Norms over ``axes`` (keepdims) of each array, overflow-safe, with one shared cond."""
    if not leaves:
        return []
    accs = [acc_dtype(x.dtype) for x in leaves]
    natives = [_native(x, b) for x, b in zip(leaves, bucketed)]
    if p == math.inf:
        return [_max_abs(*args) for args in zip(leaves, axes, accs, natives)]
    sums = [_power_sum(x, p, a, acc, nat) for x, a, acc, nat in zip(leaves, axes, accs, natives)]
    oks = [_exact_range(s) for s in sums]
    all_ok = jnp.all(jnp.stack([jnp.all(ok) for ok in oks]))

    def fast() -> list[Array]:
        return [root(s, p) for s in sums]

    def scaled() -> list[Array]:
        out = []
        # The rare path reduces natively: XLA:CPU's library kernels would materialise
        # widened copies where two reductions read one low-precision leaf.
        for x, a, acc, b, s, ok in zip(leaves, axes, accs, bucketed, sums, oks):
            nat = _native(x, b, rare=True)
            m = _max_abs(x, a, acc, nat)
            x = lax.optimization_barrier((x, m))[0]  # a second, separately fused read
            n = _unscale(m, _scaled_sum(x, _safe_divisor(m)[0], p, a, nat), p)
            out.append(jnp.where(ok, root(s, p), n))
        return out

    return lax.cond(all_ok, fast, scaled)


def _max_abs(x: Array, axes: Optional[tuple[int, ...]], acc: np.dtype, native: bool) -> Array:
    if x.size == 0:
        shape = tuple(1 if (axes is None or i in axes) else d for i, d in enumerate(x.shape))
        return jnp.zeros(shape, acc)
    return _reduce(x, _abs(x, acc), axes, "max", native)


def _scaled_sum(
    x: Array, d: Array, p: float, axes: Optional[tuple[int, ...]], native: bool
) -> Array:
    """``sum (|x|/d)^p`` over ``axes`` (keepdims), in the leaf's accumulation dtype."""
    acc = acc_dtype(x.dtype)
    return _reduce(x, _power(_abs(x, acc) / d.astype(acc), p), axes, "sum", native)


def _unscale(m: Array, t: Array, p: float) -> Array:
    """The norm ``m * t^(1/p)`` from a max magnitude ``m`` and a power sum scaled by it."""
    _, good = _safe_divisor(m)
    # m == 0: the norm is 0; m inf or NaN: it is m (PyTorch's propagation).
    return jnp.where(good, m * root(t, p), jnp.where(m == 0, 0, m))


# ----------------------------------------------------------------------------------------
# Global norms (clip_by_global_norm, global_norm): one scalar over many leaves.


def _bucketable(x: Array) -> bool:
    """Whether ``x`` is small and whole on one device, so copying it costs no traffic."""
    return x.size * x.dtype.itemsize <= BUCKET_MAX_BYTES and _one_device(x)


def _one_device(x: Array) -> bool:
    """Whether ``x`` lives whole on each device that holds it (single device, replicated,
    or a local block inside ``shard_map``), so reducing it needs no collective."""
    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # numpy arrays, Python scalars
        return True
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "size", 0) <= 1:
        return True
    spec_axes: set[str] = set()
    for entry in getattr(sharding, "spec", ()):
        if entry is None:
            continue
        spec_axes.update(entry if isinstance(entry, tuple) else (entry,))
    AxisType = jax.sharding.AxisType
    for name, kind in zip(mesh.axis_names, mesh.axis_types):
        if kind == AxisType.Manual:
            continue  # inside shard_map: x is this device's local block
        if kind == AxisType.Explicit and name not in spec_axes:
            continue  # replicated along this axis
        return False  # sharded, or Auto (placement decided later by XLA)
    return True


def _concatenate(parts: Sequence[Array]) -> Array:
    """``jnp.concatenate``, moving bfloat16 as raw 16-bit words: XLA:CPU would otherwise
    run a bfloat16 concatenation in float32, a widened copy of every part."""
    if parts[0].dtype != jnp.bfloat16:
        return jnp.concatenate(parts)
    words = jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint16) for x in parts])
    return lax.bitcast_convert_type(words, jnp.bfloat16)


def _units(leaves: Sequence[Array], bucket: bool) -> tuple[list[Array], list[bool]]:
    """The arrays to reduce (big or sharded leaves as they are, small ones concatenated),
    and which of them are buckets."""
    units: list[Array] = []
    buckets: dict[np.dtype, list[Array]] = {}
    for x in leaves:
        x = jnp.asarray(x)
        if x.size == 0:
            continue
        if bucket and _bucketable(x):
            buckets.setdefault(np.dtype(x.dtype), []).append(x)
        else:
            units.append(x)
    for group in buckets.values():
        units.append(group[0] if len(group) == 1 else _concatenate([g.ravel() for g in group]))
    return units, [False] * (len(units) - len(buckets)) + [True] * len(buckets)


def _global_max(
    units: Sequence[Array], natives: Sequence[bool], acc: np.dtype, axis_name: AxisName
) -> Array:
    m = jnp.zeros((), acc)
    for u, nat in zip(units, natives):
        m = jnp.maximum(m, _max_abs(u, None, acc_dtype(u.dtype), nat).reshape(()).astype(acc))
    return _pmax(m, axis_name)


def global_norm(
    leaves: Sequence[Array],
    p: float,
    *,
    axis_name: AxisName = None,
    bucket: bool = True,
) -> Array:
    """The p-norm of all ``leaves`` together, as if concatenated into one vector.

    Args:
      leaves: floating or complex arrays (already selected by ``need_clip``).
      p: the norm type (> 0, or inf).
      axis_name: mapped axis name(s) over which the leaves are shards (inside
        ``shard_map``/``pmap``); partial sums are ``psum``-ed, maxima ``pmax``-ed.
      bucket: concatenate small single-device leaves before reducing.

    Returns:
      A scalar in the widest accumulation dtype of the leaves (float32 at least).
    """
    acc = result_dtype(leaves)
    units, bucketed = _units(_reduction_view(leaves), bucket)
    natives = [_native(u, b) for u, b in zip(units, bucketed)]
    if p == math.inf:
        return _global_max(units, natives, acc, axis_name)
    s = jnp.zeros((), acc)
    for u, nat in zip(units, natives):
        s = s + _power_sum(u, p, None, acc_dtype(u.dtype), nat).reshape(()).astype(acc)
    s = _psum(s, axis_name)

    def scaled() -> Array:
        # Native reductions on the rare path (see _unit_norms).
        rare = [_native(u, b, rare=True) for u, b in zip(units, bucketed)]
        m = _global_max(units, rare, acc, axis_name)
        again = lax.optimization_barrier((units, m))[0]  # a second, separately fused read
        d, _ = _safe_divisor(m)
        t = jnp.zeros((), acc)
        for u, nat in zip(again, rare):
            t = t + _scaled_sum(u, d, p, None, nat).reshape(()).astype(acc)
        return _unscale(m, _psum(t, axis_name), p)

    return lax.cond(_exact_range(s), lambda: root(s, p), scaled)


# ----------------------------------------------------------------------------------------
# Scaling and checks shared by every mode.


def clip_scale(norm: Array, clip_norm: Any) -> Array:
    """``1`` where ``norm <= clip_norm``, else ``clip_norm / norm`` (0 for inf, NaN for NaN).

    The division is guarded so that its derivative is finite when no clipping happens.
    """
    c = jnp.asarray(clip_norm, norm.dtype)
    keep = norm <= c
    return jnp.where(keep, jnp.ones_like(norm), c / jnp.where(keep, 1, norm))


def apply_scale(x: Array, scale: Array) -> Array:
    """``x * scale`` with one rounding into ``x.dtype``; a scale of 1 is bit-exact."""
    acc = acc_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        return (x * scale.astype(acc)).astype(x.dtype)
    return (x.astype(acc) * scale.astype(acc)).astype(x.dtype)


def raise_if_nonfinite(values: Sequence[Array], names: Sequence[str]) -> None:
    """Raises (eagerly, or from inside ``jit`` via a host callback) if a norm is not finite.

    Under ``jit`` this adds a device-to-host transfer of the norms and a host
    synchronisation per call; the error then surfaces as a ``JaxRuntimeError`` whose
    message contains this one.
    """

    def check(*vals: Any) -> None:
        for v, name in zip(vals, names):
            v = np.asarray(v)
            if not np.all(np.isfinite(v)):
                raise FloatingPointError(
                    f"jaxclip: the {name} is non-finite ({v.max() if v.size else v}): the "
                    "gradients hold inf or NaN. Find where they come from, or pass "
                    "error_if_nonfinite=False to let NaN/inf propagate as in PyTorch."
                )

    if all(not isinstance(v, jax.core.Tracer) for v in values):
        check(*values)
    else:
        jax.debug.callback(check, *values)
