"""Per-slice vectors of short slices (a conv kernel over its leading axis: a third of
the leaf) are never stacked (``stacking.STACK_MAX_SIZE``), and the plain sums' range is
one code per stacked vector (``slices._range_code``). Expected values are float64 NumPy
norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip._norms import slices, stacking
from jaxclip._norms.arith import exact_lo

BIG = stacking.STACK_MAX_SIZE


def test_vectors_above_the_size_limit_are_alone():
    sizes = [10, BIG + 1, 5, BIG + 1, BIG, BIG + 2, 1]
    vs = [jnp.zeros((n,), jnp.float32) for n in sizes]
    vs += [jnp.zeros((BIG + 1,), jnp.bfloat16), jnp.zeros((3,), jnp.bfloat16)]
    # Small ones (BIG itself is not large) group per dtype; each large one is alone.
    assert stacking.groups_of(vs) == [[0, 2, 4, 6], [1], [3], [5], [7], [8]]


def test_range_code_per_stacked_vector():
    lo = exact_lo(jnp.float32)
    cases = {
        (1.0, 2.0): 0,
        (lo, 3.0): 0,  # lo itself is exact
        (1.0, lo / 2): 1,
        (0.0,): 1,  # all zeros: too small to be exact
        (np.inf, 0.0): 2,
        (1.0, np.nan): 2,
        (0.0, np.nan): 2,
        (): 0,
    }
    code = jax.jit(slices._range_code)
    for v, want in cases.items():
        assert float(code(jnp.asarray(v, jnp.float32))) == want, v
    # A NaN among many values (XLA:CPU's library max of a long float vector can drop it).
    big = np.ones(300_000, np.float32)
    big[123_457] = np.nan
    assert float(code(jnp.asarray(big))) == 2


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = {f"k{i}": rng.normal(size=(3, 3, 160, 160)).astype(np.float32) for i in range(3)}
    t["k1"][:, :, 5, :] = 0.0  # all-zero slices: the rare pass for the state's maxima
    t["k2"] *= np.float32(1e25)  # sums overflow float32: the rare pass, shifted
    t["b"] = rng.normal(size=(4, 160)).astype(np.float32)
    return t


@pytest.mark.parametrize("clip", [0.5, 3.0])
def test_several_large_vectors_clip_and_report_as_float64(clip):
    tree = _tree()
    assert 3 * 160 * 160 > BIG  # each kernel's per-slice vector is large
    tx = jaxclip.clip_by_norm(clip, axes=0)
    g = {k: jnp.asarray(v) for k, v in tree.items()}
    out, state = jax.jit(tx.update)(g, tx.init(g))
    for k, x in tree.items():
        x64 = x.astype(np.float64)
        n = np.sqrt(np.sum(x64 * x64, axis=0, keepdims=True))
        want = np.where(n > clip, x64 * (clip / np.where(n > 0, n, 1)), x64)
        np.testing.assert_allclose(np.asarray(out[k], np.float64), want, rtol=3e-7, atol=0)
        top = float(jax.tree.leaves(state)[sorted(tree).index(k)])
        np.testing.assert_allclose(top, n.max(), rtol=3e-7)


def test_no_concatenation_of_a_large_vector_in_the_compiled_program():
    g = {k: jnp.asarray(v) for k, v in _tree().items()}
    tx = jaxclip.clip_by_norm(1.0, axes=0)
    text = jax.jit(tx.update).lower(g, tx.init(g)).compile().as_text()
    sizes = []
    for line in text.splitlines():
        if " concatenate(" in line:
            shape = line.split("=", 1)[1].split("{")[0].split("[", 1)[1].split("]")[0]
            sizes.append(int(np.prod([int(d) for d in shape.split(",") if d])))
    # The small leaf's vectors may be stacked with others; a kernel's never: a copy in
    # and out of every pass (a (512, 512, 3, 3) kernel over its last axis: 2.6x the
    # naive formula's time when its norms joined the small leaves').
    assert max(sizes, default=0) <= BIG


def test_the_rare_pass_runs_only_where_a_code_asks_for_it():
    # (code, floor above small slices' norms) -> runs, for report "none" (clipping
    # alone) and for "exact" / "largest" (reported norms), one stacked vector each.
    cases = {
        (0, True): (False, False),
        (0, False): (False, False),
        (1, True): (False, True),  # small slices the floor keeps anyway
        (1, False): (True, True),
        (2, True): (True, True),
        (2, False): (True, True),
    }
    for (code, fine), (none, reported) in cases.items():
        c, f = [jnp.float32(0), jnp.float32(code)], [jnp.bool_(True), jnp.bool_(fine)]
        assert bool(slices._goes_rare(c, f, "none")) == none, (code, fine)
        for report in ("exact", "largest"):
            assert bool(slices._goes_rare(c, f, report)) == reported, (code, fine, report)
