"""Held-out parameter trees of real Flax / Equinox models (shapes from the modules' own init,
values random normal, filled by NumPy so no model compute is timed): ResNet-18/50, ViT-S/16,
MLP-Mixer-S/16, an LSTM LM, an Equinox MLP. Needs flax (and equinox for ``eqx_mlp``).

    python benchmarks/heldout_trees.py     # each tree's leaves and bytes
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _fill(shapes: Any, dtype: Any, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray((rng.normal(size=s.shape) * 0.05).astype(np.float32)).astype(dtype),
        shapes,
    )


def resnet(depth: int = 18, width: int = 64, classes: int = 1000) -> Any:
    import flax.linen as nn

    class Basic(nn.Module):
        f: int
        stride: int

        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            y = nn.Conv(self.f, (3, 3), (self.stride, self.stride), use_bias=False)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
            y = nn.Conv(self.f, (3, 3), use_bias=False)(y)
            y = nn.BatchNorm(use_running_average=True)(y)
            if x.shape[-1] != self.f or self.stride != 1:
                x = nn.Conv(self.f, (1, 1), (self.stride, self.stride), use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=True)(x)
            return nn.relu(x + y)

    class Bottleneck(nn.Module):
        f: int
        stride: int

        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            y = nn.Conv(self.f, (1, 1), use_bias=False)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
            y = nn.Conv(self.f, (3, 3), (self.stride, self.stride), use_bias=False)(y)
            y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
            y = nn.Conv(self.f * 4, (1, 1), use_bias=False)(y)
            y = nn.BatchNorm(use_running_average=True)(y)
            if x.shape[-1] != self.f * 4 or self.stride != 1:
                x = nn.Conv(self.f * 4, (1, 1), (self.stride, self.stride), use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=True)(x)
            return nn.relu(x + y)

    stages = {18: ([2, 2, 2, 2], Basic), 50: ([3, 4, 6, 3], Bottleneck)}[depth]

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            x = nn.Conv(width, (7, 7), (2, 2), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
            for i, n in enumerate(stages[0]):
                for j in range(n):
                    x = stages[1](width * 2**i, 2 if (j == 0 and i > 0) else 1)(x)
            return nn.Dense(classes)(x.mean((1, 2)))

    v = jax.eval_shape(ResNet().init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    return v["params"]


def vit(depth: int = 12, dim: int = 384, heads: int = 6, mlp: int = 1536, patch: int = 16) -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=heads)(y, y)
            x = x + y
            y = nn.LayerNorm()(x)
            y = nn.Dense(dim)(nn.gelu(nn.Dense(mlp)(y)))
            return x + y

    class ViT(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            x = nn.Conv(dim, (patch, patch), (patch, patch))(x)
            x = x.reshape(x.shape[0], -1, dim)
            cls = self.param("cls", nn.initializers.zeros, (1, 1, dim))
            pos = self.param("pos", nn.initializers.normal(0.02), (1, 197, dim))
            x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, dim)), x], 1) + pos
            for _ in range(depth):
                x = Block()(x)
            return nn.Dense(1000)(nn.LayerNorm()(x[:, 0]))

    v = jax.eval_shape(ViT().init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    return v["params"]


def mixer(
    depth: int = 8, dim: int = 512, tokens: int = 196, tok_mlp: int = 256, ch_mlp: int = 2048
) -> Any:
    import flax.linen as nn

    class MixerBlock(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            y = nn.LayerNorm()(x).swapaxes(1, 2)
            y = nn.Dense(tokens)(nn.gelu(nn.Dense(tok_mlp)(y))).swapaxes(1, 2)
            x = x + y
            y = nn.LayerNorm()(x)
            return x + nn.Dense(dim)(nn.gelu(nn.Dense(ch_mlp)(y)))

    class Mixer(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            x = nn.Conv(dim, (16, 16), (16, 16))(x).reshape(x.shape[0], -1, dim)
            for _ in range(depth):
                x = MixerBlock()(x)
            return nn.Dense(1000)(nn.LayerNorm()(x).mean(1))

    v = jax.eval_shape(Mixer().init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    return v["params"]


def lstm(hidden: int = 1024, vocab: int = 10000, emb: int = 512, layers: int = 2) -> Any:
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tok):  # type: ignore[no-untyped-def]
            x = nn.Embed(vocab, emb)(tok)
            for _ in range(layers):
                x = nn.RNN(nn.OptimizedLSTMCell(hidden))(x)
            return nn.Dense(vocab)(x)

    v = jax.eval_shape(LM().init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return v["params"]


def eqx_mlp() -> Any:
    import equinox as eqx

    m = eqx.nn.MLP(784, 10, 1024, 4, key=jax.random.key(0))
    return eqx.filter(m, eqx.is_inexact_array)


TREES = {
    "resnet18": lambda: resnet(18),
    "resnet50": lambda: resnet(50),
    "vit_s16": vit,
    "mixer_s16": mixer,
    "lstm": lstm,
}


def tree(name: str, dtype: Any = jnp.float32, seed: int = 0) -> Any:
    if name == "eqx_mlp":
        m = eqx_mlp()
        import equinox as eqx

        leaves, treedef = jax.tree.flatten(m)
        rng = np.random.default_rng(seed)
        return jax.tree.unflatten(
            treedef,
            [
                jnp.asarray((rng.normal(size=x.shape) * 0.05).astype(np.float32)).astype(dtype)
                for x in leaves
            ],
        ), eqx
    return _fill(TREES[name](), dtype, seed)


def mixed(name: str, seed: int = 0) -> Any:
    """Kernels in bfloat16, norms/biases (rank <= 1) in float32: a mixed-precision tree."""
    t = tree(name, jnp.float32, seed)
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, t)


def describe(t: Any) -> str:
    leaves = jax.tree.leaves(t)
    n = sum(x.size for x in leaves)
    b = sum(x.nbytes for x in leaves)
    return f"{len(leaves)} leaves, {n / 1e6:.2f} M elems, {b / 2**20:.1f} MiB"


if __name__ == "__main__":
    for k in TREES:
        print(k, describe(tree(k)))
