#!/usr/bin/env bash
# One call on a lent GPU machine (its image's python3, jax and optax; nothing installed):
# a smoke check against float64 NumPy, the benchmark matrix in one process (--inline, with
# device-bound times against the memory floor), then the default test step on the GPU beside
# the 8-simulated-device tests on the host's CPU under the image's jax.
#
#   bash benchmarks/device.sh            # $OUT: where the results go (default /tmp/jaxclip-out)
#   MATRIX_S=300 TESTS_S=200 ONLY="large/,conv/" bash benchmarks/device.sh
set -u
OUT=${OUT:-/tmp/jaxclip-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv || true
$PY - <<'EOF' || exit 1
import jax, jax.numpy as jnp, numpy as np, optax
import jaxclip
print("jax", jax.__version__, "optax", optax.__version__, jax.devices())
rng = np.random.default_rng(0)
g = {"w": rng.normal(size=(512, 256)), "k": rng.normal(size=(3, 3, 64, 64)) * 1e-3}
for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
    t = {k: jnp.asarray(v, dt) for k, v in g.items()}
    f64 = {k: np.asarray(v, np.float64) for k, v in t.items()}
    want = np.sqrt(sum(np.sum(v * v) for v in f64.values()))
    got = float(jax.jit(jaxclip.global_norm)(t))
    assert abs(got / want - 1) < 1e-5, (dt, got, want)
    rows = np.sqrt(np.sum(f64["w"] ** 2, axis=0))
    out = jax.jit(lambda t: jaxclip.clip_tree_by_norm(t, 1.0, axes=0)[0])(t)
    cols = np.sqrt(np.sum(np.asarray(out["w"], np.float64) ** 2, axis=0))
    tol = 1e-5 if dt == jnp.float32 else 1e-2
    assert np.allclose(cols, np.minimum(rows, 1.0), rtol=tol), dt
    for name, tx in [("agc", jaxclip.adaptive_clip(0.1)), ("zclip", jaxclip.zclip()),
                     ("per_example", jaxclip.clip_per_example(1.0))]:
        b = t if name != "per_example" else jax.tree.map(lambda x: x[None].repeat(4, 0), t)
        u, _ = jax.jit(tx.update)(b, tx.init(t), t)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u)), name
print("smoke ok")
EOF
# huge/ first: its cells are the ones large enough to meet the memory floor.
ONLY=${ONLY:-huge/,large/,conv/,transformer/,global_norm/whole/small1000/float32}
timeout "${MATRIX_S:-300}" $PY benchmarks/matrix.py --inline --fresh --compiles 1 --reps 20 \
  --trees large,transformer,conv,small1000,huge --only "$ONLY" \
  --out "$OUT/results_matrix_gpu.json" >"$OUT/matrix.log" 2>&1
echo "matrix rc $?: $(grep -c ': run' "$OUT/matrix.log") cells"
JAX_PLATFORMS=cpu timeout "${TESTS_S:-200}" $PY -m pytest -p no:cacheprovider -n 4 -q \
  tests/test_distributed.py tests/test_shard_map.py tests/test_layouts.py tests/test_multiprocess.py \
  >"$OUT/tests_cpu8.log" 2>&1 &
timeout "${TESTS_S:-200}" $PY -m pytest -p no:cacheprovider -n 10 -v >"$OUT/tests_gpu.log" 2>&1
echo "gpu tests rc $?"
wait
echo "cpu 8-device tests: $(tail -1 "$OUT/tests_cpu8.log")"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_gpu.log" | tail -15
grep -E "^(FAILED|ERROR)" "$OUT/tests_cpu8.log" | head -10
grep -E "FAILED" "$OUT/tests_gpu.log" | head -20
tail -n 25 "$OUT/matrix.log"
