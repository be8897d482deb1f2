"""Norms of short slices (a few elements each: a conv kernel over its 3x3 or over one of
its kernel axes) are sums of slices of the leaf on XLA:CPU (``backend._short``), not a
reduce. Expected values are float64 NumPy norms, or the reduce's own results with the
slices' sums turned off."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip._norms import backend

F64 = np.float64

# (shape, axes): over trailing axes of 3 and 2x3, a leading axis of 3, leading 3x3 (an
# HWIO kernel's window), a middle axis of 5, and leading 32 (the longest summed).
LAYOUTS = [
    ((512, 3), -1),
    ((64, 2, 3), (1, 2)),
    ((3, 3, 16, 16), 0),
    ((3, 3, 16, 16), (0, 1)),
    ((40, 5, 24), 1),
    ((32, 600), 0),
]


def _f64_norms(x: np.ndarray, axes: int | tuple[int, ...], p: float) -> np.ndarray:
    a = np.abs(x.astype(F64))
    if p == np.inf:
        return np.max(a, axis=axes)
    return np.sum(a**p, axis=axes) ** (1.0 / p)


def _data(shape: tuple[int, ...], axes: int | tuple[int, ...], scale: float) -> np.ndarray:
    rng = np.random.default_rng(len(shape) * 7 + int(np.prod(shape)) % 97)
    x = rng.normal(size=shape) * 10.0 ** rng.uniform(-1, 1, shape)
    first_slice = [slice(None)] * len(shape)
    kept = [d for d in range(len(shape)) if d not in np.atleast_1d(np.asarray(axes) % len(shape))]
    first_slice[kept[0]] = 0
    x[tuple(first_slice)] = 0.0  # whole slices of zeros
    return x * scale


P = (2.0, 1.0, 3.0, np.inf)


@jax.jit(static_argnames=("axes",))
def _clip_all_p(x, clip, axes):
    return [jaxclip.clip_tree_by_norm(x, clip, norm_type=p, axes=axes) for p in P]


def _cases() -> list:
    # float32 in every layout and the 16-bit dtypes on the HWIO window in the default run;
    # the other 16-bit sweeps in the slow run (the default run keeps its time budget).
    out = []
    for shape, axes in LAYOUTS:
        for dtype in ("float32", "bfloat16", "float16"):
            fast = dtype == "float32" or axes == (0, 1)
            marks = () if fast else (pytest.mark.slow,)
            out.append(pytest.param(shape, axes, dtype, marks=marks))
    return out


@pytest.mark.parametrize(("shape", "axes", "dtype"), _cases())
def test_short_slice_norms_against_float64(shape, axes, dtype):
    eps = {"float32": 1e-6, "bfloat16": 2**-7, "float16": 2**-10}[dtype]
    for scale in (1.0, 1e25, 1e-30) if dtype == "float32" else (1.0,):
        x = jnp.asarray(_data(shape, axes, scale), dtype)
        clip = 0.5 * scale
        xs = np.asarray(x.astype(jnp.float32), F64)
        for p, (clipped, norms) in zip(P, _clip_all_p(x, clip, axes)):
            want = _f64_norms(xs, axes, p)
            np.testing.assert_allclose(np.asarray(norms, F64), want, rtol=1e-5, atol=0)
            n = np.expand_dims(want, axes)
            expect = xs * np.where(n > clip, clip / np.where(n > 0, n, 1), 1.0)
            got = np.asarray(clipped.astype(jnp.float32), F64)
            # A float16 result below its smallest normal keeps fewer bits.
            tiny = float(jnp.finfo(dtype).smallest_subnormal)
            np.testing.assert_allclose(got, expect, rtol=2 * eps, atol=tiny)


def test_short_slices_are_not_reduced():
    # The HWIO kernel's norms over its 3x3 window: every instruction that reads the kernel
    # is an elementwise (loop) fusion, no reduce (the library reduce over a leading run of
    # 9 is ~20x slower than the summed slices).
    x = jnp.ones((3, 3, 64, 64), jnp.float32)
    fn = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=(0, 1)))
    text = fn.lower(x).compile().as_text()
    entry = text[text.index("ENTRY") :]
    name = re.search(r"(%\S+) = f32\[3,3,64,64\]\S* parameter\(0\)", entry).group(1)
    readers = [
        line.strip()
        for line in entry.splitlines()
        if re.search(re.escape(name) + r"[,)]", line.split("(", 1)[-1]) and "parameter(" not in line
    ]
    fusions = [r for r in readers if " fusion(" in r]
    assert fusions and all("kind=kLoop" in r for r in fusions), fusions
    assert not any(" reduce(" in r for r in readers), readers


@pytest.mark.parametrize(
    ("shape", "dims", "short"),
    [
        ((100, 2), (1,), True),  # two elements: the least worth adding as slices
        ((100, 8), (1,), True),
        ((100, 9), (1,), False),  # trailing: at most SHORT_TRAILING
        ((32, 100), (0,), True),
        ((33, 100), (0,), False),  # leading: at most SHORT_LEADING
        ((4, 8, 100), (0, 1), True),
        ((5, 8, 100), (0, 1), False),
        ((10, 1), (1,), False),  # one element per slice: nothing to add
        ((3,), (0,), False),  # a single slice: the reduce
        ((0, 3), (1,), False),  # no slices
    ],
)
def test_which_slices_are_summed(shape, dims, short):
    assert backend.SHORT_TRAILING == 8 and backend.SHORT_LEADING == 32
    assert backend._short(jnp.zeros(shape), dims) is short


def test_summed_slices_match_the_reduce_on_non_finite_data(monkeypatch):
    # NaN and inf stay in their own slices exactly as through the reduce; the finite
    # slices' norms agree with it to rounding.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 3, 8, 8)).astype(np.float32)
    x[0, 1, 2, 3] = np.nan
    x[2, 2, 4, 4] = np.inf
    x[:, :, 5, 5] = 0.0
    fns = {
        p: jax.jit(lambda t, p=p: jaxclip.clip_tree_by_norm(t, 1.0, norm_type=p, axes=(0, 1)))
        for p in (2.0, np.inf)
    }
    summed = {p: jax.device_get(f(x)) for p, f in fns.items()}
    monkeypatch.setattr(backend, "SHORT_LEADING", 0)
    jax.clear_caches()
    try:
        for p in fns:
            reduced = jax.device_get(
                jax.jit(lambda t, p=p: jaxclip.clip_tree_by_norm(t, 1.0, norm_type=p, axes=(0, 1)))(
                    x
                )
            )
            for a, b in zip(summed[p], reduced):
                np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
                np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
                np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-6)
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_short_slices_under_vmap_and_grad():
    # vmap: the same sums (bit-equal) as each example alone; grad against the float64
    # derivative of sum(clip(v)): 1 for a kept slice, c/n (1 - v sum(v) / n^2) for a
    # clipped one.
    rng = np.random.default_rng(9)
    x = rng.normal(size=(2, 3, 3, 8, 8)).astype(np.float32)
    one = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 2.0, axes=(0, 1))[0])
    both = jax.vmap(one)(x)
    for k in range(2):
        np.testing.assert_array_equal(np.asarray(both[k]), np.asarray(one(x[k])))
    g = jax.grad(lambda t: jnp.sum(one(t)))(x[0])
    v = x[0].astype(F64)
    n = np.sqrt(np.sum(v * v, axis=(0, 1), keepdims=True))
    total = np.sum(v, axis=(0, 1), keepdims=True)
    want = np.where(n > 2.0, 2.0 / n * (1 - v * total / n**2), 1.0)
    np.testing.assert_allclose(np.asarray(g, F64), want, rtol=1e-5, atol=1e-6)
