"""The three transformations: chains, states, need_clip, pytrees, dtypes, hyperparameters."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref

import jaxclip

GRADS = {
    "linear": {
        "weight": np.arange(-6.0, 6.0, dtype=np.float32).reshape(3, 4),
        "bias": np.array([3.0, -4.0, 12.0], np.float32),
    },
    "head": [np.array([0.5, -0.25], np.float32)],
}
PARAMS = jax.tree.map(jnp.zeros_like, GRADS)
LEAVES = [GRADS["head"][0], GRADS["linear"]["bias"], GRADS["linear"]["weight"]]  # flat order


def _tree_close(actual, expected, rtol=1e-6, atol=0.0):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(ref.f64(a), ref.f64(e), rtol=rtol, atol=atol)


class TransformsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_global_norm_in_chain_with_sgd(self):
        tx = optax.chain(jaxclip.clip_by_global_norm(1.0), optax.sgd(0.1))
        updates, state = self.variant(tx.update)(GRADS, tx.init(PARAMS))
        clipped, n = ref.clip_global(LEAVES, 1.0)
        expected = {
            "head": [-0.1 * clipped[0]],
            "linear": {"bias": -0.1 * clipped[1], "weight": -0.1 * clipped[2]},
        }
        _tree_close(updates, expected)
        np.testing.assert_allclose(optax.tree.get(state, "global_norm"), n, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_value_in_chain_with_sgd(self):
        tx = optax.chain(jaxclip.clip_by_value(max=1.0, min=-1.0), optax.sgd(0.1))
        updates, _ = self.variant(tx.update)(GRADS, tx.init(PARAMS))
        _tree_close(updates, jax.tree.map(lambda g: -0.1 * np.clip(ref.f64(g), -1, 1), GRADS))

    @chex.variants(with_jit=True, without_jit=True)
    def test_norm_in_chain_with_sgd(self):
        tx = optax.chain(jaxclip.clip_by_norm(1.0), optax.sgd(0.1))
        updates, state = self.variant(tx.update)(GRADS, tx.init(PARAMS))
        _tree_close(updates, jax.tree.map(lambda g: -0.1 * ref.clip_each(g, 1.0), GRADS))
        norms = optax.tree.get(state, "norms")
        np.testing.assert_allclose(norms["linear"]["bias"], 13.0, rtol=1e-6)
        np.testing.assert_allclose(
            norms["linear"]["weight"], ref.norm([GRADS["linear"]["weight"]], 2.0), rtol=1e-6
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_norm_with_axes_keeps_rows_below_threshold(self):
        g = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], np.float32)
        tx = jaxclip.clip_by_norm(1.0, axes=1)
        out, state = self.variant(tx.update)(g, tx.init(g))
        np.testing.assert_allclose(out, ref.clip_each(g, 1.0, axes=(1,)), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(out)[1:], g[1:])  # below threshold: bit-exact
        np.testing.assert_allclose(state.norms, 5.0, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_global_norm_types(self):
        for p in [1.0, 2.0, 3.0, 0.5, math.inf]:
            tx = jaxclip.clip_by_global_norm(2.0, norm_type=p)
            out, state = self.variant(tx.update)(GRADS, tx.init(PARAMS))
            n = ref.norm(LEAVES, p)
            np.testing.assert_allclose(state.global_norm, n, rtol=2e-6)
            _tree_close(
                out, jax.tree.map(lambda g, n=n: ref.f64(g) * ref.scale(n, 2.0), GRADS), rtol=2e-6
            )


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_function_global_norm_matches_reference():
    for p in [1.0, 2.0, 3.0, 0.5, math.inf]:
        np.testing.assert_allclose(jaxclip.global_norm(GRADS, p), ref.norm(LEAVES, p), rtol=2e-6)


@pytest.mark.parametrize(
    "need_clip",
    [
        {"linear": {"weight": True, "bias": False}, "head": True},
        {"linear": {"weight": True, "bias": False}, "head": [True]},
        lambda path, leaf: not path.endswith("bias"),
    ],
    ids=["bool-tree", "bool-tree-full", "callable"],
)
@pytest.mark.parametrize("mode", ["value", "norm", "global"])
def test_need_clip_excludes_bias(need_clip, mode):
    grads = jax.tree.map(jnp.asarray, GRADS)
    make = {
        "value": lambda: jaxclip.clip_by_value(1.0, need_clip=need_clip),
        "norm": lambda: jaxclip.clip_by_norm(1.0, need_clip=need_clip),
        "global": lambda: jaxclip.clip_by_global_norm(1.0, need_clip=need_clip),
    }[mode]
    tx = make()
    out, state = tx.update(grads, tx.init(grads))
    assert out["linear"]["bias"] is grads["linear"]["bias"]
    w, h = GRADS["linear"]["weight"], GRADS["head"][0]
    if mode == "global":
        clipped, n = ref.clip_global([h, w], 1.0)  # the bias is left out of the norm
        np.testing.assert_allclose(state.global_norm, n, rtol=1e-6)
        np.testing.assert_allclose(out["linear"]["weight"], clipped[1], rtol=1e-6)
    elif mode == "norm":
        assert isinstance(state.norms["linear"]["bias"], optax.MaskedNode)
        np.testing.assert_allclose(out["linear"]["weight"], ref.clip_each(w, 1.0), rtol=1e-6)
    else:
        np.testing.assert_array_equal(out["linear"]["weight"], np.clip(w, -1, 1))


def test_need_clip_prefix_bool_for_subtree_and_whole_tree():
    tx = jaxclip.clip_by_value(1.0, need_clip={"linear": False, "head": True})
    out, _ = tx.update(GRADS, tx.init(GRADS))
    assert out["linear"]["weight"] is GRADS["linear"]["weight"]
    np.testing.assert_array_equal(out["head"][0], GRADS["head"][0])  # within bounds
    out, _ = jaxclip.clip_by_global_norm(1.0, need_clip=False).update(GRADS, None)
    assert all(a is b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(GRADS)))


def test_callable_need_clip_sees_paths():
    seen = []
    jaxclip.global_norm(GRADS, need_clip=lambda path, leaf: seen.append(path) or True)
    assert seen == ["head/0", "linear/bias", "linear/weight"]


def test_state_carried_through_scan():
    tx = optax.chain(jaxclip.clip_by_global_norm(1.0), optax.adam(1e-2))
    params = jax.tree.map(jnp.ones_like, PARAMS)

    def step(carry, scale):
        p, s = carry
        g = jax.tree.map(lambda x: x * scale, GRADS)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), optax.tree.get(s, "global_norm")

    (_, _), norms = jax.lax.scan(step, (params, tx.init(params)), jnp.array([1.0, 2.0, 0.5]))
    np.testing.assert_allclose(norms, np.array([1.0, 2.0, 0.5]) * ref.norm(LEAVES, 2.0), rtol=1e-6)


def test_inject_hyperparams_constant_and_schedule_without_recompiling():
    traces = []

    def loss_free_step(state, grads):
        traces.append(1)
        return tx.update(grads, state)

    schedule = optax.linear_schedule(4.0, 1.0, transition_steps=3)
    tx = optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=schedule)
    step = jax.jit(loss_free_step)
    state = tx.init(PARAMS)
    n = ref.norm(LEAVES, 2.0)
    for i in range(4):
        out, state = step(state, GRADS)
        c = 4.0 - i
        _tree_close(
            out, jax.tree.map(lambda g, c=c: ref.f64(g) * ref.scale(n, c), GRADS), rtol=2e-6
        )
    assert len(traces) == 1
    np.testing.assert_allclose(optax.tree.get(state, "global_norm"), n, rtol=1e-6)
    tx2 = optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=0.5)
    out, _ = tx2.update(GRADS, tx2.init(PARAMS))
    _tree_close(out, jax.tree.map(lambda g: ref.f64(g) * ref.scale(n, 0.5), GRADS), rtol=2e-6)


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Custom:
    w: jax.Array
    rest: list


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_pytree_kinds_pass_through():
    grads = {
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "size0": jnp.zeros((0, 3)),
        "pair": Pair(jnp.array([3.0]), jnp.array([4.0])),
        "custom": Custom(jnp.array([0.0, 12.0]), [None]),
        "int_grad": np.zeros((2,), dtype=jax.dtypes.float0),
    }
    for tx in [
        jaxclip.clip_by_global_norm(1.0),
        jaxclip.clip_by_norm(1.0),
        jaxclip.clip_by_value(1.0),
    ]:
        out, _ = jax.jit(tx.update)(grads, tx.init(grads))
        chex.assert_trees_all_equal_structs(out, grads)
        assert out["size0"].shape == (0, 3)
    out, state = jaxclip.clip_by_global_norm(1.0).update(grads, None)
    assert out["int_grad"] is grads["int_grad"]
    np.testing.assert_allclose(state.global_norm, 13.0, rtol=1e-6)
    np.testing.assert_allclose(out["custom"].w, [0.0, 12.0 / 13.0], rtol=1e-6)


def test_empty_tree():
    for tx in [
        jaxclip.clip_by_global_norm(1.0),
        jaxclip.clip_by_norm(1.0),
        jaxclip.clip_by_value(1.0),
    ]:
        out, _ = tx.update({}, tx.init({}))
        assert out == {}
    assert float(jaxclip.global_norm([])) == 0.0


def test_optax_masked_nodes():
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    grads = {"w": jnp.array([3.0, 4.0, 0.0]), "b": jnp.array([100.0, 0.0])}
    tx = optax.masked(jaxclip.clip_by_global_norm(1.0), {"w": True, "b": False})
    out, state = jax.jit(tx.update)(grads, tx.init(params))
    np.testing.assert_allclose(out["w"], [0.6, 0.8, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(out["b"], grads["b"])
    np.testing.assert_allclose(optax.tree.get(state, "global_norm"), 5.0, rtol=1e-6)
    tx = optax.masked(jaxclip.clip_by_norm(1.0), {"w": True, "b": False})
    out, state = jax.jit(tx.update)(grads, tx.init(params))
    np.testing.assert_allclose(out["w"], [0.6, 0.8, 0.0], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_dtypes_kept_and_accurate(dtype):
    g = {"a": jnp.asarray([3.0, -4.0], dtype), "b": jnp.asarray([[12.0]], dtype)}
    for tx in [
        jaxclip.clip_by_global_norm(1.0),
        jaxclip.clip_by_norm(1.0),
        jaxclip.clip_by_value(1.0, -2.0),
    ]:
        out, state = jax.jit(tx.update)(g, tx.init(g))
        chex.assert_trees_all_equal_dtypes(out, g)
    out, state = jaxclip.clip_by_global_norm(1.0).update(g, None)
    assert state.global_norm.dtype == jnp.float32
    np.testing.assert_allclose(state.global_norm, 13.0, rtol=1e-6)
    tol = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(ref.f64(out["a"]), [3 / 13, -4 / 13], rtol=tol)


def test_float64_with_x64():
    with jax.enable_x64(True):
        g = [jnp.asarray([1.0, 1e-8], jnp.float64), jnp.asarray([2.0], jnp.float32)]
        out, n = jaxclip.clip_tree_by_global_norm(g, 1.0)
        assert (
            n.dtype == jnp.float64 and out[0].dtype == jnp.float64 and out[1].dtype == jnp.float32
        )
        np.testing.assert_allclose(n, ref.norm(g, 2.0), rtol=1e-15)
        np.testing.assert_allclose(out[0], ref.f64(g[0]) / ref.norm(g, 2.0), rtol=1e-15)


def test_clip_by_value_traced_bounds_keep_bf16():
    g = jnp.asarray([-3.0, 0.3, 5.0], jnp.bfloat16)
    f = jax.jit(lambda g, hi: jaxclip.clip_tree_by_value(g, hi))
    out = f(g, jnp.float32(1.0))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        ref.f64(out), ref.f64(jnp.asarray([-1.0, 0.3, 1.0], jnp.bfloat16))
    )


def test_below_threshold_is_bit_identical():
    g = {
        "a": jnp.asarray([0.1, -0.2, 0.30000001], jnp.float32),
        "b": jnp.asarray([1e-3], jnp.bfloat16),
    }
    for tx in [
        jaxclip.clip_by_global_norm(10.0),
        jaxclip.clip_by_norm(10.0),
        jaxclip.clip_by_value(10.0),
    ]:
        out, _ = jax.jit(tx.update)(g, tx.init(g))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_tensorflow_style_functions():
    ts = [jnp.asarray([3.0, 4.0]), jnp.asarray([12.0])]
    out, n = jaxclip.clip_tree_by_global_norm(ts, 1.0)
    np.testing.assert_allclose(n, 13.0, rtol=1e-6)
    out, n = jaxclip.clip_tree_by_global_norm(ts, 1.0, use_norm=26.0)
    np.testing.assert_allclose(n, 26.0)
    np.testing.assert_allclose(out[1], [12.0 / 26.0], rtol=1e-6)
    out, norms = jaxclip.clip_tree_by_norm(jnp.asarray([[3.0, 4.0], [6.0, 8.0]]), 5.0, axes=[0])
    np.testing.assert_allclose(
        norms, [ref.norm([[3.0, 6.0]], 2.0), ref.norm([[4.0, 8.0]], 2.0)], rtol=1e-6
    )


def test_value_bounds_are_those_the_leaf_dtype_holds():
    # As optax.clip and torch.clamp: each bound rounded to the nearest value of the leaf's
    # dtype (the numerics guide says so). bfloat16 holds 0.1 as 0.10009765625; float16
    # holds 1e-8 as 0.
    bf = jnp.asarray([0.2, -0.2, 0.05], jnp.bfloat16)
    got = np.asarray(jaxclip.clip_tree_by_value(bf, 0.1), np.float64)
    nearest = float(np.asarray(jnp.asarray(0.1, jnp.bfloat16), np.float64))
    assert nearest == 0.10009765625
    np.testing.assert_array_equal(got, [nearest, -nearest, 0.050048828125])
    np.testing.assert_array_equal(np.asarray(optax.clip(0.1).update(bf, None)[0], np.float64), got)
    f16 = jnp.asarray([1e-3, -1e-3], jnp.float16)
    np.testing.assert_array_equal(np.asarray(jaxclip.clip_tree_by_value(f16, 1e-8)), [0.0, 0.0])


def test_eager_value_clipping_is_one_compiled_dispatch():
    # Op by op, an eager call ran a clamp, a compare and a select per leaf (the integer
    # keys, about a dozen ops, for a min of 0): 3.8x optax.clip's eager call on a ResNet-18
    # tree, 25x with min=0. Now one jitted program per tree structure and kernels, which new
    # values do not recompile; its outputs are those of the call under jit, bit for bit.
    from jaxclip import clipping

    rng = np.random.default_rng(0)
    tree = {
        "w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(1 << 16,)), jnp.bfloat16),
        "h": jnp.asarray(rng.normal(size=(3, 5)), jnp.float16),
    }
    for lo in (None, 0.0):
        tx = jaxclip.clip_by_value(0.5, lo)
        first = tx.update(tree, optax.EmptyState())[0]
        size = clipping._clip_values_jit._cache_size()
        for scale in (2.0, 0.25):
            g = jax.tree.map(lambda x, s=scale: (x * s).astype(x.dtype), tree)
            eager = tx.update(g, optax.EmptyState())[0]
            jitted = jax.jit(tx.update)(g, optax.EmptyState())[0]
            for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(
                    np.asarray(a).view(f"u{a.dtype.itemsize}"),
                    np.asarray(b).view(f"u{b.dtype.itemsize}"),
                )
        assert clipping._clip_values_jit._cache_size() == size
        assert jax.tree.structure(first) == jax.tree.structure(tree)


def test_value_clipping_takes_python_number_leaves():
    # Its bound check read leaf.shape: a Python float leaf raised AttributeError, where
    # every other mode (and optax.clip) takes it.
    out = jaxclip.clip_tree_by_value({"a": 3.0, "b": -5.0, "c": jnp.array([0.5])}, 1.0)
    np.testing.assert_array_equal([out["a"], out["b"]], [1.0, -1.0])
    np.testing.assert_array_equal(out["c"], [0.5])
