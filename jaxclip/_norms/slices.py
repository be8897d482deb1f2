"""Per-slice norms: one norm per leaf, per slice over ``axes``, or per bucket row.

Each unit's plain sums are one pass; one ``lax.cond`` for all units takes the rare path
only when some sum is out of its exact range, and there only the units out of range
read their data again. With a ``floor`` (the clip norm), slices too small to reach it
(all-zero rows: unused embeddings, frozen leaves) count as 0 in the ``floored`` result
that clipping reads; they are read again only for the ``reported`` norms, in the same
rare pass (one conditional per unit serves both results: compile time grows with the
units once, not once per result).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxclip._norms.arith import (
    Norm,
    acc_dtype,
    always_exact,
    exact_lo,
    floor_bound,
    in_exact_range,
    in_range_norm,
    where_norm,
)
from jaxclip._norms.backend import Axes, native, one_pass, opaque, pick, rare_native
from jaxclip._norms.devices import Combine, has_unmapped, pmax, psum
from jaxclip._norms.passes import blue_norm, blue_sums, inf_norms, inf_result, max_abs, power_sum
from jaxclip._norms.rare import max_shift, shift_factors, shifted_norm, shifted_sum, sum_shift
from jaxclip._norms.rules import batchable, norm_tangent, tangent
from jaxclip._norms.stacking import (
    Groups,
    any_of,
    every,
    groups_of,
    stack,
    stacked,
    unstack,
)
from jaxclip._norms.units import Bucketed

Array = jax.Array


class _Sums(NamedTuple):
    """The units of one call and their plain power sums (combined over devices)."""

    units: tuple[Array, ...]
    p: float
    axes: tuple[Axes, ...]
    bucketed: tuple[Bucketed, ...]
    combines: tuple[Combine, ...]
    batch: int  # examples leading each unit under the vmap rule (1: none)
    sums: list[Array]
    groups: Groups
    flat: list[Array]  # the sums stacked per group


def _low(s: Array) -> Array:
    return s < exact_lo(s.dtype)


def _range_code(s: Array) -> Array:
    """Of stacked plain sums, a scalar: 2 where one overflowed or is NaN, else 1 where
    one is too small to be exact, else 0. One maximum of one code per sum: a maximum of
    flags per question would be two vectors written and read again (XLA:CPU's library
    reduction does not fuse its producer)."""
    code = jnp.where(s < jnp.inf, jnp.where(_low(s), 1.0, 0.0), 2.0).astype(jnp.float32)
    return jnp.max(code, initial=0)


def _single_pass(
    units: tuple[Array, ...], p: float, axes: tuple[Axes, ...], combines: tuple[Combine, ...]
) -> list[Norm]:
    """Norms with no rare path: ``p=inf`` (maxima), and Blue's one pass for ``p=2``."""
    if p == math.inf:
        fused = [native(x, p) for x in units]
        ms, halves = inf_norms(units, axes, fused)
        ms = [pmax(m, c) for m, c in zip(ms, combines)]
        if halves is None:
            return stacked(inf_result, ms)
        return stacked(inf_result, ms, [pmax(h, c) for h, c in zip(halves, combines)])
    parts = [
        tuple(psum(t, c) for t in blue_sums(x, a, native(x, p, rare=True)))
        for x, a, c in zip(units, axes, combines)
    ]
    return stacked(blue_norm, *(list(q) for q in zip(*parts)))


def _in_range(sums: _Sums) -> list[Norm]:
    return [in_range_norm(s, sums.p) for s in sums.flat]


def _zeros(x: Array, f: Array) -> Array:
    return jnp.zeros_like(f)


@functools.cache
def _shifted_by_sum(p: float, a: Axes, b: Bucketed, c: Combine) -> Callable[[Array, Array], Array]:
    """The rare branch of a 2-norm unit: one function per kind of unit, so that JAX
    traces it once for alike units."""

    def branch(x: Array, f: Array) -> Array:
        return psum(shifted_sum(x, p, a, rare_native(x, b, p, a), (f,)), c)

    return branch


def _neutral(m: Array) -> tuple[Array, Array, Array]:
    """The rare parts ``(m, e, t)`` of slices that need none (in range, or all zeros of
    maxima ``m``): ``(m, -inf, 0)``."""
    return m, jnp.full_like(m, -jnp.inf), jnp.zeros_like(m)


def _shifted_by_max(
    x: Array, p: float, a: Axes, b: Bucketed, c: Combine, ok: Array
) -> tuple[Array, Array, Array]:
    """The rare parts ``(m, e, t)`` of a unit: its maxima first (all-zero slices need no
    more, and a max pass is the cheaper read), then the sums shifted by them."""
    fused = native(x, p, rare=True)
    m = pmax(max_abs(x, a, acc_dtype(x.dtype), fused, parts=True), c)

    def parts() -> tuple[Array, Array, Array]:
        e, mant = max_shift(m, p)
        good = (m > 0) & jnp.isfinite(m)
        t = shifted_sum(x, p, a, fused, shift_factors(e, mant, acc_dtype(x.dtype), False))
        return m, jnp.where(good, e, -jnp.inf), psum(t, c)

    return lax.cond(every(ok | (m == 0)), functools.partial(_neutral, m), parts)


def _finish(p: float, s: Array, ok: Array, t: Array, m: Array | None = None, e: Any = None) -> Norm:
    """The norm of stacked slices: the plain sum's where ``ok``, else the shifted one's."""
    if m is None:  # a 2-norm: t was shifted by 2**-e, e from s
        n = shifted_norm(t, p, sum_shift(s, ok), None, None)
    else:
        n = shifted_norm(t, p, jnp.where(jnp.isfinite(e), e, 0), max_shift(m, p)[1], m)
    return where_norm(ok, in_range_norm(s, p), n)


def _in_range_flags(sums: _Sums) -> list[Array]:
    """Per group of stacked sums, per slice, whether its plain sum is exact (inside the
    rare branch only: as operands of the cond they would be kernels run on every call;
    per group, not per unit: a kernel per unit, for each of hundreds of units)."""
    return [in_exact_range(v, acc_dtype(v.dtype)) for v in sums.flat]


def _rare(
    sums: _Sums, oks: list[Array] | None = None, settled: list[Array] | None = None
) -> list[Norm]:
    """The rare path: a unit whose slices are all in range (``oks``, per group), or
    which ``settled`` says needs no more (its other slices count 0), keeps its plain
    norms; the others read their data again, shifted."""
    p, groups = sums.p, sums.groups
    oks = _in_range_flags(sums) if oks is None else oks
    done = _all_settled(sums, oks, None, "exact") if settled is None else settled
    kinds = zip(sums.units, sums.axes, sums.bucketed, sums.combines)
    shapes = [s.shape for s in sums.sums]
    if p == 2.0:
        factors = [
            shift_factors(sum_shift(s, ok), None, s.dtype, True)[0] for s, ok in zip(sums.flat, oks)
        ]
        ts = [
            lax.cond(d, _zeros, _shifted_by_sum(p, a, b, c), x, f)
            for (x, a, b, c), d, f in zip(kinds, done, unstack(factors, groups, shapes, False))
        ]
        return [_finish(p, s, ok, *v) for s, ok, v in zip(sums.flat, oks, stack(groups, ts))]
    unit_oks = unstack(oks, groups, shapes, False)
    parts = [
        lax.cond(
            d,
            functools.partial(_neutral, jnp.zeros_like(s)),
            functools.partial(_shifted_by_max, x, p, a, b, c, ok),
        )
        for (x, a, b, c), d, s, ok in zip(kinds, done, sums.sums, unit_oks)
    ]
    ms, es, ts = (list(v) for v in zip(*parts))
    return [_finish(p, s, ok, *v) for s, ok, v in zip(sums.flat, oks, stack(groups, ts, ms, es))]


def _all_settled(
    sums: _Sums, oks: list[Array], fine: list[Array] | None, report: str
) -> list[Array]:
    """Per unit, whether it needs no second read (:func:`_settled`), from each group's
    flags ``oks`` (and ``fine``, per group, unless ``report`` is "exact"): a unit alone
    in its group reduces its own codes, the units of a stack share one segment maximum
    (a reduction per unit is a few kernels each, for each of hundreds of units)."""
    out: dict[int, Array] = {}
    stacks: list[tuple[list[int], Array]] = []  # per stacked group: its units, their flags
    for g, members in enumerate(sums.groups):
        f = jnp.zeros((), bool) if fine is None else fine[g]
        if len(members) == 1:
            u = members[0]
            s = sums.sums[u]
            ok = oks[g] if oks[g].shape == s.shape else lax.reshape(oks[g], s.shape)
            out[u] = _settled(sums, u, ok, f, report)
        else:
            stacks.append((members, _group_settled(sums, g, oks[g], f, report)))
    # A value per unit, at offsets XLA cannot fold (one conditional for all): alike
    # units share their kernel.
    ats = iter(opaque([k for members, _ in stacks for k in range(len(members))], _first(stacks)))
    for members, flags in stacks:
        out.update((u, lax.reshape(pick(flags, next(ats), 1), ()) > 0) for u in members)
    return [out[u] for u in range(len(sums.sums))]


def _first(stacks: list[tuple[list[int], Array]]) -> Array | None:
    return stacks[0][1] if stacks else None


class _Segments(NamedTuple):
    """Of a group's stacked slices: each one's segment (a leaf or an example, whose codes
    :func:`_settled` reads together, or a whole unit), each segment's target (its unit
    needs no second read where every segment's largest code is its target) and unit,
    and which slices are read as "all in range"."""

    ids: np.ndarray
    targets: np.ndarray
    owner: np.ndarray
    in_range: np.ndarray


def _segments(sums: _Sums, members: Sequence[int], report: str) -> _Segments:
    """The :class:`_Segments` of the group of units ``members`` (static)."""
    ids, targets, owner, in_range = [], [], [], []
    for k, u in enumerate(members):
        s, kind, batch = sums.sums[u], sums.bucketed[u], sums.batch
        whole = report != "largest" or kind is True
        if not s.size:  # no segment: settled
            local, count = np.zeros(0, np.int64), 0
        elif whole or (batch == 1 and not isinstance(kind, tuple)):
            local, count = np.zeros(s.size, np.int64), 1
        elif isinstance(kind, tuple):  # per example, per leaf: its rows
            leaf = np.repeat(np.arange(len(kind)), kind)
            local, count = (np.arange(batch)[:, None] * len(kind) + leaf).ravel(), batch * len(kind)
        else:  # per example
            local, count = np.repeat(np.arange(batch), s.size // batch), batch
        ids.append(local + len(targets))
        targets += [0.0 if whole else 1.0] * count
        owner += [k] * count
        in_range.append(np.full(s.size, whole))
    return _Segments(
        np.concatenate(ids).astype(np.int32),
        np.asarray(targets, np.float32),
        np.asarray(owner, np.int32),
        np.concatenate(in_range),
    )


def _largest_code(s: Array, ok: Array, fine: Array) -> Array:
    """Per plain sum, for each leaf's largest norm: 2 where the floored norms need a second
    read (out of range, and not small under a fine floor), else 1 for a large slice (at
    least 4 lo, above any small slice's norm), else 0."""
    need = ~ok & ~(_low(s) & fine)
    return jnp.where(need, 2.0, jnp.where(s >= 4 * exact_lo(s.dtype), 1.0, 0.0))


def _group_settled(sums: _Sums, g: int, ok: Array, fine: Array, report: str) -> Array:
    """Per unit of stacked group ``g`` (flags ``ok``), positive where :func:`_settled`:
    one segment maximum of a code per slice, one segment minimum per unit."""
    s, members = sums.flat[g], sums.groups[g]
    seg = _segments(sums, members, report)
    in_range = jnp.where(ok, 0.0, 1.0)  # 0: in range
    if report == "none":
        code = jnp.where(ok | (_low(s) & fine), 0.0, 1.0)
    elif seg.in_range.all():
        code = in_range
    else:
        code = _largest_code(s, ok, fine)
        code = jnp.where(seg.in_range, in_range, code) if seg.in_range.any() else code
    top = jax.ops.segment_max(
        code.astype(jnp.float32), seg.ids, len(seg.targets), indices_are_sorted=True
    )
    hit = (top == seg.targets).astype(jnp.float32)
    return jax.ops.segment_min(hit, seg.owner, len(members), indices_are_sorted=True)


def _settled(sums: _Sums, u: int, ok: Array, fine: Array, report: str) -> Array:
    """Whether unit ``u`` needs no second read: for the floored norms, its slices out of
    range are all small where the floor is above them (an overflow or NaN never is);
    for exact reported norms, it is all in range; for each leaf's largest, also no leaf
    (a bucket's row, the rows of a leaf in a bucket of slices, else the unit, one per
    example under the vmap rule) has all its plain sums below 4 lo (above any small
    slice's norm, see ``arith.floor_bound``). One reduction of a code per slice (2:
    floored needs it; 1: a large slice; else 0): XLA:CPU compiles a kernel or two per
    distinct slice count for each reduction."""
    s, kind = sums.sums[u], sums.bucketed[u]
    if report == "exact" or (report == "largest" and kind is True):
        return every(ok)  # a bucket's row is a leaf: its largest norm is its only one
    if report != "largest":
        return every(ok | (_low(s) & fine))
    if not s.size:
        return jnp.ones((), bool)
    code = _largest_code(s, ok, fine)
    if isinstance(kind, tuple):  # a bucket of slices: per leaf, its rows' largest code
        rows = code.reshape(sums.batch, -1).T  # (slices, examples)
        leaf = np.repeat(np.arange(len(kind)), kind)
        return every(jax.ops.segment_max(rows, leaf, len(kind), indices_are_sorted=True) == 1)
    if sums.batch == 1:
        return jnp.max(code) == 1
    return every(jnp.max(code, tuple(range(1, s.ndim))) == 1)


def _goes_rare(codes: list[Array], fine: list[Array], report: str) -> Array:
    """Whether the rare pass runs, from each stacked vector's :func:`_range_code` and
    whether the floor is above its small slices' norms (``fine``, read for "none" only)."""
    if report == "none":  # only an overflow, or a small slice below a low floor
        return any_of([(c == 2) | ((c > 0) & ~f) for c, f in zip(codes, fine)])
    # exact: every slice out of range; largest: a leaf's may be small only there
    return any_of([c > 0 for c in codes])


def _floored(sums: _Sums, floor: Array, codes: list[Array], report: str) -> tuple[Any, Any]:
    """``(floored, reported)`` stacked norms for a clip norm of at least ``floor``, out
    of one ``lax.cond`` whose rare branch reads each unit again at most once for both;
    ``codes``: per stacked vector, its :func:`_range_code`."""
    p, flat = sums.p, sums.flat
    dtypes = sorted({v.dtype for v in flat}, key=str)
    fine = tuple(floor.astype(d) >= floor_bound(d, p) for d in dtypes)

    def fine_of(v: Array) -> Array:
        return fine[dtypes.index(v.dtype)]

    low = [_low(v) for v in flat]
    go = _goes_rare(codes, [fine_of(v) for v in flat], report)

    def rare_pass() -> list[Norm]:
        oks = _in_range_flags(sums)
        return _rare(sums, oks, _all_settled(sums, oks, [fine_of(v) for v in flat], report))

    norms = lax.cond(go, rare_pass, functools.partial(_in_range, sums))
    # Slices too small to reach the floor count 0 for clipping: exact or not, their
    # factor is 1, and the derivative rule reads 0 as "kept".
    floored = [
        Norm(*(jnp.where(lo & fine_of(v), 0, h) for h in n)) for lo, v, n in zip(low, flat, norms)
    ]
    return floored, (floored if report == "none" else norms)


def unit_norms_body(
    units: tuple[Array, ...],
    floor: Array | None,
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[Bucketed, ...],
    combines: tuple[Combine, ...],
    static_split: bool = False,
    report: str = "exact",
    batch: int = 1,
) -> Any:
    """The exact norms of each unit over its ``axes`` (keepdims); with a ``floor`` (a
    scalar), ``(floored, reported)``.

    ``floored`` is exact where the norm may exceed ``floor``, and 0 in place of a norm
    known to be below it: a slice whose plain sum is too small to be exact is read again
    only when ``floor`` is below ``arith.floor_bound`` (a clipping factor keeps such a
    slice whatever its exact norm). ``reported`` is, for ``report="exact"``, exact
    everywhere; for ``"largest"``, exact enough that each leaf's largest norm is exact;
    for ``"none"`` (a caller that reads only ``floored``), ``floored`` again.
    A leaf is a row of a bucket, else a whole unit, or under the vmap rule (``batch``
    examples leading) one example of it. With ``static_split`` the norms are split out
    of their stacked vectors at constant offsets, for a caller that stacks them again.
    """
    # float16, float8: no plain sum leaves the exact range, whatever the data.
    exact = all(always_exact(x.dtype, p) for x in units)
    if p == math.inf or (p == 2.0 and one_pass() and not exact):
        norms = _single_pass(units, p, axes, combines)
        return norms if floor is None else (norms, norms)
    plain = [psum(power_sum(x, p, a, native(x, p)), c) for x, a, c in zip(units, axes, combines)]
    if exact:
        norms = [in_range_norm(s, p) for s in plain]
        return norms if floor is None else (norms, norms)
    # The stacked vectors cross the cond and are split after it: split inside, each
    # unit's slice would be a kernel recomputing the whole vector's maths.
    groups = groups_of(plain)
    flat = [v for (v,) in stack(groups, plain)]
    sums = _Sums(units, p, axes, bucketed, combines, batch, plain, groups, flat)
    codes = [_range_code(v) for v in flat]
    shapes = [v.shape for v in plain]

    def split(results: Any) -> list[Norm]:
        return unstack(results, groups, shapes, static=static_split)

    if floor is None:
        out = _goes_rare(codes, [], "exact")  # every slice out of range is read again
        return split(lax.cond(out, lambda: _rare(sums), lambda: _in_range(sums)))
    floored, reported = _floored(sums, floor, codes, report)
    return split(floored), split(reported)


def _unit_norms_impl(
    units: tuple[Array, ...],
    floor: Array | None,
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[Bucketed, ...],
    combines: tuple[Combine, ...],
    static_split: bool,
    report: str,
) -> Any:
    args = (p, axes, bucketed, combines, static_split, report)
    if has_unmapped(combines):  # a named vmap's axis: the batching rule could not psum
        return unit_norms_body(units, floor, *args)
    return _batchable_unit_norms(*args)(units, floor)


@functools.cache
def _batchable_unit_norms(
    p: float,
    axes: tuple[Axes, ...],
    bucketed: tuple[Bucketed, ...],
    combines: tuple[Combine, ...],
    static_split: bool,
    report: str,
) -> Callable[[tuple[Array, ...], Array | None], Any]:
    """Per-slice norms with a ``vmap`` rule: the batch axis is one more kept axis."""
    args = (p, axes, bucketed, combines, static_split, report)

    def batched(size: int, units: tuple[Array, ...], floor: Array | None) -> Any:
        shifted = tuple(
            tuple(range(1, u.ndim)) if a is None else tuple(d + 1 for d in a)
            for u, a in zip(units, axes)
        )
        return unit_norms_body(
            units, floor, p, shifted, bucketed, combines, static_split, report, size
        )

    def slice_norms(units: tuple[Array, ...], floor: Array | None) -> Any:  # profiles' name
        return unit_norms_body(units, floor, *args)

    return batchable(slice_norms, batched)


unit_norms = jax.custom_jvp(_unit_norms_impl, nondiff_argnums=(2, 3, 4, 5, 6, 7))


@unit_norms.defjvp
def _unit_norms_jvp(
    p: float,
    axes: tuple,
    bucketed: tuple,
    combines: tuple,
    static_split: bool,
    report: str,
    primals: tuple,
    tangents: tuple,
) -> tuple[Any, Any]:
    (units, floor), (dunits, _) = primals, tangents
    out = unit_norms(units, floor, p, axes, bucketed, combines, static_split, report)

    def tangents_of(norms: list[Norm]) -> list[Norm]:
        # Each list from its own norms, so that an unused list's pass is still dropped;
        # a floored 0 has tangent 0 (its slice is kept, whose tangent is dx).
        return [
            norm_tangent(n, psum(tangent(x, dx, n, p, a), c))
            for x, dx, n, a, c in zip(units, dunits, norms, axes, combines)
        ]

    return out, (tangents_of(out) if floor is None else tuple(tangents_of(o) for o in out))
