"""Records Opacus outputs for jaxclip's ported tests (``tests/test_ported.py`` holds them as
literals). Run it where torch and opacus are installed: ``pip install torch opacus``."""

import json

import numpy as np
import opacus
import torch
from opacus import GradSampleModule
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer, DPPerLayerOptimizer
from torch import nn

torch.set_default_dtype(torch.float64)


def model():
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    with torch.no_grad():
        m[0].weight.copy_(torch.tensor(np.linspace(-1.0, 1.2, 12).reshape(3, 4)))
        m[0].bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        m[2].weight.copy_(torch.tensor(np.linspace(0.9, -1.5, 6).reshape(2, 3)))
        m[2].bias.copy_(torch.tensor([0.05, -0.05]))
    return m


def data(b):
    x = np.array([[np.sin(1.0 + i + 3 * j) * (1 + i) for j in range(4)] for i in range(b)]).reshape(
        b, 4
    )
    y = np.array([i % 2 for i in range(b)], dtype=np.int64)
    return torch.tensor(x), torch.tensor(y)


def step(kind, b, *, reduction="mean", expected=None, clip=1.0, noise=0.0, steps=1, **kw):
    m = GradSampleModule(model(), loss_reduction=reduction)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    cls = {"flat": DPOptimizer, "layer": DPPerLayerOptimizer, "ada": AdaClipDPOptimizer}[kind]
    dp = cls(
        opt,
        noise_multiplier=noise,
        max_grad_norm=clip,
        expected_batch_size=expected,
        loss_reduction=reduction,
        **kw,
    )
    x, y = data(b)
    out = {"grads": [], "summed": [], "clip": []}
    for _ in range(steps):
        dp.zero_grad()
        loss = nn.CrossEntropyLoss(reduction=reduction)(m(x), y)
        loss.backward()
        if kind == "ada":
            out["clip"].append(float(dp.max_grad_norm))
        dp.step()
        out["grads"].append([p.grad.detach().numpy().tolist() for p in m.parameters()])
        out["summed"].append(
            [
                p.summed_grad.detach().numpy().tolist() if p.summed_grad is not None else None
                for p in m.parameters()
            ]
        )
    if kind == "ada":
        out["clip"].append(float(dp.max_grad_norm))
    return out


res = {"opacus": opacus.__version__, "torch": torch.__version__}
res["flat_mean_B6_E8"] = step("flat", 6, expected=8, clip=1.0)
res["flat_sum_B6"] = step("flat", 6, reduction="sum", clip=0.5)
res["layer_mean_B6_E6"] = step("layer", 6, expected=6, clip=[0.5, 0.25, 1.0, 0.1])
res["ada_sum_B6"] = step(
    "ada",
    6,
    reduction="sum",
    clip=0.5,
    steps=4,
    target_unclipped_quantile=0.5,
    clipbound_learning_rate=0.2,
    max_clipbound=1e9,
    min_clipbound=1e-9,
    unclipped_num_std=1e-12,
)
res["ada_sum_B6_t0"] = step(
    "ada",
    6,
    reduction="sum",
    clip=2.0,
    steps=4,
    target_unclipped_quantile=0.0,
    clipbound_learning_rate=float(np.log(2.0)),
    max_clipbound=1e9,
    min_clipbound=1e-9,
    unclipped_num_std=1e-12,
)
# per-sample norms, for the record
try:
    res["empty_flat_mean_E8"] = step("flat", 0, expected=8, clip=1.0)
except Exception as e:
    res["empty_flat_mean_E8"] = f"{type(e).__name__}: {e}"
json.dump(res, open("/tmp/revC-ref/opacus_ref.json", "w"), indent=1)
print(json.dumps(res)[:3000])
