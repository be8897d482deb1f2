"""Guards for the speed mechanisms (timings live in benchmarks/, not here)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import xla_cpu_only
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip
from jaxclip import _norms
from jaxclip._norms import units


def _reduce_count(fn, tree) -> int:
    return jax.jit(fn).lower(tree).as_text().count("stablehlo.reduce")


def _widest_concatenate(compiled) -> int:
    """The most operands of any concatenation in an optimized program (JAX lowers a long
    one as a tree of 16-operand ones, which XLA merges back)."""
    text = compiled.as_text()
    ops = re.findall(r" concatenate\(([^)]*)\)", text)
    assert ops  # the buckets' concatenations
    return max(o.count("%") for o in ops)


def _chunks(n: int) -> int:
    return -(-n // units.BUCKET_MAX_LEAVES)


@pytest.mark.slow  # 7 s: the default step's budget
def test_thousand_leaf_global_norm_lowers_to_a_handful_of_reductions():
    tree = {f"p{i:04d}": jnp.ones((10,)) * (i + 1) for i in range(1000)}
    fn = lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)  # noqa: E731
    ours = _reduce_count(fn, tree)
    theirs = _reduce_count(lambda g: optax.clip_by_global_norm(1.0).update(g, None), tree)
    assert theirs >= 1000  # one kernel per leaf: what makes optax slow to compile
    # Per bucket its sum; on the rare path the same sum rescaled, by XLA's fused reduce
    # over blocks (a tail block, and the library sum of the block sums).
    assert ours <= 4 * _chunks(1000), ours
    # Buckets of at most BUCKET_MAX_LEAVES leaves: XLA's layout assignment is
    # superlinear in a concatenation's operands (a 4000-leaf clip_by_norm compiled in
    # 98 s with one bucket, 56 s with buckets of 256).
    compiled = jax.jit(fn).lower(tree).compile()
    assert _widest_concatenate(compiled) <= units.BUCKET_MAX_LEAVES
    expected = np.sqrt(sum(10.0 * (i + 1) ** 2 for i in range(1000)))
    np.testing.assert_allclose(float(compiled(tree)[1]), expected, rtol=2e-7)


@pytest.mark.slow  # 10 s: the default step's budget
@xla_cpu_only
def test_thousand_leaf_clip_by_norm_buckets_its_reductions():
    tree = {f"p{i:04d}": jnp.full((10 + i % 7,), i - 500.0) for i in range(1000)}
    fn = lambda g: jaxclip.clip_tree_by_norm(g, 1.0)  # noqa: E731
    # Per bucket: its sum and the all() over its in-range flags, and the any()s of its
    # small and overflowed sums (the floor); on the rare path the all() that picks it and
    # the rescaled sum, twice (the floored norms' cond and the reported norms'); one all()
    # over the units. A thousand leaves, not a thousand reductions.
    assert _reduce_count(fn, tree) <= 8 * _chunks(1000) + 1
    compiled = jax.jit(fn).lower(tree).compile()
    assert _widest_concatenate(compiled) <= units.BUCKET_MAX_LEAVES
    norms = compiled(tree)[1]
    # Leaf 500 is all zeros: its bucket takes the rare path, the others stay exact.
    expected = {f"p{i:04d}": abs(i - 500.0) * np.sqrt(10 + i % 7) for i in range(1000)}
    got = {k: float(v) for k, v in norms.items()}
    np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), rtol=2e-7)


def _calls(fn, tree) -> int:
    return jax.jit(fn).lower(tree).as_text(dialect="hlo").count(" call(")


@pytest.mark.parametrize("mode", ["global", "norm", "adaptive", "value"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_no_call_per_leaf(mode):
    # jnp.pad, jnp.where, jnp.clip and lax.dynamic_index_in_dim are jitted functions: each use is
    # a call in the program, which XLA's passes inline. Per leaf, they made a third of a
    # transformer's clip_by_norm compile (HLO passes 1.05 s -> 0.65 s without them).
    def tree(n: int) -> dict[str, jax.Array]:
        large = {f"w{i}": jnp.ones((128, 16 + i % 3)) for i in range(n)}
        return large | {f"b{i}": jnp.ones((16 + i % 5,)) for i in range(2 * n)}

    def fn(t):
        agc = jaxclip.adaptive_clip(0.01)
        return {
            "global": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[0],
            "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0)[0],
            "adaptive": lambda g: agc.update(g, agc.init(t), t)[0],
            "value": lambda g: jaxclip.clip_tree_by_value(g, 1.0),
        }[mode]

    small, large = tree(8), tree(24)
    # The scalar maths' calls are a fixed number; 48 more leaves add none.
    assert _calls(fn(large), large) == _calls(fn(small), small)


#: Whole-leaf clipping, the modes whose compiled kernels the tests below inspect.
_WHOLE = {
    "global": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[0],
    "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0)[0],
}


def _computations(fn, tree) -> list[str]:
    """The computations of ``fn``'s optimized program (fused ones, branches, entry)."""
    return jax.jit(fn).lower(tree).compile().as_text().split("\n\n")


def _kernels(fn, tree, shape: str) -> list[str]:
    """The compiled fused computations that output ``shape``."""
    return [
        b
        for b in _computations(fn, tree)
        if b.startswith("%fused") and f") -> {shape} {{" in b.split("\n")[0]
    ]


def _kernel_sizes(fn, tree, shape: str) -> list[int]:
    """Instruction counts of the compiled fused computations that output ``shape``."""
    return [b.count("\n") for b in _kernels(fn, tree, shape)]


@xla_cpu_only
@pytest.mark.parametrize("mode", ["global", "norm"])
def test_scaling_kernels_do_not_recompute_the_factor(mode):
    # XLA copies cheap scalar producers into every consumer: if the factor's maths (~90
    # ops of exponents and powers of two) reached each leaf's scaling kernel, compile
    # time would grow ~10x per leaf (3.7 s -> 1.7 s on a 193-leaf transformer once fixed).
    tree = {f"w{i}": jnp.ones((128, 160)) for i in range(12)}
    sizes = _kernel_sizes(_WHOLE[mode], tree, "f32[128,160]")
    assert len(sizes) >= 12, sizes  # one scaling kernel per leaf
    # x, f0, f1 (per-leaf factors: dynamic slices of the stacked vectors); compare,
    # select, 2 mul
    assert max(sizes) <= 26, sizes


def _kernel_bodies(fn, tree, shape: str) -> list[str]:
    """The compiled fused computations that output ``shape``, with names blanked."""
    return [
        re.sub(r"%[\w.\-]+|, metadata=\{.*?\}", "", b.split("\n", 1)[1])
        for b in _kernels(fn, tree, shape)
    ]


@xla_cpu_only
@pytest.mark.parametrize("mode", ["norm", "adaptive"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_alike_leaves_share_one_scaling_kernel(mode):
    # XLA:CPU compiles each distinct kernel (~40 ms); optax's alike leaves share theirs.
    # Ours read their factors out of stacked vectors at offsets XLA cannot fold
    # (_norms.backend.opaque): at constant offsets each leaf's kernel would be distinct.
    # Large leaves, and small ones in bucket rows.
    tree = {f"w{i}": jnp.ones((128, 160)) for i in range(6)}
    tree |= {f"b{i}": jnp.ones((96,)) for i in range(6)}
    agc = jaxclip.adaptive_clip(0.01)
    fn = {"norm": _WHOLE["norm"], "adaptive": lambda g: agc.update(g, agc.init(tree), tree)[0]}[
        mode
    ]
    for shape in ("f32[128,160]", "f32[96]"):
        bodies = _kernel_bodies(fn, tree, shape)
        assert len(bodies) >= 6 and len(set(bodies)) == 1, (shape, len(bodies), len(set(bodies)))


def _full_size_broadcasts(fn, tree, shape: str) -> list[str]:
    """Broadcasts to ``shape`` that the compiled program materialises (outside fusions,
    in every branch): memory_analysis() does not count a conditional branch's buffers."""
    blocks = [b for b in _computations(fn, tree) if not b.startswith(("%fused", "%wrapped"))]
    return [
        line.split("=")[0].strip()
        for b in blocks
        for line in b.splitlines()
        if "broadcast" in line.split("=")[0] and f"= {shape}" in line
    ]


@xla_cpu_only
@pytest.mark.parametrize("mode", ["global", "norm"])
def test_rare_paths_materialise_no_broadcast(mode):
    # Alike leaves reading one shared scale factor through one barrier: XLA:CPU built
    # the factor's broadcast once, at full size, in the rare branch (6.7 MB and 1.4x the
    # rare path's time on 10 leaves of 1024 x 1640).
    tree = {f"w{i}": jnp.ones((256, 160)) for i in range(4)}
    assert _full_size_broadcasts(_WHOLE[mode], tree, "f32[256,160]") == []


@xla_cpu_only
def test_large_leaves_are_not_bucketed():
    big = jnp.ones((units.BUCKET_MAX_BYTES // 4 + 1,))
    text = jax.jit(lambda g: jaxclip.global_norm(g)).lower([big, big]).as_text()
    # (The rare path stacks its chunk results: a concatenation, but not of the leaves.)
    concats = [line for line in text.splitlines() if "stablehlo.concatenate" in line]
    assert not any(f"<{2 * big.size}x" in line for line in concats), concats
    # Per leaf: the plain sum of squares, and the rare path's rescaled one.
    assert text.count("stablehlo.reduce") == 2 * 2


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_small_leaves_are_not_bucketed():
    mesh = Mesh(
        np.array(jax.devices()[:8]).reshape(2, 4),
        ("data", "model"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    sharded = [
        jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model"))) for _ in range(3)
    ]
    replicated = [jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P())) for _ in range(3)]
    with jax.set_mesh(mesh):
        text = jax.jit(lambda g: jaxclip.global_norm(g)).lower(sharded + replicated).as_text()
    # One bucket for the three replicated leaves; the sharded ones are reduced in place:
    # their sum, and on the rare path the same sum rescaled; the bucket's two sums.
    assert text.count("stablehlo.concatenate") == 1
    assert text.count("stablehlo.reduce") == 2 * 3 + 2


@xla_cpu_only
@pytest.mark.parametrize(
    "dtype",  # float16 takes bfloat16's path (suite margin: it runs in the slow step)
    [
        pytest.param(jnp.float32, marks=pytest.mark.slow),
        jnp.bfloat16,
        pytest.param(jnp.float16, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("mode", ["global", "norm"])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_temporaries_bounded_with_buckets(mode, dtype, monkeypatch):
    # Several buckets (BUCKET_MAX_LEAVES): with more than one, the rare path's scale
    # factors were once broadcast to a bucket's shape (2 MB for 1000 small leaves).
    monkeypatch.setattr(units, "BUCKET_MAX_LEAVES", 8)
    rng = np.random.default_rng(0)
    small = [jnp.asarray(rng.normal(size=(300 + 3 * i,)), dtype) for i in range(24)]
    large = [jnp.asarray(rng.normal(size=(256, 512)), dtype) for _ in range(2)]
    tree = small + large
    f = {
        "global": lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0),
        "norm": lambda g: jaxclip.clip_tree_by_norm(g, 1.0),
    }[mode]
    compiled = jax.jit(f).lower(tree).compile()
    # Three buckets, unless a trace made with the default size was reused (these shapes
    # are this test's own).
    assert _widest_concatenate(compiled) <= 8
    temp = compiled.memory_analysis().temp_size_in_bytes
    total = sum(x.nbytes for x in tree)
    # clip_by_norm pads each bucketed leaf to the next power of two (at most 2x).
    bucketed = sum(x.nbytes for x in small) * (2 if mode == "norm" else 1)
    assert temp <= 0.02 * total + bucketed, (temp, total, bucketed)


@xla_cpu_only
@pytest.mark.parametrize(
    ("shape", "axes", "library"),
    [((512, 128), 1, True), ((512, 128), 0, False), ((512, 16), 1, False)],
)
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_rare_path_rescales_long_trailing_rows_in_the_library(shape, axes, library):
    # Zero rows (an embedding's unused rows) take the rare path on every step. Its
    # rescaled rows ran 5-7x faster in XLA:CPU's library reduction than in the fused one
    # (12 against 44 ms on 50000 rows of 512); short rows and leading axes stay fused.
    text = jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=axes)[0])
    text = text.lower(jnp.ones(shape)).compile().as_text()
    assert text.count("__ynn_fusion") == (2 if library else 1)


def _per_example_text(tree) -> str:
    return jax.jit(lambda g: jaxclip.clip_tree_per_example(g, 1.0)).lower(tree).as_text()


@xla_cpu_only
@pytest.mark.parametrize(("shape", "axes"), [((2048, 2048), 0), ((3, 3, 256, 512), (0, 1, 2))])
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_float16_sums_over_leading_axes_read_a_few_rows_at_a_time(shape, axes):
    # XLA:CPU's fused reduce over a leading axis runs about 10x slower than a loop that
    # upcasts a few rows at a time for the library reduction; its temporaries stay small.
    x = jnp.ones(shape, jnp.float16)
    fn = jax.jit(lambda g: jaxclip.clip_tree_by_norm(g, 1.0, axes=axes)[0])
    compiled = fn.lower(x).compile()
    entry = compiled.as_text().split("\nENTRY ")[1]
    assert " while(" in entry  # the plain sums' loop, on the common path
    assert compiled.memory_analysis().temp_size_in_bytes <= 0.02 * x.nbytes


def _per_example_reductions(tree: list, p: float) -> str:
    fn = lambda g: _norms.per_example_norm_parts(g, p).value  # noqa: E731
    return jax.jit(fn).lower(tree).as_text()


@pytest.mark.parametrize("p", [2.0, 3.0, 0.5])
def test_per_example_rare_paths_bucket_small_leaves(p):
    """Per-example norms of many leaves: each leaf's plain sum is a reduction of its own
    (no copy on the path every step runs: a bucket of 16-bit leaves there ran 1.3-1.7x
    slower), but the rare paths read small leaves (at most 64 KiB, the batch included)
    side by side per example over the batch, and small rows side by side in the loop
    over single examples: with a reduction per leaf on each path, a thousand small leaves
    compiled in 2.7x optax's time (float32), and at p = 0.5 forty leaves of four dtypes
    compiled in 48 s (two hundred took XLA past 24 GB of memory)."""
    n = 300
    small = [
        jax.ShapeDtypeStruct((8, 4 + i % 9, 3), (jnp.float32, jnp.bfloat16)[i % 2])
        for i in range(n)
    ]
    assert _per_example_reductions(small, p).count("stablehlo.reduce") < 1.25 * n
    # 77 KB leaves of 1.2 KB rows: their own sums on the common path and over the batch,
    # rows side by side in the loop (three sums per leaf before).
    rows = [jax.ShapeDtypeStruct((64, 300 + i % 5), jnp.float32) for i in range(n)]
    per_leaf = 2 if p == 2.0 else 5  # else: the maxima first, then the shifted sums
    text = _per_example_reductions(rows, p)
    assert text.count("stablehlo.reduce") < (per_leaf + 0.25) * n
    assert text.count("stablehlo.while") == 1  # the rows path is still there


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_per_example_rare_path_reads_single_rows_only_where_the_batch_is_whole():
    # A padding (all-zero) example takes the rare path on every step: on one device its
    # row alone is read again, in a loop over the few examples out of range (one zero
    # example of 64 cost 2.1x a zero-free call when the whole batch was re-read). A batch
    # split over devices is re-read whole: a dynamic slice of it would gather it.
    tree = {"w": jnp.ones((16, 64, 32)), "b": jnp.ones((16, 32))}
    assert _per_example_text(tree).count("stablehlo.while") == 1
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Explicit,))
    split = jax.device_put(tree, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        assert _per_example_text(split).count("stablehlo.while") == 0


def test_16bit_value_clipping_compares_integer_keys():
    """XLA:CPU computes bfloat16 compares and clamps in float32 (1.3x ``optax.clip`` on a
    large leaf); its 16-bit integer keys clamp natively. float16 takes the clamp alone
    (exact there, see test_trust): a select or integer kernel over a 3x3 conv kernel's
    short last axis ran 1.6-3x ``optax.clip``."""
    f = jax.jit(lambda g: jaxclip.clip_tree_by_value(g, 1.0))
    assert "s16[256,256]" in f.lower(jnp.ones((256, 256), jnp.bfloat16)).compile().as_text()
    # Small leaves keep the float kernel: it compiles faster, and runs as fast there.
    # "s16[" is the integer type; "s16" alone may be in a file path of the metadata.
    assert "s16[" not in f.lower(jnp.ones((64, 64), jnp.bfloat16)).compile().as_text()
    text = f.lower(jnp.ones((64, 64, 3, 3), jnp.float16)).compile().as_text()
    assert "s16[" not in text and " select(" not in text and " clamp(" in text
