"""Records the real libraries' clipping outputs, for parity tests that need none of them.

Installs nothing. Run it in an environment where PyTorch, TensorFlow and PaddlePaddle
are installed (all three install on CPU from the package index), e.g.::

    python -m venv /tmp/refenv
    /tmp/refenv/bin/pip install torch==2.13.0 tensorflow-cpu paddlepaddle numpy
    /tmp/refenv/bin/python tests/reference/record.py

It rewrites ``tests/reference/reference_outputs.json`` with the sections of every
library it can import (a missing library keeps its old section). Inputs are generated
here from a fixed seed and stored beside the outputs, so the tests replay them.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np

OUT = pathlib.Path(__file__).with_name("reference_outputs.json")


def _inputs() -> dict[str, Any]:
    rng = np.random.default_rng(20261121)
    return {
        "tensors": [
            rng.normal(size=(4, 5)).astype(np.float32),
            rng.normal(size=(7,)).astype(np.float32) * 3,
            rng.normal(size=(2, 3, 2)).astype(np.float32) * 0.1,
        ],
        "matrix": rng.normal(size=(3, 4)).astype(np.float32) * 2,
    }


def _lst(x: Any) -> Any:
    return np.asarray(x, dtype=np.float64).tolist()


def record_torch(inp: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "version": torch.__version__,
        "clip_grad_norm_": [],
        "clip_grad_value_": [],
    }
    for norm_type in [1.0, 2.0, 3.0, 0.5, math.inf]:
        for max_norm in [0.5, 1e3]:
            params = [torch.nn.Parameter(torch.zeros(t.shape)) for t in inp["tensors"]]
            for p, t in zip(params, inp["tensors"]):
                p.grad = torch.tensor(t)
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
            out["clip_grad_norm_"].append(
                {
                    "norm_type": "inf" if norm_type == math.inf else norm_type,
                    "max_norm": max_norm,
                    "total_norm": float(total),
                    "grads": [_lst(p.grad.numpy()) for p in params],
                }
            )
    for clip_value in [0.5, 2.0]:
        params = [torch.nn.Parameter(torch.zeros(t.shape)) for t in inp["tensors"]]
        for p, t in zip(params, inp["tensors"]):
            p.grad = torch.tensor(t)
        torch.nn.utils.clip_grad_value_(params, clip_value)
        out["clip_grad_value_"].append(
            {"clip_value": clip_value, "grads": [_lst(p.grad.numpy()) for p in params]}
        )
    return out


def record_tensorflow(inp: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    out: dict[str, Any] = {"version": tf.__version__, "clip_by_norm": [], "clip_by_global_norm": []}
    m = tf.constant(inp["matrix"])
    for axes in [None, [0], [1], [0, 1]]:
        for clip_norm in [1.0, 2.5]:
            r = tf.clip_by_norm(m, clip_norm, axes=axes)
            out["clip_by_norm"].append({"axes": axes, "clip_norm": clip_norm, "result": _lst(r)})
    ts = [tf.constant(t) for t in inp["tensors"]]
    for clip_norm, use_norm in [(1.0, None), (100.0, None), (1.0, 8.0)]:
        un = None if use_norm is None else tf.constant(use_norm, tf.float32)
        clipped, gn = tf.clip_by_global_norm(ts, clip_norm, use_norm=un)
        out["clip_by_global_norm"].append(
            {
                "clip_norm": clip_norm,
                "use_norm": use_norm,
                "global_norm": float(gn),
                "result": [_lst(c) for c in clipped],
            }
        )
    return out


def record_paddle() -> dict[str, Any]:
    import paddle

    paddle.seed(7)
    paddle.set_device("cpu")
    rng = np.random.default_rng(3)
    x = rng.uniform(-10, 10, size=(32, 10)).astype(np.float32)
    out: dict[str, Any] = {"version": paddle.__version__, "x": _lst(x), "lr": 0.1, "steps": []}
    clips = {
        "ClipGradByValue": lambda: paddle.nn.ClipGradByValue(max=1.0, min=-1.0),
        "ClipGradByNorm": lambda: paddle.nn.ClipGradByNorm(clip_norm=1.0),
        "ClipGradByGlobalNorm": lambda: paddle.nn.ClipGradByGlobalNorm(clip_norm=1.0),
    }
    for name, make in clips.items():
        for bias_need_clip in [True, False]:
            linear = paddle.nn.Linear(10, 10, bias_attr=paddle.ParamAttr(need_clip=bias_need_clip))
            w0, b0 = linear.weight.numpy().copy(), linear.bias.numpy().copy()
            loss = 100.0 * paddle.mean(linear(paddle.to_tensor(x)) ** 2)
            loss.backward()
            gw, gb = linear.weight.grad.numpy().copy(), linear.bias.grad.numpy().copy()
            sgd = paddle.optimizer.SGD(
                learning_rate=0.1, parameters=linear.parameters(), grad_clip=make()
            )
            sgd.step()
            out["steps"].append(
                {
                    "clip": name,
                    "bias_need_clip": bias_need_clip,
                    "weight": _lst(w0),
                    "bias": _lst(b0),
                    "grad_weight": _lst(gw),
                    "grad_bias": _lst(gb),
                    "new_weight": _lst(linear.weight.numpy()),
                    "new_bias": _lst(linear.bias.numpy()),
                }
            )
    return out


RECORDERS = {
    "torch": lambda: record_torch(_inputs()),
    "tensorflow": lambda: record_tensorflow(_inputs()),
    "paddle": record_paddle,
}


def main(argv: list[str]) -> None:
    # Each library records in a process of its own: loaded together they can crash.
    if not argv:
        for key in RECORDERS:
            subprocess.run([sys.executable, __file__, key], check=False)
        return
    inp = _inputs()
    data: dict[str, Any] = json.loads(OUT.read_text()) if OUT.exists() else {}
    data["inputs"] = {"tensors": [_lst(t) for t in inp["tensors"]], "matrix": _lst(inp["matrix"])}
    for key in argv:
        try:
            data[key] = RECORDERS[key]()
            print(f"recorded {key} {data[key]['version']}")
        except ImportError as e:
            print(f"skipped {key}: {e}")
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
