"""Compile time of global-norm clipping against the number of leaves (1000 floats each).

python benchmarks/compile_scaling.py
"""

import time

import jax
import jax.numpy as jnp
import optax

import jaxclip

for n in [200, 1000]:
    g = {f"l{i}": jnp.ones((1000,), jnp.float32) for i in range(n)}
    for name, f in [
        ("optax", lambda g: optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]),
        ("jaxclip", lambda g: jaxclip.clip_tree_by_global_norm(g, 1.0)[0]),
    ]:
        t0 = time.perf_counter()
        lowered = jax.jit(f).lower(g)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"{n} leaves {name}: trace+lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s")
