"""The one numerics core: every norm jaxclip computes comes from here.

A p-norm ``(sum |x|^p)^(1/p)`` (``max |x|`` for ``p=inf``) is computed in one pass in
the common case: the plain power sum, accumulated in float32 (float64 for float64
leaves) with the upcast fused into the reduction, so no widened copy of the gradients
exists. Only when that sum is outside the range where it is exact -- it overflowed, is
non-finite, or is so small that elements may have underflowed -- does a ``lax.cond``
take the rare path. For ``p=2`` that is the same sum once more, each slice scaled by a
power of two read off its plain sum (:func:`_rescale`: an overflowed sum scales down by
2**-85 in float32, a small or zero one lifts its largest possible element to 2**43), so
every square that matters is normal and no sum overflows; it needs no pass for the
maxima, and compiles to the plain sum's kernel shape with a scale. Other ``p`` scale per
array (or slice) by the power of two of its largest magnitude (exact, never a subnormal
factor), sum, and combine the parts by their exponents. Per-example norms read again only
the rows of the examples out of range, one at a time, where those are few
(:func:`_rows_apart_limit`): a padding (all-zero) example costs its row, not a pass over the
batch. Clipping needs no exact norm of a slice too small to reach the clip norm: per-slice
factors come from norms with a floor (:func:`_unit_norms_body`), so all-zero rows (unused
embedding rows) cost no second pass; the norms reported beside them take their own
``lax.cond``, which XLA drops when the caller does not use them.

On GPU and TPU (:data:`ONE_PASS`), where reductions are bound by memory, 2-norms over
whole arrays and slices take Blue's pass directly, with no ``lax.cond``: measured on an
H100, it runs at 1.0-1.08x the naive sum of squares, halves compile time against the two
paths (no rare branch to compile) and costs nothing extra for all-zero leaves or rows.
Per-example norms keep the two paths there (one pass ran no faster on their rows, with
6-25x the temporaries). XLA:GPU removes ``lax.cond`` from the compiled program: none is
left in the H100's optimized HLO, and the two paths there ran 1.16x optax on 10 large
leaves where one pass runs 1.02x, as if the rare branch's reads ran on every call.

Norms are carried as :class:`Norm` ``(frac, exp)``, ``norm = frac * 2**exp``, so that
the clipping factor ``c / norm`` is exact even where the norm or the factor is outside
float32's normal range (gradients near float32's largest value, tiny thresholds).
Derivatives come from one ``custom_jvp`` rule, ``d||x||_p = sum sign(x) (|x|/n)^(p-1) dx``,
evaluated overflow-free from ``(frac, exp)``: the scaled path's branch points never leak
into gradients.

Many small leaves are concatenated into one buffer per dtype ("bucketing") before a
global reduction, so a thousand-leaf tree compiles to a handful of reduction kernels.
The scalar maths of per-leaf norms and factors runs once over stacked vectors
(:func:`stacked`); each leaf reads its values back at an offset XLA cannot fold
(:func:`_opaque`), so that XLA:CPU compiles one scaling kernel per leaf shape, not one
per leaf.
Only leaves that live whole on one device are bucketed: concatenating sharded leaves
would make XLA all-gather them.

XLA:CPU needs three measures to keep widened copies of low-precision gradients out of
memory (each guarded by a ``memory_analysis()`` test): reductions read the leaves through
an optimisation barrier (:func:`_reduction_view`), f16/f8 leaves, 16-bit buckets and the
rare path use a reduce XLA fuses itself (:func:`_reduce`), and bf16 buckets are
concatenated as 16-bit words (:func:`_concatenate`). XLA's own fused reduce accumulates
sequentially, so it runs over chunks of :data:`BLOCK` elements whose results are summed
by the library reduction: the rounding error stays that of a ``BLOCK``-term sum. The
single pass reduces whole arrays at once on other platforms (XLA:GPU reduces in a tree),
chosen when lowering (``lax.platform_dependent``), so that a GPU host computing on its
CPU still runs the blocks. On GPU/TPU these measures cost nothing.

Where the backend flushes subnormals (XLA:CPU does), subnormal inputs count as zero in
every norm; they are still returned bit for bit when nothing is clipped.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
AxisName = None | str | tuple[str, ...]
Axes = tuple[int, ...] | None
Elem = Callable[[Array, Any], Any]  # an array, or a tuple of them (several sums)
#: The mapped axes over which a partial norm is combined (see :func:`combine_axes`).
Combine = tuple[str, ...]
Shape = tuple[int, ...]

#: Leaves at most this many bytes may be copied into a bucket before a global reduction.
BUCKET_MAX_BYTES = 64 * 1024
#: A bucket concatenates at most this many leaves: XLA's layout assignment is superlinear
#: in a concatenation's operands (33 s of a 98 s compile for one of 3920 leaves; 3.5 s
#: with buckets of 256).
BUCKET_MAX_LEAVES = 256
#: XLA's fused (sequential) reduce runs over blocks of this many elements.
BLOCK = 256


#: How 2-norms are computed: None picks by the default backend (Blue's single pass on
#: GPU/TPU, the plain sum with a rare path on CPU), True or False forces one (also set by
#: the environment variable ``JAXCLIP_ONE_PASS=1`` or ``0``). Both are exact; a change
#: takes effect for functions traced afterwards (``jax.clear_caches()``).
def _one_pass_from_env() -> bool | None:
    value = os.environ.get("JAXCLIP_ONE_PASS", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"JAXCLIP_ONE_PASS must be 1 or 0 (or unset), got {value!r}")
    return None if value == "" else value == "1"


ONE_PASS: bool | None = _one_pass_from_env()


def _one_pass() -> bool:
    """Whether 2-norms take Blue's three accumulators in one pass with no ``lax.cond``.

    Where reductions are bound by memory (GPU, TPU) the extra arithmetic is free, and
    with no conditional each leaf compiles to one reduction kernel. XLA:CPU runs the
    variadic reduce ~2-8x slower than its library sum, so there the plain sum of squares
    runs, and a ``lax.cond`` takes the rare path only when that sum is out of range.
    The choice follows the default backend at trace time (a GPU host computing on its
    CPU gets the single pass there: exact, slower); only speed depends on it.
    """
    return jax.default_backend() != "cpu" if ONE_PASS is None else ONE_PASS


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


def _abs(x: Array, acc: np.dtype) -> Array:
    """|x| in the accumulation dtype (the convert fuses into the consumer)."""
    if jnp.iscomplexobj(x):
        return jnp.abs(x).astype(acc)
    return jnp.abs(x.astype(acc))


def _power(a: Array, p: float, split: bool = False) -> Array:
    """a**p for a >= 0; NaN stays NaN for every p.

    With ``split``, a fractional ``p`` takes :func:`_power_by_parts` (exact at any
    magnitude, 2x faster than pow in XLA:CPU's library reductions, but 9x slower inside
    its fused reduce loops): for the common path's float32/float64 sums. Elsewhere the
    data is scaled near 1 (the rare path) or 16-bit, where pow's error is small.
    """
    if p == 1.0:
        return a
    if p == 2.0:
        return a * a
    if p == int(p) and p <= 8:
        return lax.integer_pow(a, int(p))
    if p == 0.5:
        return jnp.sqrt(a)  # correctly rounded
    if split and p <= POWER_OF_TWO_MAX_P:  # above, f**p in [0.5, 1)**p would underflow
        return _power_by_parts(a, p)
    pos = a > 0
    return jnp.where(pos, jnp.power(jnp.where(pos, a, 1), p), a)


def _power_by_parts(a: Array, p: float) -> Array:
    """``a**p`` for ``a >= 0`` to about an ulp at any magnitude.

    ``pow(a, p) = exp(p ln a)`` rounds ``p ln a`` first, which costs ``|p ln a| / 2``
    ulps (23 at a ~ 1e20: p < 1 norms were 13 eps off). Here ``a = f 2**k`` and
    ``p = hi + mid + lo`` with ``hi = H 2**-S`` of 12 bits: the integer part of ``k hi``
    comes from integer arithmetic, exactly, and goes straight into the exponent bits of
    ``2**(frac(k hi) + k mid + k lo + p log2 f)``, whose argument is below ``p + 1`` in
    size. The integer part is added to the exponent bits: multiplying by a power of two
    built from it made XLA:CPU's loop 6x slower; as it is, it takes half of pow's time
    before a library reduction (``benchmarks/bench_powers.py``).
    """
    info = np.finfo(a.dtype)
    itype = np.int32 if a.dtype.itemsize == 4 else np.int64
    nm, bias = info.nmant, info.maxexp - 1
    f, k = frexp(a)
    hi, mid, lo = _split(Fraction(p), a.dtype)
    top = math.frexp(hi)[1]
    shift = 12 - top
    steps = k.astype(itype) * round(math.ldexp(hi, shift))  # k hi = steps 2**-shift
    whole = steps >> shift  # floor
    frac = (steps & ((1 << shift) - 1)).astype(a.dtype) * math.ldexp(1.0, -shift)
    r = jnp.exp2(frac + (k * mid + k * lo) + p * jnp.log2(f))
    bits = lax.bitcast_convert_type(r, itype)
    e = ((bits >> nm) & (2 * bias + 1)) + whole  # the result's biased exponent
    out = lax.bitcast_convert_type(bits + (whole << nm), a.dtype)
    out = jnp.where(e <= 0, 0, jnp.where(e > 2 * bias, jnp.inf, out))
    return jnp.where(jnp.isnan(r), r, out)


def _split(c: Fraction, dtype: Any) -> tuple[float, float, float]:
    """``c = hi + mid + lo`` (to ``dtype``'s precision squared) with ``hi`` of 12 bits,
    so that ``k * hi`` is exact for any exponent ``k`` of ``dtype``, and ``mid``, ``lo``
    in ``dtype``. ``c`` is exact (``1/p`` as a double is off by half an ulp, which a
    float64 root magnified by its exponent, ~900 at 1e-270, to 200 ulps)."""
    top = math.frexp(float(c))[1]
    hi = math.ldexp(round(math.ldexp(float(c), 12 - top)), top - 12)
    mid = float(np.asarray(float(c - Fraction(hi)), dtype))
    return hi, mid, float(np.asarray(float(c - Fraction(hi) - Fraction(mid)), dtype))


def _power_abs(x: Array, p: float, acc: np.dtype, split: bool = False) -> Array:
    if p == 2.0 and jnp.iscomplexobj(x):
        re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
        return re * re + im * im
    return _power(_abs(x, acc), p, split)


# ----------------------------------------------------------------------------------------
# Exact powers of two, and norms as (frac, exp).


def _pow2(k: Array, dtype: Any) -> Array:
    """Exactly ``2**k`` for integer-valued ``k``, clamped to ``dtype``'s normal range."""
    dtype = np.dtype(dtype)
    info = np.finfo(dtype)
    itype = np.int32 if dtype.itemsize == 4 else np.int64
    k = jnp.clip(jnp.asarray(k), info.minexp, info.maxexp - 1).astype(itype)
    return lax.bitcast_convert_type((k + (info.maxexp - 1)) << info.nmant, dtype)


def ldexp(x: Array, e: Array, *, divide_last: bool = False) -> Array:
    """``x * 2**e`` in ``x``'s dtype, exact unless the result is outside the normal range;
    ``e`` may exceed the exponent range (applied as three normal factors).

    With ``divide_last`` the third factor is applied as a division by its reciprocal (the
    same value): XLA copies a chain of cheap scalar ops into every kernel that reads its
    result, but computes a division once (see :func:`clip_scale`). Not for elementwise
    use over large arrays, where a division costs more than a product.
    """
    dtype = x.real.dtype if jnp.iscomplexobj(x) else x.dtype
    info = np.finfo(dtype)
    lo, hi = info.minexp, info.maxexp - 1
    e = jnp.asarray(e, dtype)
    e1 = jnp.clip(e, lo, hi)
    e2 = jnp.clip(e - e1, lo, hi)
    e3 = e - e1 - e2
    y = x * _pow2(e1, dtype) * _pow2(e2, dtype)
    return y / _pow2(-e3, dtype) if divide_last else y * _pow2(e3, dtype)


class Norm(NamedTuple):
    """A norm as ``frac * 2**exp``, ``exp`` an integer held in ``frac``'s dtype: the value
    itself with ``exp == 0`` where it is a normal number (or 0, inf, NaN), else a normal
    ``frac`` (see :func:`_from_root`), so that a norm beyond the dtype's range (four
    float32 values of 3e38) still clips exactly."""

    frac: Array
    exp: Array

    @property
    def value(self) -> Array:
        """The norm as a number (inf where it exceeds the dtype's range)."""
        return ldexp(self.frac, self.exp, divide_last=True)


def as_norm(value: Array) -> Norm:
    """A :class:`Norm` from a norm given as a number (``use_norm``)."""
    return Norm(value, jnp.zeros_like(value))


def frexp(x: Array) -> tuple[Array, Array]:
    """``(f, e)`` with ``x = f * 2**e``, ``f`` in [0.5, 1), ``e`` an integer held in
    ``x``'s dtype, for ``x >= 0``; ``(x, 0)`` where ``x`` is 0, inf or NaN. A few bit
    operations (``jnp.frexp`` traces ~3x more ops, which adds up over many leaves)."""
    info = np.finfo(x.dtype)
    itype = np.int32 if x.dtype.itemsize == 4 else np.int64
    nm, bias = info.nmant, info.maxexp - 1
    sub = x < info.tiny  # subnormal (or zero): normalise first
    xs = jnp.where(sub, x * _pow2(jnp.asarray(nm + 1), x.dtype), x)
    bits = lax.bitcast_convert_type(xs, itype)
    e = (bits >> nm) - (bias - 1)
    mant = (bits & ((1 << nm) - 1)) | ((bias - 1) << nm)
    f = lax.bitcast_convert_type(mant.astype(itype), x.dtype)
    e = e.astype(x.dtype) - jnp.where(sub, nm + 1, 0).astype(x.dtype)
    # A subnormal that the normalising product flushed (XLA:CPU) counts as 0, as in the
    # sums; its bits read as 0.5 * 2**-150 (p < 1 norms counted each as 2**(-151 p)).
    flushed = sub & (xs == 0)
    special = (x == 0) | ~jnp.isfinite(x) | flushed
    f = jnp.where(flushed, 0, jnp.where(special, x, f))
    return f, jnp.where(special, 0, e).astype(x.dtype)


def root(s: Array, p: float) -> Array:
    """s**(1/p) for s >= 0; NaN and inf pass through."""
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
        q = jnp.floor_divide(jnp.frexp(safe)[1], k)
        q = jnp.where(jnp.isfinite(safe), q, 0)
        r = jnp.ldexp(jnp.power(jnp.ldexp(safe, -k * q), 1.0 / p), q)
    else:
        r = jnp.power(safe, 1.0 / p)
    return jnp.where(zero, 0, r)


def _exact_range(s: Array, acc: np.dtype) -> Array:
    """Whether a power sum of :func:`_power_sum` accumulated in ``acc`` is exact as it
    stands (no overflow, no lost underflow): elements whose power underflowed lose at most
    ``n * tiny`` in all, far below an ulp of any sum above ``tiny * 2**64`` for a
    realistic ``n``."""
    return (s >= _exact_lo(acc)) & (s < jnp.inf)


def _exact_lo(acc: Any) -> float:
    """The smallest power sum in :func:`_exact_range`: ``tiny * 2**64``."""
    return float(np.finfo(acc).tiny) * 2.0**64


# ----------------------------------------------------------------------------------------
# Reductions.


def _reduction_view(arrays: Sequence[Array]) -> list[Array]:
    """The arrays behind an optimisation barrier, for the reductions to read.

    When a leaf feeds both a reduction and the scaling pass, XLA:CPU materialises its
    float32 upcast once for both (a full widened copy of bf16/f16 gradients). Reading
    the reductions through a barrier (a no-op alias) keeps each upcast fused into its
    own consumer, so no temporary exists.
    """
    return _barrier(arrays)[0]


def _barrier(arrays: Sequence[Array], extra: Any = None) -> tuple[list[Array], list[Any]]:
    """``optimization_barrier`` of ``arrays``, one barrier per set of varying mesh axes:
    inside ``shard_map`` a single barrier would make every array vary across the union
    of their axes. With ``extra`` (scale factors), each array passes its own barrier
    with its own copy of ``extra``: from one shared copy, XLA:CPU computes the factor's
    broadcast once for all arrays of a shape, at full size (a 6.7 MB temporary and 1.4x
    the time of the global norm's rare path on 10 leaves of 1024 x 1640)."""
    if extra is not None:
        pairs = [lax.optimization_barrier((x, extra)) for x in arrays]
        return [x for x, _ in pairs], [e for _, e in pairs]
    groups: dict[frozenset[str], list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(_varying(x), []).append(i)
    out = list(arrays)
    for members in groups.values():
        xs = lax.optimization_barrier([arrays[i] for i in members])
        for i, x in zip(members, xs):
            out[i] = x
    return out, [None] * len(arrays)


def _native(x: Array, bucketed: bool, rare: bool = False, p: float = 2.0) -> bool:
    """Whether ``x`` is reduced by XLA's own fused reduce (see :func:`_reduce`): f16 and
    8-bit leaves, 16-bit buckets, every ``p=inf`` max (XLA:CPU's library max of 4096 or
    more elements loses a NaN, returning -inf or a wrong maximum; the fused one is as
    fast), and everything on the rare path (XLA:CPU's library reduce would materialise
    the broadcast of the scale factors, or a widened copy where two reductions read one
    low-precision leaf); never a sharded leaf, whose variadic reduce XLA would partition
    with an all-gather (:func:`_inf_norm` carries its NaN by an ``any``)."""
    small = x.dtype.itemsize < 4 and not jnp.iscomplexobj(x)
    # bf16 goes to the library reduce only where its convert fuses (integer powers).
    fractional = math.isfinite(p) and p != int(p)
    wanted = rare or p == math.inf
    wanted |= small and (x.dtype != jnp.bfloat16 or bucketed or fractional)
    return wanted and _one_device(x)


#: The rare path rescales rows of at least this many elements in the library reduction.
LIBRARY_ROW_MIN = 64


def _rare_native(x: Array, bucketed: bool, p: float, axes: Axes) -> bool:
    """:func:`_native` for the rare path's second read of a 2-norm: the library reduction
    (faster to compile and to run) for a 32/64-bit leaf reduced whole or over trailing
    axes of at least :data:`LIBRARY_ROW_MIN` elements, each row scaled by its factor:
    5-7x faster than the fused reduce there (12 against 44 ms on 50000 rows of 512,
    an embedding whose unused rows are zero, so that the rare path runs on every step).
    The fused one for narrower data, whose upcast XLA:CPU would otherwise materialise
    for both reads; for buckets, whose row scales' broadcast it would materialise (2 MB,
    half the bucket, for a thousand small leaves); for leading or middle axes (the
    library ran 5-40x slower there) and short rows (3x slower on rows of 16)."""
    dims = tuple(range(x.ndim)) if axes is None else tuple(sorted(axes))
    trailing = dims == tuple(range(x.ndim - len(dims), x.ndim))
    rows = math.prod(x.shape[d] for d in dims) >= LIBRARY_ROW_MIN or len(dims) == x.ndim
    fused = p != 2.0 or x.dtype.itemsize < 4 or bucketed or not (trailing and rows)
    return _native(x, bucketed, rare=fused, p=p)


def _fused_reduce(x: Array, elem: Elem, s: Any, dims: tuple[int, ...], op: str) -> Array:
    """``op`` of ``elem(x)`` over ``dims`` (dropped) as one variadic reduce XLA fuses itself.

    The reduce also takes ``min |x|``, tied into the result (``min >= 0`` unless NaN, when
    the result is NaN anyway), so that it is not simplified back into a library reduce.
    """
    v = elem(x, s)
    if isinstance(v, tuple):  # several sums in one pass (already variadic)
        zeros = tuple(jnp.zeros((), t.dtype) for t in v)
        return lax.reduce(v, zeros, lambda a, b: tuple(map(jnp.add, a, b)), dims)
    zero = jnp.zeros((), v.dtype)
    combine = jnp.add if op == "sum" else jnp.maximum
    r, low = lax.reduce(
        (v, _abs(x, v.dtype)),
        (zero, jnp.asarray(jnp.inf, v.dtype)),
        lambda a, b: (combine(a[0], b[0]), jnp.minimum(a[1], b[1])),
        dims,
    )
    # lax, not jnp.where: a jitted function, a call per reduction in the program.
    return lax.select(low >= 0, r, lax.full_like(r, jnp.nan))


def _reduce(
    x: Array, elem: Elem, axes: Axes, op: str, native: bool, s: tuple[Array, ...] | None = None
) -> Array:
    """Sum or max of ``elem(x, s)`` over ``axes`` (all when None), with keepdims.

    ``elem`` is elementwise, applied to ``x`` or to a reshaped part of it; ``s`` (keepdims
    shape, or None) are per-slice operands reshaped along with it. With ``native``
    the reduction is XLA's fused one: XLA:CPU's library kernels cannot fuse an f16 -> f32
    convert nor a concatenation and would materialise a widened copy. That reduce adds
    sequentially (up to ~n/2 ulps off on constant data: 7e-3 over 2e6 elements), so a sum
    runs over chunks of :data:`BLOCK` elements (twice that for 8-bit data) of the reduced
    axes, flattened where adjacent, whose results a library reduction adds
    (pairwise-accurate); the chunk results cost ``8 / BLOCK`` bytes per element. Reduced
    axes that are not adjacent are reduced a run at a time, the last first.
    """
    dims = tuple(range(x.ndim)) if axes is None else tuple(sorted(axes))
    kept = tuple(1 if i in dims else d for i, d in enumerate(x.shape))
    if not native:
        return (jnp.sum if op == "sum" else jnp.max)(elem(x, s), axis=dims, keepdims=True)
    block = BLOCK if x.dtype.itemsize > 1 else 2 * BLOCK  # chunk results <= 2% of the bytes
    n = len(dims)
    length = math.prod(x.shape[d] for d in dims)
    if op == "max" or length <= block:  # a max is exact in any order
        return _shaped(_fused_reduce(x, elem, s, dims, op), kept)
    at = dims[0]
    if dims != tuple(range(at, at + n)):
        # Not adjacent: the last run of adjacent axes, then the partial sums (in the
        # accumulation dtype, and smaller) over the other axes by the library reduction.
        last = next(d for i, d in enumerate(dims) if dims[i:] == tuple(range(d, dims[-1] + 1)))
        r = _reduce(x, elem, tuple(range(last, dims[-1] + 1)), op, native, s)
        others = tuple(d for d in dims if d < last)
        return jax.tree.map(lambda v: jnp.sum(v, axis=others, keepdims=True), r)
    # Adjacent (trailing, leading, or in the middle): one axis of ``length``, in chunks.
    flat = x.reshape((*x.shape[:at], length, *x.shape[at + n :]))
    if s is not None:
        s = tuple(f.reshape((*f.shape[:at], 1, *f.shape[at + n :])) for f in s)
    chunks = length // block
    shape = (*flat.shape[:at], chunks, block, *flat.shape[at + 1 :])
    main = lax.slice_in_dim(flat, 0, chunks * block, axis=at).reshape(shape)
    s1 = None if s is None else tuple(jnp.expand_dims(f, at + 1) for f in s)
    r = _fused_reduce(main, elem, s1, (at + 1,), op)
    if isinstance(r, tuple):  # one library reduction for all the sums' chunk results
        r = tuple(jnp.sum(jnp.stack(r), axis=at + 1))
    else:
        r = jnp.sum(r, axis=at)
    if chunks * block < length:
        tail = lax.slice_in_dim(flat, chunks * block, length, axis=at)
        r = jax.tree.map(jnp.add, r, _fused_reduce(tail, elem, s, (at,), op))
    return _shaped(r, kept)


def _shaped(r: Any, shape: Shape) -> Any:
    return jax.tree.map(lambda v: v.reshape(shape), r)


def _max_abs(x: Array, axes: Axes, acc: np.dtype, native: bool, parts: bool = False) -> Array:
    """``max |x|``; with ``parts``, of a complex ``x`` its largest real or imaginary part
    instead, for the rare path's scale: finite wherever the parts are (``|x|`` overflows
    beyond the dtype's largest value) and within a factor ``sqrt(2)`` of ``max |x|``."""
    if x.size == 0:
        shape = tuple(1 if (axes is None or i in axes) else d for i, d in enumerate(x.shape))
        return jnp.zeros(shape, acc)
    if parts and jnp.iscomplexobj(x):
        return _reduce(
            x, lambda v, _: jnp.maximum(_abs(v.real, acc), _abs(v.imag, acc)), axes, "max", native
        )
    return _reduce(x, lambda v, _: _abs(v, acc), axes, "max", native)


def _halved(x: Array) -> Array:
    """A complex ``x / 2``, its parts halved: its modulus is finite wherever the parts
    are (``|x|`` overflows above the dtype's largest value)."""
    return lax.complex(x.real * 0.5, x.imag * 0.5)


def _inf_norms(
    xs: Sequence[Array], axes: Sequence[Axes], natives: Sequence[bool]
) -> tuple[list[Array], list[Array] | None]:
    """``max |x|`` of each array (see :func:`_inf_norm`), and, where one is complex, also
    ``max |x / 2|`` of each (parts halved before the modulus: finite where the parts are,
    when ``|x|`` itself overflows), for :func:`_inf_result`; None for real arrays only."""
    ms = [_inf_norm(x, a, acc_dtype(x.dtype), nat) for x, a, nat in zip(xs, axes, natives)]
    if not any(jnp.iscomplexobj(x) for x in xs):
        return ms, None
    halves = [
        _inf_norm(_halved(x), a, acc_dtype(x.dtype), nat) if jnp.iscomplexobj(x) else m * 0.5
        for x, a, nat, m in zip(xs, axes, natives, ms)
    ]
    return ms, halves


def _inf_result(m: Array, half: Array | None = None) -> Norm:
    """The inf-norm of largest magnitude ``m``: where ``m`` overflowed but ``half``
    (``max |x / 2|``, complex arrays) did not, ``half * 2`` kept as a :class:`Norm`."""
    n = _special(m, _from_root(m, jnp.zeros_like(m)))
    if half is None:
        return n
    h = _from_root(half, jnp.ones_like(half))
    over = (m == jnp.inf) & jnp.isfinite(half)
    return Norm(jnp.where(over, h.frac, n.frac), jnp.where(over, h.exp, n.exp))


def _inf_norm(x: Array, axes: Axes, acc: np.dtype, native: bool) -> Array:
    """``max |x|`` for ``p=inf``, NaN where ``x`` holds one: XLA:CPU's cross-device max
    drops NaN, so a sharded ``x`` carries it by an ``any`` (on the rare path, NaN reaches
    the norm through the scaled sum instead)."""
    m = _max_abs(x, axes, acc, native)
    if _one_device(x):
        return m
    return jnp.where(jnp.any(jnp.isnan(x), axis=axes, keepdims=True), jnp.nan, m)


def _power_sum(x: Array, p: float, axes: Axes, native: bool) -> Array:
    """``sum |x|^p`` over ``axes`` (keepdims), in ``x``'s accumulation dtype."""
    acc = acc_dtype(x.dtype)
    return _reduce(x, lambda v, _: _power_abs(v, p, acc, not native), axes, "sum", native)


#: Up to this p the rare path scales by a power of two (exact); above it, also by the
#: mantissa of the largest magnitude: the largest term, in [0.5, 1)^p, would underflow.
POWER_OF_TWO_MAX_P = 64.0


def _scale_of(m: Array, p: float) -> tuple[Array, Array | None]:
    """For the rare path of a p-norm of largest magnitude ``m`` (per slice): ``e``, the
    exponent of ``m``, and ``mant``: the terms are ``(|x| 2**-e / mant)^p``, so that the
    largest is 1 (``mant`` is None, i.e. 1, up to :data:`POWER_OF_TWO_MAX_P`, else m's
    mantissa, at the cost of one rounding per term) and the norm is
    ``mant t**(1/p) 2**e``."""
    e = frexp(m)[1]
    if p <= POWER_OF_TWO_MAX_P:
        return e, None
    good = (m > 0) & jnp.isfinite(m)
    return e, jnp.where(good, ldexp(m, -e), 1)


def _factors(e: Array, mant: Array | None, dtype: Any) -> tuple[Array, Array]:
    """``2**-e / mant`` as two normal factors in ``dtype`` (see :func:`_scale_of`)."""
    half = jnp.floor(-e / 2)
    rest = _pow2(-e - half, dtype)
    return _pow2(half, dtype), rest if mant is None else rest / mant.astype(dtype)


def _scaled_parts(
    x: Array, p: float, axes: Axes, native: bool, m: Array, combine: Combine = ()
) -> tuple[Array, Array]:
    """The rare path for one array, given ``m = max |x|`` per slice (combined): ``(e, t)``,
    ``e`` the exponent of ``m`` (float; -inf where ``m`` is 0 or not finite) and
    ``t = sum (|x| 2**-e / mant)^p`` (see :func:`_scale_of`), each term at most 1, so
    nothing overflows and only negligible terms underflow; ``t`` combined over the mapped
    axes ``combine``."""
    e, mant = _scale_of(m, p)
    good = (m > 0) & jnp.isfinite(m)
    factors = _factors(e, mant, acc_dtype(x.dtype))
    return jnp.where(good, e, -jnp.inf), _scaled_sum(x, p, axes, native, factors, combine)


def _scaled_sum(
    x: Array, p: float, axes: Axes, native: bool, factors: tuple[Array, ...], combine: Combine
) -> Array:
    """``sum (|x| f0 f1 ...)^p`` over ``axes`` (keepdims; the factors of :func:`_factors`,
    or the one of :func:`_rescaled`, per slice), combined over the mapped axes
    ``combine``."""
    acc = acc_dtype(x.dtype)
    x, factors = lax.optimization_barrier((x, factors))  # no materialised broadcast
    return _psum(_reduce(x, _scaled_elem(p, acc), axes, "sum", native, factors), combine)


#: Sums of squares of up to 2**SQUARES_LOG2 elements are bounded in :func:`_rescale`.
SQUARES_LOG2 = 40


def _rescaled(s: Array, ok: Array) -> Array:
    """``2**-e`` for ``e`` of :func:`_rescale`: one factor, normal for every such ``e``."""
    return _pow2(-_rescale(s, ok), s.dtype)


def _rescale(s: Array, ok: Array | bool) -> Array:
    """The rare path of a 2-norm without a pass for the maxima: ``e`` per slice, from its
    plain sum of squares ``s``, such that ``sum (|x| 2**-e)**2`` is exact (0 where ``ok``).

    ``s`` overflowed (inf; NaN stays NaN): every element is at most the dtype's largest,
    so ``e = (maxexp + 42) // 2`` (85 for float32) keeps a sum of 2**40 squares finite,
    and elements that matter (squares above ``s * 2**-70``) stay normal. ``s`` too small
    (elements may have underflowed, or all are zero): every element is at most
    ``sqrt(max(s, tiny))``, and ``e`` lifts that to ``2**((maxexp - 41) / 2)``, so again
    nothing overflows, and every normal element (subnormals too, where the backend keeps
    them) squares to a normal number. One more pass over the data, with the same kernel
    shape as the plain sum.
    """
    info = np.finfo(s.dtype)
    down = float((info.maxexp + SQUARES_LOG2 + 2) // 2)
    top = info.maxexp - SQUARES_LOG2 - 1
    log2 = frexp(jnp.maximum(s, info.tiny))[1]  # s < 2**log2
    up = jnp.floor((log2 - top) / 2)
    return jnp.where(ok, 0, jnp.where(s < jnp.inf, up, down)).astype(s.dtype)


def _scaled_elem(p: float, acc: np.dtype) -> Elem:
    """``(|v| * f0 * f1 ...)^p``: a term of a power sum scaled by its factors."""

    def elem(v: Array, f: Any) -> Array:
        if jnp.iscomplexobj(v):  # parts scaled before the modulus, which may overflow
            re, im = (functools.reduce(jnp.multiply, f, w.astype(acc)) for w in (v.real, v.imag))
            return _power_abs(lax.complex(re, im), p, acc)
        return _power(functools.reduce(jnp.multiply, f, _abs(v, acc)), p)

    return elem


class Blue(NamedTuple):
    """Constants of the one-pass overflow-safe 2-norm (Blue 1978; Anderson 2017, as in
    LAPACK 3.10's ``nrm2``) for an accumulation dtype, as exponents of two: magnitudes in
    ``[2**small, 2**big]`` are squared as they are, larger ones times ``2**-down``, smaller
    ones times ``2**up``. Every square is normal and no sum of up to 2**31 of them
    overflows, so each accumulator is exact to rounding."""

    small: int
    big: int
    down: int
    up: int


@functools.cache
def _blue(acc: np.dtype) -> Blue:
    info = np.finfo(acc)
    big = (info.maxexp - 32) // 2  # 2**31 squares of 2**big stay finite
    small = -((-info.minexp) // 2)  # squares of 2**small are normal
    down = info.maxexp - big  # 2**maxexp scaled to 2**big
    lowest = info.minexp - info.nmant  # the smallest subnormal
    up = ((-lowest + small) + (big - small)) // 2  # smallest squares normal, no overflow
    return Blue(small, big, down, up)


def _blue_elem(acc: np.dtype) -> Elem:
    """The three accumulators' terms of ``v`` (a NaN lands in the medium one)."""
    b = _blue(acc)
    big, small = 2.0**b.big, 2.0**b.small
    down, up = 2.0**-b.down, 2.0**b.up

    def elem(v: Array, _: Any) -> tuple[Array, Array, Array]:
        if jnp.iscomplexobj(v):  # |z|**2 = re**2 + im**2; |z| itself may overflow
            re, im = elem(jnp.real(v), None), elem(jnp.imag(v), None)
            return tuple(a + b for a, b in zip(re, im))  # type: ignore[return-value]
        a = _abs(v, acc)
        hi, lo = a > big, a < small
        # The scale is selected per element, never a constant: XLA would rewrite
        # (a * c)**2 as a**2 * c**2, which overflows or underflows.
        y = a * jnp.where(hi, down, jnp.where(lo, up, 1.0)).astype(acc)
        sq, zero = y * y, jnp.zeros((), acc)
        return jnp.where(hi, sq, zero), jnp.where(hi | lo, zero, sq), jnp.where(lo, sq, zero)

    return elem


def _blue_sums(x: Array, axes: Axes, native: bool) -> tuple[Array, Array, Array]:
    """The big, medium and small accumulators of ``x`` over ``axes`` (keepdims): one
    variadic reduce, or (a sharded ``x``, whose variadic reduce XLA would gather) three
    library reductions. On a platform other than CPU (chosen when lowering) the variadic
    reduce runs over the whole ``axes`` at once, not in blocks: XLA:GPU reduces in a
    tree."""
    elem = _blue_elem(acc_dtype(x.dtype))
    dims = tuple(range(x.ndim)) if axes is None else axes
    if native:
        # Chosen per platform at lowering (XLA:CPU's fused reduce is sequential), not by
        # the default backend: a GPU host may run this on its CPU.
        kept = tuple(1 if i in dims else d for i, d in enumerate(x.shape))
        return lax.platform_dependent(
            x,
            cpu=lambda v: _reduce(v, elem, axes, "sum", True),
            default=lambda v: _shaped(_fused_reduce(v, elem, None, dims, "sum"), kept),
        )
    return tuple(jnp.sum(t, axis=dims, keepdims=True) for t in elem(x, None))  # type: ignore[return-value]


def _blue_norm(hi: Array, mid: Array, lo: Array) -> Norm:
    """The 2-norm from the three accumulators (combined over units and devices)."""
    b = _blue(np.dtype(mid.dtype))
    down, up = 2.0**-b.down, 2.0**b.up
    # Big values present: the medium sum in their units (the small one is negligible).
    # Else medium: if tiny (below 2**-70), in the small values' units, else the small
    # sum in the medium units (< 2**-95 in all: its rounding is far below an ulp).
    # Each factor is applied twice and chosen at run time: XLA folds ``(v * c) * c`` of
    # a constant ``c`` into ``v * c**2``, which overflows.
    tiny_mid = mid < 2.0 ** (np.finfo(mid.dtype).minexp + 56)
    f_mid = jnp.where(hi > 0, down, jnp.where(tiny_mid, up, 1.0)).astype(mid.dtype)
    f_lo = jnp.where(hi > 0, 0.0, jnp.where(tiny_mid, 1.0, 1 / up)).astype(mid.dtype)
    s = hi + (mid * f_mid) * f_mid + (lo * f_lo) * f_lo
    e = jnp.where(hi > 0, b.down, jnp.where(tiny_mid, -b.up, 0)).astype(mid.dtype)
    n = _root_norm(s, 2.0, e)
    good = jnp.isfinite(s) & (s > 0)
    # NaN anywhere is NaN (it sits in the medium sum), inf is inf, all zeros 0.
    frac = jnp.where(good, n.frac, jnp.where(s > 0, s, jnp.where(jnp.isnan(s), s, 0)))
    return Norm(frac, jnp.where(good, n.exp, 0))


def _from_root(r: Array, e: Any) -> Norm:
    """The norm ``r * 2**e`` as a :class:`Norm`: ``(value, 0)`` where the value is a
    normal number (so derivatives are carried unscaled), else with ``frac`` in
    ``[2**(g-1), 2**g)`` above the range and ``[2**(-g-1), 2**-g)`` below it, ``g`` half
    the exponent range: the tangent ``dn * 2**-exp`` of ``frac`` then stays normal for
    any realistic ``dn``, where a fraction in [0.5, 1) would underflow or overflow it."""
    e = jnp.asarray(e, r.dtype)
    v = ldexp(r, e)
    frac, k = frexp(r)
    g = np.finfo(r.dtype).maxexp // 2
    shift = jnp.where(k + e > 0, g, -g).astype(r.dtype)
    normal = jnp.isfinite(v) & ((v >= np.finfo(r.dtype).tiny) | (v == 0))
    return Norm(jnp.where(normal, v, ldexp(frac, shift)), jnp.where(normal, 0, k + e - shift))


def _root_norm(s: Array, p: float, e: Any = 0, mant: Array | None = None) -> Norm:
    """The norm ``mant * s**(1/p) * 2**e`` of a power sum ``s >= 0`` (``mant`` in
    [0.5, 1] for ``p`` above :data:`POWER_OF_TWO_MAX_P`, see :func:`_scale_of`).

    Integer ``p`` use :func:`root`. Otherwise ``s = f * 2**k`` and the root is
    ``f**(1/p) * 2**(k/p)``: ``pow`` sees only ``f`` in [0.5, 1) (``pow(s, 1/p)`` would
    magnify the rounding of ``1/p`` by ``ln s``, ~1e-6 at s ~ 1e-15), ``k/p`` is formed
    with ``1/p`` split into exact parts, and its integer part stays in the exponent, so a
    root beyond the dtype's range (``p < 1``) is still exact; below ``p = 1/64`` the
    exponent of ``f**(1/p)`` joins it too (``f**(1/p)`` itself would underflow).
    """
    e = jnp.asarray(e, s.dtype)
    if p == int(p) and p <= POWER_OF_TWO_MAX_P:
        return _from_root(root(s, p), e)
    if mant is not None:  # the largest term is 1 but for rounding, raised to a huge p
        s = jnp.where(s < 1, 1, s)
    inv = 1.0 / p
    hi, mid, lo = _split(1 / Fraction(p), s.dtype)
    f, k = frexp(s)
    q = k * hi
    whole = jnp.floor(q)
    if inv <= POWER_OF_TWO_MAX_P:
        r = jnp.power(f, inv) * jnp.exp2((q - whole) + (k * mid + k * lo))
    else:  # f**(1/p) as 2**(log2(f) / p), its integer part in the exponent
        a = jnp.log2(f) * inv
        whole_a = jnp.floor(a)
        r = jnp.exp2((q - whole) + (k * mid + k * lo) + (a - whole_a))
        whole = whole + whole_a
    if mant is not None:
        r = r * mant
    n = _from_root(r, e + whole)
    good = jnp.isfinite(s) & (s > 0)
    return Norm(jnp.where(good, n.frac, s), jnp.where(good, n.exp, 0))


def _in_range_norm(s: Array, p: float) -> Norm:
    """:func:`_root_norm` of sums in :func:`_exact_range`: for ``p`` of 1 or 2 the root
    is a normal number, held as it is (a fraction of the scalar code)."""
    if p == 1.0:
        return Norm(s, jnp.zeros_like(s))
    if p == 2.0:
        return Norm(jnp.sqrt(s), jnp.zeros_like(s))
    return _root_norm(s, p)


def _special(m: Array, norm: Norm) -> Norm:
    """``norm`` where the largest magnitude ``m`` is positive and finite; else the norm is
    0 (all zeros) or ``m`` itself (inf, or NaN: PyTorch's propagation)."""
    good = (m > 0) & jnp.isfinite(m)
    frac = jnp.where(good, norm.frac, jnp.where(m == 0, 0, m)).astype(norm.frac.dtype)
    return Norm(frac, jnp.where(good, norm.exp, 0).astype(norm.frac.dtype))


def _psum(x: Any, axes: tuple[str, ...]) -> Any:
    return lax.psum(x, axes) if axes else x


def _pmax(x: Array, axes: tuple[str, ...]) -> Array:
    """``pmax`` that keeps NaN (XLA:CPU's cross-device max drops it)."""
    if not axes:
        return x
    nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), axes) > 0
    return jnp.where(nan, jnp.nan, lax.pmax(x, axes))


# ----------------------------------------------------------------------------------------
# Devices: over which mapped axes a partial norm is combined.


def _varying(x: Any) -> frozenset[str]:
    """The mesh axes ``x`` varies across inside ``shard_map`` (its type records them)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    if kind is not None:
        return frozenset(kind.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX


def _vma_tracked() -> bool:
    """Whether JAX tracks varying axes here (``shard_map`` with ``check_vma=True``, its
    default); under ``pmap`` or ``check_vma=False`` every value looks replicated."""
    try:
        from jax._src import config  # no public accessor

        return bool(config._check_vma.value)
    except (ImportError, AttributeError):
        return False


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
    tracked = _vma_tracked()
    varying = _varying(x) if tracked else frozenset()
    if axis_name is None:
        if varying and not whole:
            where = f"leaf {path!r}" if path else "a leaf"
            raise ValueError(
                f"jaxclip: {where} varies across mesh axes {tuple(sorted(varying))} inside "
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
        return tuple(sorted(varying))
    names = _axis_names(axis_name)
    if not tracked:
        return names
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if whole:  # a whole-array norm: every axis x varies across, unambiguously
        return tuple(sorted(varying)) + tuple(n for n in names if n not in manual)
    return tuple(n for n in names if n in varying or n not in manual)


def _has_unmapped(combines: Sequence[Combine]) -> bool:
    """Whether some combine axis is not a mesh axis (a named ``vmap``'s): the custom
    batching rules run outside the batching trace, where such a collective is unbound."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return any(n not in manual for c in combines for n in c)


# ----------------------------------------------------------------------------------------
# Derivatives: one rule for every norm.


def _tangent(x: Array, dx: Array, norm: Norm, p: float, axes: Axes) -> Array:
    """``sum sign(x) (|x|/n)^(p-1) dx`` over ``axes`` (keepdims); for ``p=inf`` the
    derivative of the max, shared among ties. 0 where the norm is 0."""
    acc = norm.frac.dtype
    a = _abs(x, acc)
    if jnp.iscomplexobj(x):
        h = _halved(x)  # |x| may overflow
        ah = _abs(h, acc)
        unit = jnp.conj(h) / jnp.where(ah > 0, ah, 1).astype(x.dtype)
        d = jnp.real(unit * dx.astype(x.dtype)).astype(acc)
        ratio = _over_norm(ah, norm) * 2  # |x| / n <= 1
    else:
        d = (jnp.sign(x).astype(acc) * dx.astype(acc)).astype(acc)
        ratio = _over_norm(a, norm)  # |x| / n <= 1
    dims = tuple(range(x.ndim)) if axes is None else axes
    if p == math.inf:
        top = a == norm.value
        w = top.astype(acc) / jnp.maximum(jnp.sum(top, axis=dims, keepdims=True), 1).astype(acc)
    elif p == 1.0:
        w = jnp.ones_like(ratio)
    else:
        pos = ratio > 0
        w = jnp.where(pos, jnp.power(jnp.where(pos, ratio, 1), p - 1), 0)
    return jnp.sum(w * d, axis=dims, keepdims=True)


def _over_norm(v: Array, norm: Norm) -> Array:
    """``v / n`` (1 in place of a zero norm), divided by the norm's mantissa only: XLA:CPU
    divides by a broadcast scalar as a product with its reciprocal, which is 0 for a
    divisor above 2**126. The mantissa comes from ``ldexp``, not ``frexp``'s bits, so
    that second derivatives flow through it."""
    safe = jnp.where(norm.frac > 0, norm.frac, 1)
    k = frexp(lax.stop_gradient(safe))[1]
    return ldexp(v, -(norm.exp + k)) / ldexp(safe, -k)


def _dnorm(norm: Norm, dn: Array) -> tuple[Array, Array]:
    """The tangent of ``(frac, exp)`` from the tangent ``dn`` of the norm's value; NaN
    where the norm is not finite, 0 where it is 0."""
    finite = jnp.isfinite(norm.frac)
    dfrac = jnp.where(finite, ldexp(dn, -norm.exp), jnp.nan)
    dfrac = jnp.where(norm.frac == 0, 0, dfrac)
    return dfrac, jnp.zeros_like(norm.exp)


# ----------------------------------------------------------------------------------------
# Per-slice norms (clip_by_norm, adaptive_clip): one norm per leaf, or per slice.


Layout = tuple[list[tuple[int, int]], list[int], list[tuple[list[int], int, Combine]]]


def _layout(
    leaves: Sequence[Array], axes: tuple[Axes, ...], bucket: bool, combines: Sequence[Combine]
) -> Layout:
    """Which leaves are units of their own and which are rows of a bucket (small whole
    leaves of one dtype, size class and mapped axes): per leaf ``(unit, row)`` (row -1 for
    a whole unit), the leaves that are units in order, and the buckets (members, row width,
    mapped axes), whose units follow. Static: it depends on shapes and types only."""
    where: list[tuple[int, int]] = []
    singles: list[int] = []
    groups: dict[tuple[np.dtype, int, Combine], list[int]] = {}
    for i, (x, a, c) in enumerate(zip(leaves, axes, combines)):
        # Bucket rows are zero-padded: not for a dtype with no zero (float8_e8m0fnu).
        if bucket and a is None and 0 < x.size and _bucketable(x) and _has_zero(x.dtype):
            width = 1 << (x.size - 1).bit_length()
            groups.setdefault((np.dtype(x.dtype), width, c), []).append(i)
            where.append((-1, -1))
        else:
            where.append((len(singles), -1))
            singles.append(i)
    buckets = [
        (chunk, width, c)
        for (_, width, c), members in groups.items()
        for chunk in _bucket_chunks(members)
    ]
    for u, (members, _, _) in enumerate(buckets, start=len(singles)):
        for row, i in enumerate(members):
            where[i] = (u, row)
    return where, singles, buckets


def _leaf_combines(
    leaves: Sequence[Array], axes: tuple[Axes, ...], axis_name: AxisName, paths: Any
) -> list[Combine]:
    names = paths or ("",) * len(leaves)
    return [
        combine_axes(x, axis_name, a is None or len(a) == x.ndim, path)
        for x, a, path in zip(leaves, axes, names)
    ]


def _slice_unit_norms(
    leaves: Sequence[Array],
    p: float,
    axes: tuple[Axes, ...],
    bucket: bool,
    axis_name: AxisName,
    paths: tuple[str, ...] | None,
    static_split: bool = False,
    floor: Array | None = None,
    report: str = "exact",
) -> tuple[Any, list[tuple[int, int]]]:
    """The norms of the reduced units (leaves, or buckets of small leaves as rows, see
    :func:`_layout`), and per leaf ``(unit, row)`` (row -1 for a whole unit). With a
    ``floor``, two lists of norms (see :func:`_unit_norms_body`)."""
    leaf_combines = _leaf_combines(leaves, axes, axis_name, paths)
    where = _layout(leaves, axes, bucket, leaf_combines)[0]
    norms = _layout_norms(leaves, floor, p, axes, axis_name, paths, static_split, bucket, report)
    return norms, where


@functools.partial(
    jax.jit,
    static_argnames=("p", "axes", "axis_name", "paths", "static_split", "bucket", "report"),
)
def _layout_norms(
    leaves: Sequence[Array],
    floor: Array | None,
    p: float,
    axes: tuple[Axes, ...],
    axis_name: AxisName,
    paths: tuple[str, ...] | None,
    static_split: bool,
    bucket: bool,
    report: str,
) -> Any:
    """The unit norms of :func:`_slice_unit_norms`: jitted, so that two alike trees (AGC's
    gradients and params) trace it once."""
    leaf_combines = _leaf_combines(leaves, axes, axis_name, paths)
    _, singles, buckets = _layout(leaves, axes, bucket, leaf_combines)
    leaves = _reduction_view(leaves)
    units = [leaves[i] for i in singles]
    unit_axes = [axes[i] for i in singles]
    combines = [leaf_combines[i] for i in singles]
    for members, width, c in buckets:
        rows = []
        for i in members:
            # lax, not jnp (ravel, pad, x[None]): ~5x faster to trace, a thousand leaves;
            # and jnp.pad is a jitted function, one call per leaf in the program.
            x = lax.reshape(leaves[i], (1, leaves[i].size))
            pad = [(0, 0, 0), (0, width - x.size, 0)]
            rows.append(x if x.size == width else lax.pad(x, np.zeros((), x.dtype), pad))
        units.append(_concatenate(rows))
        unit_axes.append((1,))
        combines.append(c)
    bucketed = (False,) * (len(units) - len(buckets)) + (True,) * len(buckets)
    if not units:
        return [] if floor is None else ([], [])
    return _unit_norms(
        tuple(units), floor, p, tuple(unit_axes), bucketed, tuple(combines), static_split, report
    )


@functools.cache
def _has_zero(dtype: Any) -> bool:
    return bool(np.asarray(0, dtype) == 0)  # NaN for float8_e8m0fnu


def _per_leaf(
    leaves: Sequence[Array], per_unit: Sequence[Any], where: Sequence[tuple[int, int]]
) -> list[Any]:
    """Per leaf, its unit's tuple of arrays, or the row of a bucket (at an opaque index,
    see :func:`_opaque`), shaped to broadcast."""
    bucketed = [i for i, (_, row) in enumerate(where) if row >= 0]
    like = leaves[bucketed[0]] if bucketed else None
    rows = dict(zip(bucketed, _opaque([where[i][1] for i in bucketed], like)))
    out = []
    for i, (x, (u, row)) in enumerate(zip(leaves, where)):
        v = per_unit[u]
        if row >= 0:
            kept = (1,) * x.ndim  # a single-device row: lax.reshape needs no sharding
            picked = [lax.reshape(_pick(f, rows[i], 1), kept) for f in v]
            v = type(v)(*picked) if hasattr(v, "_fields") else tuple(picked)
        out.append(v)
    return out


@functools.partial(jax.jit, static_argnames=("p", "axes", "bucket", "axis_name", "paths"))
def slice_norms(
    leaves: Sequence[Array],
    p: float,
    axes: tuple[Axes, ...],
    *,
    bucket: bool = True,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> list[Norm]:
    """Norms of each leaf over its ``axes`` (all axes when None), with ``keepdims``.

    Small whole-leaf norms are computed in buckets: leaves of one dtype and size class
    (the next power of two) are zero-padded into the rows of one matrix, whose row norms
    are one reduction, so a thousand small leaves compile to a few kernels.

    Args:
      leaves: floating or complex arrays.
      p: the norm type (> 0, or inf).
      axes: per leaf, the axes to reduce (normalised, non-negative), or None for all.
      bucket: bucket small single-device leaves whose ``axes`` is None.
      axis_name: mapped axes over which partial norms are combined (see
        :func:`combine_axes`).
      paths: the leaves' paths, for error messages.

    Returns:
      Per leaf, a :class:`Norm` broadcastable against it, in its accumulation dtype.
    """
    norms, where = _slice_unit_norms(leaves, p, axes, bucket, axis_name, paths)
    return _per_leaf(leaves, norms, where)


@functools.partial(jax.jit, static_argnames=("p", "axes", "bucket", "axis_name", "paths", "report"))
def clip_slices(
    leaves: Sequence[Array],
    p: float,
    axes: tuple[Axes, ...],
    clip_norm: Any,
    *,
    bucket: bool = True,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
    report: str = "exact",
) -> tuple[list[Array], list[Array]]:
    """Each leaf (each slice over its ``axes``) scaled to norm at most ``clip_norm``.

    The clipping factors are computed once per reduced unit (a bucket's rows together),
    not once per leaf, so a thousand small leaves add a few scalar ops each. They need
    no exact norm of slices too small to reach ``clip_norm`` (all-zero rows): the norms
    returned do (``report="exact"``, a second pass where such slices exist, which XLA
    drops when they are unused), or only as far as each leaf's largest (``"largest"``).

    Returns:
      ``(clipped, norms)``: the scaled leaves, and per leaf its norms with the ``axes``
      dimensions removed (a scalar for a whole leaf).
    """
    # The unit norms are split at constant offsets and stacked again right here, which XLA
    # folds away (split at opaque offsets, two kernels per unit ran on every call).
    floor = jnp.min(jnp.asarray(clip_norm))
    (norms, reported), where = _slice_unit_norms(
        leaves, p, axes, bucket, axis_name, paths, True, floor, report
    )

    def factors(frac: Array, exp: Array, rfrac: Array, rexp: Array) -> tuple[Array, ...]:
        # The reported value last: the opaque offsets are read off the first output, which
        # would keep the reported norms' pass alive when they are unused.
        return (*clip_scale(Norm(frac, exp), clip_norm), frac, exp, Norm(rfrac, rexp).value)

    fracs, exps = [n.frac for n in norms], [n.exp for n in norms]
    rfracs, rexps = [n.frac for n in reported], [n.exp for n in reported]
    per_leaf = stacked(factors, fracs, exps, rfracs, rexps, where=where, raw=True)
    scales = [Scale(*f[:3]) for f in per_leaf]
    leaf_norms = [Norm(*f[3:5]) for f in per_leaf]  # read only by the derivative rule
    cs = {n.frac.dtype: _as(clip_norm, n) for n in norms}
    out = clip_all(leaves, scales, leaf_norms, [cs[n.frac.dtype] for n in leaf_norms])
    values = []
    for x, a, (*_, value) in zip(leaves, axes, per_leaf):
        kept = () if a is None else tuple(d for i, d in enumerate(x.shape) if i not in a)
        if value.shape != kept:  # a single value: lax.reshape; else the slices' norms
            one = value.size == 1 and _one_device(value)
            value = lax.reshape(value, kept) if one else jnp.squeeze(value, axis=a)
        values.append(value)
    return out, values


@functools.partial(jax.jit, static_argnames=("axes", "axis_name", "paths"))
def clip_slices_relative(
    leaves: Sequence[Array],
    refs: Sequence[Array],
    axes: tuple[Axes, ...],
    clipping: Any,
    eps: Any,
    *,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> list[Array] | None:
    """Each slice of ``leaves`` scaled to 2-norm at most ``clipping * max(n, eps)``, ``n``
    the 2-norm of the same slice of ``refs`` (AGC: the gradients against the params).

    As :func:`clip_slices`, the limits and factors of all units are one set of kernels,
    and each leaf reads its values once; None where ``refs`` bucket otherwise than
    ``leaves`` (dtypes that group differently), for the caller's per-leaf path.
    """
    # Floors (see _unit_norms_body): a limit is at least clipping * eps, and a reference
    # norm below eps counts as eps, so all-zero rows of either need no second pass.
    eps_floor = jnp.min(jnp.asarray(eps))
    (norms, _), where = _slice_unit_norms(
        leaves, 2.0, axes, True, axis_name, paths, True, jnp.min(clipping * eps_floor)
    )
    (rnorms, _), rwhere = _slice_unit_norms(
        refs, 2.0, axes, True, axis_name, paths, True, eps_floor
    )
    if where != rwhere or [n.frac.shape for n in norms] != [n.frac.shape for n in rnorms]:
        return None

    def factors(frac: Array, exp: Array, rfrac: Array, rexp: Array) -> tuple[Array, ...]:
        limit = clipping * jnp.maximum(Norm(rfrac, rexp).value, eps)
        return (*clip_scale(Norm(frac, exp), limit), frac, exp, limit)

    per_leaf = stacked(
        factors,
        [n.frac for n in norms],
        [n.exp for n in norms],
        [r.frac.astype(n.frac.dtype) for r, n in zip(rnorms, norms)],
        [r.exp.astype(n.frac.dtype) for r, n in zip(rnorms, norms)],
        where=where,
        raw=True,
    )
    scales = [Scale(*f[:3]) for f in per_leaf]
    return clip_all(leaves, scales, [Norm(*f[3:5]) for f in per_leaf], [f[5] for f in per_leaf])


def _unit_norms_impl(
    units: tuple[Array, ...],
    floor: Array | None,
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[bool, ...],
    combines: tuple[Combine, ...],
    static_split: bool,
    report: str,
) -> Any:
    """Norms over ``axes`` (keepdims) of each array, overflow-safe, with one shared cond;
    partial norms combined over each array's mapped axes (per-slice vectors, no data).
    With ``static_split`` the norms are split out of their stacked vectors at constant
    offsets: for a caller that stacks them again (XLA folds the pair away), not for one
    whose per-leaf kernels read them (each would be a kernel of its own).

    With a ``floor`` (see :func:`_unit_norms_body`), two lists: norms exact at or above
    the floor, and norms for the caller to ``report``."""
    if _has_unmapped(combines):
        return _unit_norms_body(units, floor, p, axes, bucketed, combines, static_split, report)
    return _batchable_unit_norms(p, axes, bucketed, combines, static_split, report)(units, floor)


def _broadcast_unbatched(
    size: int, batched: Sequence[bool], units: tuple[Array, ...]
) -> tuple[Array, ...]:
    """A custom batching rule's operands, each with the batch axis leading (an unbatched
    unit is broadcast: rare, e.g. ``in_axes=None`` for some leaves)."""
    return tuple(u if b else jnp.broadcast_to(u, (size, *u.shape)) for u, b in zip(units, batched))


@functools.cache
def _batchable_unit_norms(
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[bool, ...],
    combines: tuple[Combine, ...],
    static_split: bool,
    report: str,
) -> Callable[[tuple[Array, ...], Array | None], Any]:
    """Per-slice norms with their own ``vmap`` rule: the batch axis is one more kept
    axis, so the cond stays unbatched (a batched cond would run both branches). A
    batched floor is its smallest value."""

    @jax.custom_batching.custom_vmap
    def norms(units: tuple[Array, ...], floor: Array | None) -> Any:
        return _unit_norms_body(units, floor, p, axes, bucketed, combines, static_split, report)

    @norms.def_vmap
    def rule(size: int, in_batched: Any, units: tuple[Array, ...], floor: Any) -> tuple[Any, Any]:
        units = _broadcast_unbatched(size, in_batched[0], units)
        if floor is not None and in_batched[1]:
            floor = jnp.min(floor)
        shifted = tuple(
            tuple(range(1, u.ndim)) if a is None else tuple(d + 1 for d in a)
            for u, a in zip(units, axes)
        )
        out = _unit_norms_body(
            units, floor, p, shifted, bucketed, combines, static_split, report, size
        )
        return out, jax.tree.map(lambda _: True, out)

    return norms


def _floor_bound(acc: np.dtype, p: float) -> float:
    """The largest norm of a slice whose power sum is below :func:`_exact_range`: the sum
    is below ``lo = tiny * 2**64``, and underflow lost less than ``n * tiny < lo`` of it,
    so the norm is below ``(2 lo)**(1/p)``; twice that, and at least ``tiny``."""
    return max((4 * _exact_lo(acc)) ** (1 / p), float(np.finfo(acc).tiny))


def _unit_norms_body(
    units: tuple[Array, ...],
    floor: Array | None,
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[bool, ...],
    combines: tuple[Combine, ...],
    static_split: bool = False,
    report: str = "exact",
    batch: int = 1,
) -> Any:
    """The exact norms of each unit; with a ``floor`` (a scalar), ``(floored, reported)``.

    ``floored`` is exact where the norm may exceed ``floor``, and 0 in place of a norm
    known to be below it: a slice whose plain sum is too small to be exact (all zeros:
    an unused embedding row, a frozen leaf) is read again only when ``floor`` is below
    :func:`_floor_bound` (a clipping factor keeps such a slice whatever its exact norm).
    ``reported`` is, for ``report="exact"``, exact everywhere (its second pass is dropped
    by XLA when the caller does not use it); for ``"largest"``, exact enough that each
    leaf's largest norm is exact (a leaf with a slice well above the bound needs no
    exact norms of its small slices). A leaf is a row of a bucket, else a whole unit,
    or under the vmap rule (``batch`` examples leading) one example of it.
    """
    natives = [_native(x, b, p=p) for x, b in zip(units, bucketed)]
    accs = [acc_dtype(x.dtype) for x in units]
    if p == math.inf or (p == 2.0 and _one_pass()):
        norms = _single_pass_norms(units, p, axes, bucketed, combines, natives)
        return norms if floor is None else (norms, norms)
    sums = [
        _psum(_power_sum(x, p, a, nat), c) for x, a, nat, c in zip(units, axes, natives, combines)
    ]
    # Both branches return the stacked vectors, split after the cond: split inside, each
    # unit's slice would be a kernel recomputing the whole vector's maths.
    groups = _stack_groups(sums)
    flat = [v for (v,) in _stack(groups, sums)]
    # One flag from the stacked sums; the per-unit flags only inside the rare branch
    # (as operands of the cond they were two kernels per unit run on every call).
    all_ok = _all([jnp.all(_exact_range(v, v.dtype)) for v in flat])

    def low(s: Array) -> Array:
        return s < _exact_lo(s.dtype)

    def flags() -> tuple[list[Array], list[Array]]:
        """Per slice whether its sum is in range, and per unit whether all are."""
        oks = [_exact_range(s, acc) for s, acc in zip(sums, accs)]
        return oks, [_every(ok) for ok in oks]

    def fast() -> list[Norm]:
        return [_in_range_norm(s, p) for s in flat]

    def scaled(skip: Callable[[int, Array, Array], Array] | None = None) -> list[Norm]:
        # Per unit: only a unit with a slice out of range reads its data again (and with
        # ``skip``, only where skip(unit, sums, oks) is false: its other slices out of
        # range get norm 0): for p=2 its sums rescaled (_rescale), else its maxima, then
        # (unless those slices are all zeros) a scaled sum.
        # For p=2 the factors of every unit are one set of kernels.
        oks, unit_ok = flags()
        if skip is not None:
            unit_ok = [skip(u, s, ok) for u, (s, ok) in enumerate(zip(sums, oks))]
        if p == 2.0:
            factors = stacked(_rescaled, sums, oks)
            # Branches as operand functions, one per (axes, bucketed, combine): JAX
            # reuses their traced jaxprs across alike units (half the trace time).
            rescaled: dict[tuple[Axes, bool, Combine], Callable[..., Any]] = {}

            def branch(a: Axes, b: bool, c: Combine) -> Callable[..., Any]:
                if (a, b, c) not in rescaled:
                    rescaled[a, b, c] = lambda x, f: rare(x, a, b, c, None, f)
                return rescaled[a, b, c]

            # The exponents are recomputed from the stacked sums in finish(): one
            # value per unit crosses into its branch (each is a kernel of its own).
            ts = [
                lax.cond(unit, lambda x, f: jnp.zeros_like(f), branch(a, b, c), x, f)
                for x, a, b, c, unit, f in zip(units, axes, bucketed, combines, unit_ok, factors)
            ]
            return [finish(*flat) for flat in _stack(groups, sums, oks, ts)]
        parts = [
            lax.cond(
                unit,
                lambda s=s: neutral(jnp.zeros_like(s)),
                functools.partial(rare, x, a, b, c, ok, None),
            )
            for x, a, b, c, ok, unit, s in zip(units, axes, bucketed, combines, oks, unit_ok, sums)
        ]
        ms, es, ts = (list(v) for v in zip(*parts))
        return [finish(*flat) for flat in _stack(groups, sums, oks, ts, ms, es)]

    def neutral(m: Array) -> tuple[Array, Array, Array]:
        """The rare parts of slices that need none (in range, or all zeros of maxima
        ``m``): ``(m, -inf, 0)``."""
        return m, jnp.full_like(m, -jnp.inf), jnp.zeros_like(m)

    def finish(s: Array, ok: Array, t: Array, m: Array | None = None, e: Any = None) -> Norm:
        f = _in_range_norm(s, p)
        if m is None:  # p=2: t is the sum rescaled by 2**-e, e from s (see _rescale)
            n = _root_norm(t, p, _rescale(s, ok))
        else:
            mant = _scale_of(m, p)[1]
            n = _special(m, _root_norm(t, p, jnp.where(jnp.isfinite(e), e, 0), mant))
        return Norm(jnp.where(ok, f.frac, n.frac), jnp.where(ok, f.exp, n.exp))

    def rare(x: Array, a: Axes, b: bool, c: Combine, ok: Any, f: Any) -> Any:
        if p == 2.0:  # one more sum, rescaled per slice by what the plain one showed
            return _scaled_sum(x, p, a, _rare_native(x, b, p, a), (f,), c)
        native = _native(x, b, rare=True)
        # The maxima first: all-zero slices (a frozen leaf, unused rows) need no more, and
        # a max pass is ~2x faster than the scaled sum on XLA:CPU.
        m = _pmax(_max_abs(x, a, acc_dtype(x.dtype), native, parts=True), c)

        def parts() -> tuple[Array, Array, Array]:
            return (m, *_scaled_parts(x, p, a, native, m, c))

        return lax.cond(jnp.all(ok | (m == 0)), functools.partial(neutral, m), parts)

    shapes = [v.shape for v in sums]

    def split(results: Any) -> list[Norm]:
        return _unstack(results, groups, shapes, static=static_split)

    if floor is None:
        return split(lax.cond(all_ok, fast, scaled))

    # Per dtype: is the floor above every small slice's norm? Then those need no pass.
    dtypes = sorted({v.dtype for v in flat}, key=str)
    fine = tuple(floor.astype(d) >= _floor_bound(d, p) for d in dtypes)
    any_low = [jnp.any(low(v)) for v in flat]
    over = _any([jnp.any(~(v < jnp.inf)) for v in flat])  # overflowed, or NaN
    need = _any([over] + [lo & ~fine[dtypes.index(v.dtype)] for lo, v in zip(any_low, flat)])
    left = _any([lo & fine[dtypes.index(v.dtype)] for lo, v in zip(any_low, flat)])

    def small_leaves(u: int, s: Array) -> Array:
        """Per leaf of unit ``u`` (a bucket's rows, else the unit, one per example under
        the vmap rule), whether it has a small slice and none of a plain sum of 4 lo or
        more (above any small slice's norm, see _floor_bound). Reductions, not segment
        ops: a scatter over a sharded unit's sums fails under explicit sharding."""
        if bucketed[u]:
            return low(s)
        dims = tuple(range(1 if batch > 1 else 0, s.ndim))
        return low(jnp.min(s, dims)) & ~(jnp.max(s, dims) >= 4 * _exact_lo(s.dtype))

    def rare_pass(ops: tuple[tuple[Array, ...], Array]) -> list[Norm]:
        """The rare pass for every use, told apart by operands (so it is traced once): a
        unit is read again unless its slices out of range are all small where ``fines``
        (per dtype) says the floor is above them; with ``whole``, unless it is settled:
        no overflow, and each of its leaves has a norm above every small one."""
        fines, whole = ops

        def skip(u: int, s: Array, ok: Array) -> Array:
            kept = _every(ok | (low(s) & fines[dtypes.index(s.dtype)]))
            if report != "largest":
                return kept
            small = jnp.any(small_leaves(u, s))
            return jnp.where(whole, ~jnp.any(~(s < jnp.inf)) & ~small, kept)

        return scaled(skip)

    def cheap(ops: Any) -> list[Norm]:
        return [Norm(*(jnp.where(low(v), 0, h) for h in n)) for v, n in zip(flat, fast())]

    no, yes = jnp.zeros((), bool), jnp.ones((), bool)
    floored = lax.cond(need, rare_pass, cheap, (fine, no))

    def keep(ops: Any) -> list[Norm]:
        return floored

    if report == "exact":  # floored is exact when all is in range, or no slice was skipped
        exact = (tuple(no for _ in fine), no)
        return split(floored), split(lax.cond(all_ok | (need & ~left), keep, rare_pass, exact))

    def some_small() -> Array:
        return _any([jnp.any(small_leaves(u, s)) for u, s in enumerate(sums)])

    # False varying as all_ok does (inside shard_map both branches must).
    some = lax.cond(all_ok, lambda: all_ok & False, some_small)
    return split(floored), split(lax.cond(some, rare_pass, keep, (fine, yes)))


def _single_pass_norms(
    units: tuple[Array, ...],
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[bool, ...],
    combines: tuple[Combine, ...],
    natives: Sequence[bool],
) -> list[Norm]:
    """Norms with no rare path: ``p=inf`` (maxima), and Blue's one pass for ``p=2``."""
    if p == math.inf:
        ms, halves = _inf_norms(units, axes, natives)
        ms = [_pmax(m, c) for m, c in zip(ms, combines)]
        if halves is None:
            return stacked(_inf_result, ms)
        return stacked(_inf_result, ms, [_pmax(h, c) for h, c in zip(halves, combines)])
    parts = [
        tuple(_psum(t, c) for t in _blue_sums(x, a, _native(x, b, rare=True)))
        for x, a, b, c in zip(units, axes, bucketed, combines)
    ]
    return stacked(_blue_norm, *(list(q) for q in zip(*parts)))


def _all(flags: Sequence[Array]) -> Array:
    return functools.reduce(jnp.logical_and, flags)


def _any(flags: Sequence[Array]) -> Array:
    return functools.reduce(jnp.logical_or, flags)


def _every(ok: Array) -> Array:
    return ok.reshape(()) if ok.size == 1 else jnp.all(ok)


Groups = list[list[int]]


def _stack_groups(first: Sequence[Array]) -> Groups:
    """Which arrays :func:`stacked` concatenates together: per dtype and per set of
    varying mesh axes (inside ``shard_map``, a concatenation varies across all of its
    parts'), and only where they are whole on each device."""
    groups: dict[tuple[np.dtype, frozenset[str], int], list[int]] = {}
    for i, v in enumerate(first):
        # A sharded value (per-slice norms of a sharded leaf) stays alone: concatenating
        # it would make XLA all-gather it.
        alone = -1 if v.size == 1 or _one_device(v) else i
        groups.setdefault((np.dtype(v.dtype), _varying(v), alone), []).append(i)
    return list(groups.values())


def _stack(groups: Groups, *lists: Sequence[Array]) -> list[list[Array]]:
    """Per group, each list's arrays raveled and concatenated."""
    return [
        [
            jnp.concatenate([jnp.ravel(arrays[i]) for i in members])
            if len(members) > 1
            else jnp.ravel(arrays[members[0]])
            for arrays in lists
        ]
        for members in groups
    ]


def _unstack(
    results: Sequence[Any],
    groups: Groups,
    shapes: Sequence[Shape],
    where: Sequence[tuple[int, int]] | None = None,
    static: bool = False,
    raw: bool = False,
) -> list[Any]:
    """Per array, its part of its group's result (a pytree of stacked vectors), sliced at
    offsets XLA cannot see as constants (:func:`_opaque`; constants with ``static``).
    With ``where`` (per leaf: its array, and its row of that array or -1, see
    :func:`_per_leaf`), per leaf instead: a row as a scalar, at one opaque offset too.
    With ``raw``, a single value sliced out stays a vector of one element (a consumer
    that broadcasts it, :func:`spread`, needs no reshape: one op less to trace each)."""
    where = where or [(i, -1) for i in range(len(shapes))]
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    at: dict[int, int] = {}  # each array's offset in its group's vectors
    for members in groups:
        at.update(
            zip(members, itertools.accumulate([math.prod(shapes[i]) for i in members], initial=0))
        )
    pieces = []  # per leaf: (group, offset, size, shape)
    for u, row in where:
        size = math.prod(shapes[u]) if row < 0 else 1
        pieces.append((group_of[u], at[u] + max(row, 0), size, shapes[u] if row < 0 else ()))
    flat = [jax.tree.flatten(r) for r in results]
    sliced = [i for i, (g, _, _, _) in enumerate(pieces) if len(groups[g]) > 1 or where[i][1] >= 0]
    like = flat[pieces[sliced[0]][0]][0][0] if sliced else None
    # _opaque gives plain constants without ``like``.
    at_of = [pieces[i][1] for i in sliced]
    offsets = dict(zip(sliced, _opaque(at_of, None if static else like)))
    out = []
    for i, (g, _, size, shape) in enumerate(pieces):
        vs, tree = flat[g]
        if i in offsets:  # a slice of a single-device vector: lax.reshape (~5x faster to trace)
            vs = [_pick(v, offsets[i], size) for v in vs]
            if not (raw and size == 1):
                vs = [v if v.shape == shape else lax.reshape(v, shape) for v in vs]
        else:
            vs = [v if v.shape == shape else v.reshape(shape) for v in vs]
        out.append(tree.unflatten(vs))
    return out


def _pick(v: Array, at: Any, size: int) -> Array:
    """``v[at : at + size]`` (along the first axis) for an offset ``at >= 0``: one
    dynamic slice (``lax.dynamic_index_in_dim`` is a jitted function: a call per use, a
    thousand per tree, which XLA's passes then inline; negative offsets cost a select)."""
    starts = (at, *(np.int32(0),) * (v.ndim - 1))
    return lax.dynamic_slice(v, starts, (size, *v.shape[1:]), allow_negative_indices=False)


def _opaque(values: Sequence[int], like: Array | None) -> list[Any]:
    """``values`` as int32 scalars that XLA cannot fold into the kernels that read them:
    outputs of a ``lax.cond`` on a traced predicate (from ``like``) whose branches both
    return them. Each leaf's scaling kernel reads its scalars out of the stacked vectors
    at such an offset, so that the kernels of alike leaves are identical and XLA:CPU
    compiles them once; at a constant offset every one is a kernel of its own (~40 ms of
    compile each: 193 of them on a transformer's clip_by_norm). Plain constants with the
    single pass (GPU/TPU), which keeps no conditional."""
    # numpy scalars: ~4x faster to trace than jnp.int32, a thousand of them per tree.
    if like is None or not values or _one_pass():
        return list(np.asarray(values, np.int32))

    def consts() -> list[Any]:
        return list(np.asarray(values, np.int32))

    return lax.cond(jnp.ravel(like)[0].astype(bool), consts, consts)


def stacked(
    fn: Callable[..., Any],
    *lists: Sequence[Array],
    where: Sequence[tuple[int, int]] | None = None,
    raw: bool = False,
) -> list[Any]:
    """``fn`` applied once to the concatenation of each list's arrays (raveled), the
    results split back to each array's shape (or, with ``where``, per leaf, see
    :func:`_unstack`): the scalar maths of a norm (roots, exponents, clipping factors) is
    one set of kernels however many leaves there are, which keeps compile time flat (see
    :func:`_stack_groups`)."""
    groups = _stack_groups(lists[0])
    results = [fn(*flat) for flat in _stack(groups, *lists)]
    return _unstack(results, groups, [v.shape for v in lists[0]], where, raw=raw)


_unit_norms = jax.custom_jvp(_unit_norms_impl, nondiff_argnums=(2, 3, 4, 5, 6, 7))


@_unit_norms.defjvp
def _unit_norms_rule(
    p: float,
    axes: tuple,
    bucketed: tuple,
    combines: tuple,
    static_split: bool,
    report: str,
    primals: tuple,
    tangents: tuple,
):
    (units, floor), (dunits, _) = primals, tangents
    out = _unit_norms(units, floor, p, axes, bucketed, combines, static_split, report)

    def tangent(norms: list[Norm]) -> list[Norm]:
        # Each list from its own norms, so that an unused list's pass is still dropped;
        # a floored 0 has tangent 0 (its slice is kept, whose tangent is dx).
        return [
            Norm(*_dnorm(n, _psum(_tangent(x, dx, n, p, a), c)))
            for x, dx, n, a, c in zip(units, dunits, norms, axes, combines)
        ]

    return out, (tangent(out) if floor is None else tuple(tangent(o) for o in out))


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
    if mesh is None:
        return True
    spec_axes: set[str] = set()
    for entry in getattr(sharding, "spec", ()):
        if entry is None:
            continue
        spec_axes.update(entry if isinstance(entry, tuple) else (entry,))
    single = getattr(mesh, "size", 0) <= 1
    AxisType = jax.sharding.AxisType
    for name, kind in zip(mesh.axis_names, mesh.axis_types):
        if kind == AxisType.Manual:
            continue  # inside shard_map: x is this device's local block
        if kind == AxisType.Explicit and name not in spec_axes:
            continue  # replicated along this axis
        if kind != AxisType.Explicit and single:
            continue  # one device: nothing to partition
        # Sharded, or Auto (placement decided later by XLA); an Explicit sharding is
        # part of the type even on one device, where reshapes and concatenations with
        # replicated arrays are type errors.
        return False
    return True


def _concatenate(parts: Sequence[Array]) -> Array:
    """``jnp.concatenate``, moving bfloat16 as raw 16-bit words: XLA:CPU would otherwise
    run a bfloat16 concatenation in float32, a widened copy of every part."""
    if parts[0].dtype != jnp.bfloat16:
        return jnp.concatenate(parts)
    return _concatenate_words(tuple(parts))


@jax.custom_jvp
def _concatenate_words(parts: tuple[Array, ...]) -> Array:
    words = jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint16) for x in parts])
    return lax.bitcast_convert_type(words, jnp.bfloat16)


@_concatenate_words.defjvp
def _concatenate_words_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    # The words carry no derivative: the tangents are concatenated as numbers.
    (parts,), (dparts,) = primals, tangents
    return _concatenate_words(parts), jnp.concatenate(dparts)


def _bucket_chunks(members: list[Any]) -> list[list[Any]]:
    """A bucket's members split into runs of at most :data:`BUCKET_MAX_LEAVES`."""
    return [
        members[at : at + BUCKET_MAX_LEAVES] for at in range(0, len(members), BUCKET_MAX_LEAVES)
    ]


def _units(
    leaves: Sequence[Array], combines: Sequence[Combine], bucket: bool
) -> tuple[list[Array], list[bool], list[Combine]]:
    """The arrays to reduce (big or sharded leaves as they are, small ones concatenated
    per dtype and mapped axes), which of them are buckets, and their mapped axes."""
    units: list[Array] = []
    where: list[Combine] = []
    buckets: dict[tuple[np.dtype, Combine], list[Array]] = {}
    for x, c in zip(leaves, combines):
        x = jnp.asarray(x)
        if x.size == 0:
            continue
        if bucket and _bucketable(x):
            buckets.setdefault((np.dtype(x.dtype), c), []).append(x)
        else:
            units.append(x)
            where.append(c)
    chunks = [(chunk, c) for (_, c), group in buckets.items() for chunk in _bucket_chunks(group)]
    for group, c in chunks:
        units.append(group[0] if len(group) == 1 else _concatenate([g.ravel() for g in group]))
        where.append(c)
    return units, [False] * (len(units) - len(chunks)) + [True] * len(chunks), where


def _sum_over(
    values: Sequence[Array], combines: Sequence[Combine], acc: Any, shape: Shape = ()
) -> Array:
    """The sum of partial sums (each of ``shape``), each group of equal mapped axes
    ``psum``-ed once."""
    groups: dict[Combine, Array] = {}
    for v, c in zip(values, combines):
        v = v.reshape(shape).astype(acc)
        groups[c] = groups[c] + v if c in groups else v
    total = jnp.zeros(shape, acc)
    for c, v in groups.items():
        total = total + _psum(v, c)
    return total


def _max_over(
    values: Sequence[Array], combines: Sequence[Combine], acc: Any, shape: Shape = ()
) -> Array:
    """The max of partial maxima (NaN kept), each group ``pmax``-ed once."""
    groups: dict[Combine, Array] = {}
    for v, c in zip(values, combines):
        v = v.reshape(shape).astype(acc)
        groups[c] = jnp.maximum(groups[c], v) if c in groups else v
    total = jnp.zeros(shape, acc)
    for c, v in groups.items():
        total = jnp.maximum(total, _pmax(v, c))
    return total


@functools.partial(jax.jit, static_argnames=("p", "axis_name", "bucket"))
def global_norm_parts(
    leaves: Sequence[Array],
    p: float,
    *,
    axis_name: AxisName = None,
    bucket: bool = True,
) -> Norm:
    """The p-norm of all ``leaves`` together, as if concatenated into one vector.

    Args:
      leaves: floating or complex arrays (already selected by ``need_clip``).
      p: the norm type (> 0, or inf).
      axis_name: mapped axis name(s) over which partial norms are combined (see
        :func:`combine_axes`; by default, inside ``shard_map``, the axes each leaf varies
        across): partial sums are ``psum``-ed, maxima ``pmax``-ed.
      bucket: concatenate small single-device leaves before reducing.

    Returns:
      A scalar :class:`Norm` in the widest accumulation dtype of the leaves.
    """
    acc = result_dtype(leaves)
    combines = [combine_axes(x, axis_name, whole=True) for x in leaves]
    units, bucketed, combines = _units(_reduction_view(leaves), combines, bucket)
    if not units:
        zero = jnp.zeros((), acc)
        return Norm(zero, zero)
    return _global_norm(tuple(units), p, tuple(bucketed), tuple(combines), 0)


def global_norm(
    leaves: Sequence[Array], p: float, *, axis_name: AxisName = None, bucket: bool = True
) -> Array:
    """:func:`global_norm_parts` as a number (inf where it exceeds the dtype's range)."""
    return global_norm_parts(leaves, p, axis_name=axis_name, bucket=bucket).value


def _global_norm_impl(
    units: tuple[Array, ...],
    p: float,
    bucketed: tuple[bool, ...],
    combines: tuple[Combine, ...],
    lead: int,
) -> Norm:
    if lead or _has_unmapped(combines):
        return _global_norm_body(units, p, bucketed, combines, lead)
    return _batchable_global_norm(p, bucketed, combines)(units)


@functools.cache
def _batchable_global_norm(
    p: float, bucketed: tuple[bool, ...], combines: tuple[Combine, ...]
) -> Callable[[tuple[Array, ...]], Norm]:
    """The global norm with its own ``vmap`` rule: a batched ``lax.cond`` would run both
    branches; the rule computes every example's norm with one unbatched cond (the scaled
    path only where some example needs it)."""

    @jax.custom_batching.custom_vmap
    def norm(units: tuple[Array, ...]) -> Norm:
        return _global_norm_body(units, p, bucketed, combines, 0)

    @norm.def_vmap
    def rule(size: int, in_batched: Any, units: tuple[Array, ...]) -> tuple[Norm, Any]:
        units = _broadcast_unbatched(size, in_batched[0], units)
        return _global_norm_body(units, p, bucketed, combines, 1), Norm._make((True, True))

    return norm


#: Per-example norms re-read the rows of their out-of-range examples one at a time when
#: at most one in this many examples is out of range, else the whole batch at once...
ROWS_APART_OF = 8
#: ... or more of them where an example is large: a loop over rows of this many bytes runs
#: as fast per byte as a pass over the batch (XLA:CPU, 2 cores: 36 KB rows of 6 leaves,
#: one in four examples zero, 0.67 against 0.86 ms; 1 MB rows of 12 leaves, 0.31 ms a
#: row, 23 ms for the batch of 64), so up to (row bytes / this) of the batch take the loop,
#: at most three quarters of it (all 64 of those 1 MB rows: 48 against 44 ms).
ROW_BYTES_ALONE = 64 * 1024


def _rows_apart_limit(units: Sequence[Array], batch: int) -> int:
    """The most out-of-range examples whose rows the rare path reads one at a time."""
    row = sum(u.size * u.dtype.itemsize for u in units) // batch
    return max(1, batch // ROWS_APART_OF, min(batch * 3 // 4, batch * row // ROW_BYTES_ALONE))


def _rows_apart(units: Sequence[Array], combines: Sequence[Combine], shape: Shape) -> bool:
    """Whether the rare path of per-example norms may read single examples' rows: each
    unit whole on one device (a dynamic slice of a sharded batch axis would gather it) and
    nothing combined across devices (a collective in a loop whose trip count differs)."""
    return len(shape) == 1 and shape[0] > 1 and not any(combines) and all(map(_one_device, units))


def _row(x: Array, b: Array) -> Array:
    """``x[b]``; a 16-bit ``x`` passes a barrier with ``b`` first: XLA would otherwise
    widen the whole array once, outside the loop that slices it (a float32 copy of every
    leaf, 2 MB on four (16, 64, 128) leaves)."""
    if x.dtype.itemsize == 2 and not jnp.iscomplexobj(x):
        x, b = lax.optimization_barrier((x, b))
    return lax.dynamic_index_in_dim(x, b, 0, keepdims=False)


def _global_norm_body(
    units: tuple[Array, ...],
    p: float,
    bucketed: tuple[bool, ...],
    combines: tuple[Combine, ...],
    lead: int,
) -> Norm:
    """The norm over all of ``units`` but their ``lead`` leading (batch) axes."""
    acc = result_dtype(units)
    shape = units[0].shape[:lead]
    axes = [tuple(range(lead, u.ndim)) if lead else None for u in units]

    natives = [_native(u, b, p=p) for u, b in zip(units, bucketed)]
    if p == math.inf:
        ms, halves = _inf_norms(units, axes, natives)
        m = _max_over(ms, combines, acc, shape)
        return _inf_result(m, None if halves is None else _max_over(halves, combines, acc, shape))
    # A 2-norm in one accumulation dtype: Blue's three accumulators, each summed over the
    # units, in one pass; with two paths, the rare one rescaled by the plain sum.
    blue = p == 2.0 and len({acc_dtype(u.dtype) for u in units}) == 1
    # Per-example norms (``lead``) keep the two paths: on an H100 their rows ran no
    # faster in one pass, with 6-25x the temporaries (benchmarks/last_run.md).
    if blue and _one_pass() and not lead:
        parts = [
            _blue_sums(u, a, _native(u, b, rare=True)) for u, a, b in zip(units, axes, bucketed)
        ]
        return _blue_norm(*(_sum_over(q, combines, acc, shape) for q in zip(*parts)))
    sums = [_power_sum(u, p, a, nat) for u, a, nat in zip(units, axes, natives)]
    s = _sum_over(sums, combines, acc, shape)
    # The narrowest accumulation dtype decides: its underflow is what may be lost.
    narrow = min((acc_dtype(u.dtype) for u in units), key=lambda d: d.itemsize)

    def scaled_of(us: Sequence[Array], s: Array, ok: Any, shape: Shape) -> Norm:
        """The rare path over ``us`` (all examples, or one example's rows with ``shape``
        ``()``) whose plain sums are ``s``."""
        # Native reductions for 16-bit units (see _native); one scale 2**-e for all (per
        # example), applied as two normal factors per dtype: for a 2-norm in one
        # accumulation dtype from the plain sum (_rescale), else from the largest
        # magnitude m = f * 2**e.
        ax = [tuple(range(len(shape), u.ndim)) if shape else None for u in us]
        rare = [
            _rare_native(u, b, p, a) if blue else _native(u, b, rare=True)
            for u, b, a in zip(us, bucketed, ax)
        ]

        def keep(v: Array, u: Array) -> Array:  # a per-example value, against u
            return v.reshape(shape + (1,) * (u.ndim - len(shape)))

        if blue:
            m, e, mant = None, _rescale(s, ok), None
        else:
            ms = [
                _max_abs(u, a, acc_dtype(u.dtype), nat, parts=True)
                for u, a, nat in zip(us, ax, rare)
            ]
            m = _max_over(ms, combines, acc, shape)
            e, mant = _scale_of(m, p)
        # 2**-e per accumulation dtype (clamped: parts out of its range are negligible).
        # For a 2-norm in one dtype, 2**-e is one normal factor (see _rescale), out of a
        # division: XLA copies cheap scalar ops into each unit's kernel, not a division.
        factors = (
            {acc: (1 / _pow2(e, acc),)}
            if blue
            else {d: _factors(e, mant, d) for d in {acc_dtype(u.dtype) for u in us}}
        )
        # A second, separately fused read; the factors pass the barrier too, else XLA:CPU
        # materialises their broadcast to the leaves' shape.
        again, per_unit = _barrier(us, factors)
        ts = []
        for u, a, nat, fs in zip(again, ax, rare, per_unit):
            ua = acc_dtype(u.dtype)
            f = tuple(keep(v, u) for v in fs[ua])
            ts.append(_reduce(u, _scaled_elem(p, ua), a, "sum", nat, f))
        t = _sum_over(ts, combines, acc, shape)
        n = _root_norm(t, p, e, mant)
        return n if m is None else _special(m, n)

    def scaled() -> Norm:
        # Unbatched, the branch itself says the sum is out of range.
        n = scaled_of(units, s, ok if shape else False, shape)
        if not shape:
            return n
        # Examples in range keep the fast result: each one's norm, to the bit, does not
        # depend on the others in the batch.
        f = _in_range_norm(s, p)
        return Norm(jnp.where(ok, f.frac, n.frac), jnp.where(ok, f.exp, n.exp))

    def flagged() -> Norm:
        # Only the examples out of range read their rows again, one at a time: one zero
        # (padding) example costs a row, not a pass over the batch.
        idx = jnp.nonzero(~ok, size=shape[0], fill_value=0)[0]

        def one(j: Array, n: Norm) -> Norm:
            b = idx[j]
            rows = [_row(u, b) for u in units]
            r = scaled_of(rows, s[b], False, ())
            return Norm(n.frac.at[b].set(r.frac), n.exp.at[b].set(r.exp))

        return lax.fori_loop(0, count, one, _in_range_norm(s, p))

    ok = _exact_range(s, narrow)
    if not shape:
        return lax.cond(ok, lambda: _in_range_norm(s, p), scaled)
    rare_path = scaled
    if _rows_apart(units, combines, shape):
        count = jnp.sum(~ok)  # examples out of range
        few = count <= _rows_apart_limit(units, shape[0])
        rare_path = lambda: lax.cond(few, flagged, scaled)  # noqa: E731
    return lax.cond(jnp.all(ok), lambda: _in_range_norm(s, p), rare_path)


_global_norm = jax.custom_jvp(_global_norm_impl, nondiff_argnums=(1, 2, 3, 4))


@_global_norm.defjvp
def _global_norm_rule(
    p: float, bucketed: tuple, combines: tuple, lead: int, primals: tuple, tangents: tuple
):
    (units,), (dunits,) = primals, tangents
    norm = _global_norm(units, p, bucketed, combines, lead)
    shape = norm.frac.shape
    parts = []
    for u, du in zip(units, dunits):
        kept = shape + (1,) * (u.ndim - lead)
        n = Norm(norm.frac.reshape(kept), norm.exp.reshape(kept))
        parts.append(_tangent(u, du, n, p, tuple(range(lead, u.ndim)) if lead else None))
    dn = _sum_over(parts, combines, norm.frac.dtype, shape)
    return norm, Norm(*_dnorm(norm, dn))


# ----------------------------------------------------------------------------------------
# Scaling and checks shared by every mode.


class Scale(NamedTuple):
    """The clipping factor of a norm: ``x`` is kept as it is where ``keep``, else
    multiplied by ``f0`` then ``f1``: ``f0`` carries the mantissa of ``c / n`` and as much
    of its exponent as stays normal, ``f1`` (a power of two, 1 unless ``c / n`` is below
    the normal range) the rest, so that no factor is ever subnormal. ``keep`` is
    ``f1 == 0``: :func:`clip_scale` sets ``f1`` to 0 where the norm is within the limit."""

    keep: Array
    f0: Array
    f1: Array


def clip_scale(norm: Norm | Array, clip_norm: Any) -> Scale:
    """Keep where ``norm <= clip_norm``, else the factor ``clip_norm / norm`` (0 for an
    inf norm, NaN for NaN), exact at any magnitude: the factor is ``c / n`` rounded once
    (Paddle's and TensorFlow's result; no epsilon).

    A ``clip_norm`` at or below 0 (a traced schedule that decays to 0) means "updates
    of norm 0": the factor is 0, never negative.
    """
    if not isinstance(norm, Norm):
        norm = as_norm(jnp.asarray(norm))
    acc = norm.frac.dtype
    c = jnp.maximum(jnp.asarray(clip_norm, acc), 0)
    keep = norm.value <= c
    ce = frexp(lax.stop_gradient(c))[1]
    cf = ldexp(c, -ce)  # in [0.5, 1), differentiable in c
    k = frexp(lax.stop_gradient(norm.frac))[1]
    frac = ldexp(norm.frac, -k)  # in [0.5, 1)
    shift = ce - norm.exp - k
    info = np.finfo(acc)
    s0 = jnp.clip(shift, info.minexp + 1, info.maxexp - 2)  # (c / n) * 2**s0 is normal
    # Both factors come out of a division: XLA copies cheap scalar ops into every kernel
    # that reads their result (a thousand leaves would each redo this maths), but not a
    # division, which it computes once.
    # The rest goes in one more normal factor; f1 == 0 marks "keep". Where c / n is below
    # what two normal factors reach (~2**-251: a norm beyond the dtype's range, or c near
    # its smallest normal), every output is below 4 * tiny and f0 flushes it to 0 (a
    # clamped f1 left outputs up to ~1e12 c: p=0.1 norms of 1e88). Selected before the
    # division, which stays the factor's last op.
    rest = s0 - shift
    f0 = jnp.where(rest > -info.minexp, 0, cf * _pow2(s0, acc)) / jnp.where(keep, 1, frac)
    f1 = 1 / jnp.where(keep, jnp.inf, _pow2(jnp.minimum(rest, -info.minexp), acc))
    return Scale(f1 == 0, f0, f1)


def spread(v: Array, like: Array) -> Array:
    """``v`` broadcast (numpy's rules) to the shape and sharding of ``like``."""
    if v.shape == like.shape:
        return v
    if v.ndim and v.size == 1 and (v.ndim > 1 or not like.ndim):
        v = lax.reshape(v, ())  # one value (a whole leaf's): one broadcast, not three ops
    dims = tuple(range(like.ndim - v.ndim, like.ndim))
    return lax.broadcast_in_dim(v, like.shape, dims, out_sharding=jax.typeof(like).sharding)


def apply_scale(x: Array, scale: Scale) -> Array:
    """``x`` where the scale keeps it (bit for bit, subnormals included), else
    ``x * c / n`` with one rounding into ``x.dtype``."""
    acc = acc_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        f0, f1 = scale.f0.astype(acc), scale.f1.astype(acc)
        return jnp.where(scale.keep, x, (x * f0 * f1).astype(x.dtype))
    # lax, not jnp: this runs once per leaf, and jnp's wrappers cost ~1 ms of tracing
    # each (a thousand-leaf tree's trace is mostly such calls).
    f0, f1 = (spread(lax.convert_element_type(f, acc), x) for f in scale[1:])
    y = lax.mul(lax.mul(lax.convert_element_type(x, acc), f0), f1)
    keep = spread(jnp.asarray(scale.keep), x)
    return lax.select(keep, x, lax.convert_element_type(y, x.dtype))


@jax.custom_jvp
def _clipped(
    xs: tuple[Array, ...],
    keeps: tuple[Array, ...],
    f0s: tuple[Array, ...],
    f1s: tuple[Array, ...],
    fracs: tuple[Array, ...],
    exps: tuple[Array, ...],
    cs: tuple[Array, ...],
) -> list[Array]:
    """:func:`apply_scale` of each array by the scale of its norm ``frac * 2**exp`` and
    clip norm ``c``, differentiated as one step (see :func:`clip_all`)."""
    return [apply_scale(x, Scale(k, a, b)) for x, k, a, b in zip(xs, keeps, f0s, f1s)]


@_clipped.defjvp
def _clipped_jvp(primals: tuple, tangents: tuple) -> tuple[list[Array], list[Array]]:
    outs, ts = [], []
    for x, keep, f0, f1, frac, exp, c, dx, dfrac, dc in zip(
        *primals, tangents[0], tangents[4], tangents[6]
    ):
        if not x.ndim:  # a single value as a vector of one (see _unstack's raw)
            keep, f0, f1, frac, exp, c, dfrac, dc = (
                v.reshape(()) for v in (keep, f0, f1, frac, exp, c, dfrac, dc)
            )
        outs.append(apply_scale(x, Scale(keep, f0, f1)))
        ts.append(_clipped_tangent(x, keep, f0, f1, Norm(frac, exp), c, dx, dfrac, dc))
    return outs, ts


def _clipped_tangent(
    x: Array,
    keep: Array,
    f0: Array,
    f1: Array,
    n: Norm,
    c: Array,
    dx: Array,
    dfrac: Array,
    dc: Array,
) -> Array:
    acc = acc_dtype(x.dtype)

    def wide(v: Array) -> Array:
        return v if jnp.iscomplexobj(v) else v.astype(acc)

    # d(x c/n) = (c/n) (dx - (x/n) dn) + (x/n) dc, each part well scaled (|x/n| <= 1, dn
    # unscaled): the chain rule through the factor would form sum(x * ct), which
    # overflows for large x, and dn/n, which underflows. Where x is kept the factors are
    # replaced by 1, so that no inf * 0 reaches the transpose (c = inf: f0 = inf, f1 = 0).
    x_n = _over_norm(wide(x), n)
    f0s, f1s = jnp.where(keep, 1, f0).astype(acc), jnp.where(keep, 1, f1).astype(acc)
    dn = jnp.where(keep, 0, ldexp(dfrac, n.exp))
    dcs = jnp.where(keep | (c < 0), 0, dc)
    t = (wide(dx) - x_n * dn) * f0s * f1s + x_n * dcs
    return jnp.where(keep, dx, t.astype(x.dtype))


def clip_all(
    xs: Sequence[Array], scales: Sequence[Scale], norms: Sequence[Norm], clip_norms: Sequence[Any]
) -> list[Array]:
    """``apply_scale(x, scale)`` of each array, for ``scale = clip_scale(norm, clip_norm)``,
    with derivatives that stay finite where ``x`` or the norm are near the dtype's largest
    value and where ``clip_norm`` is infinite. One ``custom_jvp`` for all the arrays: one
    per array cost ~0.7 ms of tracing each (0.7 s on a thousand leaves)."""
    if not xs:
        return []
    return _clipped(
        tuple(xs),
        tuple(s.keep for s in scales),
        tuple(s.f0 for s in scales),
        tuple(s.f1 for s in scales),
        tuple(n.frac for n in norms),
        tuple(n.exp for n in norms),
        tuple(_as(c, n) for c, n in zip(clip_norms, norms)),
    )


def _as(clip_norm: Any, norm: Norm) -> Array:
    """``clip_norm`` as an array of the norm's dtype; as it is when it already is one
    (callers convert once for many leaves: ``jnp.asarray`` costs ~0.3 ms of tracing)."""
    dtype = norm.frac.dtype
    if isinstance(clip_norm, jax.Array) and clip_norm.dtype == dtype and not clip_norm.weak_type:
        return clip_norm
    return jnp.asarray(clip_norm, dtype)


@jax.jit
def rescale(xs: Sequence[Array], norm: Norm | Array, clip_norm: Any) -> list[Array]:
    """Every array of ``xs`` (of joint norm ``norm``) scaled so that the norm is at most
    ``clip_norm``; one compiled call, so eager use costs one dispatch."""
    if not isinstance(norm, Norm):
        norm = as_norm(jnp.asarray(norm))
    scale = clip_scale(norm, clip_norm)
    c = _as(clip_norm, norm)
    return clip_all(xs, [scale] * len(xs), [norm] * len(xs), [c] * len(xs))


@jax.jit
def rescale_each(xs: Sequence[Array], norms: Sequence[Norm], clip_norms: Any) -> list[Array]:
    """Each array of ``xs`` scaled by its own norm (per slice) to at most its clip norm
    (one for all, or one per array)."""
    if not isinstance(clip_norms, (list, tuple)):
        clip_norms = [clip_norms] * len(xs)
    if not xs:
        return []
    cs = [
        jnp.broadcast_to(jnp.asarray(c, n.frac.dtype), n.frac.shape)
        for n, c in zip(norms, clip_norms)
    ]
    # One set of kernels for every array's factors (see stacked).
    scales = stacked(
        lambda f, e, c: clip_scale(Norm(f, e), c),
        [n.frac for n in norms],
        [n.exp for n in norms],
        cs,
    )
    return clip_all(xs, scales, norms, cs)


def raise_if_nonfinite(values: Sequence[Array], names: Sequence[str]) -> None:
    """Raises :class:`~jaxclip.NonFiniteNormError` if a norm is not finite.

    Eagerly (concrete norms) it is raised as is. Under ``jit`` the check runs in a host
    callback (a device-to-host transfer of the norms and a host synchronisation per call),
    and JAX reports the error as a ``jax.errors.JaxRuntimeError`` whose message contains
    this one; ``NonFiniteNormError`` subclasses ``JaxRuntimeError``, so ``except
    jax.errors.JaxRuntimeError`` catches both with the same message.
    """
    from jaxclip._checks import NonFiniteNormError

    def check(*vals: Any) -> None:
        for v, name in zip(vals, names):
            v = np.asarray(v)
            if not np.all(np.isfinite(v)):
                top = np.finfo(v.dtype).max if v.dtype.kind == "f" else np.inf
                raise NonFiniteNormError(
                    f"jaxclip: the {name} is non-finite ({v.max() if v.size else v}): the "
                    f"gradients hold inf or NaN, or their norm exceeds {v.dtype}'s range "
                    f"({top:.3g}). Find where they come from, or pass "
                    "error_if_nonfinite=False: NaN/inf then propagate as in PyTorch, and "
                    "finite gradients whose norm overflows are still clipped exactly."
                )

    try:
        concrete = [np.asarray(v) for v in values]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        jax.debug.callback(check, *values)
    else:
        check(*concrete)


# ----------------------------------------------------------------------------------------
# Per-example norms (clip_per_example): one norm per example over many batched leaves.


@functools.partial(jax.jit, static_argnames=("p", "axis_name", "paths"))
def per_example_norm_parts(
    leaves: Sequence[Array],
    p: float,
    *,
    axis_name: AxisName = None,
    paths: tuple[str, ...] | None = None,
) -> Norm:
    """Per example ``b``, the p-norm of all ``leaves[i][b]`` together (axis 0 is the batch).

    The per-example counterpart of :func:`global_norm_parts`: per leaf, a power sum over
    every axis but 0, summed over the leaves per example, then the root; one ``lax.cond``
    for the whole batch takes the scaled path (each example scaled by the power of two of
    its own largest magnitude) only when some example's sum is out of exact range.

    Args:
      leaves: floating or complex arrays, each of shape ``(batch, ...)``, one batch size.
      p: the norm type (> 0, or inf).
      axis_name: inside ``shard_map``, the mesh axes that split the leaves' non-batch
        dimensions (``()`` when only the batch is split): see :func:`combine_axes`, the
        batch axis being the kept one.
      paths: the leaves' paths, for error messages.

    Returns:
      A :class:`Norm` of shape ``(batch,)`` in the widest accumulation dtype of the leaves.
    """
    names = paths or ("",) * len(leaves)
    combines = tuple(
        combine_axes(x, axis_name, False, n, batch=True) for x, n in zip(leaves, names)
    )
    # One reduced axis per example (a free reshape of a row-major leaf): XLA:CPU reduces
    # (B, n) 1.6x faster than (B, n1, n2) over two axes. Not for sharded leaves, whose
    # merged axes XLA could gather.
    flat = [
        x.reshape(x.shape[0], math.prod(x.shape[1:])) if _one_device(x) and x.ndim != 2 else x
        for x in (jnp.asarray(x) for x in leaves)
    ]
    units = tuple(_reduction_view(flat))
    return _global_norm(units, p, (False,) * len(units), combines, 1)
