"""Hyperparameter checks: every transformation validates its arguments here.

Each check takes the value as the user passed it (a Python number, a NumPy or JAX array,
or a traced array under ``jit``/``optax.inject_hyperparams``) and raises an error that
names the function, the parameter, why the value is wrong and what to pass instead.

- The *type* (a real number, not a string, ``None``, bool or complex) and the *shape* are
  static, so they are checked for traced values too. A wrong type is a
  :class:`HyperparameterTypeError`, which is both a ``TypeError`` and a ``ValueError``
  (as NumPy's ``AxisError`` is both an ``IndexError`` and a ``ValueError``).
- The *value* (``> 0``, in a range) is checked only where it is concrete; traced
  values are the caller's business (see each mode's docstring for what it does with them).

The names are package-internal: public within jaxclip, not part of its API.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxclip import _tree
from jaxclip._errors import HyperparameterTypeError
from jaxclip._norms.arith import result_dtype

Array = jax.Array
Axes = None | int | Sequence[int]


_TRACED = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError)


def concrete(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array, or None when it is traced (its value is not known yet).

    Uses JAX's public errors for traced values rather than a check on the tracer type.
    """
    try:
        return np.asarray(value)
    except _TRACED:
        return None


class StaticDefault:
    """A default hyperparameter that ``optax.inject_hyperparams`` leaves static.

    ``inject_hyperparams`` turns every numeric argument, defaults included, into an
    array; shapes and code paths (``norm_type``, buffer sizes) must stay Python numbers.
    This stands for its value (``float``, ``int``, ``repr``) without being a number.
    """

    def __init__(self, value: int | float) -> None:
        self.value = value

    def __float__(self) -> float:
        return float(self.value)

    def __index__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


#: Default ``norm_type`` of every norm-based mode (the Euclidean norm).
L2 = StaticDefault(2.0)
#: A ``norm_type`` argument: a number, or a static default.
NormType = float | StaticDefault
#: A buffer-size argument (``window``, ``warmup_steps``): an int, or a static default.
StaticInt = int | StaticDefault


def static_hint(name: str, fn: str | None = None) -> str:
    """What to do when ``optax.inject_hyperparams`` has made a static argument an array."""
    where = f"jaxclip.{fn}" if fn else "the jaxclip transform"
    return (
        "optax.inject_hyperparams turns every numeric argument into a JAX array (traced under "
        f"jit); keep {name} a Python value with static_args: "
        f"optax.inject_hyperparams({where}, static_args=({name!r},))(...)"
    )


def _is_traced(value: Any) -> bool:
    """A traced JAX array (e.g. a hyperparameter that ``inject_hyperparams`` put in the
    state), where a static Python value is needed."""
    return isinstance(value, jax.Array) and concrete(value) is None


#: The smallest ``norm_type`` accepted (see :func:`check_norm_type`).
MIN_NORM_TYPE = 2.0**-10


def check_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float, or a ValueError saying what is accepted."""
    if concrete(norm_type) is None:
        raise ValueError(
            f"jaxclip: norm_type={_show(norm_type)} is traced; it must be a static Python "
            "number (it decides the computation), e.g. 2.0 or float('inf'). "
            f"{static_hint('norm_type')}."
        )
    if isinstance(norm_type, (bool, np.bool_)):
        raise ValueError(
            f"jaxclip: norm_type={norm_type!r} is a bool, not a norm; use a float p > 0 "
            "(2.0 for the Euclidean norm) or float('inf')."
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
    if p < MIN_NORM_TYPE:
        raise ValueError(
            f"jaxclip: norm_type={norm_type!r} is below 2**-10, the smallest p supported: "
            "a p-norm's rounding error grows as 1/p (1e-3 relative at 2**-10), and two "
            "nonzero elements of one magnitude already have a norm 2**(1/p) times it, "
            "past any float's range. Use p >= 2**-10 (or 1.0 for the sum of magnitudes)."
        )
    return p


def _show(value: Any) -> str:
    """A value for an error message: its repr, or its shape and dtype for a large array."""
    size = np.size(value) if not isinstance(value, (str, bytes)) else 1
    if size <= 8:
        return repr(value)
    return f"<an array of shape {np.shape(value)}>"


def real(value: Any, name: str, fn: str, what: str, *, scalar: bool = True) -> np.ndarray | None:
    """Checks that ``value`` is a real number (or, with ``scalar=False``, a real array);
    returns its concrete value, or None when traced. ``what`` says what to pass."""
    hint = f"pass {what}"
    if value is None or isinstance(value, (str, bytes, bool, np.bool_)):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: {name}={_show(value)} is a {type(value).__name__}, not a number; "
            f"{hint}."
        )
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: {name}={_show(value)} is an integer beyond int64's range, which "
            f"JAX cannot hold; pass it as a float, {name}=float({_show(value)})."
        )
    v = concrete(value)
    if v is None:  # traced: its dtype and shape are still known
        try:
            aval = jnp.asarray(value)
        except TypeError as e:
            raise HyperparameterTypeError(f"jaxclip.{fn}: {name} is not a number; {hint}.") from e
        dtype, shape = np.dtype(aval.dtype), aval.shape
    else:
        dtype, shape = v.dtype, v.shape
    if jnp.issubdtype(dtype, jnp.bool_):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: {name}={_show(value)} is boolean, not a number; {hint}."
        )
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: {name}={_show(value)} is complex; {hint} (a real number: take abs() or "
            ".real of it)."
        )
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: {name}={_show(value)} (dtype {dtype}) is not a number JAX can "
            f"hold; {hint} (float() converts it)."
        )
    if scalar and shape != ():
        raise ValueError(
            f"jaxclip.{fn}: {name} must be a scalar; got an array of shape {shape}. "
            f"{hint.capitalize()}."
        )
    return v


def check_clip_norm(clip_norm: Any, fn: str, name: str = "clip_norm", zero: bool = False) -> None:
    """A norm threshold: a real scalar > 0 (inf turns clipping off); ``zero`` allows 0 (an
    adaptive clip norm's start, which its updates move)."""
    bound = ">= 0" if zero else "> 0"
    what = f"a real number {bound}, e.g. 1.0 (a Python number or a JAX scalar array)"
    v = real(clip_norm, name, fn, what)
    if v is not None and not (v >= 0 if zero else v > 0):  # also catches NaN
        raise ValueError(
            f"jaxclip.{fn}: {name}={clip_norm!r} must be {bound} (the largest norm the "
            "updates may have after clipping); to turn clipping off, use float('inf')."
        )


def check_norm_range(
    value: Any,
    name: str,
    dtype: Any,
    fn: str,
    effect: str = "norms above it would not be clipped",
    off: str = ", or float('inf') to turn clipping off",
) -> None:
    """A concrete threshold on norms of ``dtype`` (float32, or float64 for 64-bit leaves):
    a finite one beyond that dtype's range would be cast to inf there, which silently
    turns clipping (or skipping) off for norms above the threshold. Checked where the
    leaves, hence the norms' dtype, are known (at trace time); traced values are not."""
    v = concrete(value)
    if v is None:
        return
    top = float(np.finfo(dtype).max)
    mag = np.abs(np.asarray(v, np.float64))
    if np.any(np.isfinite(mag) & (mag > top)):
        raise ValueError(
            f"jaxclip.{fn}: {name}={value!r} is beyond the range of {np.dtype(dtype).name} "
            f"(largest {top:.8g}), the dtype the norms of these leaves are computed and "
            f"compared in: there it would be inf, and {effect}. Pass at most {top:.8g}{off}."
        )


def check_joint_norm_range(
    value: Any, name: str, leaves: Sequence[Any], fn: str, **message: str
) -> None:
    """:func:`check_norm_range` in the dtype of one norm over ``leaves`` (a global norm,
    a group's, an example's); no leaves, no norm to compare."""
    if leaves:
        check_norm_range(value, name, result_dtype(leaves), fn, **message)


def check_use_norm(use_norm: Any, fn: str) -> None:
    """A global norm computed already: a real scalar >= 0 (NaN passes: it propagates as a
    NaN norm)."""
    v = real(use_norm, "use_norm", fn, "a norm >= 0")
    if v is not None and np.any(v < 0):
        raise ValueError(
            f"jaxclip.{fn}: use_norm={use_norm!r} is negative; pass the global norm of the "
            "tree (>= 0), e.g. from jaxclip.global_norm."
        )


def check_threshold(threshold: Any, fn: str) -> None:
    """The largest global norm of a step that is applied (spike skipping)."""
    v = real(threshold, "threshold", fn, "a real number > 0")
    if v is not None and not v > 0:
        raise ValueError(
            f"jaxclip.{fn}: threshold={threshold!r} must be > 0 (the largest global norm of a "
            "step that is applied; steps above it are skipped); to skip only non-finite "
            "steps, use float('inf')."
        )


def check_clipping(clipping: Any, fn: str) -> None:
    """AGC's ``clipping``: the largest ratio of gradient norm to parameter norm."""
    v = real(clipping, "clipping", fn, "a real number > 0, e.g. 0.01")
    if v is not None and not v > 0:
        raise ValueError(
            f"jaxclip.{fn}: clipping={clipping!r} must be > 0 (the largest ratio of a unit's "
            "gradient norm to its parameter norm; the paper uses 0.01 to 0.16); to turn "
            "clipping off, use float('inf')."
        )


def check_eps(eps: Any, fn: str) -> None:
    """AGC's ``eps``: the smallest parameter norm a unit's limit is based on."""
    v = real(eps, "eps", fn, "a small real number > 0, e.g. 1e-3")
    if v is not None and not (v > 0 and np.isfinite(v)):
        raise ValueError(
            f"jaxclip.{fn}: eps={eps!r} must be finite and > 0 (the smallest parameter norm a "
            "unit's limit is based on, so that zero-initialised units still move; the paper "
            "uses 1e-3)."
        )


def check_zclip_eps(eps: Any, fn: str) -> None:
    """ZClip's ``eps``: added to the standard deviation in the z-score."""
    v = real(eps, "eps", fn, "a small real number >= 0, e.g. 1e-6")
    if v is not None and not (v >= 0 and np.isfinite(v)):
        raise ValueError(
            f"jaxclip.{fn}: eps={eps!r} must be finite and >= 0 (it is added to the standard "
            "deviation in the z-score, so that a constant norm history does not divide by "
            "zero; the reference uses 1e-6)."
        )


def check_z_thresh(z_thresh: Any, fn: str) -> None:
    """ZClip's ``z_thresh``: the z-score above which a norm is a spike."""
    v = real(z_thresh, "z_thresh", fn, "a real number > 0, e.g. 2.5")
    if v is not None and not v > 0:
        raise ValueError(
            f"jaxclip.{fn}: z_thresh={z_thresh!r} must be > 0 (the z-score above which a global "
            "norm counts as a spike; the paper uses 2.5); to never clip spikes, use "
            "float('inf')."
        )


def check_alpha(alpha: Any, fn: str) -> None:
    """ZClip's ``alpha``: the weight of the old statistics in the moving averages."""
    v = real(alpha, "alpha", fn, "a real number in [0, 1), e.g. 0.97")
    if v is not None and not 0 <= v < 1:
        raise ValueError(
            f"jaxclip.{fn}: alpha={alpha!r} must be in [0, 1) (the weight of the old statistics "
            "in the moving mean and variance; the paper uses 0.97, 0 keeps only the last norm)."
        )


def check_percentile(percentile: Any, fn: str, name: str = "percentile") -> None:
    """AutoClip's ``percentile`` of the past norms."""
    v = real(percentile, name, fn, "a real number in (0, 100], e.g. 10.0")
    if v is not None and not 0 < v <= 100:
        raise ValueError(
            f"jaxclip.{fn}: {name}={percentile!r} must be in (0, 100] (the percentile of the "
            "past global norms used as the threshold; the paper uses 10, 100 clips to the "
            "largest norm seen)."
        )


def check_callable(value: Any, name: str, fn: str, signature: str) -> None:
    """An optional callable such as ``group(path, leaf) -> label`` (or a
    :class:`~jaxclip.Selector` wrapping one)."""
    if value is not None and not callable(value) and not isinstance(value, _tree.Selector):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: {name}={value!r} is a {type(value).__name__}, not a callable; pass "
            f"a function {signature}, or None."
        )


def static_int(value: Any, name: str, fn: str, sizes: str = "the state") -> int:
    """A buffer size: a Python int >= 1 (not traced; it fixes the shape of ``sizes``: a
    transform's state, which ``optax.inject_hyperparams`` would otherwise trace)."""
    state = sizes == "the state"
    if _is_traced(value):
        raise ValueError(
            f"jaxclip.{fn}: {name}={_show(value)} is traced; it must be a Python int >= 1 "
            f"(it sizes {sizes})." + (f" {static_hint(name, fn)}." if state else "")
        )
    if isinstance(value, (bool, np.bool_)):
        n = None
    else:
        try:
            n = operator.index(value)
        except TypeError:  # floats, strings, traced arrays (JAX's errors are TypeErrors)
            n = None
    if n is None or n < 1:
        # The wrong type (a float, a string) is a TypeError, as in autoclip's own checks.
        raise (TypeError if n is None else ValueError)(
            f"jaxclip.{fn}: {name}={value!r} must be a Python int >= 1 (it sizes {sizes})"
            + (f"; with optax.inject_hyperparams pass static_args=({name!r},)." if state else ".")
        )
    return n


# ----------------------------------------------------------------------------------------
# Value bounds (clip_by_value): scalars or arrays that broadcast against each leaf.


def _as_bound(value: Any, name: str, fn: str) -> tuple[Any, np.ndarray | None]:
    """A bound as passed (Python sequences and unsigned integers, whose negation would wrap
    around, turned into NumPy arrays) and its concrete value."""
    v = real(value, name, fn, "a real number or an array of real numbers", scalar=False)
    if v is not None and jnp.issubdtype(v.dtype, jnp.unsignedinteger):
        v = v.astype(np.float64)
        value = v
    elif isinstance(value, (list, tuple)):
        value = v if v is not None else jnp.asarray(value)
    return value, v


def _first_bad(ok: np.ndarray) -> str:
    """``" (first at index (i, j))"`` for the first False of an array condition, ``""`` for
    a scalar one."""
    if ok.ndim == 0:
        return ""
    return f" (first at index {tuple(int(i) for i in np.argwhere(~ok)[0])})"


def _refuse_nan(v: Any, name: str, given: Any, fn: str) -> None:
    """A concrete bound holding NaN is an error that says so (a comparison would report it
    as out of order, or warn)."""
    # jnp.issubdtype: ml_dtypes' bfloat16 and float8 are not NumPy floating subtypes.
    if v is not None and jnp.issubdtype(v.dtype, jnp.floating) and np.isnan(v).any():
        nan = np.asarray(~np.isnan(v))
        raise ValueError(
            f"jaxclip.{fn}: {name}={_show(given)} is NaN{_first_bad(nan)}; pass a real "
            "bound (-inf or inf for none)."
        )


def value_bounds(max_value: Any, min_value: Any, fn: str = "clip_by_value") -> tuple[Any, Any]:
    """``(lo, hi)`` for value clipping, checked elementwise where concrete.

    Bounds are real scalars or arrays (NumPy, JAX, or nested lists) that broadcast against
    each clipped leaf, as ``tf.clip_by_value`` takes them. With ``min=None`` the range is
    ``[-max, max]`` and ``max`` must be > 0 everywhere; else ``min <= max`` everywhere.
    """
    hi, vmax = _as_bound(max_value, "max", fn)
    _refuse_nan(vmax, "max", max_value, fn)
    if min_value is None:
        if vmax is not None:
            ok = np.asarray(vmax > 0)
            if not ok.all():
                raise ValueError(
                    f"jaxclip.{fn}(max={_show(max_value)}) with min=None clips into [-max, max], "
                    f"so max must be > 0{' everywhere' if ok.ndim else ''}{_first_bad(ok)}; pass "
                    "min explicitly for another range."
                )
        return (-hi if vmax is None else -vmax), hi  # concrete stays concrete under jit
    lo, vmin = _as_bound(min_value, "min", fn)
    try:
        np.broadcast_shapes(np.shape(lo), np.shape(hi))
    except ValueError as e:
        raise ValueError(
            f"jaxclip.{fn}: min of shape {np.shape(lo)} and max of shape {np.shape(hi)} do not "
            "broadcast against each other; pass bounds of broadcastable shapes."
        ) from e
    _refuse_nan(vmin, "min", min_value, fn)
    if vmax is not None and vmin is not None:
        ok = np.asarray(vmin <= vmax)
        if not ok.all():
            where = " elementwise" if ok.ndim else ""
            raise ValueError(
                f"jaxclip.{fn} got min={_show(min_value)} > max={_show(max_value)}"
                f"{_first_bad(ok)}; min must be <= max{where} (did you swap them?)."
            )
    return lo, hi


def check_bound_shape(bound: Any, name: str, leaf: Array, path: str, fn: str) -> None:
    """A value bound must broadcast to ``leaf``'s shape without enlarging it (as TensorFlow)."""
    shape = np.shape(bound)
    try:
        fits = np.broadcast_shapes(shape, np.shape(leaf)) == np.shape(leaf)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"jaxclip.{fn}: {name} of shape {shape} does not broadcast to the leaf at "
            f"{_tree.shown(path)}, which has shape {np.shape(leaf)}. Use bounds that broadcast to "
            "every clipped leaf (a scalar, or an array of a trailing part of its shape), or "
            "exclude this leaf with need_clip."
        )


# ----------------------------------------------------------------------------------------
# Axes (clip_by_norm, adaptive_clip).


def _axis(a: Any) -> int | None:
    if isinstance(a, (bool, np.bool_)):
        return None
    try:
        return operator.index(a)
    except TypeError:  # floats, strings, arrays, traced values
        return None


def check_axes(axes: Any, fn: str = "clip_by_norm") -> tuple[int, ...] | None:
    """``axes`` as a tuple of Python ints (None stays None), or a clear error."""
    if axes is None:
        return None
    if _is_traced(axes):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: axes={_show(axes)} is traced; axes decides the shapes of the "
            "computation, so it must be a static Python int or tuple of ints, e.g. axes=1. "
            f"{static_hint('axes', fn)}."
        )
    bad = HyperparameterTypeError(
        f"jaxclip.{fn}: axes={axes!r} must be an int or a sequence of ints, e.g. axes=1 or "
        "axes=(0, 1) (as tf.clip_by_norm), or None for whole leaves."
    )
    single = _axis(axes)
    if single is not None:
        return (single,)
    if isinstance(axes, (str, bytes)) or np.ndim(axes) > 1:
        raise bad
    try:
        seq = tuple(axes)
    except TypeError:
        raise bad from None
    out = tuple(_axis(a) for a in seq)
    if any(a is None for a in out):
        raise bad
    if len(set(out)) != len(out):
        raise ValueError(f"jaxclip.{fn}: axes={axes!r} names an axis twice; name each axis once.")
    return out  # type: ignore[return-value]


def leaf_axes(axes: tuple[int, ...] | None, leaf: Array, path: str) -> tuple[int, ...] | None:
    """``axes`` normalised for one leaf (sorted, non-negative), or a ValueError naming it."""
    if axes is None:
        return None
    nd = leaf.ndim
    if any(not -nd <= a < nd for a in axes):
        raise ValueError(
            f"jaxclip: axes={axes} is out of range for the leaf at {_tree.shown(path)}, "
            f"which has shape {leaf.shape} ({nd} axes). Use axes valid for every selected "
            "leaf, or exclude this one with need_clip."
        )
    normalized = tuple(sorted(a % nd for a in axes))
    if len(set(normalized)) != len(normalized):
        raise ValueError(
            f"jaxclip: axes={axes} names one axis twice for the leaf at {_tree.shown(path)} "
            f"({leaf.ndim} axes, so a negative and a positive index meet); name each axis once."
        )
    return normalized


def check_count(value: Any, name: str, fn: str) -> None:
    """A count of steps: an int >= 0 (a Python int or an integer array; traced is fine)."""
    v = None if isinstance(value, (bool, np.bool_)) else concrete(value)
    if isinstance(value, (bool, np.bool_)) or (
        v is not None and not (v.shape == () and np.issubdtype(v.dtype, np.integer) and v >= 0)
    ):
        raise ValueError(
            f"jaxclip.{fn}: {name}={value!r} must be an int >= 0 (a count of steps), or None."
        )


def check_quantile(quantile: Any, fn: str) -> None:
    """The autoclip package's ``quantile`` of the past norms, in [0, 1]."""
    v = real(quantile, "quantile", fn, "a real number in [0, 1], e.g. 0.9")
    if v is not None and not 0 <= v <= 1:
        raise ValueError(
            f"jaxclip.{fn}: quantile={quantile!r} must be in [0, 1] (the quantile of the past "
            "norms used as the threshold; the autoclip package's default is 0.9; for a "
            "percentile p, pass p / 100)."
        )


def check_deviations(deviations: Any, fn: str) -> None:
    """The autoclip package's ``deviations``: the threshold in standard deviations."""
    v = real(deviations, "deviations", fn, "a real number >= 0, e.g. 2.0")
    if v is not None and not (v >= 0 and np.isfinite(v)):
        raise ValueError(
            f"jaxclip.{fn}: deviations={deviations!r} must be finite and >= 0 (the threshold is "
            "deviations times the standard deviation of the past norms; the autoclip "
            "package's default is 2.0)."
        )


def check_choice(value: Any, name: str, choices: tuple[str, ...], fn: str) -> str:
    """One of a few option strings (case-insensitive, as the reference packages)."""
    v = value.lower() if isinstance(value, str) else value
    if v not in choices:
        raise ValueError(
            f"jaxclip.{fn}: {name}={value!r} must be one of {', '.join(map(repr, choices))}."
        )
    return v


def check_positive(value: Any, name: str, fn: str, meaning: str) -> None:
    """A real scalar > 0 (``meaning`` says what it does, for the message)."""
    v = real(value, name, fn, "a real number > 0")
    if v is not None and not v > 0:  # also catches NaN
        raise ValueError(f"jaxclip.{fn}: {name}={value!r} must be > 0 ({meaning}).")


def check_cap(value: Any, name: str, fn: str) -> None:
    """An optional fixed cap on the global norm (ZClip's ``max_grad_norm``)."""
    v = real(value, name, fn, "a real number > 0, or None for no cap")
    if v is not None and not v > 0:
        raise ValueError(
            f"jaxclip.{fn}: {name}={value!r} must be > 0 (a fixed cap on the global norm of "
            f"every step); for no cap, pass {name}=None."
        )


# ----------------------------------------------------------------------------------------
# Flags, need_clip, seeds and buffer sizes, checked where they are given.


def check_flag(value: Any, name: str, fn: str) -> bool:
    """An on/off option: a Python (or NumPy) bool, or a concrete boolean scalar array (what
    ``optax.inject_hyperparams`` makes of a bool outside ``jit``)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    v = None if isinstance(value, (str, bytes)) or value is None else concrete(value)
    if v is not None and v.shape == () and v.dtype == np.bool_:
        return bool(v)
    if _is_traced(value):
        raise ValueError(
            f"jaxclip.{fn}: {name} is traced; it must be a Python bool (it decides the "
            f"computation). {static_hint(name, fn)}."
        )
    raise HyperparameterTypeError(
        f"jaxclip.{fn}: {name}={_show(value)} is a {type(value).__name__}, not a bool; pass "
        f"{name}=True or {name}=False."
    )


def check_need_clip(need_clip: Any, fn: str) -> None:
    """``need_clip``: None, a function ``(path, leaf) -> bool`` (or a Selector), or a pytree
    of bools. Whether a tree fits the gradients is checked where they meet (``select``)."""
    if need_clip is None or _tree.is_selector_function(need_clip):
        return
    for path, m in jax.tree_util.tree_flatten_with_path(need_clip)[0]:
        if not _tree._is_bool(m):
            where = f" at {_tree.shown(_tree.path_str(path))}" if path else ""
            raise HyperparameterTypeError(
                f"jaxclip.{fn}: need_clip{where} is {_show(m)} of type {type(m).__name__}; pass "
                "None (every float leaf), a pytree of bools (True to clip a leaf or subtree), "
                "or a function need_clip(path, leaf) -> bool, e.g. jaxclip.exclude_names('bias')."
            )


def check_seed(seed: Any, fn: str) -> None:
    """A PRNG seed: an int in int64's or uint64's range (traced is fine: its dtype is known),
    or a ``jax.random`` key (a typed key, or a raw ``uint32[2]`` one)."""
    hint = (
        "pass an int, e.g. seed=0, or a jax.random key, e.g. seed=jax.random.key(0) "
        "(a fresh one per run: seed=int(time.time_ns()) % 2**63 if you want it random)"
    )
    if isinstance(seed, (bool, np.bool_)) or seed is None or isinstance(seed, (str, bytes)):
        raise HyperparameterTypeError(
            f"jaxclip.{fn}: seed={_show(seed)} is a {type(seed).__name__}; {hint}."
        )
    if isinstance(seed, int):
        if not -(2**63) <= seed < 2**63:
            raise HyperparameterTypeError(
                f"jaxclip.{fn}: seed={seed} is beyond int64's range, which a JAX PRNG seed "
                f"cannot hold; {hint}, e.g. seed={seed % 2**63}."
            )
        return
    dtype = getattr(seed, "dtype", None)
    shape = np.shape(seed) if dtype is not None else None
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return
    if dtype is not None and np.dtype(dtype) == np.uint32 and shape == (2,):
        return  # a raw key, jax.random.PRNGKey(0)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer) and shape == ():
        return
    raise HyperparameterTypeError(
        f"jaxclip.{fn}: seed={_show(seed)} is a {type(seed).__name__}"
        f"{'' if dtype is None else f' of dtype {dtype} and shape {shape}'}; {hint}."
    )


#: The largest buffer size (``window``, ``history_length``, ``batch_size``...): beyond it a
#: state could not be allocated, and JAX's own error would not say which argument it was.
MAX_SIZE = 2**31 - 1


def static_size(value: Any, name: str, fn: str, sizes: str = "the state") -> int:
    """:func:`static_int`, at most :data:`MAX_SIZE`."""
    n = static_int(value, name, fn, sizes)
    if n > MAX_SIZE:
        raise ValueError(
            f"jaxclip.{fn}: {name}={n} is too large (it sizes {sizes}); pass an int from 1 "
            f"to 2**31 - 1."
        )
    return n


def check_finite_nonneg(value: Any, name: str, fn: str, meaning: str) -> None:
    """A real scalar, finite and >= 0 (``meaning`` says what it does, for the message)."""
    v = real(value, name, fn, "a finite real number >= 0")
    if v is not None and not (v >= 0 and np.isfinite(v)):  # also catches NaN
        raise ValueError(f"jaxclip.{fn}: {name}={value!r} must be >= 0 and finite ({meaning}).")


def check_axes_range(axes: Any, fn: str) -> tuple[int, ...] | None:
    """:func:`check_axes`, and every axis small enough to index some array's shape (whether
    it fits each leaf is checked on the leaf, by :func:`leaf_axes`)."""
    out = check_axes(axes, fn)
    if out is not None and any(not -64 <= a < 64 for a in out):
        raise ValueError(
            f"jaxclip.{fn}: axes={axes!r} is out of range for any array (at most 64 "
            "dimensions); pass the axes of each slice, e.g. axes=1 or axes=-1."
        )
    return out
