"""Inside ``shard_map`` every mode gives each device the single-device result with no
``axis_name``: each leaf's partial norm is combined over exactly the mesh axes it varies
across. Meshes of 1, 2 and 8 simulated CPU devices (see conftest.py), Auto and Explicit."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

ALL = ("data", "expert", "model")
# A transformer-like mix: tensor-parallel kernels, FSDP shards, experts, replicated scales
# and biases (small ones are bucketed), a sharded bf16 leaf and a large replicated leaf.
LEAVES = {
    "attn/kernel": ((8, 16), np.float32, P(None, "model")),
    "mlp/kernel": ((12, 6), np.float32, P("data")),
    "experts/w": ((4, 3, 5), np.float32, P("expert")),
    "both": ((4, 8), np.float32, P("data", "model")),
    "norm/scale": ((5,), np.float32, P()),
    "attn/bias": ((16,), np.float32, P()),
    "emb": ((8, 4), jnp.bfloat16, P(None, "model")),
    "big_replicated": ((160, 128), np.float32, P()),
}
SPECS = {k: spec for k, (_, _, spec) in LEAVES.items()}


def _host(scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        k: (scale * rng.normal(size=shape)).astype(dtype) for k, (shape, dtype, _) in LEAVES.items()
    }


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2, 2), ALL, axis_types=(AxisType.Explicit,) * 3)


def _per_device(tree):
    """Each device's copy of per-device values, stacked: out_specs P(ALL) on a [None]."""
    return jax.tree.map(lambda v: jnp.asarray(v)[None], tree)


def _run(fn, tree, mesh):
    """``fn(tree) -> (tree_like_input, aux)`` inside shard_map; aux per device."""

    def body(g):
        out, aux = fn(g)
        return out, _per_device(aux)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPECS,), out_specs=(SPECS, P(ALL))))
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in tree.items()}
    compiled = f.lower(placed).compile()  # once, for the result and its HLO
    return compiled(placed), compiled.as_text()


def _same_on_every_device(aux, single) -> None:
    for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(single)):
        a = np.asarray(a, np.float64)
        assert a.shape[0] == 8
        for row in a:  # every device the same, and the single-device value
            np.testing.assert_allclose(row, np.asarray(b, np.float64), rtol=3e-6, atol=1e-30)


def _whole_slices(result):
    """The per-column norms of leaves whose columns are not split (the same on every
    device); the others' columns are checked through the clipped leaves."""
    clipped, norms = result
    return clipped, {k: norms[k] for k in ("mlp/kernel", "experts/w", "norm/scale")}


def _tx_mode(tx: optax.GradientTransformation):
    def run(g):
        updates, state = tx.update(g, tx.init(g), g)
        return updates, state

    return run


MODES = {
    "global_p2": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0),
    "global_inf": lambda g: jaxclip.clip_tree_by_global_norm(g, 0.5, norm_type=math.inf),
    "global_p0.5": lambda g: jaxclip.clip_tree_by_global_norm(g, 1e3, norm_type=0.5),
    "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0),
    "norm_inf": lambda g: jaxclip.clip_tree_by_norm(g, 0.5, norm_type=math.inf),
    # axes=0 on leaves split over "data"/"expert" along axis 0; kept axes elsewhere.
    "norm_axes0": lambda g: _whole_slices(
        jaxclip.clip_tree_by_norm(g, 1.0, axes=0, axis_name=("data", "expert"))
    ),
    "grouped": lambda g: jaxclip.clip_tree_by_global_norm(
        g, 1.0, group=lambda path, _: path.split("/")[0]
    ),
    # AGC's units reduce axis 0 (all of a vector), which "data"/"expert" split.
    "adaptive_clip": _tx_mode(jaxclip.adaptive_clip(0.05, axis_name=("data", "expert"))),
    "quantile_clip": _tx_mode(jaxclip.quantile_clip()),
    "auto_clip": _tx_mode(jaxclip.auto_clip()),
    "zclip": _tx_mode(jaxclip.zclip()),
    "skip": _tx_mode(jaxclip.skip_large_updates(optax.sgd(1.0), 20.0)),
}
# One device: no mapped axes to name.
SINGLE = {
    "norm_axes0": lambda g: _whole_slices(jaxclip.clip_tree_by_norm(g, 1.0, axes=0)),
    "adaptive_clip": _tx_mode(jaxclip.adaptive_clip(0.05)),
}


# The default run keeps one mode of each kind; the rest run in the slow CI step.
SLOW_MODES = {
    "norm",  # suite budget; per-unit norms in shard_map: the tensor-parallel AGC test
    "norm_axes0",  # sharded axes=0 slices: test_clip_by_norm_axes_over_a_sharded_axis_is_per_slice
    "skip",
    "global_p0.5",
    "norm_inf",
    "grouped",
    "quantile_clip",
    "auto_clip",
    "adaptive_clip",
    "zclip",
}


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=[pytest.mark.slow] if m in SLOW_MODES else []) for m in MODES]
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_mixed_tree_every_mode_gives_each_device_the_single_device_result(mode):
    host = _host()
    (out, aux), hlo = _run(MODES[mode], host, _mesh())
    single_out, single_aux = SINGLE.get(mode, MODES[mode])(jax.tree.map(jnp.asarray, host))
    _same_on_every_device(aux, single_aux)
    for k in host:
        np.testing.assert_allclose(
            np.asarray(out[k], np.float64),
            np.asarray(single_out[k], np.float64),
            rtol=1e-2 if host[k].dtype == jnp.bfloat16 else 3e-6,
        )
    # Only norms cross devices: scalars, or per-slice vectors (axes=0: 16 columns at most).
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    for line in hlo.splitlines():
        if re.search(r"= \S+ all-reduce(-start)?\(", line):
            for dims in re.findall(r"\w+\[([\d,]*)\]", line.split("all-reduce")[0]):
                assert math.prod(int(d) for d in dims.split(",") if d) <= 16, line


@pytest.mark.slow
def test_norms_equal_the_float64_reference_at_extreme_magnitudes():
    for scale in (1e-30, 1e25):  # the scaled path, with collectives inside its branch
        host = {k: v for k, v in _host(scale).items() if v.dtype == np.float32}
        specs = {k: SPECS[k] for k in host}

        def body(g):
            n2 = jaxclip.global_norm(g)
            n1 = jaxclip.global_norm(g, 1.0)
            _, per_leaf = jaxclip.clip_tree_by_norm(g, 1.0)
            return _per_device((n2, n1, per_leaf))

        f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(specs,), out_specs=P(ALL)))
        placed = {k: jax.device_put(v, NamedSharding(_mesh(), specs[k])) for k, v in host.items()}
        n2, n1, per_leaf = f(placed)
        np.testing.assert_allclose(n2, ref.norm(list(host.values()), 2.0), rtol=2e-6)
        np.testing.assert_allclose(n1, ref.norm(list(host.values()), 1.0), rtol=2e-6)
        for k, v in host.items():
            np.testing.assert_allclose(per_leaf[k], ref.norm([v], 2.0), rtol=2e-6)


@pytest.mark.slow
def test_grad_through_clipping_inside_shard_map():
    host = {k: v for k, v in _host().items() if v.dtype == np.float32}
    specs = {k: SPECS[k] for k in host}

    def loss(g):  # a norm of the clipped tree: no constant, and the same on every device
        clipped, _ = jaxclip.clip_tree_by_global_norm(g, 1.0)
        return jaxclip.global_norm(clipped, 3.0)

    f = jax.jit(jax.shard_map(jax.grad(loss), mesh=_mesh(), in_specs=(specs,), out_specs=specs))
    placed = {k: jax.device_put(v, NamedSharding(_mesh(), specs[k])) for k, v in host.items()}
    got = f(placed)
    want = jax.grad(loss)(jax.tree.map(jnp.asarray, host))
    for k in host:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7)


def test_axis_name_never_counts_a_replicated_leaf_once_per_device():
    host = {"w": np.arange(8.0, dtype=np.float32), "b": np.ones(3, np.float32)}
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    specs = {"w": P("x"), "b": P()}
    f = jax.jit(
        jax.shard_map(
            lambda g: (jaxclip.global_norm(g, axis_name="x"), jaxclip.global_norm(g)),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=(P(), P()),
        )
    )
    with_name, without = f(
        {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    )
    np.testing.assert_allclose([with_name, without], ref.norm(list(host.values()), 2.0), rtol=2e-6)


def test_check_vma_false_needs_axis_name_as_before():
    x = np.arange(16.0, dtype=np.float32)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    f = jax.jit(
        jax.shard_map(
            lambda g: jaxclip.global_norm(g, axis_name="x")[None],
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
    )
    np.testing.assert_allclose(
        f(jax.device_put(x, NamedSharding(mesh, P("x")))), np.full(8, ref.norm([x], 2.0)), rtol=2e-6
    )


def test_state_of_split_slices_is_the_leafs_largest_without_vma_tracking():
    """Under ``check_vma=False`` and ``pmap`` with a tree of axis names, ``clip_by_norm``'s
    state (each leaf's largest slice norm) of a leaf whose kept dimension is split is the
    leaf's largest on every device, as on one device: each device held its own rows'."""
    x = (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) - 60) / 50
    want = {a: float(np.max(np.linalg.norm(x.astype(np.float64), axis=a))) for a in (1, 0)}
    txs = {a: jaxclip.clip_by_norm(1.0, axes=a, axis_name={"w": ()}) for a in (1, 0, None)}
    states = {a: tx.init({"w": x}) for a, tx in txs.items()}

    def body(rows, cols):  # rows: (4, 8) of a row split; cols: (16, 2) of a column split
        return jnp.stack(
            [
                txs[1].update({"w": rows}, states[1])[1].norms["w"],
                txs[0].update({"w": cols}, states[0])[1].norms["w"],
                # A whole leaf with no axis to combine over: each device's own block.
                txs[None].update({"w": rows}, states[None])[1].norms["w"],
            ]
        )

    mesh = jax.make_mesh(
        (4,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )
    f = jax.jit(
        jax.shard_map(
            lambda r, c: body(r, c)[None],
            mesh=mesh,
            in_specs=(P("model", None), P(None, "model")),
            out_specs=P("model"),
            check_vma=False,
        )
    )
    put = lambda spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got = {"shard_map": np.asarray(f(put(P("model", None)), put(P(None, "model"))))}
    cols = np.stack(np.split(x, 4, axis=1))
    got["pmap"] = np.asarray(jax.pmap(body, axis_name="i")(x.reshape(4, 4, 8), cols))
    own = np.linalg.norm(x.astype(np.float64).reshape(4, 32), axis=1)
    for mode, g in got.items():
        np.testing.assert_allclose(g[:, 0], want[1], rtol=2e-6, err_msg=mode)
        np.testing.assert_allclose(g[:, 1], want[0], rtol=2e-6, err_msg=mode)
        np.testing.assert_allclose(g[:, 2], own, rtol=2e-6, err_msg=mode)


def test_wrong_axis_name_and_ambiguous_slices_are_clear_errors():
    mesh = _mesh()
    host = _host()
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in host.items()}

    def run(fn):
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SPECS,), out_specs=P()))(placed)

    with pytest.raises(
        NameError, match=r"axis_name 'batch' \(for the leaf '.*'\) is not a mapped axis.*'data'"
    ):
        run(lambda g: jaxclip.global_norm(g, axis_name="batch"))
    with pytest.raises(
        ValueError, match=r"leaf 'attn/kernel' varies across mesh axes \('model',\)"
    ):
        run(lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=0)[1]["norm/scale"])


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1dev", "2dev"])
@pytest.mark.parametrize(
    "kind",
    [AxisType.Auto, pytest.param(AxisType.Explicit, marks=pytest.mark.slow)],
    ids=["auto", "explicit"],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_small_meshes_with_sharded_and_replicated_small_leaves(n, kind):
    """The one-device mesh (every laptop) and two devices: a sharded leaf next to small
    replicated ones of several dtypes, under jit, in a chain."""
    mesh = jax.make_mesh((n,), ("x",), axis_types=(kind,), devices=jax.devices()[:n])
    rng = np.random.default_rng(2)
    host = {
        "w": rng.normal(size=(4, 6)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(np.float32),
        "s": rng.normal(size=(2, 2)).astype(jnp.bfloat16),
    }
    specs = {"w": P("x"), "b": P(), "s": P()}
    tx = optax.chain(jaxclip.clip_by_norm(1.0), jaxclip.clip_by_global_norm(1.0), optax.sgd(1.0))

    def step(g):
        clipped, n_global = jaxclip.clip_tree_by_global_norm(g, 1.0)
        by_leaf, norms = jaxclip.clip_tree_by_norm(g, 1.0)
        updates, _ = tx.update(g, tx.init(g))
        return clipped, n_global, by_leaf, norms, updates

    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
        got = jax.jit(step)(placed)
    want = step(jax.tree.map(jnp.asarray, host))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6)
    np.testing.assert_allclose(got[1], ref.norm(list(host.values()), 2.0), rtol=2e-6)
    assert got[0]["w"].sharding.is_equivalent_to(placed["w"].sharding, 2)


def test_named_vmap_with_axis_name_combines_over_the_vmapped_axis():
    x = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    full = ref.norm([x], 2.0)
    got = jax.vmap(lambda r: jaxclip.global_norm({"a": r}, axis_name="b"), axis_name="b")(x)
    np.testing.assert_allclose(got, np.full(4, full), rtol=2e-6)
    _, n = jax.vmap(
        lambda r: jaxclip.clip_tree_by_norm({"a": r}, 1.0, axis_name="b"), axis_name="b"
    )(x)
    np.testing.assert_allclose(n["a"], np.full(4, full), rtol=2e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_tensor_parallel_layer_agc_and_per_example_inside_shard_map():
    """A column-parallel layer: kernel (in, out) and bias split over "model". AGC's kernel
    units (columns) are whole on each device (axis_name=()), its bias is one unit whose
    norm the type says to combine; per-example norms sum the split features."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(4)
    params = {"kernel": rng.normal(size=(6, 8)), "bias": rng.normal(size=(8,))}
    params = jax.tree.map(lambda v: v.astype(np.float32), params)
    grads = jax.tree.map(lambda v: (3.0 * v[::-1]).astype(np.float32), params)
    specs = {"kernel": P(None, "model"), "bias": P("model")}
    put = lambda t, s=specs: {k: jax.device_put(v, NamedSharding(mesh, s[k])) for k, v in t.items()}  # noqa: E731
    agc = jaxclip.adaptive_clip(0.01, axis_name=())
    f = jax.jit(
        jax.shard_map(
            lambda g, p: agc.update(g, agc.init(p), p)[0],
            mesh=mesh,
            in_specs=(specs, specs),
            out_specs=specs,
        )
    )
    want = jaxclip.adaptive_clip(0.01).update(grads, optax.EmptyState(), params)[0]
    for k, v in f(put(grads), put(params)).items():
        np.testing.assert_allclose(v, want[k], rtol=2e-6)

    per_ex = {"w": rng.normal(size=(4, 8)).astype(np.float32), "b": rng.normal(size=(4, 3))}
    per_ex["b"] = per_ex["b"].astype(np.float32)
    pspecs = {"w": P(None, "model"), "b": P()}
    want_n = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2, axis=1) for v in per_ex.values()))

    def body(g, axis_name=("model",)):
        return jaxclip.clip_tree_per_example(g, 1.0, reduce=None, axis_name=axis_name)[1]

    g = put(per_ex, pspecs)
    n = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspecs,), out_specs=P()))(g)
    np.testing.assert_allclose(n, want_n, rtol=2e-6)
    with pytest.raises(ValueError, match=r"leaf 'w' varies across mesh axes \('model',\)"):
        jax.jit(
            jax.shard_map(lambda g: body(g, None), mesh=mesh, in_specs=(pspecs,), out_specs=P())
        )(g)


def test_per_example_with_the_batch_split_on_an_explicit_mesh():
    mesh = jax.make_mesh(
        (1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1]
    )
    g = {"w": np.arange(24, dtype=np.float32).reshape(8, 3) / 10}
    want, want_n = jaxclip.clip_tree_per_example(g, 1.0)
    with jax.set_mesh(mesh):
        placed = {"w": jax.device_put(g["w"], NamedSharding(mesh, P("data")))}
        got, n = jax.jit(lambda t: jaxclip.clip_tree_per_example(t, 1.0))(placed)
    np.testing.assert_allclose(got["w"], want["w"], rtol=2e-6)
    np.testing.assert_allclose(n, want_n, rtol=2e-6)


def _noise_blocks(mesh, spec, axis_name, shape=(16, 2048)):
    """Each device's update of ``clip_per_example`` with noise on all-zero per-example
    gradients of ``shape`` split by ``spec``, stacked per device, and their sum over
    "data" (the data-parallel gradient sum the docs ask for)."""
    tx = jaxclip.clip_per_example(
        1.0, noise_multiplier=1.0, reduce="sum", seed=3, axis_name=axis_name
    )

    def body(g):
        u = tx.update({"w": g}, tx.init({"w": g[0]}))[0]["w"]
        return u[None], jax.lax.psum(u, "data")

    out = P("model") if "model" in mesh.axis_names else P()
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(P(mesh.axis_names), out))
    zeros = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    blocks, total = jax.jit(f)(zeros)
    return np.asarray(blocks, np.float64), np.asarray(total, np.float64)


def _assert_independent(blocks):
    flat = blocks.reshape(blocks.shape[0], -1)
    corr = np.corrcoef(flat)[np.triu_indices(len(flat), 1)]
    assert np.abs(corr).max() < 0.12, corr  # 2048 draws: sd 0.022


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_dp_noise_is_drawn_once_over_data_parallel_devices():
    """Each of 8 data-parallel devices sums its examples; their sum over "data" must have
    the noise std of one draw (1.0), not 8 identical draws (std 8)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    blocks, total = _noise_blocks(mesh, P("data"), ())
    assert abs(total.std() - 1.0) < 0.05, total.std()  # 2048 draws: sd of the ratio 1.6%
    assert abs(blocks.std() * math.sqrt(8) - 1.0) < 0.05
    _assert_independent(blocks)


def test_dp_noise_on_a_feature_split_leaf_is_independent_per_shard():
    """Batch over "data" (2), features over "model" (4): every device's block is its own
    draw, and the sum over "data" has std 1 on every feature."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    blocks, total = _noise_blocks(mesh, P("data", "model"), ("model",), shape=(8, 4 * 2048))
    assert total.shape == (4 * 2048,)
    for shard in total.reshape(4, 2048):
        assert abs(shard.std() - 1.0) < 0.06, shard.std()
    _assert_independent(blocks)
    _assert_independent(total.reshape(4, 2048))


def test_dp_noise_with_check_vma_false_is_refused():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    tx = jaxclip.clip_per_example(1.0, noise_multiplier=1.0, axis_name=())
    f = jax.shard_map(
        lambda g: tx.update({"w": g}, tx.init({"w": g[0]}))[0]["w"],
        mesh=mesh,
        in_specs=(P("data"),),
        out_specs=P("data"),
        check_vma=False,
    )
    with pytest.raises(ValueError, match=r"shard_map\(check_vma=False\).*with its default"):
        jax.jit(f)(jax.device_put(np.zeros((16, 4), np.float32), NamedSharding(mesh, P("data"))))


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_per_example_states_over_untracked_data_parallel_devices():
    """Under ``pmap`` and ``shard_map(check_vma=False)`` the states that count the batch
    (adaptive_clip_per_example's clip norm, clip_per_example's clipped fraction) are those
    of the whole batch on every device; each device counted its own examples. A count
    against a given expected size, which axes holding the same examples would inflate,
    is refused."""
    rng = np.random.default_rng(0)
    scale = np.repeat([0.1, 0.1, 5.0, 5.0], 4)[:, None]  # devices 0, 1 small; 2, 3 large
    g = (rng.normal(size=(16, 6)) * scale).astype(np.float32)
    ada = jaxclip.adaptive_clip_per_example(1.0, reduce="sum", axis_name=())
    frac = jaxclip.clip_per_example(1.0, reduce="sum", axis_name=())
    s_ada, s_frac = ada.init({"w": g[0]}), frac.init({"w": g[0]})

    def body(x):
        c = ada.update({"w": x}, s_ada)[1].clip_norm
        f = frac.update({"w": x}, s_frac)[1].clipped_fraction
        return jnp.stack([c, jnp.ravel(jnp.asarray(jax.tree.leaves(f)[0]))[0]])

    want = np.asarray(body(jnp.asarray(g)))
    # Half of the examples are at or below the clip norm 1: the fraction is the target.
    np.testing.assert_allclose(want, [1.0, 0.5], rtol=1e-6)
    got = {"pmap": np.asarray(jax.pmap(body, axis_name="i")(g.reshape(4, 4, 6)))}
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )
    f = jax.shard_map(
        lambda x: body(x)[None], mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False
    )
    got["check_vma=False"] = np.asarray(
        jax.jit(f)(jax.device_put(g, NamedSharding(mesh, P("data"))))
    )
    for mode, v in got.items():
        np.testing.assert_allclose(v, np.broadcast_to(want, v.shape), rtol=1e-6, err_msg=mode)
    sized = jaxclip.adaptive_clip_per_example(
        1.0, reduce="sum", axis_name=(), expected_num_records=16
    )
    noised = jaxclip.adaptive_clip_per_example(
        1.0, reduce="sum", axis_name=(), clipped_count_stddev=0.5
    )
    for tx in (sized, noised):
        with pytest.raises(ValueError, match=r"cannot tell which devices hold different examples"):
            jax.pmap(lambda x, tx=tx: tx.update({"w": x}, s_ada)[1].clip_norm, axis_name="i")(
                g.reshape(4, 4, 6)
            )


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_data_parallel_per_example_names_axis_name_empty_and_reads_its_own_rows():
    """Batch of 32 split over 8 devices, some of whose examples are zero (padding) or tiny:
    each device re-reads only its own out-of-range rows, and the norms and the summed
    update equal the single-device ones. Without axis_name the error says that data
    parallel is axis_name=()."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(5)
    g = {"w": rng.normal(size=(32, 6, 5)).astype(np.float32), "b": np.ones((32, 5), np.float32)}
    for leaf in g.values():
        leaf[[0, 9, 10, 31]] = 0.0  # padding: one device has two, two have one
        leaf[20] *= np.float32(1e-24)  # squares underflow float32
    want, want_n = jaxclip.clip_tree_per_example(g, 1.0)

    def body(t, axis_name):
        out, n = jaxclip.clip_tree_per_example(t, 1.0, axis_name=axis_name)
        return jax.tree.map(lambda v: jax.lax.psum(v, "data"), out), n

    placed = jax.device_put(g, NamedSharding(mesh, P("data")))
    run = jax.shard_map(
        lambda t: body(t, ()), mesh=mesh, in_specs=(P("data"),), out_specs=(P(), P("data"))
    )
    got, n = jax.jit(run)(placed)
    np.testing.assert_allclose(n, want_n, rtol=2e-6)
    x = np.concatenate([v.reshape(32, -1).astype(np.float64) for v in jax.tree.leaves(g)], 1)
    np.testing.assert_allclose(n, np.sqrt((x**2).sum(1)), rtol=2e-6)  # float64 formula
    for k in g:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=1e-6)
    unnamed = jax.shard_map(
        lambda t: body(t, None), mesh=mesh, in_specs=(P("data"),), out_specs=(P(), P("data"))
    )
    with pytest.raises(ValueError, match=r"Data parallel .* is axis_name=\(\)"):
        jax.jit(unnamed)(placed)


def test_float16_row_loops_inside_shard_map():
    """Float16 blocks are summed a few rows at a time (a loop whose carry must vary as the
    block does): whole, over the leading axis, and over the trailing one."""
    x = np.random.default_rng(3).lognormal(0.0, 2.0, (4096, 1024)).astype(np.float16)
    x64 = x.astype(np.float64)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    whole = jax.shard_map(jaxclip.global_norm, mesh=mesh, in_specs=P("d", None), out_specs=P())
    np.testing.assert_allclose(float(jax.jit(whole)(x)), np.sqrt(np.sum(x64**2)), rtol=1e-6)

    def rows(t):
        return jaxclip.clip_tree_by_norm(t, 1.0, axes=0, axis_name=())[1]

    per = jax.shard_map(rows, mesh=mesh, in_specs=P(None, "d"), out_specs=P("d"))
    want = np.sqrt(np.sum(x64**2, axis=0))
    np.testing.assert_allclose(ref.f64(jax.jit(per)(x)), want, rtol=1e-6)

    def trailing(t):  # chunks of whole rows (backend._looped_rows), the rows split
        return jaxclip.clip_tree_by_norm(t, 1.0, axes=1, axis_name=())[1]

    per = jax.shard_map(trailing, mesh=mesh, in_specs=P("d", None), out_specs=P("d"))
    assert "while(" in jax.jit(per).lower(x).compile().as_text()
    want = np.sqrt(np.sum(x64**2, axis=1))
    np.testing.assert_allclose(ref.f64(jax.jit(per)(x)), want, rtol=1e-6)


def test_adaptive_clip_takes_its_units_from_the_whole_array():
    # Tensor-parallel kernels whose split dimension is 1 on each device: a (16, 4) kernel
    # split over its outputs is a (16, 1) block, which alone would look like one unit;
    # its units are the whole kernel's columns. Likewise (4, 16) split over its inputs.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs = {"col": P(None, "model"), "row": P("model", None), "bias": P()}
    rng = np.random.default_rng(9)
    shapes = {"col": (16, 4), "row": (4, 16), "bias": (16,)}
    g = {k: (5 * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
    p = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}

    def body(g, p):
        return jaxclip.clip_tree_adaptive(g, p, 0.05, axis_name=specs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, specs), out_specs=specs))
    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in t.items()}  # noqa: E731
    got = f(put(g), put(p))
    for k in shapes:
        a = None if k == "bias" else (0,)
        limit = 0.05 * np.maximum(ref.norm([p[k]], 2.0, a), 1e-3)
        want = ref.f64(g[k]) * ref.scale(ref.norm([g[k]], 2.0, a), limit)
        np.testing.assert_allclose(ref.f64(got[k]), want, rtol=1e-6, err_msg=k)
    # Outside shard_map a leaf is the whole array, whatever its spec says: a (1, 16)
    # kernel is one unit.
    g1, p1 = g["row"][:1], p["row"][:1]
    out = jaxclip.clip_tree_adaptive(g1, p1, 0.05, axis_name=specs["row"])
    limit = 0.05 * max(ref.norm([p1], 2.0), 1e-3)
    want = ref.f64(g1) * ref.scale(ref.norm([g1], 2.0), limit)
    np.testing.assert_allclose(ref.f64(out), want, rtol=1e-6)


def test_adaptive_clip_refuses_a_block_whose_units_its_shape_cannot_say():
    # A row of an (8, 6) kernel split by rows is a (1, 6) block: alone it looks like one
    # unit, but the kernel's units are its columns. Without the leaf's PartitionSpec
    # that is an error naming the leaf (it was the whole-leaf norm); with it, the
    # columns' norms. A (1, 6) leaf that is not split stays one unit.
    rng = np.random.default_rng(12)
    g = (3 * rng.normal(size=(8, 6))).astype(np.float32)
    p = rng.normal(size=(8, 6)).astype(np.float32)
    limit = 0.05 * np.maximum(ref.norm([p], 2.0, (0,)), 1e-3)
    want = ref.f64(g) * ref.scale(ref.norm([g], 2.0, (0,)), limit)
    rows = lambda a: a[:, None, :]  # noqa: E731

    def agc(axis_name):
        fn = lambda g, p: jaxclip.clip_tree_adaptive(g, p, 0.05, axis_name=axis_name)  # noqa: E731
        return jax.pmap(fn, axis_name="i")

    with pytest.raises(ValueError, match=r"leaf the root of the tree is a block \(1, 6\)"):
        agc("i")(rows(g), rows(p))
    got = agc(P("i", None))(rows(g), rows(p))[:, 0, :]
    np.testing.assert_allclose(ref.f64(got), want, rtol=1e-6)
    one = agc(())(rows(g), rows(p))  # each device's (1, 6) leaf is its own array
    for d in range(8):
        lim = 0.05 * max(ref.norm([p[d]], 2.0), 1e-3)
        want_d = ref.f64(g[d]) * ref.scale(ref.norm([g[d]], 2.0), lim)
        np.testing.assert_allclose(ref.f64(one[d, 0]), want_d, rtol=1e-6)
    # Blocks whose shape says their units need only the axes: a (2, 6) block of a
    # (16, 6) kernel split by rows, and a (6,) block of a vector (one unit).
    g2 = (3 * rng.normal(size=(8, 2, 6))).astype(np.float32)
    p2 = rng.normal(size=(8, 2, 6)).astype(np.float32)
    lim2 = 0.05 * np.maximum(ref.norm([p2], 2.0, (0, 1)), 1e-3)
    want2 = ref.f64(g2) * ref.scale(ref.norm([g2], 2.0, (0, 1)), lim2)
    np.testing.assert_allclose(ref.f64(agc("i")(g2, p2)), want2, rtol=1e-6)
    lim1 = 0.05 * max(ref.norm([p], 2.0), 1e-3)
    want1 = ref.f64(g) * ref.scale(ref.norm([g], 2.0), lim1)
    np.testing.assert_allclose(ref.f64(agc("i")(g, p)), want1, rtol=1e-6)
    mesh = jax.make_mesh((8,), ("model",))
    spec = {"w": P("model", None)}
    body = lambda g, p: jaxclip.clip_tree_adaptive(g, p, 0.05)  # noqa: E731
    tp = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    put = lambda a: {"w": jax.device_put(a, NamedSharding(mesh, spec["w"]))}  # noqa: E731
    with pytest.raises(ValueError, match=r"leaf 'w' is a block \(1, 6\).*\('model',\)"):
        tp(put(g), put(p))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_whole_specs_inside_a_shard_map_over_some_mesh_axes(check_vma):
    """A shard_map manual over "model" only (XLA partitions "data"), with the leaves' whole
    PartitionSpecs as axis_name (a model's annotations, which name "data" too): "data"
    splits no device's block there. It was a NameError ('data' is not a mapped axis)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    whole = {"col": P("data", "model"), "row": P("model", "data"), "vec": P("data")}
    local = {"col": P(None, "model"), "row": P("model", None), "vec": P()}
    shapes = {"col": (8, 16), "row": (16, 8), "vec": (8,)}
    rng = np.random.default_rng(13)
    g = {k: (3 * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
    p = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    tx = jaxclip.clip_by_norm(1.0, axes=0, axis_name=whole)

    def body(g, p):
        clipped, state = tx.update(g, tx.init(p))
        agc = jaxclip.clip_tree_adaptive(g, p, 0.05, axis_name=whole)
        return clipped, state.norms, agc, jaxclip.global_norm(g, axis_name=whole)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(local, local),
        out_specs=(local, P(), local, P()),
        axis_names={"model"},
        check_vma=check_vma,
    )
    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, whole[k])) for k, v in t.items()}  # noqa: E731
    with jax.set_mesh(mesh):
        clipped, norms, agc, n = jax.jit(f)(put(g), put(p))
    np.testing.assert_allclose(n, ref.norm(list(g.values()), 2.0), rtol=2e-6)
    for k in shapes:
        np.testing.assert_allclose(
            ref.f64(clipped[k]), ref.clip_each(g[k], 1.0, 2.0, (0,)), rtol=2e-6
        )
        np.testing.assert_allclose(norms[k], np.max(ref.norm([g[k]], 2.0, (0,))), rtol=2e-6)
        a = None if k == "vec" else (0,)
        limit = 0.05 * np.maximum(ref.norm([p[k]], 2.0, a), 1e-3)
        want = ref.f64(g[k]) * ref.scale(ref.norm([g[k]], 2.0, a), limit)
        np.testing.assert_allclose(ref.f64(agc[k]), want, rtol=2e-6, err_msg=k)


def test_jit_on_an_explicit_mesh_with_a_leaf_split_over_two_kept_axes():
    # The per-slice norms of an (8, 64, 4) leaf over axis 1, split over x and y: they
    # stay split as they are (raveling them is an error on an Explicit mesh).
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(8)
    host = {"m": rng.normal(size=(8, 64, 4)).astype(np.float32), "b": np.ones((2, 5), np.float32)}
    specs = {"m": P("x", None, "y"), "b": P()}
    g = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    tx = jaxclip.clip_by_norm(1.0, axes=1)
    clipped, state = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_allclose(
        ref.f64(clipped["m"]), ref.clip_each(host["m"], 1.0, 2.0, (1,)), rtol=4 * 2.0**-23
    )
    want = np.max(ref.norm([host["m"]], 2.0, (1,)))
    np.testing.assert_allclose(float(state.norms["m"]), want, rtol=4 * 2.0**-23)
    _, norms = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=1))(g)
    np.testing.assert_allclose(
        ref.f64(norms["m"]), np.squeeze(ref.norm([host["m"]], 2.0, (1,)), 1), rtol=4 * 2.0**-23
    )


def test_vectors_split_over_an_explicit_mesh_are_never_stacked():
    # Concatenating a split vector would make XLA gather it (or, raveled, be an error).
    from jaxclip._norms import stacking

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    two = jax.device_put(jnp.ones(2), NamedSharding(mesh, P("x")))
    four = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("y")))
    whole = jax.device_put(jnp.ones(6), NamedSharding(mesh, P()))
    vs = [jnp.zeros(3), two, jnp.zeros(5), four, whole]
    assert stacking.groups_of(vs) == [[0, 2, 4], [1], [3]]
