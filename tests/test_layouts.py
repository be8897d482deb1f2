"""Trees that mix layouts: ``axis_name`` per leaf (a tree, a rule, the leaves'
``PartitionSpec``), every norm-based mode's ``axis_name`` under ``pmap``, replicated
states, and states that optax's tools (``tree_map_params``, ``tree.get``) and
checkpointing understand. 8 simulated CPU devices (see conftest.py)."""

from __future__ import annotations

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip import _registry

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

#: A column-parallel then a row-parallel kernel, and a replicated bias.
SPECS = {"l1": P(None, "model"), "l2": P("model", None), "b": P()}


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "l1": rng.normal(size=(6, 8)).astype(np.float32),
        "l2": rng.normal(size=(8, 6)).astype(np.float32),
        "b": rng.normal(size=(6,)).astype(np.float32),
    }


def _blocks(tree: dict, n: int = 4) -> dict:
    """Per device of ``n``, its block of each leaf under SPECS, stacked for ``pmap``."""
    out = {}
    for k, v in tree.items():
        spec = tuple(SPECS[k])
        if "model" in spec:
            out[k] = np.stack(np.split(v, n, axis=spec.index("model")))
        else:
            out[k] = np.stack([v] * n)
    return out


ADAPTIVE = {
    "zclip": lambda a: jaxclip.zclip(axis_name=a),
    "auto_clip": lambda a: jaxclip.auto_clip(axis_name=a),
    "quantile_clip": lambda a: jaxclip.quantile_clip(global_threshold=True, axis_name=a),
    "standard_clip": lambda a: jaxclip.standard_clip(global_threshold=True, axis_name=a),
    "skip_large_updates": lambda a: jaxclip.skip_large_updates(optax.identity(), 1e9, axis_name=a),
}


@pytest.mark.parametrize("name", list(ADAPTIVE))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_adaptive_modes_under_pmap_log_the_global_norm_on_every_device(name):
    """A leaf split over 4 devices: each device's state holds the whole tree's norm."""
    tree = _tree()
    want = ref.norm(list(tree.values()), 2.0)
    tx = ADAPTIVE[name](SPECS)

    def run(g):
        _, state = tx.update(g, tx.init(g))
        return jaxclip.clip_stats(state)

    stats = jax.pmap(run, axis_name="model", devices=jax.devices()[:4])(_blocks(tree))
    norms = np.asarray(next(v for k, v in stats.items() if "norm" in k))
    np.testing.assert_allclose(norms, [want] * 4, rtol=2e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_mixed_layout_per_slice_norms_inside_shard_map():
    """clip_by_norm(axes=1) on a column- and a row-parallel kernel: per leaf axis names
    (a dict, a rule, the specs) give the single-device rows and a replicated state."""
    tree = {k: v for k, v in _tree().items() if k != "b"}
    mesh = jax.make_mesh((4,), ("model",))
    want_out, want_norms = jaxclip.clip_tree_by_norm(tree, 0.5, axes=1)
    want_state = {k: np.max(ref.norm([v], 2.0, (1,))) for k, v in tree.items()}
    specs = {k: SPECS[k] for k in tree}
    for axis_name in (
        {"l1": "model", "l2": ()},
        lambda path, leaf: "model" if path == "l1" else (),
        specs,
    ):
        tx = jaxclip.clip_by_norm(0.5, axes=1, axis_name=axis_name)

        def body(g, tx=tx):
            out, state = tx.update(g, tx.init(g))
            return out, state.norms

        run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(specs, P()))
        g = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
        out, state = jax.jit(run)(g)
        for k in tree:
            np.testing.assert_allclose(out[k], want_out[k], rtol=2e-6, err_msg=k)
            np.testing.assert_allclose(state[k], want_state[k], rtol=2e-6, err_msg=k)
    assert want_norms["l2"].shape == (8,)
    # The same transformation under jit over the mesh (no mapped axes: XLA partitions).
    with jax.set_mesh(mesh):
        out, state = jax.jit(lambda g: tx.update(g, tx.init(g)))(g)
    for k in tree:
        np.testing.assert_allclose(out[k], want_out[k], rtol=2e-6, err_msg=k)
        np.testing.assert_allclose(state.norms[k], want_state[k], rtol=2e-6, err_msg=k)


def test_one_axis_name_for_a_mixed_tree_sums_what_it_should_not_and_specs_do_not():
    """The issue's trap: one axis name for both kernels sums l2's row norms across devices;
    the specs take l2's rows as whole."""
    tree = {k: v for k, v in _tree().items() if k != "b"}
    mesh = jax.make_mesh((4,), ("model",))
    specs = {k: SPECS[k] for k in tree}
    want = {k: np.max(ref.norm([v], 2.0, (1,))) for k, v in tree.items()}

    def largest(axis_name):
        tx = jaxclip.clip_by_norm(1e9, axes=1, axis_name=axis_name)
        body = lambda g: jax.tree.map(  # noqa: E731
            lambda v: lax.pmax(v, "model"), tx.update(g, tx.init(g))[1].norms
        )
        run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P())
        g = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
        return jax.jit(run)(g)

    assert float(largest("model")["l2"]) > 1.1 * want["l2"]  # summed: wrong, as documented
    np.testing.assert_allclose(largest(specs)["l2"], want["l2"], rtol=2e-6)


def test_partition_spec_that_does_not_describe_the_leaf_names_it():
    mesh = jax.make_mesh((4,), ("model",))
    x = jax.device_put(_tree()["l1"], NamedSharding(mesh, P(None, "model")))
    tx = jaxclip.clip_by_norm(1.0, axes=1, axis_name={"w": P()})
    run = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P(None, "model"), out_specs=P()
    )
    with pytest.raises(ValueError, match=r"'w'.*PartitionSpec"):
        jax.jit(lambda v: run({"w": v}))(x)


def test_axis_name_trees_that_do_not_fit_say_where():
    g = {"a": jnp.ones(3), "b": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"no entry for the leaf at 'b'"):
        jaxclip.global_norm(g, axis_name={"a": ()})
    with pytest.raises(TypeError, match=r"axis_name at 'a' is 3"):
        jaxclip.clip_by_norm(1.0, axis_name={"a": 3})
    with pytest.raises(TypeError, match=r"axis_name \('b', leaf\) is 1.5"):
        jaxclip.global_norm(g, axis_name=lambda p, x: () if p == "a" else 1.5)
    # Entries that agree resolve to one value: the same compiled function as a plain name.
    assert float(jaxclip.global_norm(g, axis_name={"a": (), "b": ()})) == pytest.approx(5**0.5)


def _params() -> dict:
    return {"w": jnp.ones((4, 3)), "b": jnp.ones(3), "frozen": jnp.ones(2)}


@pytest.mark.parametrize("mode", [m.name for m in _registry.MODES if not m.batched])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_states_work_with_tree_map_params_tree_get_and_checkpoints(mode):
    """Inside a chain: shardings built from the params' specs with
    ``optax.tree_map_params`` (unselected leaves are ``optax.MaskedNode``, as
    ``optax.masked``'s), field lookup with ``optax.tree.get``, and a Flax checkpoint's
    state-dict round trip."""
    m = next(x for x in _registry.MODES if x.name == mode)
    kw = {} if mode == "clip_by_value" else {"need_clip": jaxclip.exclude_names("frozen")}
    tx = optax.chain(m.build(**kw), optax.adam(1e-3))
    params = _params()
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    specs = {"w": P("model"), "b": P(), "frozen": P()}
    shardings = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    )
    is_spec = lambda v: isinstance(v, P)  # noqa: E731
    full = jax.tree.broadcast(shardings, state, is_leaf=is_spec)
    specs_per_array = jax.tree.leaves(full, is_leaf=is_spec)
    arrays = jax.tree.leaves(state)
    assert len(specs_per_array) == len(arrays)
    for spec, v in zip(specs_per_array, arrays):  # a usable sharding: no more dims than v
        assert is_spec(spec) and len(spec) <= np.ndim(v), (spec, np.shape(v))
    restored = flax.serialization.from_state_dict(state, flax.serialization.to_state_dict(state))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if m.state is not None and "norms" in m.state._fields:
        norms = optax.tree.get(state, "norms")
        assert isinstance(norms["frozen"], optax.MaskedNode)
        assert float(norms["w"]) == pytest.approx(float(np.sqrt(12.0)))


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_flax_nnx_partition_specs_serve_as_axis_name():
    """``nnx.get_partition_spec``'s tree (shard_map's in_specs for an NNX model) as is."""
    from flax import nnx

    mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        lin = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
    _, state = nnx.split(lin, nnx.Param)
    specs = nnx.get_partition_spec(state)
    tx = jaxclip.clip_by_norm(0.5, axes=0, axis_name=specs)
    f = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=(specs,), out_specs=specs
    )
    got = jax.jit(f)(state)
    kernel = np.asarray(state["kernel"][...])
    want = ref.clip_each(kernel, 0.5, 2.0, (0,))
    np.testing.assert_allclose(np.asarray(got["kernel"][...]), want, rtol=2e-6)


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_nnx_optimizer_on_a_partition_annotated_model_keeps_scalar_norms():
    """``nnx.Optimizer`` builds states from ``nnx.Param`` variables: a per-leaf norm
    wrapped in one took the kernel's sharding (a rank-2 spec on a scalar: construction
    failed). The norms are plain scalars, each leaf's largest row norm."""
    from flax import nnx

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        lin = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
        tx = jaxclip.clip_by_norm(0.05, axes=-1, need_clip=lambda path, leaf: leaf.ndim == 2)
        opt = nnx.Optimizer(lin, optax.chain(tx, optax.sgd(0.1)), wrt=nnx.Param)
        x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(lin)
        opt.update(lin, grads)
    norms = opt.opt_state[0].norms
    assert isinstance(norms["bias"], optax.MaskedNode)
    kernel = np.asarray(norms["kernel"])  # a scalar, not a Param
    g = ref.f64(grads["kernel"][...])
    np.testing.assert_allclose(kernel, np.max(np.linalg.norm(g, axis=-1)), rtol=2e-6)


def test_specs_that_do_not_fit_their_leaves_name_them():
    """A spec with more entries than its leaf has dimensions (a prefix entry over a bias),
    and, in a global-norm mode, a leaf varying across an axis its spec does not name."""
    mesh = jax.make_mesh((4,), ("model",))
    g = {"w": np.ones((8, 4), np.float32), "b": np.ones(4, np.float32)}
    in_specs = {"w": P("model", None), "b": P()}
    for axis_name, match in (
        (P("model", None), r"'b'.*2 entries but the leaf has 1"),
        ({"w": P(), "b": P()}, r"'w' varies across mesh axes \('model',\)"),
    ):
        tx = jaxclip.zclip(axis_name=axis_name)
        run = jax.shard_map(
            lambda v, tx=tx: tx.update(v, tx.init(v))[0],
            mesh=mesh,
            in_specs=(in_specs,),
            out_specs=in_specs,
        )
        put = {k: jax.device_put(v, NamedSharding(mesh, in_specs[k])) for k, v in g.items()}
        with pytest.raises(ValueError, match=match):
            jax.jit(run)(put)


@pytest.mark.parametrize(
    "build",
    [
        lambda g: jaxclip.clip_by_global_norm(1.0, group=g),
        lambda g: jaxclip.clip_per_example(1.0, group=g, batch_size=2),
    ],
    ids=["clip_by_global_norm", "clip_per_example"],
)
def test_grouped_states_work_with_tree_map_params(build):
    """A grouped state's dict of group norms is one non-parameter subtree for
    ``optax.tree_map_params`` (its stand-in params have no paths to group), with either
    ``transform_non_params`` the distributed guide shows; it used to be an empty dict
    there, a pytree structure error against the real state."""
    tx = optax.chain(build(lambda path, _: path.split("/")[0]), optax.adam(1e-3))
    params = {"a": {"w": jnp.ones((4, 2))}, "b": {"w": jnp.ones(3)}}
    specs = {"a": {"w": P(None, "model")}, "b": {"w": P()}}
    state = tx.init(params)
    is_leaf = lambda v: isinstance(v, (optax.MaskedNode, P))  # noqa: E731
    for non_params in (lambda _: P(), lambda t: jax.tree.map(lambda _: P(), t)):
        shardings = optax.tree_map_params(
            tx, lambda _, s: s, state, specs, transform_non_params=non_params, is_leaf=is_leaf
        )
        full = jax.tree.broadcast(shardings, state, is_leaf=lambda v: isinstance(v, P))
        assert len(jax.tree.leaves(full, is_leaf=lambda v: isinstance(v, P))) == len(
            jax.tree.leaves(state)
        )
        assert optax.tree.get(shardings, "mu") == specs
