"""Differential harness: every norm-based mode of jaxclip against a float64 NumPy reference.

Modes: ``global_norm``, ``clip_tree_by_global_norm`` (norm and outputs), ``clip_tree_by_norm``
per leaf and per slice (``axes=``), the global norms that ``zclip``, ``auto_clip`` and
``skip_large_updates`` keep in their states, and ``adaptive_clip`` against the AGC formula.
Axes of the sweep: dtypes (float16, bfloat16, float32, float64, complex64, float8_e4m3fn,
float8_e5m2), sizes (1 element to 5e7 in one leaf, 1000 leaves adding up to 3e7), magnitudes
(smallest subnormal, smallest normal ... largest finite, and trees that span the range),
``norm_type`` in {0.5, 1, 1.5, 2, 3, 7.5, 9, inf}, NaN/inf at the first, middle and last
element, and execution modes (eager, ``jit``, ``vmap``, ``grad``/``jvp``, ``lax.scan``, an
8-device mesh). Expected values come from float64 formulas (``reference.py`` and the helpers
below), never from jaxclip.

Error bounds tested:

* Norm: within ``RTOL = 1e-5`` relative of the float64 norm of the stored values, for
  float32 accumulation at any size (tested up to 5e7 elements) and every magnitude from the
  dtype's smallest normal to its largest finite value, in every execution mode. Two
  exceptions, both forced by the result's dtype (float32, float64 when a leaf is float64):
  a true norm above that dtype's largest finite value may be reported as inf; a true norm
  below its smallest normal (inputs subnormal in float32/float64) may be reported as 0,
  because XLA:CPU flushes subnormal float32/float64 arithmetic to zero. float16 and float8
  subnormals are normal in float32 and get no exception.
* Clipped output: each element equals ``x * c / n`` (float64 ``n``) within ``eps + 2e-5``
  relative (``eps`` of the output dtype: one rounding, plus the norm's own error through
  ``c / n``), or within the output dtype's smallest normal where the exact result is
  subnormal; so a clipped output is never 0, NaN or inf where the exact one is a normal
  number, even when the true norm overflows float32. The float64 norm of the output is at
  most ``c * (1 + k eps)``, ``k = 2`` for ``p`` = 1, 2, inf, 3 for other ``p >= 1`` and
  ``1 + 2/p`` below (the power sum's rounding reaches the norm times ``1/p``):
  :func:`_bound_eps`. Where nothing is clipped the output is bit-identical (values that
  are subnormal in float32/float64 may be flushed to 0 on XLA:CPU).
* Non-finite: a NaN anywhere gives a NaN norm and NaN outputs; an inf gives an inf norm,
  scale 0 (finite entries 0, the inf entry NaN), for every ``norm_type``.
* Derivatives: ``jax.grad``/``jax.jvp`` of the norm equal ``sign(x) (|x|/n)^(p-1)``
  (``sign(x_k) e_k`` at the unique maximum for inf) and those of the clipped output the
  float64 chain rule, within 1e-5 (relative to the largest component), at every magnitude
  where the norm is a normal float32; where nothing is clipped the derivative of the output
  is the identity (zero gradients included).

Compiles dominate the cost: every jitted function is built once per shape family by a
``functools.cache`` factory and reused across the parametrized cases (magnitudes, NaN positions,
thresholds are arguments, never constants), and the big arrays are built once per module.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip

RTOL = 1e-5  # the stated bound of a norm against float64
OUT_RTOL = 2e-5  # added to the output dtype's eps for a clipped element: the norm's error via c / n
INF = math.inf
PS = (0.5, 1.0, 1.5, 2.0, 3.0, 7.5, 9.0, INF)

DTYPES = {
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
    "float64": jnp.float64,
    "complex64": jnp.complex64,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}
WIDE = (np.dtype(np.float64), np.dtype(np.complex128))


# ----------------------------------------------------------------------------------------
# float64 helpers and assertions.


class Range(NamedTuple):
    tiny: float  # smallest normal
    max: float
    eps: float
    sub: float  # smallest subnormal


@functools.cache
def _range(dtype: Any) -> Range:
    fi = jnp.finfo(dtype)  # complex64 -> float32's; float8 via ml_dtypes
    return Range(float(fi.tiny), float(fi.max), float(fi.eps), float(fi.smallest_subnormal))


def _acc(*dtypes: Any) -> np.dtype:
    """The dtype of a norm over leaves of these dtypes (DESIGN.md): float64 if any is 64-bit."""
    return (
        np.dtype(np.float64) if any(np.dtype(d) in WIDE for d in dtypes) else np.dtype(np.float32)
    )


def _x64(*dtypes: Any):
    """A context enabling float64 where a case has 64-bit leaves (a no-op otherwise)."""
    if not any(np.dtype(d) in WIDE for d in dtypes):
        return contextlib.nullcontext()
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # pragma: no cover - older/newer JAX without the context manager
        pytest.skip("float64 cases need the jax.enable_x64 context manager")
    return enable(True)


def _rounded(value: float, dtype: Any) -> float:
    """A threshold as the value the library sees once it is cast to the norm's dtype."""
    return float(np.asarray(value, dtype))


def _label(m: float) -> str:
    return f"{m:g}"


def _fmt(v: Any) -> str:
    return np.array2string(np.asarray(v), precision=9, threshold=8)


def _assert_norm(got: Any, want: Any, acc: Any, what: str) -> None:
    """A norm against float64, under the bounds of the module docstring."""
    g_all = np.asarray(np.asarray(got), np.float64)
    w_all = np.asarray(want, np.float64)
    assert g_all.shape == w_all.shape, f"{what}: shape {g_all.shape}, expected {w_all.shape}"
    r = _range(acc)
    bad = []
    for i in np.ndindex(w_all.shape):
        g, w = float(g_all[i]), float(w_all[i])
        if math.isnan(w):
            ok = math.isnan(g)
        elif w == INF:
            ok = g == INF
        elif w > r.max:  # the true norm overflows the result dtype: inf (or its max) is right
            ok = g >= r.max
        elif w < r.tiny:  # subnormal result: subnormal inputs, which XLA:CPU may flush to 0
            ok = g == 0 or abs(g - w) <= RTOL * w + 2 * r.sub
        else:
            ok = abs(g - w) <= RTOL * w
        if not ok:
            bad.append(f"[{','.join(map(str, i))}] got {g:.9g}, float64 {w:.9g}")
    if bad:
        raise AssertionError(f"{what}: " + "; ".join(bad[:4]))


def _assert_scaled(out: Any, x: Any, scale: Any, what: str) -> None:
    """``out == x * scale`` (float64 scale) up to one rounding into ``x``'s dtype."""
    assert out.dtype == x.dtype, f"{what}: dtype {out.dtype}, expected {x.dtype}"
    r = _range(x.dtype)
    o = ref.f64(out)
    e = ref.f64(x) * np.asarray(scale, np.float64)
    mag = np.abs(e)
    ok = np.ones(e.shape, bool)
    # Complex: each part is rounded on its own, and may be subnormal while |e| is not.
    for op, ep in [(o.real, e.real), (o.imag, e.imag)] if np.iscomplexobj(e) else [(o, e)]:
        # Values within a few ulps above the smallest normal may round (the clipping factor
        # is rounded down by one ulp) into the subnormal range, which XLA:CPU flushes.
        tol = (r.eps + OUT_RTOL) * mag + np.where(
            np.abs(ep) < r.tiny * (1 + 4 * r.eps), r.tiny, 0.0
        )
        ok &= np.abs(op - ep) <= tol
    if not ok.all():
        i = tuple(int(k) for k in np.argwhere(~ok)[0])
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.size} elements off, first at {list(i)}: "
            f"got {o[i]!r}, float64 {e[i]!r} (input {ref.f64(x)[i]!r})"
        )


def _magnitude_less_subnormal_step(out: Any) -> np.ndarray:
    """|out| in float64, where each subnormal value (each subnormal part of a complex one)
    of a float32 or wider output counts one smallest-subnormal step less: rounding into
    the subnormal range has an absolute error, which no relative bound covers. 16-bit and
    8-bit outputs are rounded toward zero there (the numerics guide): taken as they are."""
    r = _range(out.dtype)
    o = ref.f64(out)
    if np.dtype(out.dtype).itemsize <= 2 and not np.iscomplexobj(o):
        return np.abs(o)

    def down(a: np.ndarray) -> np.ndarray:
        a = np.abs(a)
        return np.where(a < r.tiny, np.maximum(a - r.sub, 0.0), a)

    return np.hypot(down(o.real), down(o.imag)) if np.iscomplexobj(o) else down(o)


def _bound_eps(p: float) -> float:
    """The stated bound on the norm of a clipped output, in eps of its dtype over ``c``:
    the factor's and the outputs' roundings (one eps) plus the norm's own error: one eps
    for p = 1, 2 and inf; for other p the terms' powers and the root's each round (two
    eps: 1.95 measured at p = 1.01 under jax 0.12, 1.68 under 0.10), times ``1/p`` below 1."""
    return 2.0 if p in (1.0, 2.0, math.inf) else 1 + 2 / min(p, 1.0)


def _assert_bound(out: Any, c: float, p: float, axes: tuple[int, ...] | None, what: str) -> None:
    """float64 norm of the clipped output <= c * (1 + k eps of the output dtype), k from
    :func:`_bound_eps`: the factor is exactly c / n rounded once, as in Paddle and
    TensorFlow, so the bound adds the norm's own error (a few ulps: the scaled path sums
    in chunks) to the roundings."""
    r = _range(out.dtype)
    n = np.asarray(ref.norm([_magnitude_less_subnormal_step(out)], p, axes), np.float64)
    k = _bound_eps(p)
    limit = c * (1 + k * r.eps)
    if not np.all(n <= limit):
        raise AssertionError(
            f"{what}: norm after clipping {_fmt(n)} > c * (1 + {k} eps) = {limit!r}"
        )


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8).reshape((*a.shape, a.dtype.itemsize))


def _assert_unchanged(out: Any, x: Any, acc: Any, what: str, where: Any = True) -> None:
    """Bit-identical where ``where``; values subnormal in the accumulation dtype may be 0
    (XLA:CPU flushes subnormal float32/float64 arithmetic to zero)."""
    o, xv = np.asarray(out), np.asarray(x)
    assert o.dtype == xv.dtype and o.shape == xv.shape, (
        f"{what}: {o.dtype}{o.shape} vs {xv.dtype}{xv.shape}"
    )
    same = np.all(_bits(o) == _bits(xv), axis=-1)
    flushed = (np.abs(ref.f64(xv)) < _range(acc).tiny) & (ref.f64(o) == 0)
    ok = same | flushed | ~np.broadcast_to(where, xv.shape)
    if not ok.all():
        i = tuple(int(k) for k in np.argwhere(~ok)[0])
        raise AssertionError(
            f"{what}: not returned unchanged at {list(i)}: got {o[i]!r}, input {xv[i]!r}"
        )


def _norm_and_scale(x: Any, p: float, axes: tuple[int, ...] | None, c: float) -> tuple[Any, Any]:
    """The float64 norm (``ref.norm``) and the scale ``min(1, c / n)``, exact also where the
    norm of float64 values overflows float64 (it is then computed for x / 2**64)."""
    xf = ref.f64(x)
    finite = np.abs(xf[np.isfinite(xf)])
    k = 2.0**-64 if finite.size and finite.max() > 2.0**1000 else 1.0
    ns = np.asarray(ref.norm([xf * k], p, axes), np.float64)
    with np.errstate(over="ignore"):
        n = ns / k
    keep = ns <= c * k
    return (n if axes else float(n)), np.where(keep, 1.0, (c * k) / np.where(keep, 1.0, ns))


def _check_mode(
    out: Any,
    norm: Any,
    x: Any,
    c: float,
    p: float,
    axes: tuple[int, ...] | None,
    acc: Any,
    what: str,
) -> None:
    """One clip call against float64: its norm(s), output values, the bound, pass-through."""
    want, scale = _norm_and_scale(x, p, axes, c)
    _assert_norm(norm, np.squeeze(want, axes) if axes else want, acc, f"{what} norm")
    assert np.asarray(norm).dtype == acc, (
        f"{what}: norm dtype {np.asarray(norm).dtype}, expected {acc}"
    )
    if out is None:
        return
    keep = np.broadcast_to(scale == 1, np.shape(x))
    if np.abs(ref.f64(x)).max(initial=0) < _range(acc).tiny:
        # Subnormal in float32/float64: flushing may apply anywhere; no growth, nothing non-finite.
        o = ref.f64(out)
        assert np.all(np.isfinite(o)) and np.all(np.abs(o) <= np.abs(ref.f64(x))), (
            f"{what}: {_fmt(o)}"
        )
        return
    _assert_unchanged(out, x, acc, f"{what} (n <= c)", keep)
    if not keep.all():
        _assert_scaled(out, x, scale, f"{what} output")
        _assert_bound(out, c, p, axes, f"{what} output")


def _collect(checks: dict[str, Any]) -> None:
    """Runs every check, then fails with all messages (so one case does not hide the rest)."""
    errors = []
    for label, check in checks.items():
        try:
            check()
        except AssertionError as e:
            errors.append(f"{label}: {e}")
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)


def _sumsq_f64(a: np.ndarray) -> float:
    """sum |a|^2 in float64, in chunks (for the big leaves)."""
    flat = a.reshape(-1)
    return float(
        sum(
            np.square(flat[i : i + (1 << 22)].astype(np.float64)).sum()
            for i in range(0, flat.size, 1 << 22)
        )
    )


def _normals(n: int, seed: int) -> np.ndarray:
    """n standard normal float64 values: a fixed random block of 10007, tiled."""
    block = np.random.default_rng(seed).standard_normal(min(n, 10007))
    return np.resize(block, n)


def _pattern(shape: tuple[int, ...], m: float, dtype: Any, seed: int = 0) -> np.ndarray:
    """float64 values m * u, |u| in [0.5, 1], random signs (complex: random phases among
    pi/4 + k pi/2, so that both parts are within [0.35, 0.71] of |m u|)."""
    rng = np.random.default_rng(seed)
    u = rng.uniform(0.5, 1.0, shape)
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        return m * u * np.exp(1j * np.pi * (0.25 + 0.5 * rng.integers(0, 4, shape)))
    return m * u * rng.choice([-1.0, 1.0], shape)


# ----------------------------------------------------------------------------------------
# The core sweep: one (3, 4) leaf per dtype and magnitude, every mode, jitted once per p.

MODES = {  # name -> axes of its norms
    "global_norm": None,
    "clip_tree_by_global_norm": None,
    "clip_tree_by_norm": None,
    "clip_tree_by_norm(axes=1)": (1,),
}


def _core(p: float, modes: tuple[str, ...] = tuple(MODES)):
    def run(x, c):
        out = {}
        if "global_norm" in modes:
            out["global_norm"] = (None, jaxclip.global_norm([x], p))
        if "clip_tree_by_global_norm" in modes:
            gc_out, gc_norm = jaxclip.clip_tree_by_global_norm({"x": x}, c, norm_type=p)
            out["clip_tree_by_global_norm"] = (gc_out["x"], gc_norm)
        if "clip_tree_by_norm" in modes:
            out["clip_tree_by_norm"] = jaxclip.clip_tree_by_norm(x, c, norm_type=p)
        if "clip_tree_by_norm(axes=1)" in modes:
            out["clip_tree_by_norm(axes=1)"] = jaxclip.clip_tree_by_norm(x, c, norm_type=p, axes=1)
        return out

    return run


@functools.cache
def _core_jit(p: float):
    return jax.jit(_core(p))


# Every dtype at p=2, float32 at every p, and the paths particular to 16-bit leaves at a few.
CORE = (
    [(name, 2.0) for name in DTYPES]
    + [("float32", p) for p in PS if p != 2.0]
    + [("bfloat16", INF), ("float16", 0.5)]
)

DECADES = {
    "float16": [1e-3, 1.0, 1e2, 1e4, 3e4],
    "bfloat16": [1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 5e37, 1e38],
    "float32": [1e-30, 1e-25, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 5e37, 1e38, 2e38],
    "float64": [1e-300, 1e-200, 1e-100, 1e-30, 1.0, 1e30, 1e100, 1e200, 1e300],
    "complex64": [1e-30, 1e-20, 1.0, 1e20, 1e30, 5e37, 1e38],
    "float8_e4m3fn": [0.1, 1.0, 10.0, 100.0],
    "float8_e5m2": [1e-3, 1.0, 100.0, 1e4],
}


def _magnitudes(name: str) -> list[tuple[str, float]]:
    r = _range(DTYPES[name])
    return (
        [("subnormal", r.sub), ("smallest-normal", r.tiny)]
        + [(_label(m), m) for m in DECADES[name]]
        + [("max", r.max)]
    )


BASE = np.array([1.0, -0.75, 0.5, 0.25])
ALT = np.array([-1.0, 1.0, -1.0, 1.0])
CBASE = np.array([1.0, -0.75j, 0.3 + 0.4j, 0.25j])
CALT = np.array([-1.0, 1j, -1j, 1.0])


def _core_values(dtype: Any, m: float) -> np.ndarray:
    """(3, 4) float64 values: a mixed row, a row of +-m (largest element m), a zero row.

    At the smallest-normal magnitude the mixed row is scaled so that all its elements stay
    normal; at the largest finite one the row norms exceed the dtype's range."""
    complex_ = np.issubdtype(np.dtype(dtype), np.complexfloating)
    tiny = _range(dtype).tiny
    s = 4 * tiny if tiny <= m < 4 * tiny else m
    base, alt = (CBASE, CALT) if complex_ else (BASE, ALT)
    return np.stack([s * base, m * alt, np.zeros(4)])


def _run_core(
    fn: Any,
    x: Any,
    p: float,
    calls: tuple[str, ...] = ("clip", "unit", "keep"),
    modes: tuple[str, ...] = tuple(MODES),
) -> None:
    acc = _acc(x.dtype)
    r = _range(acc)
    xv = np.asarray(x)
    with np.errstate(over="ignore"):  # float64 leaves at their largest values
        n = ref.norm([xv], p)
        n0 = ref.norm([xv[0]], p)
    thresholds = {
        "clip": _rounded(min(0.5 * n0, r.max / 4), acc),  # clips the global norm and rows 0-1
        "unit": 1.0,  # at the largest magnitudes c / n is subnormal, the outputs are not
        "keep": _rounded(2 * n, acc) if 2 * n <= r.max else INF,  # clips nothing
    }
    checks = {}
    for call in calls:
        c = thresholds[call]
        res = fn(x, c)
        for mode in modes:
            out, norm = res[mode]
            axes = MODES[mode]
            checks[f"c={c:.3g} {mode}"] = functools.partial(
                _check_mode, out, norm, x, c, p, axes, acc, f"{mode}(c={c:.6g})"
            )
    _collect(checks)


#: The (dtype, p) pairs of the default run (suite budget): p=2 in every dtype, and float32
#: at a fractional, an integer and the infinite norm type. The others run in the slow step.
FAST_CORE = {(name, 2.0) for name in DTYPES} | {("float32", p) for p in (0.5, 3.0, INF)}


def _tier(name: str, p: float) -> list:
    return [] if (name, p) in FAST_CORE else [pytest.mark.slow]


def _core_cases():
    for name, p in CORE:
        marks = _tier(name, p)
        for label, m in _magnitudes(name):
            yield pytest.param(name, p, m, id=f"{name}-p{p:g}-{label}", marks=marks)


@pytest.mark.parametrize("name, p, m", list(_core_cases()))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_modes_match_float64_over_dtypes_and_magnitudes(name, p, m):
    dtype = DTYPES[name]
    with _x64(dtype):
        x = jnp.asarray(_core_values(dtype, m), dtype)
        _run_core(_core_jit(p), x, p)


EAGER = [pytest.param("float32", 2.0, 1e38, id="float32-p2-1e+38")]


@pytest.mark.parametrize("name, p, m", EAGER)
def test_eager_matches_float64(name, p, m):
    """Without jit, thresholds as Python floats (one call, two modes: eager calls are slow)."""
    dtype = DTYPES[name]
    x = jnp.asarray(_core_values(dtype, m), dtype)
    modes = ("clip_tree_by_global_norm", "clip_tree_by_norm(axes=1)")
    _run_core(_core(p, modes), x, p, calls=("unit",), modes=modes)


# ----------------------------------------------------------------------------------------
# NaN and inf at the first, middle and last element, for every norm_type.

POSITIONS = {"first": (0, 0), "middle": (1, 2), "last": (2, 3)}


def _check_nonfinite(res: dict, x: Any, bad: str, pos: tuple[int, int], p: float, c: float) -> None:
    acc = _acc(x.dtype)
    want = math.nan if bad == "nan" else INF
    row = pos[0]

    def assert_poisoned(out: Any, what: str, rows: Any = slice(None)) -> None:
        o = ref.f64(out)[rows]
        if bad == "nan":
            assert np.all(np.isnan(o)), f"{what}: expected all NaN, got {_fmt(o)}"
        else:  # scale c / inf = 0: the inf entry becomes NaN, every other entry 0
            mask = np.zeros(x.shape, bool)
            mask[pos] = True
            mask = mask[rows]
            assert np.all(np.isnan(o[mask])) and np.all(o[~mask] == 0), (
                f"{what}: expected 0 and NaN, got {_fmt(o)}"
            )

    checks = {}
    for mode in ("global_norm", "clip_tree_by_global_norm", "clip_tree_by_norm"):
        out, norm = res[mode]
        checks[mode + " norm"] = functools.partial(_assert_norm, norm, want, acc, f"{mode} norm")
        if out is not None:
            checks[mode + " output"] = functools.partial(assert_poisoned, out, f"{mode} output")
    out, norm = res["clip_tree_by_norm(axes=1)"]
    xv = np.asarray(x)
    xf = ref.f64(xv)
    want_rows = np.squeeze(ref.norm([np.where(np.isfinite(xf), xf, 0)], p, (1,)), 1)
    want_rows[row] = want
    checks["slice norms"] = functools.partial(
        _assert_norm, norm, want_rows, acc, "clip_tree_by_norm(axes=1) norms"
    )
    checks["slice output, bad row"] = functools.partial(assert_poisoned, out, "bad row", row)
    others = [i for i in range(x.shape[0]) if i != row]

    def other_rows() -> None:
        xs = xv[others]
        _check_mode(
            np.asarray(out)[others], np.asarray(norm)[others], xs, c, p, (1,), acc, "finite rows"
        )

    checks["slice output, finite rows"] = other_rows
    _collect(checks)


def _nonfinite_value(bad: str, dtype: Any) -> Any:
    v = math.nan if bad == "nan" else INF
    return complex(v, 0.0) if np.issubdtype(np.dtype(dtype), np.complexfloating) else v


def _nonfinite_input(name: str, bad: str, where: str) -> Any:
    dtype = DTYPES[name]
    xv = _core_values(dtype, 1.0).astype(
        np.complex128 if np.issubdtype(np.dtype(dtype), np.complexfloating) else np.float64
    )
    xv[POSITIONS[where]] = _nonfinite_value(bad, dtype)
    return jnp.asarray(xv, dtype)


def _nonfinite_cases():
    for name, p in CORE:
        for bad in ("nan", "inf"):
            if bad == "inf" and name == "float8_e4m3fn":
                continue  # no inf in this format
            for where in POSITIONS:
                marks = _tier(name, p) if p == 2.0 else [pytest.mark.slow]  # suite budget
                yield pytest.param(
                    name, p, bad, where, id=f"{name}-p{p:g}-{bad}-{where}", marks=marks
                )


@pytest.mark.parametrize("name, p, bad, where", list(_nonfinite_cases()))
def test_nonfinite_propagates_for_every_norm_type(name, p, bad, where):
    with _x64(DTYPES[name]):
        x = _nonfinite_input(name, bad, where)
        _check_nonfinite(_core_jit(p)(x, 1.0), x, bad, POSITIONS[where], p, 1.0)


# ----------------------------------------------------------------------------------------
# Trees mixing dtypes and magnitudes across the whole range.

MIX_DTYPES = {
    "a": jnp.float32,
    "b": jnp.float32,
    "c": jnp.bfloat16,
    "d": jnp.float16,
    "e": jnp.float8_e5m2,
    "z": jnp.complex64,
}
MIX_SHAPES = {"a": (1000,), "b": (1,), "c": (3, 5), "d": (7,), "e": (4,), "z": (3,)}
F32, BF16, F16, E5M2 = (
    _range(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e5m2)
)
MIXES = {  # per-leaf magnitudes (elements within [0.5, 1] of them)
    "span": {
        "a": 2 * F32.tiny,
        "b": F32.max,
        "c": 1e-30,
        "d": F16.max,
        "e": 2 * E5M2.tiny,
        "z": 1e20,
    },
    "squares-overflow": {"a": 1e18, "b": 1e19, "c": 1e19, "d": 1e4, "e": 1.0, "z": 1e18},
    "squares-underflow": {"a": 1e-21, "b": 1e-20, "c": 1e-21, "d": 1e-5, "e": 1e-4, "z": 1e-20},
    "all-max": {
        "a": F32.max,
        "b": F32.max,
        "c": BF16.max,
        "d": F16.max,
        "e": E5M2.max,
        "z": F32.max / 2,
    },
    "all-smallest-normal": {
        "a": 2 * F32.tiny,
        "b": 2 * F32.tiny,
        "c": 2 * BF16.tiny,
        "d": 2 * F16.tiny,
        "e": 2 * E5M2.tiny,
        "z": 4 * F32.tiny,
    },
    "one-leaf-nonzero": {"a": 0.0, "b": 1e-37, "c": 0.0, "d": 0.0, "e": 0.0, "z": 0.0},
}


def _tree_modes(p: float):
    def run(tree, c, c_leaf):
        gc_out, gc_norm = jaxclip.clip_tree_by_global_norm(tree, c, norm_type=p)
        leaf_out, leaf_norms = jaxclip.clip_tree_by_norm(tree, c_leaf, norm_type=p)
        return jaxclip.global_norm(tree, p), gc_out, gc_norm, leaf_out, leaf_norms

    return run


@functools.cache
def _tree_jit(p: float):
    return jax.jit(_tree_modes(p))


def _check_tree(res: Any, tree: dict, p: float, c: float, c_leaf: float, acc: Any) -> None:
    g, gc_out, gc_norm, leaf_out, leaf_norms = res
    leaves = [np.asarray(v) for v in tree.values()]
    want = ref.norm(leaves, p)
    scale = ref.scale(want, c)
    checks = {
        "global_norm": functools.partial(_assert_norm, g, want, acc, "global_norm"),
        "clip_tree_by_global_norm norm": functools.partial(
            _assert_norm, gc_norm, want, acc, "global norm"
        ),
    }

    def global_outputs() -> None:
        for k, x in tree.items():
            o = gc_out[k]
            if scale == 1:
                _assert_unchanged(o, x, acc, f"leaf {k}")
            else:
                _assert_scaled(o, x, scale, f"leaf {k}")
        if scale != 1:
            # Over all leaves, each rounded in its own dtype: the widest eps of the tree bounds it.
            outs = [_magnitude_less_subnormal_step(gc_out[k]) for k in tree]
            eps = max(_range(x.dtype).eps for x in tree.values())
            total = ref.norm(outs, p)
            if not total <= c * (1 + 2 * eps):
                raise AssertionError(
                    f"norm after clipping {total!r} > c * (1 + 2 eps) = {c * (1 + 2 * eps)!r}"
                )

    checks["clip_tree_by_global_norm outputs"] = global_outputs
    for k, x in tree.items():
        checks[f"clip_tree_by_norm leaf {k}"] = functools.partial(
            _check_mode,
            leaf_out[k],
            leaf_norms[k],
            x,
            c_leaf,
            p,
            None,
            _acc(x.dtype),
            f"clip_tree_by_norm[{k}]",
        )
    _collect(checks)


def _mix_tree(mags: dict) -> dict:
    return {
        k: jnp.asarray(_pattern(MIX_SHAPES[k], mags[k], dt, seed=i), dt)
        for i, (k, dt) in enumerate(MIX_DTYPES.items())
    }


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_mixed_trees_spanning_the_range(mix):
    p = 2.0
    tree = _mix_tree(MIXES[mix])
    leaves = [np.asarray(v) for v in tree.values()]
    n = ref.norm(leaves, p)
    c = _rounded(min(0.5 * n, F32.max / 4), np.float32) if n > 0 else 1.0
    # Per leaf: a threshold that clips some leaves and keeps others.
    leaf_norms = sorted(ref.norm([x], p) for x in leaves if ref.norm([x], p) > 0)
    c_leaf = _rounded(min(0.5 * leaf_norms[len(leaf_norms) // 2], F32.max / 4), np.float32)
    res = _tree_jit(p)(tree, c, c_leaf)
    _check_tree(res, tree, p, c, c_leaf, np.float32)


X64_CASES = {  # (float32 leaf, float64 leaf, expected global 2-norm)
    "f32-1e-25+f64-1e-30": ([1e-25, 1e-25], [1e-30], math.sqrt(2) * 1e-25),
    "f32-zeros+f64-1e-300": ([0.0, 0.0], [1e-300], 1e-300),
    "f32-1e38+f64-1e300": ([1e38, -1e38], [1e300], 1e300),
    "f32-max+f64-1": ([F32.max, F32.max], [1.0], math.sqrt(2) * F32.max),
    "f32-smallest-normal+f64-smallest-normal": (
        [F32.tiny, F32.tiny],
        [_range(jnp.float64).tiny],
        math.sqrt(2) * F32.tiny,
    ),
}


@pytest.mark.parametrize("case", list(X64_CASES))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_mixed_float32_float64_tree(case):
    a, b, expected = X64_CASES[case]
    with _x64(jnp.float64):
        tree = {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float64)}
        n = ref.norm([np.asarray(v) for v in tree.values()], 2.0)
        np.testing.assert_allclose(n, expected, rtol=1e-6)  # the reference itself
        c = 0.5 * n
        leaf_c = 0.5 * max(ref.norm([np.asarray(v)], 2.0) for v in tree.values())  # clips one leaf
        res = _tree_jit(2.0)(tree, c, leaf_c)
        _check_tree(res, tree, 2.0, c, leaf_c, np.float64)


# ----------------------------------------------------------------------------------------
# Sizes: 1 element to 1e6 per leaf here, up to 5e7 below.

SIZES = {  # leaf -> (dtype, elements, magnitude)
    "float32-1": ("float32", 1, 1e20),
    "float32-2": ("float32", 2, 1e20),
    "float32-65537": ("float32", 65537, 1e20),
    "float32-1000003": ("float32", 1_000_003, 1e20),
    "bfloat16-1000003": ("bfloat16", 1_000_003, 1e-20),
    "float16-1000003": ("float16", 1_000_003, 1.0),
}


@functools.cache
def _fractional_clip(p: float) -> Any:
    clip = lambda x: jaxclip.clip_tree_by_global_norm(x, 1.0, norm_type=p)[0]  # noqa: E731
    return jax.jit(jax.vmap(clip))


# Two norm types in the default step, the others in the slow step (suite budget).
@pytest.mark.parametrize(
    "p", [*(pytest.param(p, marks=pytest.mark.slow) for p in (0.1, 0.25, 0.9, 2.5, 1.01)), 0.75]
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_fractional_p_bound_at_magnitudes_up_to_1e20(p):
    """Rows of log-normal magnitudes (sigma 4) scaled by 10**[-20, 20]: pow(a, p) =
    exp(p ln a) rounds p ln a, up to |p ln a| / 2 ulps per term, which put the output
    norm 13.6 eps over c at p = 0.9 and 5.5 at p = 1.01. Each row's output norm stays
    within the stated bound, and its norm within 1e-5."""
    rng = np.random.default_rng(int(p * 100))
    for size in (2, 300, 1000):
        rows = rng.lognormal(0, 4, (40, size)) * 10 ** rng.uniform(-20, 20, (40, 1))
        x = rows.astype(np.float32)
        out = np.asarray(_fractional_clip(p)(x))
        for i in range(len(x)):
            _assert_bound(out[i], 1.0, p, None, f"p={p} size {size} row {i}")


@pytest.mark.slow  # 40-digit decimal references: the slow step
def test_float64_fractional_norms_to_a_few_ulps_at_1e300():
    """The root's ``1/p`` as a double is off by half an ulp; its exponent (~900 at a power
    sum of 1e-270) magnified that to 210 ulps at p = 0.9. Reference: 40-digit decimals."""
    import decimal

    ctx = decimal.Context(prec=40)
    rng = np.random.default_rng(5)
    norm = jax.jit(jaxclip.global_norm, static_argnames="norm_type")
    for p in (0.3, 0.9, 1.7):
        for m in (1e-300, 1e-100, 1e100):
            x = rng.lognormal(0, 3, 200) * m
            terms = (ctx.power(decimal.Decimal(float(v)), decimal.Decimal(p)) for v in x)
            want = ctx.power(sum(terms, decimal.Decimal(0)), 1 / decimal.Decimal(p))
            with _x64(np.float64):
                got = float(norm(jnp.asarray(x), norm_type=p))
            err = abs(decimal.Decimal(got) / want - 1) / decimal.Decimal(np.finfo(float).eps)
            assert err < 8, f"p={p} at {m:g}: {float(err):.1f} ulps"


def test_common_path_fractional_powers_do_not_call_pow():
    """Before a library reduction XLA:CPU's pow is 2x slower than the exponent-split
    power, and less exact (the rare path, on data scaled near 1, keeps pow)."""
    from jaxclip._norms import passes

    for dtype in (jnp.float32, jnp.float64):
        with _x64(dtype):
            common = lambda x: passes.power_sum(x, 1.5, None, fused=False)  # noqa: E731
            text = jax.jit(common).lower(jnp.ones(8, dtype)).as_text()
            assert "stablehlo.power" not in text, text
            assert "stablehlo.exponential" in text  # the split power's exp2


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_leaf_sizes_1_to_1e6():
    """One tree of float32 leaves (1e20: squares overflow) of 1 to 1e6 elements, and 1e6-element
    bfloat16 (1e-20: squares underflow) and float16 leaves: the per-leaf norms test each size
    and dtype, the global norm the whole tree."""
    tree = {
        k: jnp.asarray(_normals(n, seed=n) * m, DTYPES[name]) for k, (name, n, m) in SIZES.items()
    }
    leaves = [np.asarray(v) for v in tree.values()]
    c = _rounded(0.5 * ref.norm(leaves, 2.0), np.float32)
    # Per leaf: one threshold, which clips the float32 leaves and keeps the others.
    c_leaf = _rounded(1e15, np.float32)
    _check_tree(_tree_jit(2.0)(tree, c, c_leaf), tree, 2.0, c, c_leaf, np.float32)


class _Big:
    """The large arrays, built on first use and dropped with the module's fixture."""

    @functools.cached_property
    def ones_f16(self) -> jax.Array:
        return jnp.ones(30_000_000, jnp.float16)

    @functools.cached_property
    def huge_f32(self) -> jax.Array:
        return jnp.full(30_000_000, 1e20, jnp.float32)

    @functools.cached_property
    def random_f16(self) -> tuple[np.ndarray, jax.Array]:
        host = np.resize(_normals(10007, seed=7).astype(np.float16), 50_000_000)
        return host, jnp.asarray(host)

    @functools.cached_property
    def many_bf16(self) -> list[jax.Array]:
        leaf = jnp.ones(30_000, jnp.bfloat16)
        return [leaf + 0 for _ in range(1000)]  # distinct buffers


@pytest.fixture(scope="module")
def big() -> _Big:
    return _Big()


@functools.cache
def _big_leaf_fn():
    def run(x, c):
        out, n = jaxclip.clip_tree_by_global_norm([x], c)
        leaf_out, leaf_n = jaxclip.clip_tree_by_norm(x, c)
        return jaxclip.global_norm([x]), n, out[0], leaf_n, jnp.min(leaf_out), jnp.max(leaf_out)

    return jax.jit(run)


@pytest.mark.parametrize(
    "which, value",
    [("ones_f16", 1.0), ("huge_f32", 1e20)],
    ids=["float16-ones-3e7", "float32-1e20-3e7"],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_one_leaf_of_3e7_elements(big, which, value):
    x = getattr(big, which)
    value = float(np.asarray(value, x.dtype))  # as stored
    want = math.sqrt(x.size) * value  # 5477.2256 * value
    c = 1.0
    g, n, out, leaf_n, leaf_min, leaf_max = _big_leaf_fn()(x, c)
    o = np.asarray(out)
    e = np.asarray(value, np.float64) * c / want
    eps = _range(x.dtype).eps

    def outputs() -> None:
        assert out.dtype == x.dtype
        lo, hi = float(o.min()), float(o.max())
        if not max(abs(lo - e), abs(hi - e)) <= (eps + OUT_RTOL) * e:
            raise AssertionError(f"outputs in [{lo!r}, {hi!r}], float64 {e!r}")
        total = math.sqrt(_sumsq_f64(o))
        # The scaled path (1e20: the squares overflow) sums 3e7 terms in sequential chunks
        # of 256: its norm's own error (~1e-6 on constant data) adds to the roundings.
        bound = c * (1 + 2 * eps + (2e-6 if value > 1e19 else 0.0))
        if not total <= bound:
            raise AssertionError(f"norm after clipping {total!r} > {bound!r}")

    def leaf_outputs() -> None:
        lo, hi = float(leaf_min), float(leaf_max)
        if not max(abs(lo - e), abs(hi - e)) <= (eps + OUT_RTOL) * e:
            raise AssertionError(f"outputs in [{lo!r}, {hi!r}], float64 {e!r}")

    _collect(
        {
            "global_norm": functools.partial(_assert_norm, g, want, np.float32, "global_norm"),
            "clip_tree_by_global_norm norm": functools.partial(
                _assert_norm, n, want, np.float32, "norm"
            ),
            "clip_tree_by_norm norm": functools.partial(
                _assert_norm, leaf_n, want, np.float32, "leaf norm"
            ),
            "clip_tree_by_global_norm output": outputs,
            "clip_tree_by_norm output": leaf_outputs,
        }
    )


@functools.cache
def _big_random_fn():
    def run(x):
        halves = x.reshape(2, -1)
        return jaxclip.global_norm({"x": x}), jaxclip.clip_tree_by_norm(halves, 1.0, axes=1)[1]

    return jax.jit(run)


def test_random_float16_leaf_of_5e7_elements(big):
    host, x = big.random_f16
    want = math.sqrt(_sumsq_f64(host))
    halves = host.reshape(2, -1)
    want_halves = np.array([math.sqrt(_sumsq_f64(h)) for h in halves])
    g, n_halves = _big_random_fn()(x)
    _collect(
        {
            "global_norm": functools.partial(_assert_norm, g, want, np.float32, "global_norm"),
            "clip_tree_by_norm(axes=1) of (2, 2.5e7)": functools.partial(
                _assert_norm, n_halves, want_halves, np.float32, "slice norms"
            ),
        }
    )


@functools.cache
def _many_leaves_fn():
    return jax.jit(lambda leaves: jaxclip.global_norm(leaves))


def test_1000_bfloat16_leaves_adding_up_to_3e7(big):
    n = _many_leaves_fn()(big.many_bf16)
    _assert_norm(n, math.sqrt(30_000_000), np.float32, "global_norm of 1000 x 30000 ones")


# ----------------------------------------------------------------------------------------
# Derivatives of the norm and of the clipped outputs against the float64 formulas.

DERIV_PS = (0.5, 2.0, INF)  # the pow, sqrt and max paths
DERIV_SCALES = (1e-37, 1e-25, 1e-22, 1e-3, 1.0, 1e25, 1e37)
XD = np.array([1.0, -2.0, 3.0, -4.0])  # unique largest magnitude, no zero
XS = np.array([[1.0, -2.0, 3.0, -4.0], [0.5, 0.25, -1.0, 2.0]])
WD = np.array([1.0, 2.0, -1.0, 0.5])
TD = np.array([0.1, 0.2, -0.3, 0.4])
WS = np.array([[1.0, -1.0, 0.5, 2.0], [0.3, 1.0, -2.0, 1.0]])


@functools.cache
def _derivatives(p: float):
    def norm(v):
        return jaxclip.global_norm({"v": v}, p)

    def clipped(v, c):
        return jaxclip.clip_tree_by_global_norm({"v": v}, c, norm_type=p)[0]["v"]

    def sliced(v, c):
        return jaxclip.clip_tree_by_norm(v, c, norm_type=p, axes=1)[0]

    def run(x, t, w, c, xs, ws, cs):
        return {
            "grad global_norm": jax.grad(norm)(x),
            "jvp global_norm": jax.jvp(norm, (x,), (t,))[1],
            "grad clip_tree_by_global_norm": jax.grad(lambda v: jnp.vdot(w, clipped(v, c)))(x),
            "grad clip_tree_by_norm(axes=1)": jax.grad(lambda v: jnp.vdot(ws, sliced(v, cs)))(xs),
        }

    return jax.jit(run)


def _dnorm(x: np.ndarray, p: float) -> tuple[np.ndarray, float]:
    """The gradient of the p-norm (float64) and the norm."""
    n = ref.norm([x], p)
    if p == INF:
        g = np.zeros_like(x)
        k = int(np.argmax(np.abs(x)))
        g[k] = np.sign(x[k])
        return g, n
    return np.sign(x) * (np.abs(x) / n) ** (p - 1), n


def _dclip(x: np.ndarray, w: np.ndarray, c: float, p: float) -> np.ndarray:
    """The gradient of w . (x * min(1, c / n)) (float64)."""
    if not np.any(x):
        return w
    g, n = _dnorm(x, p)
    if n <= c:
        return w
    return (c / n) * w - np.dot(w, x) * (c / n**2) * g


def _assert_close(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(
        got, want, rtol=RTOL, atol=RTOL * np.abs(want).max(initial=0), err_msg=what
    )


def _deriv_cases():
    for p in DERIV_PS:
        for s in DERIV_SCALES:
            n = ref.norm([XD * s], p)
            if F32.tiny * 16 < n < F32.max / 4:  # the norm (and 2 n) a normal float32
                marks = [] if s in (1e-37, 1.0, 1e37) else [pytest.mark.slow]  # suite budget
                yield pytest.param(p, s, id=f"p{p:g}-{s:g}", marks=marks)
        yield pytest.param(p, 0.0, id=f"p{p:g}-zeros")


@pytest.mark.parametrize("p, s", list(_deriv_cases()))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_derivatives_match_float64(p, s):
    x, xs = XD * s, XS * s
    x32, xs32 = (ref.f64(np.asarray(v, np.float32)) for v in (x, xs))
    n = ref.norm([x32], p)
    ns = np.squeeze(ref.norm([xs32], p, (1,)), 1)
    thresholds = {  # (global c, per-slice c); at s = 0 nothing is clipped
        "clipped": (0.5 * n, 0.5 * (ns[0] + ns[1])),  # per slice: clips row 0, keeps row 1
        "kept": (max(1.0, 2 * n), max(1.0, 2 * ns.max())),
    }
    checks = {}
    for kind, (c, cs) in thresholds.items():
        c, cs = (_rounded(v, np.float32) if s else 1.0 for v in (c, cs))
        args = (
            *(jnp.asarray(v, jnp.float32) for v in (x, TD, WD)),
            c,
            jnp.asarray(xs, jnp.float32),
        )
        res = {
            k: np.asarray(v)
            for k, v in _derivatives(p)(*args, jnp.asarray(WS, jnp.float32), cs).items()
        }
        if s:  # the norm is not differentiable at 0
            g, _ = _dnorm(x32, p)
            checks[f"{kind} grad global_norm"] = functools.partial(
                _assert_close, res["grad global_norm"], g, "grad"
            )
            checks[f"{kind} jvp global_norm"] = functools.partial(
                _assert_close, res["jvp global_norm"], np.dot(g, TD), "jvp"
            )
        checks[f"{kind} grad clip_tree_by_global_norm"] = functools.partial(
            _assert_close, res["grad clip_tree_by_global_norm"], _dclip(x32, WD, c, p), f"c={c!r}"
        )
        want_rows = np.stack([_dclip(xs32[i], WS[i], cs, p) for i in range(2)])
        checks[f"{kind} grad clip_tree_by_norm(axes=1)"] = functools.partial(
            _assert_close, res["grad clip_tree_by_norm(axes=1)"], want_rows, f"c={cs!r}"
        )
    _collect(checks)


# ----------------------------------------------------------------------------------------
# vmap: a batch of examples at magnitudes across the float32 range, thresholds batched too.

VMAP_ROWS = {  # label -> (magnitude of a (float32), magnitude of b (bfloat16))
    "1": (1.0, 1.0),
    "1e-30": (1e-30, 1e-30),
    "1e20|1e-20": (1e20, 1e-20),
    "1e37": (1e37, 1e37),
    "smallest-normal": (2 * F32.tiny, 2 * BF16.tiny),
    "max": (F32.max, 1.0),
    "zeros": (0.0, 0.0),
    "nan": (1.0, 1.0),
    "inf": (1.0, 1.0),
}


@functools.cache
def _vmapped(p: float):
    def one(a, b, c):
        out, n = jaxclip.clip_tree_by_global_norm({"a": a, "b": b}, c, norm_type=p)
        slice_out, slice_n = jaxclip.clip_tree_by_norm(a, c, norm_type=p, axes=1)
        return jaxclip.global_norm([a, b], p), n, out, slice_out, slice_n

    return jax.jit(jax.vmap(one))


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_vmap_over_batched_leaves():
    p = 2.0
    a = np.stack(
        [_pattern((2, 3), m, np.float32, seed=i) for i, (m, _) in enumerate(VMAP_ROWS.values())]
    )
    b = np.stack(
        [_pattern((4,), m, np.float32, seed=50 + i) for i, (_, m) in enumerate(VMAP_ROWS.values())]
    )
    labels = list(VMAP_ROWS)
    a[labels.index("nan"), 1, 2] = math.nan
    b[labels.index("inf"), 3] = INF
    a32, b16 = np.asarray(a, np.float32), np.asarray(jnp.asarray(b, jnp.bfloat16))
    cs = []
    for i in range(len(labels)):
        with np.errstate(invalid="ignore"):  # the rows holding NaN and inf
            n = ref.norm([a32[i], b16[i]], p)
        cs.append(_rounded(min(0.5 * n, F32.max / 4), np.float32) if 0 < n < INF else 1.0)
    g, n, out, slice_out, slice_n = _vmapped(p)(
        jnp.asarray(a32), jnp.asarray(b16), jnp.asarray(cs, jnp.float32)
    )
    checks = {}
    for i, label in enumerate(labels):
        if label in ("nan", "inf"):
            want = math.nan if label == "nan" else INF
            checks[label] = functools.partial(
                _assert_norm, np.asarray(n)[i], want, np.float32, "global norm"
            )
            checks[label + " global_norm"] = functools.partial(
                _assert_norm, np.asarray(g)[i], want, np.float32, "global_norm"
            )
            continue
        want = ref.norm([a32[i], b16[i]], p)
        checks[label + " global_norm"] = functools.partial(
            _assert_norm, np.asarray(g)[i], want, np.float32, "global_norm"
        )
        sub = {"a": jnp.asarray(a32[i]), "b": jnp.asarray(b16[i])}
        res = (
            np.asarray(g)[i],
            {k: np.asarray(out[k])[i] for k in sub},
            np.asarray(n)[i],
            {k: None for k in sub},
            None,
        )
        checks[label + " clip_tree_by_global_norm"] = functools.partial(
            _check_global_only, res, sub, p, cs[i]
        )
        checks[label + " clip_tree_by_norm(axes=1)"] = functools.partial(
            _check_mode,
            np.asarray(slice_out)[i],
            np.asarray(slice_n)[i],
            a32[i],
            cs[i],
            p,
            (1,),
            np.float32,
            "slices",
        )
    _collect(checks)


def _check_global_only(res: Any, tree: dict, p: float, c: float) -> None:
    """The global-norm part of _check_tree (its per-leaf part skipped)."""
    _, gc_out, gc_norm, _, _ = res
    leaves = [np.asarray(v) for v in tree.values()]
    want = ref.norm(leaves, p)
    _assert_norm(gc_norm, want, np.float32, "global norm")
    scale = ref.scale(want, c)
    for k, x in tree.items():
        if scale == 1:
            _assert_unchanged(gc_out[k], np.asarray(x), np.float32, f"leaf {k}")
        else:
            _assert_scaled(gc_out[k], np.asarray(x), scale, f"leaf {k}")


# ----------------------------------------------------------------------------------------
# The norms the adaptive modes keep, over lax.scan; adaptive_clip against the AGC formula.

STEP_DTYPES = {
    "w": jnp.float32,
    "b": jnp.bfloat16,
    "h": jnp.float16,
    "z": jnp.complex64,
    "q": jnp.float8_e4m3fn,
}
STEP_SHAPES = {"w": (2, 3), "b": (4,), "h": (3,), "z": (2,), "q": (3,)}
E4M3 = _range(jnp.float8_e4m3fn)
STEPS = {  # label -> per-leaf magnitudes
    "1": {"w": 1.0, "b": 1.0, "h": 1.0, "z": 1.0, "q": 1.0},
    "small": {"w": 1e-30, "b": 1e-30, "h": 1e-3, "z": 1e-30, "q": 0.05},
    "smallest-normal": {
        "w": 2 * F32.tiny,
        "b": 2 * BF16.tiny,
        "h": 2 * F16.tiny,
        "z": 4 * F32.tiny,
        "q": 2 * E4M3.tiny,
    },
    "1e20": {"w": 1e20, "b": 1e20, "h": 1e4, "z": 1e20, "q": 100.0},
    "1e38": {"w": 1e38, "b": 1.0, "h": 1.0, "z": 1.0, "q": 1.0},
    "max": {"w": F32.max, "b": BF16.max, "h": F16.max, "z": F32.max / 2, "q": E4M3.max},
    "nan": {"w": 1.0, "b": 1.0, "h": 1.0, "z": 1.0, "q": 1.0},
    "1-again": {"w": 1.0, "b": 1.0, "h": 1.0, "z": 1.0, "q": 1.0},
}
NORM_STATES = ("clip_by_global_norm", "zclip", "auto_clip", "skip_large_updates")


def _step_trees() -> list[dict]:
    trees = []
    for i, (label, mags) in enumerate(STEPS.items()):
        tree = {
            k: _pattern(STEP_SHAPES[k], mags[k], dt, seed=10 * i + j)
            for j, (k, dt) in enumerate(STEP_DTYPES.items())
        }
        if label == "nan":
            tree["w"][0, 1] = math.nan
        trees.append({k: jnp.asarray(v, STEP_DTYPES[k]) for k, v in tree.items()})
    return trees


@functools.cache
def _adaptive():
    txs = {
        "clip_by_global_norm": jaxclip.clip_by_global_norm(1.0),
        "clip_by_norm": jaxclip.clip_by_norm(1.0),
        "zclip": jaxclip.zclip(warmup_steps=3),
        "auto_clip": jaxclip.auto_clip(),
        "skip_large_updates": jaxclip.skip_large_updates(optax.sgd(1.0), 1.0),
    }

    def init(tree):
        return {k: tx.init(tree) for k, tx in txs.items()}

    def step(states, g):
        new, outs = {}, {}
        for k, tx in txs.items():
            outs[k], new[k] = tx.update(g, states[k])
        norms = {k: optax.tree.get(new[k], "global_norm") for k in NORM_STATES}
        record = (
            norms,
            new["clip_by_norm"].norms,
            outs["clip_by_global_norm"],
            outs["skip_large_updates"],
        )
        return new, (record, new["skip_large_updates"].skipped)

    def scan(states, stacked):
        return jax.lax.scan(step, states, stacked)[1]

    return jax.jit(init), jax.jit(scan)


@pytest.mark.slow  # suite margin: runs in the slow step (CI runs both)
def test_adaptive_mode_norms_over_lax_scan():
    """Five transforms updated side by side inside one lax.scan over steps whose magnitudes
    span the range (step 0 is the first update from init)."""
    init, scan = _adaptive()
    trees = _step_trees()
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    records, skipped = scan(init(trees[0]), stacked)
    per_step = [jax.tree.map(lambda v, i=i: v[i], (records, skipped)) for i in range(len(trees))]
    checks = {}
    expected_skipped = 0
    for label, tree, ((norms, leaf_norms, clipped, applied), skipped) in zip(
        STEPS, trees, per_step
    ):
        leaves = [np.asarray(v) for v in tree.values()]
        want = ref.norm(leaves, 2.0) if label != "nan" else math.nan
        for mode in NORM_STATES:
            checks[f"{label} {mode}"] = functools.partial(
                _assert_norm, norms[mode], want, np.float32, f"{mode} state global_norm"
            )
        for k, x in tree.items():
            w = ref.norm([np.asarray(x)], 2.0) if not (label == "nan" and k == "w") else math.nan
            checks[f"{label} clip_by_norm[{k}]"] = functools.partial(
                _assert_norm, leaf_norms[k], w, np.float32, "ClipByNormState.norms"
            )
        if label != "nan":
            res = (None, clipped, norms["clip_by_global_norm"], None, None)
            checks[f"{label} clip_by_global_norm output"] = functools.partial(
                _check_global_only, res, tree, 2.0, 1.0
            )
        skip = not (want <= 1.0)
        expected_skipped += skip

        def skip_check(
            applied=applied, tree=tree, skip=skip, skipped=skipped, count=expected_skipped
        ) -> None:
            for k, x in tree.items():
                o = ref.f64(applied[k])
                want_o = np.zeros_like(o) if skip else -ref.f64(x)
                if not np.array_equal(o, want_o, equal_nan=True):
                    raise AssertionError(f"{k}: applied {_fmt(o)}, expected {_fmt(want_o)}")
            if int(skipped) != count:
                raise AssertionError(f"skipped {int(skipped)} steps in all, expected {count}")

        checks[f"{label} skip_large_updates {'skips' if skip else 'applies'}"] = skip_check
    _collect(checks)


AGC_DTYPES = {
    "kernel": jnp.float32,
    "conv": jnp.bfloat16,
    "bias": jnp.float16,
    "scale": jnp.float32,
}
AGC_SHAPES = {"kernel": (3, 4), "conv": (2, 2, 1, 3), "bias": (4,), "scale": ()}
AGC_CLIPPING, AGC_EPS = 0.01, 1e-30
AGC_CASES = {  # label -> (gradient magnitude, parameter magnitude), float16 leaves (g16, p16)
    "1|1": (1.0, 1.0, 1.0, 1.0),
    "1e20|1": (1e20, 1.0, 1e4, 1.0),
    "1e-25|1e-20": (1e-25, 1e-20, 1e-4, 1e-2),
    "1e-20|1e-25": (1e-20, 1e-25, 1e-2, 1e-4),
    "1e37|1e30": (1e37, 1e30, 3e4, 1e2),
    "1e38|1": (1e38, 1.0, 6e4, 1.0),
    "1|zeros": (1.0, 0.0, 1.0, 0.0),
    "smallest-normal|1e-36": (2 * F32.tiny, 1e-36, 2 * F16.tiny, 1e-3),
}


def _agc_units(ndim: int) -> tuple[int, ...] | None:
    return None if ndim <= 1 else tuple(range(ndim - 1))


@functools.cache
def _agc():
    tx = jaxclip.adaptive_clip(AGC_CLIPPING, eps=AGC_EPS)
    return jax.jit(lambda g, params: tx.update(g, tx.init(params), params)[0])


@pytest.mark.parametrize("case", list(AGC_CASES))
def test_adaptive_clip_matches_float64_agc(case):
    gm, pm, gm16, pm16 = AGC_CASES[case]
    g, params = {}, {}
    for i, (k, dt) in enumerate(AGC_DTYPES.items()):
        g16 = dt == jnp.float16
        g[k] = jnp.asarray(_pattern(AGC_SHAPES[k], gm16 if g16 else gm, dt, seed=i), dt)
        params[k] = jnp.asarray(_pattern(AGC_SHAPES[k], pm16 if g16 else pm, dt, seed=20 + i), dt)
    out = _agc()(g, params)
    checks = {}
    for k in AGC_DTYPES:
        x, w = np.asarray(g[k]), np.asarray(params[k])
        axes = _agc_units(x.ndim)
        gn = np.asarray(ref.norm([x], 2.0, axes) if axes else ref.norm([x], 2.0))
        pn = np.asarray(ref.norm([w], 2.0, axes) if axes else ref.norm([w], 2.0))
        limit = AGC_CLIPPING * np.maximum(pn, AGC_EPS)
        scale = np.where(gn > limit, limit / np.where(gn > limit, gn, 1.0), 1.0)

        def check(k=k, x=x, scale=scale, limit=limit, axes=axes) -> None:
            o = out[k]
            keep = np.broadcast_to(scale == 1, x.shape)
            _assert_unchanged(o, x, np.float32, f"{k} (unit norm <= limit)", keep)
            if not keep.all():
                _assert_scaled(o, x, scale, f"{k} output")
                a = _magnitude_less_subnormal_step(o)
                r = _range(x.dtype)
                n_out = np.asarray(ref.norm([a], 2.0, axes) if axes else ref.norm([a], 2.0))
                # The limit comes from a parameter norm, itself within RTOL of float64.
                if not np.all(n_out <= limit * (1 + RTOL + r.eps)):
                    raise AssertionError(
                        f"{k}: unit norms after clipping {_fmt(n_out)} > limits {_fmt(limit)}"
                    )

        checks[k] = check
    _collect(checks)


# ----------------------------------------------------------------------------------------
# An 8-device mesh: a sharded leaf and a replicated one.

MESH_CASES = {  # label -> (magnitude of the sharded leaf, of the replicated one)
    "1": (1.0, 1.0),
    "1e-30": (1e-30, 1e-30),
    "1e20|1e-20": (1e20, 1e-20),
    "1e37|1": (1e37, 1.0),
    "max|smallest-normal": (F32.max, 2 * F32.tiny),
    "nan": (1.0, 1.0),
}


@functools.cache
def _mesh_fn(p: float):
    def run(tree, c):
        out, n = jaxclip.clip_tree_by_global_norm(tree, c, norm_type=p)
        leaf_out, leaf_n = jaxclip.clip_tree_by_norm(tree, c, norm_type=p, axes=0)
        return jaxclip.global_norm(tree, p), out, n, leaf_out, leaf_n

    return jax.jit(run)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices, see conftest.py")
@pytest.mark.parametrize("p", [2.0, INF], ids=lambda p: f"p{p:g}")
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_sharded_over_8_devices(p):
    mesh = jax.make_mesh((8,), ("d",))
    checks = {}
    with jax.set_mesh(mesh):
        for i, (label, (mw, mb)) in enumerate(MESH_CASES.items()):
            host = {
                "w": _pattern((64, 3), mw, np.float32, seed=i).astype(np.float32),
                "b": _pattern((5,), mb, np.float32, seed=30 + i).astype(np.float32),
            }
            if label == "nan":
                host["w"][37, 1] = math.nan
            tree = {
                "w": jax.device_put(host["w"], NamedSharding(mesh, P("d"))),
                "b": jax.device_put(host["b"], NamedSharding(mesh, P())),
            }
            n_ref = ref.norm(list(host.values()), p)
            c = _rounded(min(0.5 * n_ref, F32.max / 4), np.float32) if np.isfinite(n_ref) else 1.0
            g, out, n, leaf_out, leaf_n = _mesh_fn(p)(tree, c)
            if label == "nan":
                checks[label] = functools.partial(
                    _assert_norm, n, math.nan, np.float32, "global norm"
                )
                checks[label + " global_norm"] = functools.partial(
                    _assert_norm, g, math.nan, np.float32, "global_norm"
                )
                cols = np.squeeze(ref.norm([np.nan_to_num(host["w"], nan=0.0)], p, (0,)), 0)
                cols[1] = math.nan  # the NaN's column only
                checks[label + " w slices"] = functools.partial(
                    _assert_norm, leaf_n["w"], cols, np.float32, "columns of w"
                )
                continue
            checks[label + " global_norm"] = functools.partial(
                _assert_norm, g, n_ref, np.float32, "global_norm"
            )
            res = (g, out, n, None, None)
            checks[label + " clip_tree_by_global_norm"] = functools.partial(
                _check_global_only, res, host, p, c
            )
            for k, x in host.items():
                checks[f"{label} clip_tree_by_norm(axes=0)[{k}]"] = functools.partial(
                    _check_mode, leaf_out[k], leaf_n[k], x, c, p, (0,), np.float32, f"slices of {k}"
                )

            def shardings(out=out, leaf_out=leaf_out, tree=tree) -> None:
                for o in (out["w"], leaf_out["w"]):
                    if not o.sharding.is_equivalent_to(tree["w"].sharding, 2):
                        raise AssertionError(
                            f"output sharding {o.sharding}, input {tree['w'].sharding}"
                        )

            checks[label + " output sharding"] = shardings
    _collect(checks)
