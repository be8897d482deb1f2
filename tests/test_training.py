"""Twenty training steps of every mode of the registry, in each distributed layout, equal
to the single-device run: ``jit`` over Auto and Explicit meshes (fully-sharded data
parallel), ``shard_map`` data parallel, ``shard_map`` tensor parallel with data parallel
(column- and row-parallel layers, with and without varying axes tracked), and ``pmap``
tensor parallel. 8 simulated CPU devices (see conftest.py). The twenty steps are one
``lax.scan`` per run: one compile per layout and mode. The states come out replicated
(``out_specs=P()``) and equal to the single-device states."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip import _registry

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

STEPS, BATCH, D_IN, HIDDEN, D_OUT = 20, 16, 8, 16, 4
#: Column-parallel first layer, row-parallel second (Megatron's MLP) over "model".
TP_SPECS = {
    "l1": {"kernel": P(None, "model"), "bias": P("model")},
    "l2": {"kernel": P("model", None), "bias": P()},
}
KERNELS = jaxclip.exclude_names("bias")
#: Modes beyond the registry's examples: per-slice norms, whose reduced or kept
#: dimensions are split across devices in the tensor-parallel layouts.
EXTRA = {
    "clip_by_norm_rows": ("clip_by_norm", {"clip_norm": 0.05, "axes": 1, "need_clip": KERNELS}),
    "clip_by_norm_cols": ("clip_by_norm", {"clip_norm": 0.05, "axes": 0}),
    "global_p3": ("clip_by_global_norm", {"clip_norm": 0.1, "norm_type": 3.0}),
    "quantile_per_leaf": ("quantile_clip", {"quantile": 0.5, "history_length": 8}),
    "zclip_tight": ("zclip", {"z_thresh": 0.5, "warmup_steps": 3, "max_grad_norm": 0.05}),
}
MODES = {m.name: (m.name, {}) for m in _registry.MODES} | EXTRA
#: A few (layout, mode) pairs in the default run (suite budget); every pair runs slow.
FAST = {("shard_map_tp", "clip_by_norm_rows"), ("pmap_tp", "auto_clip")}


def _host(tree: Any) -> Any:
    """NumPy copies (a PRNG key as its key data)."""
    is_key = lambda v: jnp.issubdtype(v.dtype, jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.map(lambda v: np.asarray(jax.random.key_data(v) if is_key(v) else v), tree)


def _mode(name: str) -> _registry.Mode:
    return next(m for m in _registry.MODES if m.name == name)


def _tx(name: str, **kw: Any) -> tuple[optax.GradientTransformation, bool]:
    base, over = MODES[name]
    mode = _mode(base)
    takes_axis = "axis_name" in inspect.signature(mode.factory).parameters
    kwargs = {**over, **({} if "axis_name" not in kw or not takes_axis else kw)}
    return optax.chain(mode.build(**kwargs), optax.sgd(0.1)), mode.batched


def _data() -> tuple[dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    params = {
        "l1": {"kernel": rng.normal(size=(D_IN, HIDDEN)), "bias": 0.1 * rng.normal(size=HIDDEN)},
        "l2": {"kernel": rng.normal(size=(HIDDEN, D_OUT)), "bias": 0.1 * rng.normal(size=D_OUT)},
    }
    params = jax.tree.map(lambda v: v.astype(np.float32), params)
    x = rng.normal(size=(STEPS, BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(STEPS, BATCH, D_OUT)).astype(np.float32)
    y[7] *= 30.0  # a spike: the adaptive modes clip it
    return params, x, y


def _forward(params: dict, x: jax.Array, model: str | None) -> jax.Array:
    """The MLP; with ``model``, its tensor-parallel form on local blocks."""
    h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"])
    out = h @ params["l2"]["kernel"]
    if model is not None:
        out = lax.psum(out, model)
    return out + params["l2"]["bias"]


def _loss(params: dict, x: jax.Array, y: jax.Array, model: str | None = None) -> jax.Array:
    return jnp.mean((_forward(params, x, model) - y) ** 2)


def _grads(params: dict, x: jax.Array, y: jax.Array, batched: bool) -> dict:
    """The batch's gradient, or each example's (a leading batch axis)."""
    if not batched:
        return jax.grad(_loss)(params, x, y)
    one = lambda p, a, b: _loss(p, a[None], b[None])  # noqa: E731
    return jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)


def _train(step: Callable, params: dict, state: Any, x: Any, y: Any) -> tuple[dict, Any]:
    def body(carry, xy):
        return step(*carry, *xy), None

    return lax.scan(body, (params, state), (x, y))[0]


def _sgd_step(tx: optax.GradientTransformation, batched: bool) -> Callable:
    def step(params, state, x, y):
        grads = _grads(params, x, y, batched)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@functools.cache
def _single(name: str) -> tuple[dict, Any]:
    """The single-device run, the reference (cached: every layout compares with it)."""
    tx, batched = _tx(name)
    params, x, y = _data()
    with jax.default_device(jax.devices()[0]):
        run = jax.jit(lambda p, s, a, b: _train(_sgd_step(tx, batched), p, s, a, b))
        out = run(params, tx.init(params), x, y)
    return _host(out)


def _compare(name: str, got: tuple[dict, Any]) -> None:
    want = _single(name)
    got = _host(got)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        where = jax.tree_util.keystr(path)
        assert g.shape == w.shape, where
        if g.dtype.kind != "f":
            np.testing.assert_array_equal(g, w, err_msg=where)
            continue
        # each leaf's difference relative to the leaf (float64 norms)
        finite = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=where)
        diff = np.linalg.norm((g - w)[finite].astype(np.float64))
        assert diff <= 1e-6 * np.linalg.norm(w[finite].astype(np.float64)), (where, diff)


def _jit_layout(name: str, explicit: bool) -> tuple[dict, Any]:
    """``jit`` over a mesh: kernels and the batch split over "fsdp" (fully-sharded data
    parallel); XLA partitions the norms. With Explicit axes the kernels are gathered for
    the matmuls (their gradients come back split)."""
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
    tx, batched = _tx(name)
    params, x, y = _data()
    gather = (lambda v: jax.sharding.reshard(v, P())) if explicit else (lambda v: v)
    with jax.set_mesh(mesh):
        put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))  # noqa: E731
        params = {
            k: {"kernel": put(v["kernel"], P("fsdp")), "bias": put(v["bias"], P())}
            for k, v in params.items()
        }
        x, y = put(x, P(None, "fsdp")), put(y, P(None, "fsdp"))

        def step(p, s, a, b):
            grads = _grads(jax.tree.map(gather, p), a, b, True) if batched else None
            if grads is None:  # the kernels' gradients come back split, as the kernels
                grads = jax.grad(lambda q: _loss(jax.tree.map(gather, q), a, b))(p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        run = jax.jit(lambda p, s, a, b: _train(step, p, s, a, b))
        return run(params, tx.init(params), x, y)


def _shard_map_dp(name: str) -> tuple[dict, Any]:
    """``shard_map`` data parallel: replicated params, the batch split over "data", the
    mean of the loss taken across devices (JAX then sums the replicated gradients).
    Per-example gradients are of this device's examples: the params are marked varying
    first (else JAX sums row i over the devices), and ``axis_name=()`` says each example
    is whole on one device."""
    mesh = jax.make_mesh((8,), ("data",))
    tx, batched = _tx(name, axis_name=())
    params, x, y = _data()

    def step(p, s, a, b):
        if batched:
            grads = _grads(
                jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), p), a, b, True
            )
        else:
            grads = jax.grad(lambda q: lax.pmean(_loss(q, a, b), "data"))(p)
        updates, s = tx.update(grads, s, p)
        if batched:  # each device's mean of its rows: their mean is the batch's
            updates = jax.tree.map(lambda u: lax.pmean(u, "data"), updates)
        return optax.apply_updates(p, updates), s

    body = jax.shard_map(
        lambda p, s, a, b: _train(step, p, s, a, b),
        mesh=mesh,
        in_specs=(P(), P(), P(None, "data"), P(None, "data")),
        out_specs=P(),
    )
    x, y = (jax.device_put(v, NamedSharding(mesh, P(None, "data"))) for v in (x, y))
    return jax.jit(body)(params, tx.init(params), x, y)


def _local(params: dict, specs: dict, sizes: dict[str, int], index: dict[str, int]) -> dict:
    """Device ``index``'s block of each parameter under ``specs``."""

    def block(v, spec):
        for d, axis in enumerate(tuple(spec)):
            if axis is not None:
                n = v.shape[d] // sizes[axis]
                v = lax.dynamic_slice_in_dim(v, index[axis] * n, n, axis=d)
        return v

    return jax.tree.map(block, params, specs)


def _gathered_grads(p: dict, a: jax.Array, b: jax.Array, data: str | None) -> dict:
    """Where varying axes are not tracked (``pmap``, ``check_vma=False``) JAX's
    derivative of ``psum`` is not the tensor-parallel one: each device takes the whole
    model's gradient (its blocks gathered) and keeps its own block."""
    full = jax.tree.map(
        lambda v, spec: (
            lax.all_gather(v, "model", axis=tuple(spec).index("model"), tiled=True)
            if "model" in tuple(spec)
            else v
        ),
        p,
        TP_SPECS,
    )
    g = jax.grad(_loss)(full, a, b)
    if data is not None:
        g = jax.tree.map(lambda v: lax.pmean(v, data), g)
    i = lax.axis_index("model")
    return _local(g, TP_SPECS, {"model": 4}, {"model": i})


def _shard_map_tp(name: str, check_vma: bool) -> tuple[dict, Any]:
    """``shard_map`` over ("data", "model"): the MLP column- then row-parallel over
    "model", the batch over "data". Every mode takes the params' specs as axis_name."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tx, _ = _tx(name, axis_name=TP_SPECS)
    params, x, y = _data()

    def step(p, s, a, b):
        if check_vma:
            grads = jax.grad(lambda q: lax.pmean(_loss(q, a, b, "model"), "data"))(p)
        else:
            grads = _gathered_grads(p, a, b, "data")
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    body = jax.shard_map(
        lambda p, s, a, b: _train(step, p, s, a, b),
        mesh=mesh,
        in_specs=(TP_SPECS, P(), P(None, "data"), P(None, "data")),
        out_specs=(TP_SPECS, P()),
        check_vma=check_vma,
    )
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), params, TP_SPECS)
    x, y = (jax.device_put(v, NamedSharding(mesh, P(None, "data"))) for v in (x, y))
    return jax.jit(body)(params, tx.init(params), x, y)


def _pmap_tp(name: str) -> tuple[dict, Any]:
    """``pmap`` over 4 devices named "model": the same tensor-parallel MLP, each device
    holding its blocks; every mode takes the params' specs as axis_name."""
    tx, _ = _tx(name, axis_name=TP_SPECS)
    params, x, y = _data()
    n = 4
    blocks = [_local(params, TP_SPECS, {"model": n}, {"model": i}) for i in range(n)]
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *blocks)

    def step(p, s, a, b):
        updates, s = tx.update(_gathered_grads(p, a, b, None), s, p)
        return optax.apply_updates(p, updates), s

    def run(p, a, b):
        return _train(step, p, tx.init(p), a, b)

    pmapped = jax.pmap(run, axis_name="model", in_axes=(0, None, None), devices=jax.devices()[:n])
    out_p, out_s = pmapped(stacked, x, y)
    for leaf in jax.tree.leaves(out_s):  # every device holds the same state
        leaf = np.asarray(leaf)
        for i in range(1, n):
            np.testing.assert_array_equal(leaf[i], leaf[0])
    joined = jax.tree.map(
        lambda v, spec: (
            np.concatenate(list(np.asarray(v)), axis=tuple(spec).index("model"))
            if "model" in tuple(spec)
            else np.asarray(v)[0]
        ),
        out_p,
        TP_SPECS,
    )
    return joined, jax.tree.map(lambda v: np.asarray(v)[0], out_s)


LAYOUTS: dict[str, Callable[[str], tuple[dict, Any]]] = {
    "jit_auto": functools.partial(_jit_layout, explicit=False),
    "jit_explicit": functools.partial(_jit_layout, explicit=True),
    "shard_map_dp": _shard_map_dp,
    "shard_map_tp": functools.partial(_shard_map_tp, check_vma=True),
    "shard_map_tp_unchecked": functools.partial(_shard_map_tp, check_vma=False),
    "pmap_tp": _pmap_tp,
}


def _cases():
    for layout in LAYOUTS:
        for mode in MODES:
            if (
                layout in ("shard_map_tp", "shard_map_tp_unchecked", "pmap_tp")
                and _mode(MODES[mode][0]).batched
            ):
                continue  # per-example gradients of a model split across devices: not a layout
            marks = [] if (layout, mode) in FAST else [pytest.mark.slow]
            yield pytest.param(layout, mode, id=f"{layout}-{mode}", marks=marks)


@pytest.mark.parametrize("layout, mode", list(_cases()))
def test_twenty_steps_equal_the_single_device_run(layout, mode):
    _compare(mode, LAYOUTS[layout](mode))
