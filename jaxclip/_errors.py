"""jaxclip's exceptions, and the check that raises :class:`NonFiniteNormError`.

Every error jaxclip raises is a built-in type (``ValueError``, ``TypeError``) with a
message that names the function, the argument or leaf path, and the fix; the classes
here are the two that add a type of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

Array = jax.Array


class HyperparameterTypeError(TypeError, ValueError):
    """A hyperparameter of the wrong type (a string, None, a bool, a complex number...).

    Both a ``TypeError`` and a ``ValueError``, so that code catching either for bad
    hyperparameters catches it.
    """


class NonFiniteNormError(FloatingPointError, jax.errors.JaxRuntimeError):
    """A norm was inf or NaN and the mode was built with ``error_if_nonfinite=True``.

    Catch ``jax.errors.JaxRuntimeError`` to catch it in every execution mode, with the
    same message text:

    - eagerly (the norm is concrete), this exception is raised as is: it is also a
      ``FloatingPointError`` and a ``jax.errors.JaxRuntimeError``, itself a
      ``RuntimeError`` (what PyTorch's ``clip_grad_norm_`` raises);
    - under ``jit`` (also inside ``optax.chain``, ``scan``, ``nnx.jit``, ``eqx.filter_jit``),
      the check runs in a host callback and JAX reports any exception raised there as a
      plain ``jax.errors.JaxRuntimeError`` whose message contains
      ``NonFiniteNormError: <this message>``. JAX offers no way to raise another type out
      of a compiled computation (``checkify`` needs the caller to wrap the function in
      ``checkify.checkify`` and call ``err.throw()``), so ``except NonFiniteNormError``
      alone catches the eager case only.
    """

    __module__ = "jaxclip"  # shown as jaxclip.NonFiniteNormError in tracebacks

    def __init__(self, message: str) -> None:
        # JaxRuntimeError's (nanobind) __init__ keeps the message its __str__ shows.
        jax.errors.JaxRuntimeError.__init__(self, message)


def raise_if_nonfinite(values: Sequence[Array], names: Sequence[str]) -> None:
    """Raises :class:`NonFiniteNormError` if a norm is not finite.

    Eagerly (concrete norms) it is raised as is. Under ``jit`` the check runs in a host
    callback (a device-to-host transfer of the norms and a host synchronisation per
    call), and JAX reports the error as a ``jax.errors.JaxRuntimeError`` whose message
    contains this one; ``NonFiniteNormError`` subclasses ``JaxRuntimeError``, so ``except
    jax.errors.JaxRuntimeError`` catches both with the same message.
    """

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
