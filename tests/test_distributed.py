"""Sharded and multi-device clipping on 8 simulated CPU devices (see conftest.py)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SPECS = {
    "both": P("data", "model"),
    "cols": P(None, "model"),
    "rows": P("model"),
    "replicated": P(),
    "small_replicated": P(),
    "vec": P("data"),
}
SHAPES = {
    "both": (8, 16),
    "cols": (6, 8),
    "rows": (16, 3),
    "replicated": (5, 7),
    "small_replicated": (3,),
    "vec": (4,),
}


def _grads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _mesh(kind: AxisType) -> Mesh:
    return Mesh(
        np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"), axis_types=(kind, kind)
    )


def _place(tree: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in tree.items()}


MODES = {
    "global_p2": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0),
    "global_p1": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=1.0),
    "global_inf": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=math.inf),
    "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0),
    "norm_axes0": lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=0),
    "value": lambda g: (jaxclip.clip_tree_by_value(g, 0.5), None),
}


def _collectives_are_small(hlo: str, max_elems: int) -> None:
    """No gradient leaf moves: no gathers or permutes; all-reduces carry norms only."""
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    for line in hlo.splitlines():
        if re.search(r"= \S+ all-reduce(-start)?\(", line):
            shape = line.split("=", 1)[1].split("all-reduce")[0]
            for dims in re.findall(r"\w+\[([\d,]*)\]", shape):
                assert math.prod(int(d) for d in dims.split(",") if d) <= max_elems, line


def _jit_cases() -> list:
    """Every mode on Auto and Explicit axes; the default run keeps Auto for all but
    global_p1, value and norm_axes0, and Explicit for global_p2 (the rest run in the slow
    step)."""
    cases = []
    for kind, kind_id in ((AxisType.Auto, "auto"), (AxisType.Explicit, "explicit")):
        for m in MODES:
            slow = m in ("global_p1", "value", "norm_axes0")
            slow |= kind_id == "explicit" and m != "global_p2"
            marks = [pytest.mark.slow] if slow else []
            cases.append(pytest.param(m, kind, marks=marks, id=f"{m}-{kind_id}"))
    return cases


@pytest.mark.parametrize(("mode", "kind"), _jit_cases())
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_jit_over_mesh_matches_single_device(mode, kind):
    host = _grads()
    mesh = _mesh(kind)
    sharded = _place(host, mesh)
    fn = jax.jit(MODES[mode])
    with jax.set_mesh(mesh):
        out, aux = fn(sharded)
        hlo = fn.lower(sharded).compile().as_text()
    single, single_aux = MODES[mode](jax.tree.map(jnp.asarray, host))
    for k in host:
        np.testing.assert_allclose(out[k], single[k], rtol=2e-6, atol=1e-7)
        assert out[k].sharding.is_equivalent_to(sharded[k].sharding, out[k].ndim), k
    if aux is not None:
        for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(single_aux)):
            np.testing.assert_allclose(a, b, rtol=2e-6)
    # Scalars, except per-slice norms when a norm's axis is sharded (16 columns at most).
    _collectives_are_small(hlo, 16 if mode == "norm_axes0" else 1)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_clip_by_norm_axes_over_a_sharded_axis_is_per_slice():
    host = _grads()
    sharded = _place(host, _mesh(AxisType.Auto))
    out, norms = jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=0))(sharded)
    for k in ("both", "rows"):  # axis 0 is sharded for these
        np.testing.assert_allclose(
            norms[k], np.squeeze(ref.norm([host[k]], 2.0, axes=(0,)), 0), rtol=2e-6
        )
        np.testing.assert_allclose(out[k], ref.clip_each(host[k], 1.0, axes=(0,)), rtol=2e-6)


NONFINITE_PS = (1.0, 3.0, 0.5, 2.0, math.inf)


def _nonfinite_norms(g: dict[str, jax.Array]) -> tuple:
    """Global norms for every p, per-column L1 norms of ``both`` and the clipped tree."""
    norms = [jaxclip.global_norm(g, norm_type=p) for p in NONFINITE_PS]
    _, cols = jaxclip.clip_tree_by_norm({"both": g["both"]}, 1.0, axes=0, norm_type=1.0)
    clipped, _ = jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=1.0)
    return norms, cols["both"], clipped


_nonfinite_jit = jax.jit(_nonfinite_norms)


@pytest.mark.parametrize(
    "kind",
    [AxisType.Auto, pytest.param(AxisType.Explicit, marks=pytest.mark.slow)],
    ids=["auto", "explicit"],
)
def test_nan_in_a_split_leaf_beside_an_inf_stays_nan(kind):
    """XLA's cross-device float max can drop a NaN. The rare path of p != 2 starts from
    the maximum, so a NaN in a leaf split over "model" beside an inf elsewhere gave an inf
    norm, and the clipped tree came out zeroed. Expected values are float64 NumPy sums."""
    host = _grads()
    host["both"][1, 3] = np.nan  # data shard 0, model shard 0 ...
    host["both"][6, 3] = np.inf  # ... and an inf in the same column on data shard 1
    host["both"][5, 9] = -np.inf  # a column with an inf alone
    host["small_replicated"][2] = np.inf
    mesh = _mesh(kind)
    with jax.set_mesh(mesh):
        norms, cols, clipped = _nonfinite_jit(_place(host, mesh))
    for p, n in zip(NONFINITE_PS, norms):
        assert np.isnan(n), (p, n)
    a = np.abs(host["both"].astype(np.float64))
    want = np.sum(a, axis=0)  # NaN in column 3, inf in column 9, finite elsewhere
    np.testing.assert_allclose(np.asarray(cols, np.float64), want, rtol=2e-6)
    cols = np.asarray(cols)
    assert np.isnan(cols[3]) and cols[9] == np.inf
    for k, v in clipped.items():
        assert np.isnan(np.asarray(v)).all(), k  # c / NaN scales every element to NaN


AGC_SHAPES = {"a": (8, 16), "b": (16, 8), "c": (8, 4), "e": (4, 4)}
AGC_GRADS = {"a": P(None, "model"), "b": P(), "c": P("data", None), "e": P()}
AGC_PARAMS = {"a": P("model", None), "b": P("model", None), "c": P(), "e": P(None, "model")}


@pytest.mark.parametrize(
    "kind",
    [AxisType.Auto, pytest.param(AxisType.Explicit, marks=pytest.mark.slow)],  # suite budget
    ids=["auto", "explicit"],
)
def test_agc_with_params_placed_otherwise_than_gradients(kind):
    """AGC's params may be sharded otherwise than its gradients (replicated params beside
    row- or column-split gradients, as with ZeRO): the params' per-slice norms stacked
    beside the gradients' came out raveled beside shaped ones and broadcast into a matrix
    (a reshape error), or concatenated across placements (an Explicit mesh's type error)."""
    rng = np.random.default_rng(1)
    g = {k: rng.normal(size=s).astype(np.float32) for k, s in AGC_SHAPES.items()}
    p = {k: rng.normal(size=s).astype(np.float32) for k, s in AGC_SHAPES.items()}
    mesh = _mesh(kind)
    gs = {k: jax.device_put(v, NamedSharding(mesh, AGC_GRADS[k])) for k, v in g.items()}
    ps = {k: jax.device_put(v, NamedSharding(mesh, AGC_PARAMS[k])) for k, v in p.items()}
    ps["e"] = jnp.asarray(p["e"])  # uncommitted, on one device
    f = jax.jit(lambda a, b: [jaxclip.clip_tree_adaptive(a, b, 0.05, axes=1)])
    for axes, out in zip((1,), f(gs, ps)):
        for k in AGC_SHAPES:  # float64: each unit scaled to 0.05 max(||param unit||, 1e-3)
            pn = np.maximum(np.linalg.norm(p[k].astype(np.float64), axis=axes, keepdims=True), 1e-3)
            gn = np.linalg.norm(g[k].astype(np.float64), axis=axes, keepdims=True)
            want = g[k] * np.where(gn > 0.05 * pn, 0.05 * pn / gn, 1.0)
            np.testing.assert_allclose(np.asarray(out[k], np.float64), want, rtol=2e-6, err_msg=k)
    if kind == AxisType.Auto:  # suite budget: the derivative's placements are Explicit's
        return
    # The derivative, in gradients and params: its clip norms come placed as the params.
    w = {k: rng.normal(size=s).astype(np.float32) for k, s in AGC_SHAPES.items()}

    def loss(a, b):
        out = jaxclip.clip_tree_adaptive(a, b, 0.05, axes=1)
        return sum(jnp.sum(out[k] * w[k]) for k in AGC_SHAPES)

    d = jax.jit(jax.grad(loss, argnums=(0, 1)))
    # Under the mesh, as JAX's Explicit sharding guide does: without a context mesh jax
    # 0.11 fails to transpose a slice whose cotangent is on the mesh and whose operand is
    # on none (a constant's placement; plain jax does it too: docs/guides/distributed.md).
    with jax.set_mesh(mesh):
        placed = d(gs, ps)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(d(g, p))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-7)


def test_sharded_maxima_keep_16_and_8_bit_leaves_in_their_width():
    """The NaN-keeping maximum of a sharded leaf (the rare path's shift for p != 2, and
    p = inf) reads its magnitudes' bits in the leaf's own width: a bfloat16 leaf widened
    to float32 first was a temporary of twice its size (XLA's memory_analysis), and a
    float8 leaf has bits of one byte."""
    mesh = _mesh(AxisType.Auto)
    x = jax.device_put(
        jnp.ones((1024, 1024), jnp.bfloat16), NamedSharding(mesh, P("data", "model"))
    )
    block = x.nbytes // 8
    for p in (1.0, math.inf):
        f = jax.jit(lambda t, p=p: jaxclip.clip_tree_by_global_norm(t, 1.0, norm_type=p)[0])
        assert f.lower(x).compile().memory_analysis().temp_size_in_bytes < block // 16, p
    h = np.full((8, 16), 3.0, np.float32)
    h[5, 9] = np.nan
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        y = jax.device_put(jnp.asarray(h, dtype), NamedSharding(mesh, P("data", "model")))
        n = jax.jit(lambda t: [jaxclip.global_norm(t, norm_type=q) for q in (math.inf, 1.0)])(y)
        assert all(np.isnan(float(v)) for v in n), dtype
        y = jax.device_put(jnp.asarray(np.nan_to_num(h, nan=-2.0), dtype), y.sharding)
        n = jax.jit(lambda t: jaxclip.global_norm(t, norm_type=math.inf))(y)
        assert float(n) == 3.0, dtype


def test_empty_leaf_split_on_an_explicit_mesh():
    """An empty leaf split over an Explicit mesh axis: its slices' norms are 0 for every p
    and its derivative is empty (the rare path's maxima were zeros placed nowhere, which a
    conditional or a derivative rule typed apart from the leaf)."""
    mesh = _mesh(AxisType.Explicit)
    x = jax.device_put(jnp.zeros((0, 8), jnp.float32), NamedSharding(mesh, P(None, "model")))

    def f(x):
        return sum(
            jnp.sum(jaxclip.clip_tree_by_norm(x, 1.0, axes=0, norm_type=p)[1])
            for p in (1.0, 3.0, math.inf)
        )

    with jax.set_mesh(mesh):
        assert float(jax.jit(f)(x)) == 0.0
        assert jax.jit(jax.grad(f))(x).shape == (0, 8)


def test_float16_rows_of_a_sharded_leaf_are_summed_in_place():
    """Float16 row sums loop over chunks of rows on one device only: a dynamic slice of a
    leaf split across devices would make XLA gather it."""
    x = np.random.default_rng(2).lognormal(0.0, 2.0, (1024, 64)).astype(np.float16)
    placed = jax.device_put(x, NamedSharding(_mesh(AxisType.Auto), P("data", "model")))
    f = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=-1)[1])
    hlo = f.lower(placed).compile().as_text()
    _collectives_are_small(hlo, 1024)
    assert "while(" not in hlo
    want = np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=-1))
    np.testing.assert_allclose(np.asarray(f(placed), np.float64), want, rtol=2e-6)


@pytest.mark.parametrize("p", [2.0, pytest.param(1.0, marks=pytest.mark.slow), math.inf])
@pytest.mark.parametrize("axis_name", ["model", ("data", "model")], ids=["model", "data+model"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_shard_map_fsdp_norm_equals_full_norm(p, axis_name):
    host = {k: v for k, v in _grads().items() if k in ("both", "cols")}
    mesh = _mesh(AxisType.Explicit)
    spec = P(None, axis_name)  # every device holds a slice of every leaf

    def step(g):
        clipped, n = jaxclip.clip_tree_by_global_norm(g, 1.0, norm_type=p, axis_name=axis_name)
        return clipped, n, jaxclip.global_norm(g, p, axis_name=axis_name)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,), out_specs=(spec, P(), P())))
    placed = {k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in host.items()}
    clipped, n, n2 = f(placed)
    expected, full = ref.clip_global(list(host.values()), 1.0, p)
    np.testing.assert_allclose(n, full, rtol=2e-6)
    np.testing.assert_allclose(n2, full, rtol=2e-6)
    for k, e in zip(host, expected):
        np.testing.assert_allclose(clipped[k], e, rtol=2e-6)


def test_shard_map_data_parallel_replicas_need_no_axis_name():
    host = _grads()
    mesh = _mesh(AxisType.Explicit)
    f = jax.jit(
        jax.shard_map(
            lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[1][None],
            mesh=mesh,
            in_specs=(P(),),
            out_specs=P(("data", "model")),
        )
    )
    norms = f(host)
    np.testing.assert_allclose(norms, np.full(8, ref.norm(list(host.values()), 2.0)), rtol=2e-6)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_pmap_with_axis_name(p):
    x = np.random.default_rng(1).normal(size=(8, 5, 3)).astype(np.float32)
    f = jax.pmap(
        lambda g: jaxclip.clip_tree_by_global_norm({"w": g}, 1.0, norm_type=p, axis_name="i"),
        axis_name="i",
    )
    out, n = f(x)
    np.testing.assert_allclose(n, np.full(8, ref.norm([x], p)), rtol=2e-6)
    np.testing.assert_allclose(out["w"], ref.clip_global([x], 1.0, p)[0][0], rtol=2e-6)


def test_unbound_axis_name_is_an_error():
    with pytest.raises(NameError, match="unbound axis name"):
        jax.jit(lambda g: jaxclip.global_norm(g, axis_name="model"))(jnp.ones(3))
    tx = jaxclip.clip_by_global_norm(1.0, axis_name="batch")
    with pytest.raises(NameError, match="unbound axis name"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)))


@pytest.mark.parametrize("axes", [(0, 1), (-1, 0)])
def test_axes_naming_every_dimension_of_several_leaves_on_an_auto_mesh(axes):
    """``axes`` that name every dimension is a whole-leaf norm: with two or more leaves
    (their norms stacked, each back as shape (1,)) on an Auto mesh this was a raw
    ``axis 1 is out of bounds`` from a squeeze; one device and Explicit axes were fine."""
    mesh = _mesh(AxisType.Auto)
    tree = {k: v for k, v in _grads().items() if v.ndim == 2}
    out, norms = jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=axes))(_place(tree, mesh))
    for k, v in tree.items():
        np.testing.assert_allclose(norms[k], ref.norm([v], 2.0), rtol=1e-6)
        np.testing.assert_allclose(out[k], ref.clip_each(v, 1.0), rtol=1e-5, atol=1e-7)
        assert np.shape(norms[k]) == ()
