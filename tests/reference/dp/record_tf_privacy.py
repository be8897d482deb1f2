"""Records TF-Privacy outputs for jaxclip's ported tests (``tests/test_ported.py`` holds them as
literals). Run it where tensorflow-cpu and tensorflow-privacy are installed."""

import json
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import importlib.metadata as md

import numpy as np
import tensorflow as tf
import tfp_shim  # noqa: F401  (tensorflow_privacy's __init__ needs tf-estimator)
from tensorflow_privacy.privacy.dp_query import gaussian_query, normalized_query, test_utils
from tensorflow_privacy.privacy.dp_query import quantile_adaptive_clip_sum_query as qa
from tensorflow_privacy.privacy.dp_query import quantile_estimator_query as qe
from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized import clip_gradients_vmap

res = {"tensorflow_privacy": md.version("tensorflow_privacy"), "tensorflow": tf.__version__}


def f(t):
    return np.asarray(t).tolist()


# gaussian_query_test / normalized_query_test
r1, r2 = tf.constant([-6.0, 8.0]), tf.constant([4.0, -3.0])
res["gauss_clip"] = f(test_utils.run_query(gaussian_query.GaussianSumQuery(5.0, 0.0), [r1, r2])[0])
v = tf.Variable(5.0)
q = gaussian_query.GaussianSumQuery(v, 0.0)
v.assign(0.0)
res["gauss_clip0"] = f(test_utils.run_query(q, [r1, r2])[0])
res["normalized"] = f(
    test_utils.run_query(
        normalized_query.NormalizedQuery(gaussian_query.GaussianSumQuery(5.0, 0.0), 2.0), [r1, r2]
    )[0]
)

# clip_gradients_vmap over a batch of per-example gradient lists
rng = np.random.default_rng(11)
g0 = (rng.normal(size=(5, 3, 2)) * np.arange(1, 6)[:, None, None]).astype(np.float32)
g1 = (rng.normal(size=(5, 4)) * 0.3).astype(np.float32)
res["vmap_in"] = [f(g0), f(g1)]
out = tf.vectorized_map(lambda g: clip_gradients_vmap(g, 2.0), [tf.constant(g0), tf.constant(g1)])
res["vmap_out"] = [f(o) for o in out]


def adaptive(records, steps, lr_fn=None, **kw):
    lr = tf.Variable(float(kw.pop("learning_rate")))
    q = qa.QuantileAdaptiveClipSumQuery(learning_rate=lr, **kw)
    gs = q.initial_global_state()
    sums, clips = [], []
    for t in range(steps):
        if lr_fn:
            lr.assign(lr_fn(t))
        s, gs = test_utils.run_query(q, [tf.constant(r) for r in records], gs)
        sums.append(f(s))
        clips.append(float(gs.sum_state.l2_norm_clip))
    return {"sums": sums, "clips": clips}


lin = list(np.linspace(0.0, 10.0, 21, dtype=np.float32))
for low in (True, False):
    for geo in (True, False):
        name = f"{'low' if low else 'high'}_{'geo' if geo else 'arith'}"
        res["linspace_" + name] = adaptive(
            [[x] for x in lin],
            50,
            initial_l2_norm_clip=1.0 if low else 10.0,
            noise_multiplier=0.0,
            target_unclipped_quantile=0.5,
            learning_rate=1.0,
            clipped_count_stddev=0.0,
            expected_num_records=21,
            geometric_update=geo,
        )
        res["all_equal_" + name] = adaptive(
            [[5.0]] * 20,
            50,
            lr_fn=lambda t: 1.0 / np.sqrt(t + 1),
            initial_l2_norm_clip=1.0 if low else 10.0,
            noise_multiplier=0.0,
            target_unclipped_quantile=0.5,
            learning_rate=1.0,
            clipped_count_stddev=0.0,
            expected_num_records=20,
            geometric_update=geo,
        )
# expected_num_records below the count: the fraction is clamped to [0, 1]
res["clamped"] = adaptive(
    [[0.5], [0.25], [-0.75], [3.0]],
    4,
    initial_l2_norm_clip=1.0,
    noise_multiplier=0.0,
    target_unclipped_quantile=0.3,
    learning_rate=0.5,
    clipped_count_stddev=0.0,
    expected_num_records=2.0,
    geometric_update=True,
)
# arithmetic update past 0
try:
    res["negative"] = adaptive(
        [[0.5], [0.25]],
        3,
        initial_l2_norm_clip=0.6,
        noise_multiplier=0.0,
        target_unclipped_quantile=0.0,
        learning_rate=1.0,
        clipped_count_stddev=0.0,
        expected_num_records=2.0,
        geometric_update=False,
    )
except Exception as e:
    res["negative"] = f"{type(e).__name__}: {e}"
# quantile_estimator_query fixed (expected_num_records=2.0) target_zero
q = qe.QuantileEstimatorQuery(10.0, 0.0, 1.0, 0.0, 2.0, False)
gs = q.initial_global_state()
est = []
for _ in range(5):
    e, gs = test_utils.run_query(q, [tf.constant(8.5), tf.constant(7.25)], gs)
    est.append(float(e))
res["estimator_fixed_target_zero"] = est
json.dump(res, open("/tmp/revC-ref/tfp_ref.json", "w"), indent=1)
print(
    {
        k: (v if not isinstance(v, dict) else v["clips"][-3:])
        for k, v in res.items()
        if k not in ("vmap_in", "vmap_out")
    }
)
