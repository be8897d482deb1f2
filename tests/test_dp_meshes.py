"""DP-SGD's aggregation with the batch split over devices: ``clipped_grad`` inside
``shard_map`` and under ``jit`` on meshes, and ``adaptive_clip_per_example(norms=...)``'s
noise and mean there, against float64 NumPy and the single-device statistics."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxclip

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

B, F, C = 64, 32, 1.0


def _loss(p, x, y):
    return 0.5 * (x @ p["w"] + p["b"] - y) ** 2


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, F)).astype(np.float32)
    x[::5] *= 0.01  # some examples within the clip norm
    y = rng.normal(size=B).astype(np.float32)
    params = {"w": (rng.normal(size=F) * 0.1).astype(np.float32), "b": np.float32(0.3)}
    return x, y, params


def _want(x, y, params):
    """The clipped sums and the norms, in float64."""
    r = x.astype(np.float64) @ params["w"].astype(np.float64) + float(params["b"]) - y
    gw, gb = r[:, None] * x, r
    n = np.sqrt(np.sum(gw**2, 1) + gb**2)
    f = np.minimum(1.0, C / n)
    return (f[:, None] * gw).sum(0), (f * gb).sum(), n


def _close(s, norms, want):
    ww, wb, wn = want
    np.testing.assert_allclose(np.asarray(s["w"], np.float64), ww, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(float(s["b"]), wb, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(norms, np.float64), wn, rtol=2e-6)


@pytest.mark.parametrize(
    "check_vma",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # suite budget
)
def test_clipped_grad_inside_data_parallel_shard_map(check_vma):
    """Each device's sum is its own examples' (replicated params: JAX would otherwise
    transpose their broadcast into a psum over "data", mixing the devices' examples)."""
    x, y, params = _data()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rows = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)
    for micro in (None, 4, 3):
        g = jaxclip.clipped_grad(_loss, C, microbatch_size=micro, return_norms=True,
                                 batch_argnums=(1, 2))  # fmt: skip

        def step(xb, yb, g=g):
            s, aux = g(params, xb, yb)
            return jax.lax.psum(s, "data"), aux.norms

        f = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                          out_specs=(P(), P("data")), check_vma=check_vma)  # fmt: skip
        s, norms = jax.jit(f)(xs, ys)
        _close(s, norms, _want(x, y, params))


def test_clipped_grad_with_tensor_and_data_parallel_params():
    """Features split over "model" (4), examples over "data" (2): each example's norm is
    combined over "model" only."""
    x, y, params = _data()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def loss(p, xr, yr):  # one example; its features split over "model"
        return 0.5 * (lax.psum(xr @ p["w"], "model") + p["b"] - yr) ** 2

    def step(p, xb, yb):
        s, aux = jaxclip.clipped_grad(loss, C, microbatch_size=8, return_norms=True,
                                      batch_argnums=(1, 2))(p, xb, yb)  # fmt: skip
        return jax.tree.map(lambda v: jax.lax.psum(v, "data"), s), aux.norms

    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))  # noqa: E731
    p = {"w": put(params["w"], P("model")), "b": put(params["b"], P())}
    specs = ({"w": P("model"), "b": P()}, P("data", "model"), P("data"))
    f = jax.shard_map(step, mesh=mesh, in_specs=specs,
                      out_specs=({"w": P("model"), "b": P()}, P("data")))  # fmt: skip
    s, norms = jax.jit(f)(p, put(x, P("data", "model")), put(y, P("data")))
    _close(s, norms, _want(x, y, params))


def test_clipped_grad_microbatches_on_meshes():
    """Under jit on a mesh that splits the batch: microbatch k holds rows k, k + steps, ...,
    so each device keeps its own rows (no all-gather of the batch on an Auto mesh, and
    an Explicit mesh can place them); a microbatch size that cannot split evenly on an
    Explicit mesh is a ValueError naming the sizes that can."""
    x, y, params = _data()
    want = _want(x, y, params)
    g = jaxclip.clipped_grad(_loss, C, microbatch_size=16, return_norms=True,
                             batch_argnums=(1, 2))  # fmt: skip
    call = jax.jit(lambda p, a, b: g(p, a, b))
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        rows = NamedSharding(mesh, P("data"))
        args = (params, jax.device_put(x, rows), jax.device_put(y, rows))
        with jax.set_mesh(mesh):
            s, aux = call(*args)
            _close(s, aux.norms, want)
            if kind == AxisType.Auto:
                text = call.lower(*args).compile().as_text()
                assert not re.findall(r"all-gather\(", text)
            else:
                bad = jaxclip.clipped_grad(_loss, C, microbatch_size=12, batch_argnums=(1, 2))
                with pytest.raises(ValueError, match=r"multiple of 8 that divides 64 \(one of"):
                    jax.jit(bad)(*args)
                # The batch replicated: any microbatch size (here one that pads).
                rep = NamedSharding(mesh, P(None))
                whole = (params, jax.device_put(x, rep), jax.device_put(y, rep))
                s, aux = jax.jit(lambda p, a, b: jaxclip.clipped_grad(
                    _loss, C, microbatch_size=12, return_norms=True, batch_argnums=(1, 2)
                )(p, a, b))(*whole)  # fmt: skip
                _close(s, aux.norms, want)
    # The batch split over two axes of an Explicit 2x4 mesh: 8 devices.
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    args = (params, jax.device_put(x, rows), jax.device_put(y, rows))
    with jax.set_mesh(mesh):
        s, aux = call(*args)
        _close(s, aux.norms, want)
        bad = jaxclip.clipped_grad(_loss, C, microbatch_size=4, batch_argnums=(1, 2))
        with pytest.raises(ValueError, match=r"\('data', 'fsdp'\) \(8 devices\)"):
            jax.jit(bad)(*args)


@pytest.mark.parametrize(
    "reduce",
    ["sum", pytest.param("mean", marks=pytest.mark.slow)],  # suite budget
)
def test_adaptive_norms_noise_and_mean_over_data_parallel_devices(reduce):
    """``adaptive_clip_per_example(norms=...)`` fed by ``clipped_grad`` on 8 data-parallel
    devices: the noise of the aggregate has the single-device std (``z * C``, over the
    batch for the mean) whether the sums are added before the update (each device draws
    the whole noise, alike) or after (each draws its share, independently); the mean of
    unclipped examples (all ones) is 1 either way."""
    z, c, d = 1.5, 2.0, 4096
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rows = NamedSharding(mesh, P("data"))
    w = jnp.zeros(d)
    for noise, scale in ((z, 0.0), (0.0, 1.0)):  # pure noise; then the signal alone
        tx = jaxclip.adaptive_clip_per_example(
            c, noise_multiplier=noise, clipped_count_stddev=0.0, reduce=reduce
        )
        st = tx.init(w)
        loss = lambda w, x, k=scale: k * jnp.sum(w * x)  # noqa: E731  the gradient: k * x
        xs = jax.device_put(np.full((B, d), 1.0 / 64, np.float32), rows)  # norm 1 <= c
        outs = []
        for first in (True, False):

            def step(xb, first=first, tx=tx, st=st, loss=loss):
                s, aux = jaxclip.clipped_grad(loss, st.clip_norm, return_norms=True)(w, xb)
                if first:
                    s = jax.lax.psum(s, "data")
                u = tx.update(s, st, norms=aux.norms)[0]
                if not first:
                    u = jax.lax.psum(u, "data") if reduce == "sum" else jax.lax.pmean(u, "data")
                return u

            f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())
            outs.append(np.asarray(jax.jit(f)(xs), np.float64))
        if noise:  # one device: the whole noise, for norms= and for clip_per_example
            x0 = np.zeros((4, d), np.float32)
            per_row = 4 / B if reduce == "mean" else 1  # 4 rows, not B
            u = jax.jit(lambda s, n, tx=tx, st=st: tx.update(s, st, norms=n)[0])
            outs.append(np.asarray(u(x0.sum(0), jnp.zeros(4))) * per_row)
            cpe = jaxclip.clip_per_example(c, noise_multiplier=z, reduce=reduce)
            u = jax.jit(lambda g, cpe=cpe: cpe.update(g, cpe.init(w))[0])
            outs.append(np.asarray(u(x0)) * per_row)
        for out in outs:
            if noise:  # 4096 draws: the std's relative sd is 1.1%
                want = z * c / (B if reduce == "mean" else 1)
                assert abs(out.std() / want - 1) < 0.05, (out.std(), want)
            else:
                want = 1.0 / 64 * (1 if reduce == "mean" else B)
                np.testing.assert_allclose(out, want, rtol=1e-6)


def test_clipped_grad_finds_the_batch_axes_from_the_params():
    """The batch's axes are those the batch varies across and no param does: one batch
    argument whose features are split over "model" like the params (tensor parallel),
    a batch leaf made inside the body (per-example weights, varying across nothing), and
    params sharded over the batch's own axis (FSDP: a ValueError, no silent mixing)."""
    x, _, params = _data()
    w = params["w"]
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))  # noqa: E731
    r = x.astype(np.float64) @ w - 1.0
    norms = np.abs(r) * np.linalg.norm(x, axis=1)
    want = (np.minimum(1.0, C / norms)[:, None] * r[:, None] * x).sum(0)

    def tp_loss(w, xr, cr):  # one example, its features split over "model"; a weight cr
        return 0.5 * cr * (lax.psum(xr @ w, "model") - 1.0) ** 2

    def step(w, xb):
        g = jaxclip.clipped_grad(tp_loss, C, return_norms=True, batch_argnums=(1, 2))
        s, aux = g(w, xb, jnp.ones(xb.shape[0]))
        return lax.psum(s, "data"), aux.norms

    f = jax.shard_map(step, mesh=mesh, in_specs=(P("model"), P("data", "model")),
                      out_specs=(P("model"), P("data")))  # fmt: skip
    s, n = jax.jit(f)(put(w, P("model")), put(x, P("data", "model")))
    # float32's x @ w - 1 cancels where x is small: 3e-6 of such a residual
    np.testing.assert_allclose(np.asarray(s, np.float64), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(n, np.float64), norms, rtol=1e-5)
    # The data alone, split like the params over "model": ambiguous (FSDP, or features)
    # until batch_axis_name says which axes split the batch.
    for names in (None, "data"):

        def alone(w, xb, names=names):
            g = jaxclip.clipped_grad(lambda w, xr: tp_loss(w, xr, 1.0), C, batch_axis_name=names)
            return lax.psum(g(w, xb), "data")

        f = jax.shard_map(alone, mesh=mesh, in_specs=(P("model"), P("data", "model")),
                          out_specs=P("model"))  # fmt: skip
        args = (put(w, P("model")), put(x, P("data", "model")))
        if names is None:
            with pytest.raises(
                ValueError, match=r"'model',\), and so does a param.*batch_axis_name"
            ):
                jax.jit(f)(*args)
        else:
            s = jax.jit(f)(*args)
            np.testing.assert_allclose(np.asarray(s, np.float64), want, rtol=1e-5, atol=1e-6)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    def fsdp_loss(w, xr):  # the params' shards gathered for each example
        return 0.5 * (xr @ lax.all_gather(w, "data", tiled=True) - 1.0) ** 2

    for names, error in (
        (None, r"inside shard_map .*\(FSDP\)"),
        ("data", r"=\('data',\) says split"),
    ):

        def fsdp_step(w, xb, names=names):
            g = jaxclip.clipped_grad(fsdp_loss, C, batch_axis_name=names)
            return lax.psum(g(w, xb), "data")

        f = jax.shard_map(fsdp_step, mesh=mesh, in_specs=(P("data"), P("data")),
                          out_specs=P("data"))  # fmt: skip
        with pytest.raises(ValueError, match=error):
            jax.jit(f)(put(w, P("data")), put(x, P("data")))


def test_adaptive_norms_mean_under_pmap_is_each_devices_sum():
    """Under ``pmap`` (no varying-axis types) the update's mean is over each device's rows,
    so the ``pmean`` of the updates is the mean of every example (all ones: 1)."""
    tx = jaxclip.adaptive_clip_per_example(4.0, reduce="mean")
    st = tx.init(jnp.zeros(4))

    def step(xb):
        s, norms = jaxclip.clip_tree_per_example(xb, st.clip_norm, axis_name=())
        return jax.lax.pmean(tx.update(s, st, norms=norms)[0], "data")

    out = jax.pmap(step, axis_name="data")(np.ones((8, 8, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(out), 1.0)


def test_clipped_grad_pure_tensor_parallel():
    """No axis splits the batch (the data replicated over "model"): each param's own axes
    split its features, so a column-split W1 and a row-split W2 have each example's norm
    combined over "model"; the replicated bias counts once."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 6)), rng.normal(size=16)
    w1, w2, b = rng.normal(size=(6, 8)) * 0.5, rng.normal(size=8) * 0.5, 0.3

    def loss(p, xr, yr):
        h = jnp.tanh(xr @ p["W1"])
        return 0.5 * (lax.psum(h @ p["W2"], "model") + p["b"] - yr) ** 2

    h = np.tanh(x @ w1)
    r = h @ w2 + b - y
    g1 = r[:, None, None] * x[:, :, None] * (w2 * (1 - h**2))[:, None, :]
    g2, gb = r[:, None] * h, r
    n = np.sqrt((g1**2).sum((1, 2)) + (g2**2).sum(1) + gb**2)
    f = np.minimum(1.0, C / n)
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,))
    specs = {"W1": P(None, "model"), "W2": P("model"), "b": P()}
    g = jaxclip.clipped_grad(loss, C, microbatch_size=4, return_norms=True, batch_argnums=(1, 2))
    body = jax.shard_map(lambda p, a, c: (lambda s, aux: (s, aux.norms))(*g(p, a, c)), mesh=mesh,
                         in_specs=(specs, P(), P()), out_specs=(specs, P()))  # fmt: skip
    p = {k: jax.device_put(np.asarray(v, np.float32), NamedSharding(mesh, specs[k]))
         for k, v in {"W1": w1, "W2": w2, "b": b}.items()}  # fmt: skip
    s, norms = jax.jit(body)(p, x.astype(np.float32), y.astype(np.float32))
    np.testing.assert_allclose(np.asarray(norms, np.float64), n, rtol=1e-5)
    for k, want in (("W1", (f[:, None, None] * g1).sum(0)), ("W2", (f[:, None] * g2).sum(0)),
                    ("b", (f * gb).sum())):  # fmt: skip
        np.testing.assert_allclose(np.asarray(s[k], np.float64), want, rtol=1e-5, atol=1e-6)


def test_clipped_grad_batch_axes_ambiguous_or_misnamed():
    """A per-device argument (a dropout key folded with the device's index) varies across
    "data" like the batch: default, a ValueError asks for batch_axis_name; named, the sums
    and norms are each example's. A batch_axis_name that leaves out an axis only the batch
    varies across, names one it does not, or is not a mesh axis, is a ValueError."""
    x, y, params = _data()
    want = _want(x, y, params)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rows = NamedSharding(mesh, P("data"))
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)

    def loss(p, xr, yr, key):  # the key does not change the loss; it varies across "data"
        return _loss(p, xr, yr) + 0.0 * jax.random.uniform(key)

    def run(names, keyed=True):
        def step(xb, yb):
            key = jax.random.key(0)
            if keyed:
                key = jax.random.fold_in(key, lax.axis_index("data"))
            g = jaxclip.clipped_grad(loss, C, return_norms=True, batch_argnums=(1, 2),
                                     batch_axis_name=names)  # fmt: skip
            s, aux = g(params, xb, yb, key)
            return lax.psum(s, "data"), aux.norms

        f = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                          out_specs=(P(), P("data")))  # fmt: skip
        return jax.jit(f)(xs, ys)

    with pytest.raises(ValueError, match=r"\('data',\), and so does a param or another"):
        run(None)
    s, norms = run("data")
    _close(s, norms, want)
    # Named, the axes another argument varies across are taken as given.
    for names in ((), "nope"):
        with pytest.raises(ValueError, match=r"batch_axis_name=.*Name the axes that split"):
            run(names, keyed=False)


def test_complex_leaves_keep_their_imaginary_part_with_the_batch_split():
    """A complex per-example leaf (selected, and one left unclipped) with the batch split
    over 8 devices under jit: the sums are the single-device ones (float64 NumPy), not
    their real parts."""
    rng = np.random.default_rng(1)
    z = (rng.normal(size=(16, 5)) + 1j * rng.normal(size=(16, 5))).astype(np.complex64)
    r = rng.normal(size=(16, 3)).astype(np.float32)
    z64 = z.astype(np.complex128)
    n = np.sqrt(np.sum(np.abs(z64) ** 2, 1) + np.sum(r.astype(np.float64) ** 2, 1))
    f = np.minimum(1.0, 1.5 / n)[:, None]
    clip = jax.jit(lambda g: jaxclip.clip_tree_per_example(g, 1.5)[0])
    keep = jax.jit(
        lambda g: jaxclip.clip_tree_per_example(g, 1.5, need_clip=jaxclip.exclude_names("z"))[0]
    )
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        g = jax.device_put({"z": z, "r": r}, NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            got, unclipped = clip(g), keep(g)
        np.testing.assert_allclose(np.asarray(got["z"]), (f * z64).sum(0), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(unclipped["z"]), z64.sum(0), rtol=2e-6, atol=1e-6)


def test_float16_sums_in_data_parallel_shard_map():
    """float16 per-example sums inside shard_map (XLA:CPU's loop over blocks of columns
    must vary over the devices as the leaf does), psum'd, against float64."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(64, 70, 113)) * 0.05).astype(np.float16)
    x64 = x.astype(np.float64).reshape(64, -1)
    f = np.minimum(1.0, 1.0 / np.linalg.norm(x64, axis=1))[:, None]
    want = (f * x64).sum(0).reshape(70, 113)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    def local(g):
        s, _ = jaxclip.clip_tree_per_example(g, 1.0, axis_name=())
        return jax.tree.map(lambda v: lax.psum(v, "data"), s)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),), out_specs=P()))
    with jax.set_mesh(mesh):
        got = run({"x": jax.device_put(x, NamedSharding(mesh, P("data")))})
    # Eight float16 partial sums, each rounded, then added in float16: a few ulp of 0.3.
    np.testing.assert_allclose(np.asarray(got["x"], np.float64), want, rtol=2e-3, atol=5e-4)
