"""Which units the rare path reads again: the per-group verdicts against a NumPy spec.

A unit that is wrongly called settled would keep an inexact norm; one wrongly called
unsettled reads its data a second time for nothing. Results cannot show the second
kind, so these tests read the verdicts themselves (``slices._all_settled``) for stacked
groups, units alone, buckets of leaves, buckets of slices and per-example units, and
compare each with the rule its docstring states, written here in float64 NumPy.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxclip._norms import slices
from jaxclip._norms.arith import exact_lo, in_exact_range
from jaxclip._norms.stacking import stack

LO = exact_lo(np.float32)
F32_MAX = float(np.finfo(np.float32).max)

# Sums by their role: in range and large (a leaf's largest may be one), in range below
# 4 lo (never a leaf's largest for certain), too small to be exact, and overflowed/NaN.
LARGE = [4 * LO, 8 * LO, 1.0, 1e30, F32_MAX]  # 4 lo: the bound itself
MID = [1.5 * LO, 3.9 * LO]
LOW = [0.0, 1e-45, LO / 2, LO * 0.999]
BAD = [np.inf, np.nan]
PALETTES = [LARGE, LARGE + MID, LARGE + LOW, LARGE + BAD, LARGE + MID + LOW + BAD, LOW]


def _spec(s: np.ndarray, kind: bool | tuple[int, ...], batch: int, fine: bool, report: str) -> bool:
    """The verdict for one unit's plain sums ``s`` (``slices._settled``'s docstring)."""
    s = s.astype(np.float64).ravel()
    with np.errstate(invalid="ignore"):
        ok = (s >= LO) & (s < np.inf)
        low = s < LO
    if report == "exact" or (report == "largest" and kind is True):
        return bool(ok.all())
    if report == "none":
        return bool((ok | (low & fine)).all())
    if not s.size:
        return True
    with np.errstate(invalid="ignore"):
        code = np.where(~ok & ~(low & fine), 2, np.where(s >= 4 * LO, 1, 0))
    rows = code.reshape(batch, -1)
    if isinstance(kind, tuple):  # each leaf of each example: its rows' largest code
        leaf = np.repeat(np.arange(len(kind)), kind)
        return all(rows[b, leaf == i].max() == 1 for b in range(batch) for i in range(len(kind)))
    return bool((rows.max(axis=1) == 1).all()) if batch > 1 else bool(code.max() == 1)


# (shapes of each unit's sums, each unit's kind, batch, groups): stacked groups of
# several units beside units alone, in every kind the core builds.
LAYOUTS = {
    "leaves": ([(4, 1), (1, 1), (3, 2), (5,), (2, 2)], [False] * 5, 1, [[0, 2, 3], [1], [4]]),
    "two_stacks": ([(3,), (2, 1), (4,), (1,), (6,)], [False] * 5, 1, [[0, 1], [2, 3, 4]]),
    "buckets": ([(3, 1), (4, 1), (2, 1)], [True, True, False], 1, [[0, 1, 2]]),
    "sliced_buckets": ([(5,), (6,), (2,)], [(2, 3), (1, 4, 1), False], 1, [[0, 1, 2]]),
    "examples": ([(3, 2), (3, 1), (3, 4)], [False, True, False], 3, [[0, 1], [2]]),
    "sliced_examples": ([(2, 5), (2, 3), (2, 1)], [(3, 2), (1, 2), False], 2, [[0, 1, 2]]),
    "empty": ([(0,), (3,), (0, 2), (2,)], [False] * 4, 1, [[0, 1, 2, 3]]),
    "sliced_alone": ([(5,), (2, 3)], [(2, 3), False], 1, [[0], [1]]),
    "sliced_examples_alone": ([(2, 5), (2, 4)], [(3, 2), True], 2, [[0], [1]]),
}


def _verdicts(shapes: list, kinds: list, batch: int, groups: list, report: str):
    """A jitted ``_all_settled`` of one layout: its units' sums and floor flag in."""

    def run(plain: list[jax.Array], fine: jax.Array) -> list[jax.Array]:
        flat = [v for (v,) in stack(groups, plain)]
        units = tuple(jnp.zeros_like(v) for v in plain)  # not read by the verdicts
        n = len(plain)
        sums = slices._Sums(
            units, 2.0, (None,) * n, tuple(kinds), ((),) * n, batch, plain, groups, flat
        )
        oks = [in_exact_range(v, np.float32) for v in flat]
        return slices._all_settled(sums, oks, [fine] * len(groups), report)

    return jax.jit(run)


@pytest.mark.parametrize("report", ["exact", "largest", "none"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_unit_is_read_again_exactly_when_its_rule_says(layout: str, report: str) -> None:
    shapes, kinds, batch, groups = LAYOUTS[layout]
    verdicts = _verdicts(shapes, kinds, batch, groups, report)
    rng = np.random.default_rng(sum(map(ord, layout + report)))
    seen = set()
    for trial, fine in itertools.product(range(40), (False, True)):
        plain = []
        for shape in shapes:
            palette = PALETTES[rng.integers(len(PALETTES))]
            plain.append(rng.choice(palette, size=shape).astype(np.float32))
        got = [bool(v) for v in verdicts([jnp.asarray(s) for s in plain], jnp.asarray(fine))]
        want = [_spec(s, k, batch, fine, report) for s, k in zip(plain, kinds)]
        assert got == want, (trial, fine, [s.tolist() for s in plain])
        seen |= {(u, w) for u, w in enumerate(want)}
    # Both verdicts met for every unit with data (an all-True run would prove little).
    for u, shape in enumerate(shapes):
        if np.prod(shape):
            assert {(u, False), (u, True)} <= seen, u


@pytest.mark.parametrize("report", ["exact", "largest", "none"])
def test_the_rare_pass_runs_exactly_when_a_sum_needs_it(report: str) -> None:
    """``_goes_rare`` from each stacked vector's range code: for the floored norms alone
    ("none") only an overflow or NaN, or a small sum where the floor is below it; for
    reported norms any sum out of range."""
    go = jax.jit(
        lambda vs, fine: slices._goes_rare(
            [slices._range_code(v) for v in vs], [fine] * len(vs), report
        )
    )
    rng = np.random.default_rng(7)
    seen = set()
    for trial, fine in itertools.product(range(60), (False, True)):
        vs = [rng.choice(PALETTES[rng.integers(len(PALETTES))], size=4) for _ in range(2)]
        vs = [v.astype(np.float32) for v in vs]
        with np.errstate(invalid="ignore"):
            bad = [(~(v < np.inf)).any() for v in vs]  # overflowed or NaN
            low = [(v < LO).any() for v in vs]
        want = any(b or (lo and not fine) for b, lo in zip(bad, low))
        if report != "none":
            want = any(b or lo for b, lo in zip(bad, low))
        got = bool(go([jnp.asarray(v) for v in vs], jnp.asarray(fine)))
        assert got == want, (trial, fine, [v.tolist() for v in vs])
        seen.add((fine, want))
    assert seen == {(False, False), (False, True), (True, False), (True, True)}
