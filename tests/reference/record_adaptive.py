"""Records the adaptive-clipping reference packages' outputs for tests/test_adaptive_parity.py.

The packages are PyTorch-only and are never dependencies of jaxclip or of its tests: run
this in a separate environment, e.g.::

    python3 -m venv /tmp/venv-ref
    /tmp/venv-ref/bin/pip install torch==2.13.0 zclip==1.0.0 autoclip==0.2.1 numpy
    /tmp/venv-ref/bin/python tests/reference/record_adaptive.py

It rewrites ``tests/reference/adaptive_outputs.json``. The sources it drives are
``zclip/zclip.py`` of bluorion-com/ZClip (commit 584ce4f5, the ``zclip`` 1.0.0 wheel) and
``autoclip/torch/{quantile,std}.py`` of HesitantlyHuman/autoclip (commit 34badefb, the
``autoclip`` 0.2.1 wheel). Inputs are made here from a fixed seed and stored beside the
outputs, so the tests replay them.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
from typing import Any

import numpy as np

OUT = pathlib.Path(__file__).with_name("adaptive_outputs.json")
SHAPES = [(3,), (2, 4), (5,)]

# Global norms per step: a warm-up, steady steps, spikes (x10, x40), a slow drift.
ZCLIP_NORMS = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 1.3, 12.0, 1.0, 1.1, 0.8, 40.0, 1.2, 1.5, 1.7, 2.0]
ZCLIP_CONFIGS = [
    {},
    {"max_grad_norm": None},
    {"max_grad_norm": 1.4},
    {"max_grad_norm": None, "clip_option": "mean"},
    {"max_grad_norm": None, "clip_factor": 0.7},
    {"max_grad_norm": None, "mode": "percentile"},
    {"max_grad_norm": None, "mode": "percentile", "skip_update_on_spike": True, "z_thresh": 1.5},
    {"max_grad_norm": 1.1, "alpha": 0.8, "z_thresh": 2.0, "eps": 1e-3},
]
# Per parameter, its own norm sequence, with spikes at different steps.
AUTOCLIP_NORMS = [
    [1.0, 2.0, 1.5, 3.0, 30.0, 2.0, 2.5, 1.8, 2.2, 50.0, 2.0, 1.0],
    [0.5, 0.4, 0.6, 8.0, 0.5, 0.55, 0.45, 0.5, 9.0, 0.6, 0.5, 0.4],
    [3.0, 3.0, 3.5, 2.5, 3.2, 60.0, 3.1, 2.9, 3.0, 3.3, 3.4, 3.0],
]
AUTOCLIP_CONFIGS = [
    ("QuantileClip", {"quantile": 0.5, "history_length": 4}),
    ("QuantileClip", {"quantile": 0.25, "history_length": 3, "global_threshold": True}),
    ("StandardClip", {}),
    ("StandardClip", {"deviations": 1.0, "history_length": 5, "global_threshold": True}),
]


def _directions(steps: int, seed: int) -> list[list[np.ndarray]]:
    """Per step, per parameter, a float32 array of norm 1 (in float64)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        row = []
        for shape in SHAPES:
            d = rng.normal(size=shape)
            row.append((d / np.linalg.norm(d)).astype(np.float32))
        out.append(row)
    return out


def _zclip_grads(norms: list[float]) -> list[list[np.ndarray]]:
    # Global norm n: each parameter's unit direction times n / sqrt(len(SHAPES)).
    dirs = _directions(len(norms), 14)
    k = np.float32(1 / np.sqrt(len(SHAPES)))
    return [[d * np.float32(n) * k for d in row] for n, row in zip(norms, dirs)]


def _autoclip_grads() -> list[list[np.ndarray]]:
    dirs = _directions(len(AUTOCLIP_NORMS[0]), 15)
    return [
        [d * np.float32(AUTOCLIP_NORMS[j][i]) for j, d in enumerate(row)]
        for i, row in enumerate(dirs)
    ]


def _lst(x: Any) -> Any:
    return np.asarray(x, dtype=np.float64).tolist()


def _model():
    import torch

    model = torch.nn.Module()
    for j, shape in enumerate(SHAPES):
        model.register_parameter(f"p{j}", torch.nn.Parameter(torch.zeros(shape)))
    return model


def record_zclip() -> dict[str, Any]:
    import torch
    from zclip import ZClip

    grads = _zclip_grads(ZCLIP_NORMS)
    runs = []
    for config in ZCLIP_CONFIGS:
        model = _model()
        clipper = ZClip(warmup_steps=5, **config)
        steps = []
        for row in grads:
            for p, g in zip(model.parameters(), row):
                p.grad = torch.tensor(g)
            total = clipper.step(model)
            steps.append(
                {
                    "total_norm": float(total),
                    "grads": [_lst(p.grad.numpy()) for p in model.parameters()],
                    "mean": clipper.mean,
                    "var": clipper.var,
                }
            )
        runs.append({"config": config, "steps": steps})
    return {
        "version": importlib.metadata.version("zclip"),
        "warmup_steps": 5,
        "inputs": [[_lst(g) for g in row] for row in grads],
        "runs": runs,
    }


def record_autoclip() -> dict[str, Any]:
    import torch
    from autoclip.torch import QuantileClip, StandardClip

    classes = {"QuantileClip": QuantileClip, "StandardClip": StandardClip}
    grads = _autoclip_grads()
    runs = []
    for name, config in AUTOCLIP_CONFIGS:
        model = _model()
        clipper = classes[name](model.parameters(), **config)
        steps = []
        for row in grads:
            for p, g in zip(model.parameters(), row):
                p.grad = torch.tensor(g)
            clipper.step()
            steps.append([_lst(p.grad.numpy()) for p in model.parameters()])
        runs.append({"class": name, "config": config, "steps": steps})
    return {
        "version": importlib.metadata.version("autoclip"),
        "inputs": [[_lst(g) for g in row] for row in grads],
        "runs": runs,
    }


def main() -> None:
    import torch

    out = {
        "torch": torch.__version__,
        "zclip": record_zclip(),
        "autoclip": record_autoclip(),
    }
    # NaN (StandardClip's second step) as null, so the file is strict JSON.
    text = json.dumps(out, indent=1, allow_nan=True).replace("NaN", "null")
    OUT.write_text(text + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
