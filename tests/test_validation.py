"""Hyperparameter validation, need_clip edge cases, array bounds, non-finite edge cases and
buffer donation (issue 10, items 7 to 10): each test fails on the code before the fix."""

from __future__ import annotations

import math
import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxclip
from jaxclip._registry import MODES

INF, NAN = math.inf, math.nan


def _ids(cases):
    return [c[0] for c in cases]


# ----------------------------------------------------------------------------------------
# The type of a threshold (a str, None, a bool, a complex number).

BAD_TYPES = [
    ("str", "1.0", r"clip_norm='1.0' is a str, not a number"),
    ("None", None, r"clip_norm=None is a NoneType, not a number"),
    ("bool", True, r"clip_norm=True is a bool, not a number"),
    ("np.bool_", np.bool_(True), r"clip_norm=.*bool.*not a number"),
    ("bool-array", jnp.array(True), r"clip_norm=.* is boolean, not a number"),
    ("complex", 1 + 2j, r"clip_norm=\(1\+2j\) is complex"),
    ("complex-array", jnp.array(1.0 + 0j), r"clip_norm=.* is complex"),
    ("str-array", np.array("1.0"), r"clip_norm=.* is not a number"),
]

CLIP_NORM_USERS = [
    ("clip_by_norm", lambda c: jaxclip.clip_by_norm(c)),
    ("clip_by_global_norm", lambda c: jaxclip.clip_by_global_norm(c)),
    ("clip_tree_by_norm", lambda c: jaxclip.clip_tree_by_norm({"w": jnp.ones(2)}, c)),
    ("clip_tree_by_global_norm", lambda c: jaxclip.clip_tree_by_global_norm({"w": jnp.ones(2)}, c)),
]


@pytest.mark.parametrize("fn_name, make", CLIP_NORM_USERS, ids=_ids(CLIP_NORM_USERS))
@pytest.mark.parametrize("case, value, match", BAD_TYPES, ids=_ids(BAD_TYPES))
def test_clip_norm_of_wrong_type_is_a_clear_error(fn_name, make, case, value, match):
    with pytest.raises(
        TypeError, match=rf"jaxclip\.{fn_name}: {match}.*pass a real number > 0"
    ) as e:
        make(value)
    assert isinstance(e.value, ValueError)  # caught as either


OTHER_BAD_TYPES = [
    ("max-str", lambda: jaxclip.clip_by_value("1"), r"max='1' is a str"),
    ("max-None", lambda: jaxclip.clip_by_value(None), r"max=None is a NoneType"),
    ("min-complex", lambda: jaxclip.clip_by_value(1.0, 1j), r"min=1j is complex"),
    ("max-bool", lambda: jaxclip.clip_tree_by_value(jnp.ones(2), True), r"max=True is a bool"),
    (
        "threshold-str",
        lambda: jaxclip.skip_large_updates(optax.sgd(1.0), "5"),
        r"threshold='5' is a str",
    ),
    ("clipping-None", lambda: jaxclip.adaptive_clip(None), r"clipping=None is a NoneType"),
    ("eps-complex", lambda: jaxclip.zclip(eps=1j), r"eps=1j is complex"),
    ("alpha-str", lambda: jaxclip.zclip(alpha="0.9"), r"alpha='0.9' is a str"),
    ("percentile-bool", lambda: jaxclip.auto_clip(True), r"percentile=True is a bool"),
    ("max_norm-str", lambda: jaxclip.zclip(max_norm="1"), r"max_norm='1' is a str"),
    (
        "group-not-callable",
        lambda: jaxclip.clip_by_global_norm(1.0, group="enc"),
        r"group='enc' is a str, not a callable",
    ),
]


@pytest.mark.parametrize("case, make, match", OTHER_BAD_TYPES, ids=_ids(OTHER_BAD_TYPES))
def test_other_hyperparameters_of_wrong_type(case, make, match):
    with pytest.raises(TypeError, match=match):
        make()


@pytest.mark.parametrize(
    "value",
    [1, 0.5, np.float64(2.0), np.int32(3), jnp.float32(1.0), jnp.array(1.0, jnp.bfloat16), INF],
    ids=["int", "float", "np.float64", "np.int32", "jnp.float32", "jnp.bfloat16", "inf"],
)
def test_real_thresholds_are_accepted(value):
    jaxclip.clip_by_norm(value)
    jaxclip.clip_by_global_norm(value)
    jaxclip.skip_large_updates(optax.sgd(1.0), value)
    jaxclip.zclip(z_thresh=value, max_norm=value)
    out = jaxclip.clip_tree_by_value({"w": jnp.array([-3.0, 0.5])}, value)
    np.testing.assert_allclose(
        out["w"], [max(-3.0, -float(value)), min(0.5, float(value))], rtol=1e-2
    )


def test_traced_threshold_of_wrong_dtype_is_caught_and_real_one_is_not():
    grads = {"w": jnp.array([3.0, 4.0])}
    f = lambda c: jaxclip.clip_tree_by_global_norm(grads, c)[0]  # noqa: E731
    jax.eval_shape(f, 1.0)  # traced: its value is not checked, its type is
    with pytest.raises(TypeError, match=r"clip_norm=.* is boolean"):
        jax.eval_shape(f, True)
    tx = optax.inject_hyperparams(jaxclip.clip_by_global_norm)(clip_norm=1.0)
    jax.eval_shape(tx.update, grads, tx.init(grads))


# ----------------------------------------------------------------------------------------
# Each parameter's own reason in its error.

OWN_REASONS = [
    (
        "zclip-eps-negative",
        lambda: jaxclip.zclip(eps=-1),
        r"zclip: eps=-1 must be finite and >= 0 \(it is added to the standard deviation",
    ),
    ("zclip-eps-nan", lambda: jaxclip.zclip(eps=NAN), r"eps=nan must be finite and >= 0"),
    (
        "zclip-z_thresh",
        lambda: jaxclip.zclip(z_thresh=0.0),
        r"zclip: z_thresh=0.0 must be > 0 \(the z-score above which",
    ),
    (
        "zclip-max_norm",
        lambda: jaxclip.zclip(max_norm=-1.0),
        r"max_norm=-1.0 must be > 0 .*pass max_norm=None",
    ),
    (
        "zclip-alpha",
        lambda: jaxclip.zclip(alpha=1.0),
        r"alpha=1.0 must be in \[0, 1\) \(the weight of the old",
    ),
    (
        "skip-threshold",
        lambda: jaxclip.skip_large_updates(optax.sgd(1.0), 0.0),
        r"threshold=0.0 must be > 0 \(the largest global norm of a step that is applied",
    ),
    (
        "agc-eps",
        lambda: jaxclip.adaptive_clip(0.1, eps=0.0),
        r"eps=0.0 must be finite and > 0 \(the smallest parameter norm",
    ),
    (
        "agc-clipping",
        lambda: jaxclip.adaptive_clip(-0.1),
        r"clipping=-0.1 must be > 0 \(the largest ratio",
    ),
    (
        "auto-percentile",
        lambda: jaxclip.auto_clip(0.0),
        r"percentile=0.0 must be in \(0, 100\] \(the percentile of the past",
    ),
    (
        "clip_norm-shape",
        lambda: jaxclip.clip_by_norm(jnp.ones(2)),
        r"clip_norm must be a scalar; got an array of shape \(2,\)",
    ),
]


@pytest.mark.parametrize("case, make, match", OWN_REASONS, ids=_ids(OWN_REASONS))
def test_each_parameter_has_its_own_reason(case, make, match):
    with pytest.raises(ValueError, match=match) as e:
        make()
    if case.split("-")[1] in ("eps", "z_thresh", "threshold"):
        assert "to turn clipping off" not in str(e.value)


def test_zclip_eps_zero_is_allowed():
    jaxclip.zclip(eps=0.0)


# ----------------------------------------------------------------------------------------
# Axes.

BAD_AXES = [
    ("float", 1.0),
    ("str", "01"),
    ("bool", True),
    ("float-in-list", [0, 1.5]),
    ("nested", [[0]]),
]


@pytest.mark.parametrize("case, axes", BAD_AXES, ids=_ids(BAD_AXES))
@pytest.mark.parametrize("fn", ["clip_by_norm", "adaptive_clip"])
def test_bad_axes_are_a_clear_error(fn, case, axes):
    with pytest.raises(
        ValueError, match=rf"jaxclip\.{fn}: axes=.* must be an int or a sequence of ints"
    ):
        getattr(jaxclip, fn)(1.0, axes=axes)


def test_integer_array_axes_are_accepted():
    for axes in (np.int64(1), np.array([1]), (np.int32(-1),), jnp.array([0, 1])):
        jaxclip.clip_by_norm(1.0, axes=axes)
    tx = jaxclip.clip_by_norm(1.0, axes=np.array([1]))
    g = jnp.array([[3.0, 4.0], [0.3, 0.4]])
    out, _ = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)


# ----------------------------------------------------------------------------------------
# need_clip as an Equinox bool mask, and a bool at an empty subtree.


# need_clip is resolved by one selection helper for every mode; value clipping shows the
# selection without the cost of an eager norm.


def test_equinox_bool_mask_is_a_mask_not_a_callable():
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 10.0) if eqx.is_array(x) else x, model)
    mask = eqx.tree_at(lambda m: m.bias, jax.tree.map(lambda _: True, model), False)
    assert callable(mask)
    out = jaxclip.clip_tree_by_value(grads, 1.0, need_clip=mask)
    np.testing.assert_array_equal(out.weight, jnp.ones((2, 3)))
    assert out.bias is grads.bias
    tx = jaxclip.clip_by_norm(1.0, need_clip=mask)
    state = tx.init(model)
    assert isinstance(state.norms.bias, optax.MaskedNode) and state.norms.weight is not None
    chex.assert_trees_all_equal_structs(state, jax.eval_shape(tx.update, grads, state)[1])


def test_callable_pytrees_are_still_callables():
    # jax.tree_util.Partial is a pytree node (its args are leaves) and a callable.
    select = jax.tree_util.Partial(lambda prefix, path, leaf: path.startswith(prefix), "enc")
    grads = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([30.0])}
    out = jaxclip.clip_tree_by_value(grads, 1.0, need_clip=select)
    np.testing.assert_array_equal(out["enc"], [1.0, 1.0])
    assert out["dec"] is grads["dec"]


@pytest.mark.parametrize(
    "grads_empty, mask_entry",
    [({}, False), ({}, True), ({"x": {}}, True), ([{}], False)],
    ids=["dict-False", "dict-True", "nested-dict", "list-of-dict"],
)
def test_bool_at_an_empty_subtree_is_accepted(grads_empty, mask_entry):
    grads = {"w": jnp.array([3.0, 0.5]), "empty": grads_empty}
    out = jaxclip.clip_tree_by_value(grads, 1.0, need_clip={"w": True, "empty": mask_entry})
    np.testing.assert_array_equal(out["w"], [1.0, 0.5])
    assert out["empty"] == grads_empty
    tx = jaxclip.clip_by_norm(1.0, need_clip={"w": True, "empty": mask_entry})
    assert tx.init(grads).norms["empty"] == grads_empty


# ----------------------------------------------------------------------------------------
# adaptive_clip with a param of another shape than its gradient.


@pytest.mark.parametrize(
    "pshape, gshape",
    [((1,), (4,)), ((3, 2), (2, 3)), ((), (2,))],
    ids=["broadcastable", "transposed", "scalar"],
)
def test_adaptive_clip_param_shape_mismatch_names_the_path(pshape, gshape):
    params = {"enc": {"w": jnp.ones(pshape)}, "b": jnp.ones(2)}
    grads = {"enc": {"w": jnp.ones(gshape)}, "b": jnp.ones(2)}
    tx = jaxclip.adaptive_clip(0.1)
    with pytest.raises(
        ValueError,
        match=r"adaptive_clip: the parameter at 'enc/w' has shape .* but its gradient has shape",
    ):
        tx.update(grads, tx.init(params), params)


# ----------------------------------------------------------------------------------------
# A callable need_clip sees params in init and gradients in update.

BY_DTYPE = lambda path, leaf: leaf.dtype == jnp.float32  # noqa: E731


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxclip.clip_by_norm(1.0, need_clip=BY_DTYPE),
        lambda: jaxclip.clip_by_global_norm(
            1.0, need_clip=BY_DTYPE, group=lambda path, leaf: path[:3]
        ),
    ],
    ids=["clip_by_norm", "clip_by_global_norm-group"],
)
def test_need_clip_selecting_by_dtype_is_a_clear_error(make):
    params = {"enc": jnp.ones(2, jnp.float32), "dec": jnp.ones(3, jnp.float32)}
    grads = {"enc": jnp.ones(2, jnp.bfloat16), "dec": jnp.ones(3, jnp.float32)}
    tx = make()
    with pytest.raises(
        ValueError, match=r"'enc'.*init.*update.*select by path or shape, not by dtype"
    ):
        jax.jit(tx.update)(grads, tx.init(params))


@pytest.mark.parametrize(
    "make",
    [
        lambda rule: jaxclip.clip_by_norm(1.0, need_clip=rule),
        lambda rule: jaxclip.clip_by_global_norm(1.0, need_clip=rule, group=lambda p, x: "all"),
        lambda rule: jaxclip.quantile_clip(0.5, 4, need_clip=rule),
        lambda rule: jaxclip.clip_per_example(1.0, need_clip=rule, group=lambda p, x: "all"),
    ],
    ids=["clip_by_norm", "clip_by_global_norm-group", "quantile_clip", "clip_per_example-group"],
)
def test_a_rule_true_for_an_integer_param_leaves_it_out_in_init_as_in_update(make):
    # The gradient of an integer param is float0, which update leaves out whatever the rule
    # says; init, on the param itself, raised "the leaf at 'count' has dtype int32 and is
    # selected" for exclude_names("bias") or any rule true there (need_clip=None did not).
    params = {"w": jnp.ones(2), "bias": jnp.ones(2), "count": jnp.array(0, jnp.int32)}
    state = make(jaxclip.exclude_names("bias")).init(params)
    assert not any("count" in key for key in jaxclip.clip_stats(state))
    make(lambda path, leaf: True).init(params)


def test_an_integer_param_left_out_in_init_matches_its_float0_gradient():
    params = {"w": jnp.ones(2), "count": jnp.array(0, jnp.int32)}
    grads = jax.grad(lambda p: jnp.sum(p["w"]) * 3.0, allow_int=True)(params)
    tx = jaxclip.clip_by_norm(1.0, need_clip=lambda path, leaf: True)
    out, state = tx.update(grads, tx.init(params))  # the states' entries agree
    np.testing.assert_allclose(out["w"], np.full(2, 0.5**0.5), rtol=1e-6)
    assert isinstance(state.norms["count"], optax.MaskedNode)


def test_need_clip_selecting_by_path_keeps_states_equal():
    params = {"enc": jnp.ones(2, jnp.float32), "dec": jnp.ones(3, jnp.float32)}
    grads = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    by_path = lambda path, leaf: path.startswith("enc")  # noqa: E731
    for tx in (
        jaxclip.clip_by_norm(1.0, need_clip=by_path),
        jaxclip.clip_by_global_norm(1.0, need_clip=by_path, group=lambda p, x: p),
    ):
        s0 = tx.init(params)
        s1 = jax.eval_shape(tx.update, grads, s0)[1]
        chex.assert_trees_all_equal_structs(s0, s1)


# ----------------------------------------------------------------------------------------
# Array-valued bounds in clip_by_value / clip_tree_by_value.

G = {"w": jnp.array([[-3.0, 0.5, 2.0], [1.5, -0.2, -4.0]]), "b": jnp.array([-2.0, 2.0, 0.1])}
ARRAY_BOUNDS = [
    ("jnp-min-max", jnp.array([1.0, 0.4, 3.0]), jnp.array([-1.0, 0.0, -3.0])),
    ("np-min-max", np.array([1.0, 0.4, 3.0]), np.array([-1.0, 0.0, -3.0])),
    ("list-min-max", [1.0, 0.4, 3.0], [-1.0, 0.0, -3.0]),
    ("array-max-scalar-min", jnp.array([1.0, 0.4, 3.0]), -0.5),
    ("array-max-only", jnp.array([1.0, 0.4, 3.0]), None),
    ("column-max", jnp.array([[0.5], [1.0]]), None),
    ("uint8-max", np.array([1, 2, 3], np.uint8), None),  # -max must not wrap around
]


def _clip_ref(x, hi, lo):
    hi = np.asarray(hi, np.float64)
    lo = -hi if lo is None else np.asarray(lo, np.float64)
    return np.clip(np.asarray(x, np.float64), lo, hi)


_clip_value_jit = jax.jit(
    lambda g, hi, lo: jaxclip.clip_tree_by_value(g, hi, lo, need_clip={"w": True, "b": False})
)


@pytest.mark.parametrize("case, hi, lo", ARRAY_BOUNDS, ids=_ids(ARRAY_BOUNDS))
def test_array_bounds(case, hi, lo):
    mask = {"w": True, "b": case != "column-max"}
    out = jaxclip.clip_tree_by_value(G, hi, lo, need_clip=mask)
    for k, x in G.items():
        np.testing.assert_allclose(out[k], _clip_ref(x, hi, lo) if mask[k] else x, rtol=1e-6)
    tx = jaxclip.clip_by_value(hi, lo, need_clip=mask)
    out, _ = jax.jit(tx.update)(G, tx.init(G))
    np.testing.assert_allclose(out["w"], _clip_ref(G["w"], hi, lo), rtol=1e-6)


def test_traced_array_bounds_are_not_checked():
    hi, lo = jnp.array([1.0, 0.4, 3.0]), jnp.array([-1.0, 0.0, -3.0])
    np.testing.assert_allclose(
        _clip_value_jit(G, hi, lo)["w"], _clip_ref(G["w"], hi, lo), rtol=1e-6
    )
    _clip_value_jit(G, lo, hi)  # swapped, but traced: no check (and no error)


@pytest.mark.parametrize(
    "hi, lo, match",
    [
        (jnp.array([1.0, 0.0, 3.0]), None, r"max must be > 0 everywhere \(first at index \(1,\)\)"),
        (np.array([1.0, NAN]), None, r"max=.* is NaN \(first at index \(1,\)\)"),
        (
            jnp.array([1.0, 0.4, 3.0]),
            jnp.array([-1.0, 0.5, -3.0]),
            r"min=.* > max=.* \(first at index \(1,\)\); min must be <= max elementwise",
        ),
        ([[1.0], [2.0]], [[0.0, 3.0]], r"first at index \(0, 1\)"),
        (
            jnp.ones(3),
            jnp.zeros(2),
            r"min of shape \(2,\) and max of shape \(3,\) do not broadcast",
        ),
    ],
    ids=["max-zero", "max-nan", "min-above-max", "broadcast-2d", "shapes"],
)
def test_array_bounds_checked_elementwise(hi, lo, match):
    with pytest.raises(ValueError, match=match):
        jaxclip.clip_by_value(hi, lo)
    with pytest.raises(ValueError, match=match):
        jaxclip.clip_tree_by_value(G, hi, lo)


@pytest.mark.parametrize(
    "hi, path, shape",
    [
        (jnp.ones(2), "b", r"\(2,\)"),
        (jnp.ones((4, 3)), "b", r"\(4, 3\)"),
        (jnp.ones((2, 1)), "b", r"\(2, 1\)"),
    ],
    ids=["no-broadcast", "enlarges-leaf", "enlarges-vector"],
)
def test_bounds_that_do_not_fit_a_leaf_name_it(hi, path, shape):
    with pytest.raises(
        ValueError, match=rf"max of shape {shape} does not broadcast to the leaf at '{path}'"
    ):
        jaxclip.clip_tree_by_value(G, hi, need_clip={"w": False, "b": True})
    tx = jaxclip.clip_by_value(hi, need_clip={"w": False, "b": True})
    with pytest.raises(ValueError, match=rf"leaf at '{path}'"):
        jax.jit(tx.update)(G, tx.init(G))


# ----------------------------------------------------------------------------------------
# Non-finite edge cases.


@pytest.mark.parametrize("threshold", [INF, 1e3], ids=["threshold-inf", "threshold-finite"])
def test_skip_large_updates_skips_non_finite_steps_for_any_threshold(threshold):
    tx = jaxclip.skip_large_updates(optax.sgd(1.0), threshold)
    update = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros(2)})
    for g in ([INF, 1.0], [NAN, 1.0], [-INF, -INF]):
        out, state = update({"w": jnp.array(g)}, state)
        np.testing.assert_array_equal(out["w"], [0.0, 0.0])
    out, state = update({"w": jnp.array([3.0, 4.0])}, state)
    np.testing.assert_array_equal(out["w"], [-3.0, -4.0])
    assert int(state.skipped) == 3 and int(state.consecutive) == 0


def test_auto_clip_inf_on_first_step_scales_by_zero():
    grads = {"a": jnp.array([1.0, INF, NAN]), "b": jnp.array([2.0])}
    tx = jaxclip.auto_clip(10.0, window=4)
    update = jax.jit(tx.update)
    # An inf norm (no NaN): finite entries scale by 0 (c / inf), inf entries become NaN,
    # as clip_by_global_norm does.
    out, state = update({"a": jnp.array([1.0, INF, -2.0]), "b": jnp.array([2.0])}, tx.init(grads))
    np.testing.assert_array_equal(out["a"], [0.0, NAN, -0.0])
    np.testing.assert_array_equal(out["b"], [0.0])
    assert np.isfinite(float(state.threshold))
    # A NaN norm stays NaN everywhere.
    out, state = update(grads, tx.init(grads))
    assert all(np.isnan(x).all() for x in jax.tree.leaves(out))
    # After the non-finite steps, a finite one is its own threshold (unclipped).
    out, state = update({"a": jnp.array([0.0, 3.0, 4.0]), "b": jnp.array([0.0])}, state)
    np.testing.assert_array_equal(out["a"], [0.0, 3.0, 4.0])
    np.testing.assert_allclose(state.threshold, 5.0, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# Every mode's state is donatable (init's and update's, steps 1 and 2).

PARAMS = {"enc": {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}, "dec": jnp.ones(4)}
GRADS = jax.tree.map(lambda p: 0.5 * p, PARAMS)
_first = lambda path, leaf: path.split("/")[0]  # noqa: E731

# Every registered mode (per-example modes take batched gradients: their states are
# checked in test_per_example and test_dp), and configurations whose states differ.
TRANSFORMS = [(m.name, m.build) for m in MODES if not m.batched] + [
    (
        "clip_by_norm-axes",
        lambda: jaxclip.clip_by_norm(
            1.0, axes=0, need_clip={"enc": {"w": True, "b": False}, "dec": True}
        ),
    ),
    ("clip_by_global_norm-group", lambda: jaxclip.clip_by_global_norm(1.0, group=_first)),
    ("zclip-max_norm", lambda: jaxclip.zclip(warmup_steps=1, max_norm=1.0)),
    ("skip_large_updates-adamw", lambda: jaxclip.skip_large_updates(optax.adamw(1e-3), 10.0)),
    (
        "chain-clip_by_global_norm-adamw",
        lambda: optax.chain(jaxclip.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ),
    ("chain-zclip-adamw", lambda: optax.chain(jaxclip.zclip(warmup_steps=2), optax.adamw(1e-3))),
    (
        "inject_hyperparams-auto_clip",
        lambda: optax.inject_hyperparams(jaxclip.auto_clip, static_args=("window",))(window=3),
    ),
]


def _assert_no_shared_buffers(state):
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers), "two state fields hold one buffer"


@pytest.mark.parametrize("name, make", TRANSFORMS, ids=_ids(TRANSFORMS))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_state_is_donatable(name, make):
    tx = make()
    update = jax.jit(tx.update, donate_argnums=(1,))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for init in (tx.init, jax.jit(tx.init)):
            state = init(PARAMS)
            _assert_no_shared_buffers(state)
            for _ in range(2):  # steps 1 and 2
                _, state = update(GRADS, state, PARAMS)
                _assert_no_shared_buffers(state)


def test_integers_beyond_int64_are_named_with_the_fix():
    # torch takes such bounds through float(); JAX cannot hold the int itself.
    with pytest.raises(TypeError, match=r"beyond int64.*float\("):
        jaxclip.clip_by_value(2**64)
    with pytest.raises(TypeError, match=r"clip_norm=.*beyond int64"):
        jaxclip.clip_by_global_norm(2**70)
