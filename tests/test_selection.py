"""Selection by parameter name, pattern and rank, on real Flax linen, Flax NNX and Equinox
models: the paths a rule sees are the names users see, the same for params and gradients
in every framework, and the same architecture selects the same leaves everywhere.

The expected selections come from the parameter names (``ROLES``), not from jaxclip."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref

import jaxclip

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

TOKENS = jnp.array([1, 4, 7])

# One architecture: Embedding(10, 4) -> mean over tokens -> Linear(4, 8) -> LayerNorm(8)
# -> Linear(8, 1). Each framework's parameter paths, as its users name them, and the role
# of each parameter in the architecture.
ROLES = {
    "linen": {
        "params/Embed_0/embedding": "embedding",
        "params/Dense_0/kernel": "hidden.weight",
        "params/Dense_0/bias": "hidden.bias",
        "params/LayerNorm_0/scale": "norm.scale",
        "params/LayerNorm_0/bias": "norm.offset",
        "params/Dense_1/kernel": "out.weight",
        "params/Dense_1/bias": "out.bias",
    },
    "nnx": {
        "emb/embedding": "embedding",
        "l1/kernel": "hidden.weight",
        "l1/bias": "hidden.bias",
        "ln/scale": "norm.scale",
        "ln/bias": "norm.offset",
        "l2/kernel": "out.weight",
        "l2/bias": "out.bias",
    },
    "equinox": {
        "emb/weight": "embedding",
        "l1/weight": "hidden.weight",
        "l1/bias": "hidden.bias",
        "ln/weight": "norm.scale",
        "ln/bias": "norm.offset",
        "l2/weight": "out.weight",
        "l2/bias": "out.bias",
    },
}
MATRICES = {"embedding", "hidden.weight", "out.weight"}
RULES = {
    "exclude_biases_and_norms": (lambda: jaxclip.exclude_biases_and_norms(), MATRICES),
    "min_rank(2)": (lambda: jaxclip.min_rank(2), MATRICES),
    # Equinox calls LayerNorm's scale "weight": only the biases go.
    "exclude_names(bias)": (
        lambda: jaxclip.exclude_names("bias"),
        MATRICES | {"norm.scale"},
    ),
    "matrices but embeddings": (
        lambda: jaxclip.min_rank(2) & ~jaxclip.by_path("*emb*"),
        {"hidden.weight", "out.weight"},
    ),
    # One rule for linen ("LayerNorm_0") and Equinox/NNX ("ln"): each framework's tree has
    # only one of the two patterns, which allow_unmatched declares intended.
    "biases or embeddings (regex)": (
        lambda: (
            jaxclip.by_name("bias") & ~jaxclip.by_path("*LayerNorm*", "ln/*", allow_unmatched=True)
            | jaxclip.by_path(re.compile(r".*[Ee]mb.*"))
        ),
        {"embedding", "hidden.bias", "out.bias"},
    ),
}


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(10, 4)(tokens).mean(0)
        h = nn.LayerNorm()(jnp.tanh(nn.Dense(8)(h)))
        return nn.Dense(1)(h)[0]


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(10, 4, rngs=rngs)
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.ln = nnx.LayerNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, tokens):
        h = self.emb(tokens).mean(0)
        return self.l2(self.ln(jnp.tanh(self.l1(h))))[0]


class EqxModel(eqx.Module):
    emb: eqx.nn.Embedding
    l1: eqx.nn.Linear
    ln: eqx.nn.LayerNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(10, 4, key=k1)
        self.l1 = eqx.nn.Linear(4, 8, key=k2)
        self.ln = eqx.nn.LayerNorm(8)
        self.l2 = eqx.nn.Linear(8, 1, key=k3)

    def __call__(self, tokens):
        h = jax.vmap(self.emb)(tokens).mean(0)
        return self.l2(self.ln(jnp.tanh(self.l1(h))))[0]


def _loss(y):
    return (y - 3.0) ** 2


def _filled(shapes):
    """Arrays of the traced structure, leaf i holding (1, 2, ..., size) * (i + 1) / size."""
    leaves, treedef = jax.tree.flatten(shapes)
    return treedef.unflatten(
        [
            jnp.reshape((jnp.arange(x.size, dtype=x.dtype) + 1) * (i + 1) / x.size, x.shape)
            for i, x in enumerate(leaves)
        ]
    )


# linen and Equinox: the params and the gradients as jax.grad / eqx.filter_grad return them
# (their structure, traced with eval_shape: no compile), filled with known values. NNX: real
# gradients of a real model (the optimizer test trains it).
@functools.cache
def _linen():
    model = LinenModel()

    def init_and_grad(key):
        params = model.init(key, TOKENS)
        return params, jax.grad(lambda v: _loss(model.apply(v, TOKENS)))(params)

    return _filled(jax.eval_shape(init_and_grad, jax.random.key(0)))


@functools.cache
def _nnx_model_and_grads():
    @nnx.jit
    def build():  # one compile for the initialisation and the gradient
        model = NNXModel(nnx.Rngs(0))
        return model, nnx.grad(lambda m: _loss(m(TOKENS)))(model)

    return build()


def _nnx():
    model, grads = _nnx_model_and_grads()
    return nnx.state(model, nnx.Param), grads


def _fresh_nnx_model():
    """A copy of the model whose gradients ``_nnx`` holds, for a training step."""
    return nnx.clone(_nnx_model_and_grads()[0])


@functools.cache
def _equinox():
    def init_and_grad(key):
        model = EqxModel(key)
        grads = eqx.filter_grad(lambda m: _loss(m(TOKENS)))(model)
        return eqx.filter(model, eqx.is_array), grads

    return _filled(eqx.filter_eval_shape(init_and_grad, jax.random.key(0)))


MODELS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox}


def _raw_paths(tree):
    """The paths as ``jax.tree_util.keystr`` writes them (NNX: ``.../value``)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]


def _seen_paths(tree):
    """The paths that a need_clip function is called with (traced only, not run)."""
    seen = []
    jax.eval_shape(
        lambda t: jaxclip.global_norm(t, need_clip=lambda path, leaf: seen.append(path) is None),
        tree,
    )
    return seen


@pytest.mark.parametrize("framework", MODELS)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_need_clip_sees_parameter_names_for_params_and_grads(framework):
    params, grads = MODELS[framework]()
    names = set(ROLES[framework])
    assert set(_seen_paths(params)) == names
    assert _seen_paths(grads) == _seen_paths(params)
    if framework == "nnx":  # what JAX itself calls them: the wrapper's attribute at the end
        assert {p.removesuffix("/value") for p in _raw_paths(grads)} == names
        assert all(p.endswith("/value") for p in _raw_paths(grads))


def test_linen_boxed_partitioned_params_keep_their_names():
    class Sharded(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(3, kernel_init=init)(x).sum()

    # Shapes only: selection is decided at trace time, so nothing needs to run.
    params = jax.eval_shape(Sharded().init, jax.random.key(0), jnp.ones((1, 2)))
    assert "params/Dense_0/kernel/value" in _raw_paths(params)
    assert sorted(_seen_paths(params)) == ["params/Dense_0/bias", "params/Dense_0/kernel"]
    norms = jax.eval_shape(
        lambda p: jaxclip.clip_tree_by_norm(p, 1.0, need_clip=jaxclip.exclude_names("bias"))[1],
        params,
    )
    assert _seen_paths(norms) == ["params/Dense_0/kernel"]  # None at the bias


def _expected(framework, roles):
    return {path for path, role in ROLES[framework].items() if role in roles}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("framework", MODELS)
def test_rules_select_the_same_parameters_in_every_framework(framework, rule):
    # Value clipping shows the selection leaf by leaf (and costs no norm compile per rule).
    make, roles = RULES[rule]
    _, grads = MODELS[framework]()
    chosen = _expected(framework, roles)
    assert len(chosen) == len(roles)  # every role has a parameter in each framework
    clipped = jaxclip.clip_tree_by_value(grads, 1e-6, need_clip=make())
    leaves = jax.tree.leaves(grads)
    assert all(np.abs(x).max() > 1e-6 for x in leaves)  # clipping changes every leaf
    for path, before, after in zip(_seen_paths(grads), leaves, jax.tree.leaves(clipped)):
        if path in chosen:
            np.testing.assert_array_equal(after, np.clip(before, -1e-6, 1e-6), err_msg=path)
        else:
            assert after is before, path


@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_rules_inside_nnx_optimizer():
    # Inside nnx.Optimizer the updates are plain arrays (no Variables): the same selection.
    rule, chosen = jaxclip.exclude_biases_and_norms(), _expected("nnx", MATRICES)
    model = _fresh_nnx_model()
    tx = optax.chain(
        jaxclip.clip_by_global_norm(1e-3, need_clip=rule),
        jaxclip.clip_by_norm(1e9, need_clip=rule),  # no-op, for its per-leaf state
        optax.sgd(1.0),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = nnx.state(model, nnx.Param)
    before = {p: ref.f64(x) for p, x in zip(_seen_paths(state), jax.tree.leaves(state))}
    grads = _nnx()[1]  # the gradients of this model
    g = dict(zip(_seen_paths(grads), (ref.f64(x) for x in jax.tree.leaves(grads))))
    nnx.jit(lambda optimizer, model, grads: optimizer.update(model, grads))(optimizer, model, grads)
    norm = ref.norm([g[p] for p in chosen], 2.0)
    stats = jaxclip.clip_stats(optimizer.opt_state)
    assert set(stats) == {"0/global_norm"} | {f"1/norms/{p}" for p in chosen}
    np.testing.assert_allclose(stats["0/global_norm"], norm, rtol=1e-5)
    for p in chosen:  # clip_by_norm sees the clipped updates
        np.testing.assert_allclose(
            stats[f"1/norms/{p}"], ref.norm([g[p]], 2.0) * 1e-3 / norm, rtol=1e-5
        )
    state = nnx.state(model, nnx.Param)
    after = dict(zip(_seen_paths(state), jax.tree.leaves(state)))
    for path in before:
        step = g[path] * (1e-3 / norm if path in chosen else 1.0)
        np.testing.assert_allclose(
            after[path] - before[path], -step, rtol=1e-4, atol=1e-7, err_msg=path
        )


def test_nnx_masks_line_up_with_bare_arrays_and_name_a_real_mismatch():
    # A mask of Param-wrapped bools (from the params), a plain dict and nnx.to_pure_dict's
    # dict all select the same leaves of wrapped and of bare (nnx.as_pure) gradients.
    params, grads = _nnx()
    masks = [
        jax.tree.map(lambda p: p.ndim > 1, params),
        nnx.to_pure_dict(jax.tree.map(lambda p: p.ndim > 1, params)),
    ]
    expected = {p for p, x in zip(_seen_paths(grads), jax.tree.leaves(grads)) if x.ndim > 1}
    for tree in (grads, nnx.as_pure(grads)):
        for mask in masks:
            clipped = jaxclip.clip_tree_by_value(tree, 1e-6, need_clip=mask)
            changed = {
                p
                for p, a, b in zip(
                    _seen_paths(tree), jax.tree.leaves(tree), jax.tree.leaves(clipped)
                )
                if a is not b
            }
            assert changed == expected
    extra = nnx.to_pure_dict(jax.tree.map(lambda _: True, params)) | {"head": {"kernel": True}}
    with pytest.raises(ValueError, match=r"entry at 'head/kernel' but the gradients have no leaf"):
        jaxclip.global_norm(nnx.as_pure(grads), need_clip=extra)
    missing = nnx.to_pure_dict(jax.tree.map(lambda _: True, params))
    del missing["l2"]
    with pytest.raises(ValueError, match=r"no entry for the gradient leaf at 'l2/bias'"):
        jaxclip.global_norm(grads, need_clip=missing)


def test_selectors_compose_and_read_as_written():
    rule = jaxclip.min_rank(2) & ~jaxclip.by_name("embedding") | jaxclip.by_path("head/*")
    assert repr(rule) == "min_rank(2) & ~by_name('embedding') | by_path('head/*')"
    assert repr(~rule) == "~(min_rank(2) & ~by_name('embedding') | by_path('head/*'))"
    m, v = np.ones((2, 2)), np.ones(2)
    assert rule.matches("enc/kernel", m) and not rule.matches("enc/bias", v)
    assert not rule.matches("emb/embedding", m) and rule.matches("head/bias", v)
    # A plain function composes too.
    both = jaxclip.min_rank(2) & (lambda path, leaf: path.startswith("enc"))
    assert both.matches("enc/kernel", m) and not both.matches("dec/kernel", m)


def test_selector_errors_say_what_to_pass():
    with pytest.raises(ValueError, match=r"min_rank: rank=1.5 must be a Python int >= 0"):
        jaxclip.min_rank(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"by_name: pass at least one name \(a str\)"):
        jaxclip.by_name()
    with pytest.raises(TypeError, match=r"exclude_names: 3 of type int is not a parameter name"):
        jaxclip.exclude_names(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"by_name: re.compile\('b.\*'\) of type Pattern"):
        jaxclip.by_name(re.compile("b.*"))  # type: ignore[arg-type]
    # exclude_paths takes compiled regular expressions like by_path.
    rule = jaxclip.exclude_paths(re.compile(r"emb/.*"), "*/bias")
    assert not rule.matches("emb/weight", None) and not rule.matches("l1/bias", None)
    assert rule.matches("l1/weight", None)
    bad = jaxclip.Selector(lambda path, leaf: "yes")
    with pytest.raises(TypeError, match=r"need_clip\('w', leaf\) returned 'yes'"):
        jaxclip.global_norm({"w": jnp.ones(2)}, need_clip=bad)
    with pytest.raises(TypeError, match=r"selector <lambda> returned 'yes'.*leaf at 'w'"):
        jaxclip.global_norm({"w": jnp.ones(2)}, need_clip=~bad)


# A name or path pattern that matches no leaf is an error, not a silent "clip everything".
UNMATCHED = {
    "exclude_names": (lambda **kw: jaxclip.exclude_names("biases", **kw), "'biases'"),
    "by_name": (lambda **kw: jaxclip.by_name("bias", "scales", **kw), "'scales'"),
    "exclude_paths": (lambda **kw: jaxclip.exclude_paths("l2/*", **kw), "'l2/*'"),
    "by_path": (lambda **kw: jaxclip.by_path(re.compile(r"enc/\d+"), **kw), "enc/\\\\d+"),
    "in a combination": (
        lambda **kw: jaxclip.min_rank(2) & ~jaxclip.by_name("embedding", **kw),
        "'embedding'",
    ),
    "negated twice": (lambda **kw: ~jaxclip.exclude_paths("*/gamma", **kw), "'*/gamma'"),
}
SMALL = {"l1": {"w": jnp.full((2, 2), 2.0), "bias": jnp.full(2, 100.0)}}


@pytest.mark.parametrize("case", UNMATCHED)
def test_a_pattern_that_matches_no_leaf_is_an_error_naming_it_and_the_paths(case):
    make, shown = UNMATCHED[case]
    with pytest.raises(ValueError, match="matches no leaf") as info:
        jaxclip.global_norm(SMALL, need_clip=make())
    message = str(info.value)
    assert shown in message and "'l1/bias'" in message and "'l1/w'" in message, message
    assert "allow_unmatched=True" in message, message


@pytest.mark.parametrize("case", UNMATCHED)
def test_allow_unmatched_lets_a_pattern_match_nothing(case):
    make, _ = UNMATCHED[case]
    rule = make(allow_unmatched=True)
    # The result is whatever the rule selects; the unmatched pattern itself decides nothing.
    expected = {
        path: bool(rule.matches(path, x))
        for path, x in (("l1/w", SMALL["l1"]["w"]), ("l1/bias", SMALL["l1"]["bias"]))
    }
    norm = jaxclip.global_norm(SMALL, need_clip=rule)
    want = np.sqrt(16.0 * expected["l1/w"] + 20000.0 * expected["l1/bias"])
    np.testing.assert_allclose(norm, want, rtol=1e-6)


def test_unmatched_is_checked_in_transformations_and_per_example_too():
    with pytest.raises(ValueError, match="'biases' of exclude_names"):
        tx = jaxclip.clip_by_global_norm(1.0, need_clip=jaxclip.exclude_names("biases"))
        tx.update(SMALL, tx.init(SMALL))
    with pytest.raises(ValueError, match="'l2/\\*' of exclude_paths"):
        jaxclip.clip_by_value(1.0, need_clip=jaxclip.exclude_paths("l2/*")).update(SMALL, None)
    batch = jax.tree.map(lambda x: jnp.stack([x, x]), SMALL)
    with pytest.raises(ValueError, match="'emb' of by_name"):
        jaxclip.clip_tree_per_example(batch, 1.0, need_clip=jaxclip.by_name("emb"))


def test_a_pattern_matching_a_frozen_or_masked_parameter_is_matched():
    # The bias is in the tree, without a gradient: None (frozen, eqx.filter) or
    # optax.MaskedNode (optax.masked hands the inner transform those). Was "the name 'bias'
    # of exclude_names(...) matches no leaf ... Check its spelling".
    rule = jaxclip.exclude_names("bias")
    for absent in (None, optax.MaskedNode()):
        grads = {"l1": {"w": SMALL["l1"]["w"], "bias": absent}}
        np.testing.assert_allclose(jaxclip.global_norm(grads, need_clip=rule), 4.0)
    tx = optax.masked(jaxclip.clip_by_norm(1.0, need_clip=rule), {"l1": {"w": True, "bias": False}})
    updates, _ = tx.update(SMALL, tx.init(SMALL))
    np.testing.assert_allclose(updates["l1"]["w"], np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="'biases' of exclude_names"):  # a typo still is one
        jaxclip.global_norm(grads, need_clip=jaxclip.exclude_names("biases"))


def test_a_matched_pattern_is_not_an_error_when_the_rule_selects_nothing():
    # "bias" matches a leaf; the rule then selects nothing, which is a valid selection.
    rule = jaxclip.by_name("bias") & jaxclip.min_rank(2)
    clipped, norm = jaxclip.clip_tree_by_global_norm(SMALL, 1.0, need_clip=rule)
    assert float(norm) == 0.0
    assert clipped["l1"]["bias"] is SMALL["l1"]["bias"] and clipped["l1"]["w"] is SMALL["l1"]["w"]


EXPLICITLY_NOTHING = {
    "need_clip=False": False,
    "an all-False mask": {"l1": {"w": False, "bias": False}},
    "a rule that is False everywhere": lambda path, leaf: False,
    "a Selector that is False everywhere": jaxclip.Selector(lambda path, leaf: False),
}


@pytest.mark.parametrize("case", EXPLICITLY_NOTHING)
def test_an_explicit_selection_of_nothing_clips_nothing(case):
    need_clip = EXPLICITLY_NOTHING[case]
    clipped, norm = jaxclip.clip_tree_by_global_norm(SMALL, 1.0, need_clip=need_clip)
    assert float(norm) == 0.0  # as Paddle: no parameter takes part, the norm is empty
    assert jax.tree.leaves(clipped) == jax.tree.leaves(SMALL)
    assert all(a is b for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(SMALL)))
    tx = jaxclip.clip_by_norm(1.0, need_clip=need_clip)
    updates, _ = tx.update(SMALL, tx.init(SMALL))
    assert all(a is b for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(SMALL)))


def test_exclude_biases_and_norms_needs_no_bias_or_scale():
    # One rule for every framework: a tree without "scale" (Equinox) or "bias" is fine.
    grads = {"w": jnp.full((2, 2), 2.0), "v": jnp.ones(3)}
    np.testing.assert_allclose(
        jaxclip.global_norm(grads, need_clip=jaxclip.exclude_biases_and_norms()), 4.0
    )


def test_allow_unmatched_must_be_a_bool():
    with pytest.raises(TypeError, match="allow_unmatched=True or False"):
        jaxclip.by_name("bias", allow_unmatched="yes")  # pyright: ignore[reportArgumentType]
