"""Agreement with the real libraries' recorded outputs (tests/reference/record.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import RECORDED

import jaxclip

TENSORS = [np.asarray(t, np.float32) for t in RECORDED["inputs"]["tensors"]]
MATRIX = np.asarray(RECORDED["inputs"]["matrix"], np.float32)


@pytest.mark.parametrize(
    "case",
    RECORDED["torch"]["clip_grad_norm_"],
    ids=lambda c: f"p{c['norm_type']}-c{c['max_norm']}",
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_torch_clip_grad_norm_(case):
    p = math.inf if case["norm_type"] == "inf" else case["norm_type"]
    clipped, total = jaxclip.clip_tree_by_global_norm(TENSORS, case["max_norm"], norm_type=p)
    np.testing.assert_allclose(total, case["total_norm"], rtol=2e-6)
    for ours, theirs in zip(clipped, case["grads"]):
        # torch divides by (total + 1e-6): agreement to that epsilon, relative.
        np.testing.assert_allclose(ours, np.asarray(theirs), rtol=2e-6, atol=1e-7)
    tx = jaxclip.clip_by_global_norm(case["max_norm"], norm_type=p)
    _, state = tx.update(TENSORS, tx.init(TENSORS))
    np.testing.assert_allclose(optax.tree.get(state, "global_norm"), case["total_norm"], rtol=2e-6)


@pytest.mark.parametrize(
    "case", RECORDED["torch"]["clip_grad_value_"], ids=lambda c: f"v{c['clip_value']}"
)
def test_torch_clip_grad_value_(case):
    out = jaxclip.clip_tree_by_value(TENSORS, case["clip_value"])
    for ours, theirs in zip(out, case["grads"]):
        np.testing.assert_array_equal(ours, np.asarray(theirs, np.float32))


@pytest.mark.parametrize(
    "case",
    RECORDED["tensorflow"]["clip_by_norm"],
    ids=lambda c: f"axes{c['axes']}-c{c['clip_norm']}",
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_tf_clip_by_norm(case):
    out, _ = jaxclip.clip_tree_by_norm(MATRIX, case["clip_norm"], axes=case["axes"])
    np.testing.assert_allclose(out, np.asarray(case["result"]), rtol=2e-6)
    tx = jaxclip.clip_by_norm(case["clip_norm"], axes=case["axes"])
    out, _ = jax.jit(tx.update)(MATRIX, tx.init(MATRIX))
    np.testing.assert_allclose(out, np.asarray(case["result"]), rtol=2e-6)


@pytest.mark.parametrize(
    "case",
    RECORDED["tensorflow"]["clip_by_global_norm"],
    ids=lambda c: f"c{c['clip_norm']}-u{c['use_norm']}",
)
def test_tf_clip_by_global_norm(case):
    out, gn = jaxclip.clip_tree_by_global_norm(
        TENSORS, case["clip_norm"], use_norm=case["use_norm"]
    )
    np.testing.assert_allclose(gn, case["global_norm"], rtol=2e-6)
    for ours, theirs in zip(out, case["result"]):
        np.testing.assert_allclose(ours, np.asarray(theirs), rtol=2e-6)


def _paddle_need_clip(form: str, bias_need_clip: bool):
    if form == "tree":
        return {"weight": True, "bias": bias_need_clip}
    return lambda path, leaf: bias_need_clip or not path.endswith("bias")


@pytest.mark.parametrize("form", ["tree", "callable"])
@pytest.mark.parametrize(
    "case", RECORDED["paddle"]["steps"], ids=lambda c: f"{c['clip']}-bias{c['bias_need_clip']}"
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_paddle_sgd_step(case, form):
    need_clip = _paddle_need_clip(form, case["bias_need_clip"])
    clip = {
        "ClipGradByValue": lambda: jaxclip.clip_by_value(max=1.0, min=-1.0, need_clip=need_clip),
        "ClipGradByNorm": lambda: jaxclip.clip_by_norm(1.0, need_clip=need_clip),
        "ClipGradByGlobalNorm": lambda: jaxclip.clip_by_global_norm(1.0, need_clip=need_clip),
    }[case["clip"]]()
    tx = optax.chain(clip, optax.sgd(RECORDED["paddle"]["lr"]))
    params = {k: jnp.asarray(case[k], jnp.float32) for k in ("weight", "bias")}
    grads = {k: jnp.asarray(case["grad_" + k], jnp.float32) for k in ("weight", "bias")}
    updates, _ = jax.jit(tx.update)(grads, tx.init(params))
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["weight"], np.asarray(case["new_weight"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["bias"], np.asarray(case["new_bias"]), rtol=1e-5, atol=1e-6)
    if not case["bias_need_clip"]:
        # The excluded bias takes the plain SGD step, as in Paddle.
        expected = np.asarray(case["bias"]) - 0.1 * np.asarray(case["grad_bias"])
        np.testing.assert_allclose(new["bias"], expected, rtol=1e-6, atol=1e-6)
