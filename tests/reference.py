"""float64 NumPy references for the formulas of the semantics (docs/guides/numerics.md),
never the code under test; ``RECORDED`` holds the real libraries' outputs that
``tests/reference/record.py`` wrote to ``tests/reference/reference_outputs.json``."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

RECORDED = json.loads(
    (pathlib.Path(__file__).parent / "reference" / "reference_outputs.json").read_text()
)


def f64(x: Any) -> np.ndarray:
    """A float64 (complex128) NumPy copy, exact for every narrower float dtype."""
    x = np.asarray(x)
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def norm(xs: Sequence[Any], p: float, axes: tuple[int, ...] | None = None) -> Any:
    """(sum |x|^p)^(1/p) over all of ``xs`` (axes=None) or over ``axes`` of one array.

    Computed as m * (sum (|x|/m)^p)^(1/p) in float64 so that 1e30 and 1e-30 are exact too.
    """
    if axes is not None:
        (x,) = xs
        a = np.abs(f64(x))
        m = np.max(a, axis=axes, keepdims=True) if a.size else np.zeros([1] * a.ndim)
        if p == math.inf:
            return m
        safe = np.where(m > 0, m, 1.0)
        return np.where(
            m > 0, m * np.sum((a / safe) ** p, axis=axes, keepdims=True) ** (1 / p), 0.0
        )
    flat = np.concatenate([np.abs(f64(x)).ravel() for x in xs]) if xs else np.zeros(0)
    if flat.size == 0:
        return 0.0
    m = flat.max()
    if p == math.inf or m == 0:
        return float(m)
    return float(m * np.sum((flat / m) ** p) ** (1 / p))


def scale(n: Any, c: Any) -> Any:
    """1 where n <= c, else c / n (``c`` a number, or an array broadcast against ``n``)."""
    n = np.asarray(n, np.float64)
    return np.where(n <= c, 1.0, c / np.where(n <= c, 1.0, n))


def clip_global(xs: Sequence[Any], c: float, p: float = 2.0) -> tuple[list[np.ndarray], float]:
    n = norm(xs, p)
    s = scale(n, c)
    return [f64(x) * s for x in xs], n


def clip_each(x: Any, c: float, p: float = 2.0, axes: tuple[int, ...] | None = None) -> np.ndarray:
    if axes is None:
        return f64(x) * scale(norm([x], p), c)
    return f64(x) * scale(norm([x], p, axes), c)
