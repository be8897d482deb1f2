"""Backend measures: how reductions run, and every choice made for one backend.

The maths elsewhere in the core is backend-neutral; this module alone knows what XLA:CPU
(and XLA:GPU/TPU) do with it. The switch is :data:`ONE_PASS` (:func:`one_pass`): on
GPU/TPU, where reductions are bound by memory, 2-norms take Blue's single pass with no
``lax.cond``; on CPU, the plain sum with a rare path. XLA:CPU needs these measures to
keep widened copies of low-precision gradients out of memory and kernels few (each is
guarded by a mechanism test):

- reductions read the leaves through an optimisation barrier (:func:`reduction_view`);
- f16/f8 leaves, 16-bit buckets, maxima and the rare path use a reduce XLA fuses itself
  (:func:`native`, :func:`reduce`), in chunks of :data:`BLOCK` elements, since that
  reduce adds sequentially;
- short slices (a few elements over a trailing axis, up to 32 over leading ones) are
  sums of slices of the leaf, not a reduce (:func:`reduce`, :data:`SHORT_TRAILING`);
- bf16 buckets are concatenated as 16-bit words (:func:`concatenate`);
- per-leaf scalars are read at offsets XLA cannot fold (:func:`opaque`), so alike
  leaves share one compiled kernel;
- NaN is carried past XLA:CPU's max, which can drop it (:func:`max_keeping_nan`);
- bfloat16 outputs need no rounding toward zero where float32 products flush
  (:func:`unless_flushed`).

On GPU/TPU these measures cost nothing; the blocked reduce is chosen per platform when
lowering, so a GPU host computing on its CPU still runs the blocks.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxclip._norms.arith import magnitude
from jaxclip._norms.devices import Combine, Shape, one_device, varying

Array = jax.Array
Axes = tuple[int, ...] | None
Elem = Callable[[Array, Any], Any]  # an array, or a tuple of them (several sums)

#: XLA's fused (sequential) reduce runs over blocks of this many elements.
BLOCK = 256
#: A fused sum over leading or middle axes reads a few rows at a time (:func:`_looped_sum`),
#: in chunks of at least :data:`LOOP_ROWS_ELEMS` elements, or this fraction of the leaf.
LOOP_CHUNK_OF = 64
#: ... and, however small the leaf, in two chunks at least where they hold at least this
#: many rows (fewer are faster in one fused reduce).
LOOP_SPLIT_MIN = 32
#: The rare path shifts rows of at least this many elements in the library reduction.
LIBRARY_ROW_MIN = 64
#: ... and a whole leaf's loop reads rows of the largest divisor of its size up to this.
LOOP_WHOLE_ROW = 1024
#: A looped sum reads chunks of about this many elements (a float32 chunk of 64 KiB,
#: cache-resident); over the last axis of a float16 (or 8-bit) leaf, of whole rows...
LOOP_ROWS_ELEMS = 1 << 14
#: ... rows of at most this many elements (the library reduction sums a row at once).
LOOP_ROWS_MAX = 1 << 16
#: Per-example norms re-read the rows of their out-of-range examples one at a time when
#: at most one in this many examples is out of range, else the whole batch at once...
ROWS_APART_OF = 8
#: ... or more of them where an example is large: a loop over rows of this many bytes
#: runs as fast per byte as a pass over the batch on XLA:CPU.
ROW_BYTES_ALONE = 64 * 1024
#: Clipping factors of at least this many norms are plain quotients where each is normal,
#: the exact split (``clip.clip_factor``) taken only where one is not, behind one
#: conditional: on XLA:CPU the split costs about 2 ns per norm, a quotient a fifth of it.
QUOTIENT_MIN = 4096
#: Reductions over few elements per slice are sums of slices of the leaf (one elementwise
#: pass) on XLA:CPU, whose library reduce runs 4-7x slower over a trailing axis of up to 8
#: elements and 15-30x slower over a leading or middle run of up to 32 (1M float32). The
#: choice depends on the slices alone, not the leaf's size, so that ``vmap`` (a larger
#: leaf, the same slices) computes the same sums.
SHORT_TRAILING = 8
SHORT_LEADING = 32


def _one_pass_from_env() -> bool | None:
    value = os.environ.get("JAXCLIP_ONE_PASS", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"JAXCLIP_ONE_PASS must be 1 or 0 (or unset), got {value!r}")
    return None if value == "" else value == "1"


#: How 2-norms are computed: None picks by the default backend (Blue's single pass on
#: GPU/TPU, the plain sum with a rare path on CPU), True or False forces one (also set by
#: the environment variable ``JAXCLIP_ONE_PASS=1`` or ``0``). Both are exact; a change
#: takes effect for functions traced afterwards (``jax.clear_caches()``).
ONE_PASS: bool | None = _one_pass_from_env()


def one_pass() -> bool:
    """Whether 2-norms take Blue's three accumulators in one pass with no ``lax.cond``.

    Where reductions are bound by memory (GPU, TPU) the extra arithmetic is free, and
    with no conditional each leaf compiles to one reduction kernel (XLA:GPU does not
    skip a ``lax.cond``'s reads). XLA:CPU runs the variadic reduce several times slower
    than its library sum, so there the plain sum of squares runs, and a ``lax.cond``
    takes the rare path only when that sum is out of range. The choice follows the
    default backend at trace time; only speed depends on it.
    """
    return jax.default_backend() != "cpu" if ONE_PASS is None else ONE_PASS


def quotient_first(norms: Array) -> bool:
    """Whether the clipping factors of ``norms`` are first taken as plain quotients
    (:data:`QUOTIENT_MIN`); not with the single pass (GPU/TPU), where the arithmetic is
    free beside the memory traffic and a conditional is not."""
    return norms.size >= QUOTIENT_MIN and not one_pass()


def reduction_view(arrays: Sequence[Array]) -> list[Array]:
    """The arrays behind an optimisation barrier, for the reductions to read.

    When a leaf feeds both a reduction and the scaling pass, XLA:CPU materialises its
    float32 upcast once for both (a full widened copy of bf16/f16 gradients). Reading
    the reductions through a barrier (a no-op alias) keeps each upcast fused into its
    own consumer, so no temporary exists.
    """
    return barrier(arrays)[0]


def barrier(arrays: Sequence[Array], extra: Any = None) -> tuple[list[Array], list[Any]]:
    """``optimization_barrier`` of ``arrays``, one barrier per set of varying mesh axes:
    inside ``shard_map`` a single barrier would make every array vary across the union
    of their axes. With ``extra`` (shift factors), each array passes its own barrier
    with its own copy of ``extra``: from one shared copy, XLA:CPU computes the factor's
    broadcast once for all arrays of a shape, at full size."""
    if extra is not None:
        pairs = [lax.optimization_barrier((x, extra)) for x in arrays]
        return [x for x, _ in pairs], [e for _, e in pairs]
    groups: dict[frozenset[str], list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(varying(x), []).append(i)
    out = list(arrays)
    for members in groups.values():
        xs = lax.optimization_barrier([arrays[i] for i in members])
        for i, x in zip(members, xs):
            out[i] = x
    return out, [None] * len(arrays)


def native(x: Array, p: float, rare: bool = False) -> bool:
    """Whether ``x`` is reduced by XLA's own fused reduce (see :func:`reduce`): float16
    and 8-bit data, bfloat16 at fractional ``p``, every ``p=inf`` max (XLA:CPU's library
    max of many elements can lose a NaN; the fused one is as fast), and everything on the
    rare path (XLA:CPU's library reduce would materialise the broadcast of the shift
    factors, or a widened copy where two reductions read one low-precision leaf); never a
    sharded leaf, whose variadic reduce XLA would partition with an all-gather."""
    small = x.dtype.itemsize < 4 and not jnp.iscomplexobj(x)
    # bf16 goes to the library reduce only where its convert fuses (integer powers).
    fractional = math.isfinite(p) and p != int(p)
    wanted = rare or p == math.inf
    wanted |= small and (x.dtype != jnp.bfloat16 or fractional)
    return wanted and one_device(x)


def rare_native(x: Array, bucketed: Any, p: float, axes: Axes) -> bool:
    """:func:`native` for the rare path's second read of a 2-norm: the library reduction
    (faster to compile and to run) for a 32/64-bit leaf reduced whole or over trailing
    axes of at least :data:`LIBRARY_ROW_MIN` elements, each row shifted by its factor.
    The fused one for narrower data, whose upcast XLA:CPU would otherwise materialise
    for both reads; for buckets, whose row factors' broadcast it would materialise; for
    leading or middle axes and short rows, where the library reduce is slower."""
    dims = tuple(range(x.ndim)) if axes is None else tuple(sorted(axes))
    trailing = dims == tuple(range(x.ndim - len(dims), x.ndim))
    rows = math.prod(x.shape[d] for d in dims) >= LIBRARY_ROW_MIN or len(dims) == x.ndim
    fused = p != 2.0 or x.dtype.itemsize < 4 or bool(bucketed) or not (trailing and rows)
    return native(x, p, rare=fused)


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
    add_or_max = jnp.add if op == "sum" else jnp.maximum
    r, low = lax.reduce(
        (v, magnitude(x, v.dtype)),
        (zero, jnp.asarray(jnp.inf, v.dtype)),
        lambda a, b: (add_or_max(a[0], b[0]), jnp.minimum(a[1], b[1])),
        dims,
    )
    # lax, not jnp.where: a jitted function, a call per reduction in the program.
    which = low >= 0
    spec = getattr(jax.typeof(r).sharding, "spec", None)
    if spec != getattr(jax.typeof(which).sharding, "spec", None):
        # On an Explicit mesh, a replicated leaf shifted by factors split over the batch
        # (another leaf's split) sums to split values while its minimum stays whole.
        which = jax.sharding.reshard(which, spec)
    return lax.select(which, r, lax.full_like(r, jnp.nan))


def shaped(r: Any, shape: Shape) -> Any:
    """Every array of the pytree ``r`` reshaped to ``shape``."""
    return jax.tree.map(lambda v: v.reshape(shape), r)


def reduce(
    x: Array, elem: Elem, axes: Axes, op: str, fused: bool, s: tuple[Array, ...] | None = None
) -> Array:
    """Sum or max of ``elem(x, s)`` over ``axes`` (all when None), with keepdims.

    On CPU, short slices (:func:`_short`) are added as slices of ``x`` (pairwise), in one
    elementwise pass; other backends reduce them as any others.

    ``elem`` is elementwise, applied to ``x`` or to a reshaped part of it; ``s`` (keepdims
    shape, or None) are per-slice operands reshaped along with it. With ``fused`` the
    reduction is XLA's fused one (see :func:`native`). That reduce adds sequentially, so
    a sum runs over chunks of :data:`BLOCK` elements (twice that for 8-bit data) of the
    reduced axes, flattened where adjacent, whose results a library reduction adds
    (pairwise-accurate); the chunk results cost ``8 / BLOCK`` bytes per element. Reduced
    axes that are not adjacent are reduced a run at a time, the last first.
    """
    dims = tuple(range(x.ndim)) if axes is None else tuple(sorted(axes))
    if _short(x, dims):
        return lax.platform_dependent(
            x,
            s,
            cpu=functools.partial(_unrolled, elem=elem, dims=dims, op=op),
            default=functools.partial(_reduce, elem=elem, dims=dims, op=op, fused=fused),
        )
    return _reduce(x, s, elem, dims, op, fused)


def _short(x: Array, dims: tuple[int, ...]) -> bool:
    """Whether the slices of ``x`` over ``dims`` are short enough to sum as slices (see
    :data:`SHORT_TRAILING`), on one device."""
    length = math.prod(x.shape[d] for d in dims)
    trailing = dims == tuple(range(x.ndim - len(dims), x.ndim))
    limit = SHORT_TRAILING if trailing else SHORT_LEADING
    return 1 < length <= limit and x.size > length and one_device(x)


def _unrolled(x: Array, s: Any, elem: Elem, dims: tuple[int, ...], op: str) -> Any:
    """``op`` of ``elem`` of each slice of ``x`` at every index of ``dims`` (keepdims),
    added pairwise: one elementwise kernel that reads ``x`` once."""
    terms = []
    for index in itertools.product(*(range(x.shape[d]) for d in dims)):
        part = x
        for d, i in zip(dims, index):
            part = lax.slice_in_dim(part, i, i + 1, axis=d)
        terms.append(elem(part, s))
    combine = jnp.add if op == "sum" else jnp.maximum
    while len(terms) > 1:  # pairwise: a term's rounding passes log2(n) additions
        pairs = [jax.tree.map(combine, a, b) for a, b in zip(terms[::2], terms[1::2])]
        terms = pairs + terms[len(pairs) * 2 :]
    return terms[0]


def _reduce(x: Array, s: Any, elem: Elem, dims: tuple[int, ...], op: str, fused: bool) -> Any:
    """:func:`reduce` over ``dims`` (sorted) by XLA's reductions."""
    kept = tuple(1 if i in dims else d for i, d in enumerate(x.shape))
    if not fused:
        return (jnp.sum if op == "sum" else jnp.max)(elem(x, s), axis=dims, keepdims=True)
    block = BLOCK if x.dtype.itemsize > 1 else 2 * BLOCK  # chunk results <= 2% of the bytes
    n = len(dims)
    length = math.prod(x.shape[d] for d in dims)
    if op == "sum" and s is None and x.size and dims == tuple(range(x.ndim - n, x.ndim)):
        looped = _looped_rows(x.reshape(-1, length), elem)
        if looped is not None:
            return looped.reshape(kept)
    at = dims[0] if dims else 0
    adjacent = dims == tuple(range(at, at + n))
    flat = x.reshape((*x.shape[:at], length, *x.shape[at + n :])) if adjacent and n else x
    # A loop over chunks of rows: leading or middle axes from LOOP_SPLIT_MIN rows however
    # small the leaf (see _looped_sum's ``split``), a whole leaf above one block.
    leading = at + n < x.ndim
    least = LOOP_SPLIT_MIN if leading else block + 1
    if op == "sum" and s is None and adjacent and n and length >= least:
        looped = _looped_sum(flat, elem, at, block, split=leading)
        if looped is not None:
            return shaped(looped, kept)
    if op == "max" or length <= block:  # a max is exact in any order
        return shaped(_fused_reduce(x, elem, s, dims, op), kept)
    if not adjacent:
        # Not adjacent: the last run of adjacent axes, then the partial sums (in the
        # accumulation dtype, and smaller) over the other axes by the library reduction.
        last = next(d for i, d in enumerate(dims) if dims[i:] == tuple(range(d, dims[-1] + 1)))
        r = reduce(x, elem, tuple(range(last, dims[-1] + 1)), op, fused, s)
        others = tuple(d for d in dims if d < last)
        return jax.tree.map(lambda v: jnp.sum(v, axis=others, keepdims=True), r)
    # Adjacent (trailing, leading, or in the middle): one axis of ``length``, in chunks.
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
    return shaped(r, kept)


def _looped_sum(flat: Array, elem: Elem, at: int, block: int, split: bool = False) -> Array | None:
    """The sum of ``elem(flat)`` over axis ``at`` (dropped), not the last axis: one loop
    over chunks of a few rows, each upcast and summed by the library reduction, the
    chunks' sums added into one partial sum per ``block`` chunks, the partial sums then
    added by the library reduction (pairwise). On XLA:CPU the fused reduce over a leading
    axis is about 10x slower than this on large leaves, 1.3-6x on leaves of 64-512 KiB; a
    chunk holds about :data:`LOOP_ROWS_ELEMS` elements, or ``1 / LOOP_CHUNK_OF`` of a
    larger leaf. A whole leaf (``flat`` 1-D) is read as rows of the largest divisor of its
    size up to :data:`LOOP_WHOLE_ROW` (the fused reduce of a whole float16 leaf is 2.5-6x
    slower). With ``split`` (leading or middle axes of :data:`LOOP_SPLIT_MIN` rows or
    more) a smaller leaf takes two chunks: its fused reduce over the leading axis is
    1.5-3x slower too (float16 (128, 128) to (256, 512)), and less accurate. None where
    that does not apply (trailing axes: :func:`_looped_rows`; fewer than two chunks,
    several sums, a leaf split across devices, whose dynamic slices XLA would gather,
    bfloat16, whose upcast XLA:CPU would hoist out of the loop into a widened copy of
    the leaf)."""
    if flat.dtype == jnp.bfloat16:  # XLA:CPU would widen the whole leaf out of the loop
        return None
    if not flat.size:  # no rows to chunk (an empty kept dimension)
        return None
    if flat.ndim == 1:  # a whole leaf: rows of a divisor of its size, then their sum
        width = math.gcd(flat.size, LOOP_WHOLE_ROW)
        if width < LIBRARY_ROW_MIN:  # rows too short to read fast
            return None
        columns = _looped_sum(flat.reshape(-1, width), elem, 0, block)
        return None if columns is None else jnp.sum(columns)
    length, row = flat.shape[at], flat.size // flat.shape[at]
    if at == flat.ndim - 1:
        return None
    if not one_device(flat):
        return None
    kept = (*flat.shape[:at], *flat.shape[at + 1 :])
    # The kept axes as one (two where some lead): XLA:CPU converts 16-bit chunks with a
    # short last axis (a conv kernel's 3x3) several times slower.
    pre = math.prod(flat.shape[:at])
    flat = flat.reshape((pre, length, row // pre) if at else (length, row))
    at = min(at, 1)
    rows = max(flat.nbytes // (row * 4 * LOOP_CHUNK_OF), LOOP_ROWS_ELEMS // row)
    if split:  # two chunks at least
        rows = min(rows, length // 2)
    step = 1 << max(0, rows.bit_length() - 1)
    chunks = length // step
    if chunks < 2:
        return None
    spec = jax.ShapeDtypeStruct((*flat.shape[:at], step, *flat.shape[at + 1 :]), flat.dtype)
    out = jax.eval_shape(lambda c: elem(c, None), spec)
    if isinstance(out, tuple):
        return None
    shape = (*out.shape[:at], *out.shape[at + 1 :])

    def loop(flat: Array) -> Array:
        def add(i: Any, sums: Array) -> Array:
            part = lax.dynamic_slice_in_dim(flat, i * step, step, axis=at)
            j = i // block
            total = lax.dynamic_index_in_dim(sums, j, 0) + jnp.sum(elem(part, None), axis=at)
            return lax.dynamic_update_index_in_dim(sums, total, j, 0)

        first = carry((-(-chunks // block), *shape), out.dtype, flat)
        r = jnp.sum(lax.fori_loop(0, chunks, add, first), axis=0)
        if chunks * step < length:
            tail = lax.slice_in_dim(flat, chunks * step, length, axis=at)
            r = r + reduce(tail, elem, (at,), "sum", True).reshape(shape)
        return r.reshape(kept)

    return _on_cpu(loop, flat, lambda f: jnp.sum(elem(f, None), axis=at).reshape(kept))


def _on_cpu(loop: Callable[[Array], Array], x: Array, plain: Callable[[Array], Array]) -> Array:
    """``loop(x)`` on XLA:CPU, ``plain(x)`` elsewhere: a loop over chunks is XLA:CPU's
    measure; on a GPU each of its steps is a kernel launch (float16 norms ran 20-50x
    slower there), and XLA:GPU's own reduce is fast and accurate. Chosen when lowering
    where the default backend is not the CPU (a GPU host may compute on its CPU); on a
    CPU host the loop alone is traced: no second branch to trace for every loop."""
    if jax.default_backend() == "cpu":
        return loop(x)
    return lax.platform_dependent(x, cpu=loop, default=plain)


def unless_flushed(
    y: Array, narrow: Callable[[Array], Array], plain: Callable[[Array], Array]
) -> Array:
    """``narrow(y)`` where the backend keeps float32 subnormals (GPUs), ``plain(y)`` where
    its arithmetic flushes them to zero (XLA:CPU, TPU): there a product below float32's
    smallest normal is already 0, so rounding it toward zero is a no-op. Chosen when
    lowering, as :func:`_on_cpu`."""
    if jax.default_backend() == "cpu":
        return plain(y)
    return lax.platform_dependent(y, cpu=plain, tpu=plain, default=narrow)


def _looped_rows(rows: Array, elem: Elem) -> Array | None:
    """The sum of ``elem(rows)`` (2-D, not empty) over its last axis (dropped): one loop
    over chunks of whole rows (about :data:`LOOP_ROWS_ELEMS` elements), each upcast and
    summed by the library reduction. XLA:CPU's fused reduce over rows of a float16 leaf
    runs 4-6x slower, and its library reduction of the whole leaf widens it into a
    float32 copy. None for bfloat16, rows longer than :data:`LOOP_ROWS_MAX`, fewer than
    two chunks, or several sums."""
    count, length = rows.shape
    # bfloat16: XLA:CPU would hoist its upcast out of the loop, a widened copy of the leaf.
    # (A leaf split across devices, whose dynamic slices XLA would gather, is never fused.)
    if rows.dtype == jnp.bfloat16 or length > LOOP_ROWS_MAX:
        return None
    step = 1 << max(0, (LOOP_ROWS_ELEMS // length).bit_length() - 1)
    chunks = count // step
    if chunks < 2:
        return None
    out = jax.eval_shape(lambda c: elem(c, None), jax.ShapeDtypeStruct((step, length), rows.dtype))
    if isinstance(out, tuple):
        return None

    def loop(rows: Array) -> Array:
        def add(i: Any, sums: Array) -> Array:
            part = lax.dynamic_slice_in_dim(rows, i * step, step, axis=0)
            sums_of_part = _row_sums(elem(part, None))
            return lax.dynamic_update_slice_in_dim(sums, sums_of_part, i * step, 0)

        r = lax.fori_loop(0, chunks, add, carry((count,), out.dtype, rows))
        tail = _row_sums(elem(rows[chunks * step :], None))  # the rows left (maybe none)
        return lax.dynamic_update_slice_in_dim(r, tail, chunks * step, 0)

    return _on_cpu(loop, rows, lambda r: jnp.sum(elem(r, None), axis=1))


def carry(shape: Shape, dtype: Any, like: Any) -> Array:
    """Zeros for a loop's sums over ``like`` (an array or its ``jax.ShapeDtypeStruct``):
    inside ``shard_map`` they vary as it does."""
    zeros = jnp.zeros(shape, dtype)
    axes = tuple(sorted(varying(like)))
    return lax.pcast(zeros, axes, to="varying") if axes else zeros


def _row_sums(v: Array) -> Array:
    """The sums of the rows of ``v`` (2-D): rows longer than :data:`BLOCK` in blocks of it,
    whose sums pass a barrier before they are added (XLA would merge the two reductions
    into one, which adds a row's terms in a few sequential lanes: a term below half an
    ulp of a lane's sum is lost, 4e-5 of a 3-norm over rows of 32768)."""
    count, length = v.shape
    if length <= BLOCK:
        return jnp.sum(v, axis=1)
    main = length // BLOCK * BLOCK
    blocks = jnp.sum(v[:, :main].reshape(count, main // BLOCK, BLOCK), axis=2)
    total = jnp.sum(lax.optimization_barrier(blocks), axis=1)
    return total + jnp.sum(v[:, main:], axis=1) if main < length else total


def variadic_sum(x: Array, elem: Elem, axes: Axes, fused: bool) -> tuple[Array, ...]:
    """The several sums of ``elem(x)`` (a tuple) over ``axes`` (keepdims) in one pass:
    one variadic reduce, or (a sharded ``x``, whose variadic reduce XLA would gather)
    library reductions. Chosen per platform when lowering, not by the default backend:
    XLA:CPU's fused reduce is sequential (blocks), XLA:GPU's reduces in a tree."""
    dims = tuple(range(x.ndim)) if axes is None else axes
    if not fused:
        return tuple(jnp.sum(t, axis=dims, keepdims=True) for t in elem(x, None))
    kept = tuple(1 if i in dims else d for i, d in enumerate(x.shape))
    return lax.platform_dependent(
        x,
        cpu=lambda v: reduce(v, elem, axes, "sum", True),
        default=lambda v: shaped(_fused_reduce(v, elem, None, dims, "sum"), kept),
    )


def magnitude_bits(x: Array) -> Array:
    """``|x|``'s bits as signed integers of its width, which order as the magnitudes do,
    NaN's above inf's: maxima over them keep a NaN (XLA:CPU's library float max of many
    values can drop one). :func:`from_magnitude_bits` turns them back."""
    bits = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
    # The sign bit cleared as an integer: XLA:GPU's float64 abs keeps a NaN's sign bit,
    # and a negative NaN's bits would order below every magnitude.
    return lax.bitcast_convert_type(x, bits) & jnp.iinfo(bits).max


def from_magnitude_bits(b: Array, dtype: Any) -> Array:
    """The magnitudes of :func:`magnitude_bits` ``b`` (0 for a negative ``b``, the empty
    maximum's identity) in ``dtype``."""
    return lax.bitcast_convert_type(jnp.maximum(b, 0), dtype)


def max_keeping_nan(x: Array, axes: Axes = None) -> Array:
    """``max x`` of non-negative ``x`` over ``axes`` (all when None; 0 for no elements),
    NaN where ``x`` holds one, over :func:`magnitude_bits` (a separate NaN test would be
    more kernels to compile)."""
    top = jnp.max(magnitude_bits(x), axis=axes, initial=0, keepdims=axes is not None)
    return from_magnitude_bits(top, x.dtype)


def concatenate(parts: Sequence[Array], axis: int = 0) -> Array:
    """``jnp.concatenate``, moving bfloat16 as raw 16-bit words: XLA:CPU would otherwise
    run a bfloat16 concatenation in float32, a widened copy of every part."""
    if parts[0].dtype != jnp.bfloat16:
        return jnp.concatenate(parts, axis)
    return _concatenate_words(tuple(parts), axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _concatenate_words(parts: tuple[Array, ...], axis: int) -> Array:
    words = jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint16) for x in parts], axis)
    return lax.bitcast_convert_type(words, jnp.bfloat16)


@_concatenate_words.defjvp
def _concatenate_words_jvp(axis: int, primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    # The words carry no derivative: the tangents are concatenated as numbers.
    (parts,), (dparts,) = primals, tangents
    return _concatenate_words(parts, axis), jnp.concatenate(dparts, axis)


def opaque(values: Sequence[int], like: Array | None) -> list[Any]:
    """``values`` as int32 scalars that XLA cannot fold into the kernels that read them:
    outputs of a ``lax.cond`` on a traced predicate (from ``like``) whose branches both
    return them. Each leaf's scaling kernel reads its scalars out of stacked vectors at
    such an offset, so that the kernels of alike leaves are identical and XLA:CPU
    compiles them once; at a constant offset every one is a kernel of its own. Plain
    constants with the single pass (GPU/TPU), which keeps no conditional."""
    # numpy scalars: several times faster to trace than jnp.int32, a thousand per tree.
    if like is None or not values or one_pass():
        return list(np.asarray(values, np.int32))

    def consts() -> list[Any]:
        return list(np.asarray(values, np.int32))

    return lax.cond(jnp.ravel(like)[0].astype(bool), consts, consts)


def pick(v: Array, at: Any, size: int) -> Array:
    """``v[at : at + size]`` (along the first axis) for an offset ``at >= 0``: one
    dynamic slice (``lax.dynamic_index_in_dim`` is a jitted function: a call per use, a
    thousand per tree, which XLA's passes then inline; negative offsets cost a select)."""
    starts = (at, *(np.int32(0),) * (v.ndim - 1))
    return lax.dynamic_slice(v, starts, (size, *v.shape[1:]), allow_negative_indices=False)


def row(x: Array, b: Array) -> Array:
    """``x[b]``; a 16-bit ``x`` passes a barrier with ``b`` first: XLA would otherwise
    widen the whole array once, outside the loop that slices it."""
    if x.dtype.itemsize == 2 and not jnp.iscomplexobj(x):
        x, b = lax.optimization_barrier((x, b))
    return lax.dynamic_index_in_dim(x, b, 0, keepdims=False)


def rows_apart_limit(units: Sequence[Array], batch: int) -> int:
    """The most out-of-range examples whose rows the rare path reads one at a time: a
    loop over rows runs as fast per byte as a pass over the batch where rows are large,
    and up to three quarters of the batch may take it."""
    size = sum(u.size * u.dtype.itemsize for u in units) // batch
    return max(1, batch // ROWS_APART_OF, min(batch * 3 // 4, batch * size // ROW_BYTES_ALONE))


def rows_apart(units: Sequence[Array], combines: Sequence[Combine], shape: Shape) -> bool:
    """Whether the rare path of per-example norms may read single examples' rows: each
    unit whole on one device (a dynamic slice of a sharded batch axis would gather it) and
    nothing combined across devices (a collective in a loop whose trip count differs)."""
    return len(shape) == 1 and shape[0] > 1 and not any(combines) and all(map(one_device, units))
