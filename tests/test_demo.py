"""The demo's claims, as the README states them, checked against a (shorter) run.

README: unclipped SGD at the high learning rate ends above the do-nothing baseline (every
seed); every fixed-bound and adaptive-bound mode at that learning rate beats the baseline
and matches or beats the best unclipped learning rate of the sweep, which is an interior
one; ZClip and spike skipping do not rescue it.
"""

import contextlib
import importlib.util
import io

import numpy as np
import optax
import pytest

from jaxclip import demo

RESCUE = ("clip_by_global_norm", "clip_by_norm", "clip_by_value", "adaptive_clip", "auto_clip")
NO_RESCUE = ("zclip", "skip_large_updates")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    out = tmp_path_factory.mktemp("demo") / "demo.png"
    args = ["--quick", "--out", str(out)] + ([] if has_mpl else ["--no-plot"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = demo.main(args)
    return results, printed.getvalue(), out if has_mpl else None


@pytest.mark.slow
def test_demo_claims(run):
    results, printed, png = run
    by_name = {r.config.name.split(",")[0].split("(")[0]: r for r in results}
    base = demo.baseline_bits()
    assert 4.3 < base < 4.6  # ~4.47 bits: the entropy of the sonnets' characters

    unclipped = [r for r in results if r.config.make is optax.identity]
    assert [r.config.lr for r in unclipped] == list(demo.SWEEP)
    means = [float(np.mean(r.final())) for r in unclipped]
    best = int(np.argmin(means))
    # The best unclipped rate is an interior one: the sweep brackets it.
    assert 0 < best < len(unclipped) - 1, means
    assert np.all(unclipped[best].final() < base - 0.5)
    # Unclipped at the high learning rate: every seed ends above the baseline (or NaN).
    assert np.all(unclipped[-1].final() > base + 0.5), unclipped[-1].final()

    clipped = [r for r in results if r.config.make is not optax.identity]
    assert {r.config.lr for r in clipped} == {demo.HIGH_LR}
    for name in RESCUE:
        f = by_name[name].final()
        assert np.all(f < base - 0.5), (name, f)  # well below the baseline, every seed
        assert f.mean() <= means[best] + 0.05, (name, f, means[best])  # matches or beats
        assert by_name[name].clipped.mean() > 0.2, name  # and it did clip
    for name in NO_RESCUE:
        assert np.mean(by_name[name].final()) > base, name

    assert "| baseline: character frequencies | 4.47 |" in printed  # the entropy, 2 decimals
    assert "best unclipped learning rate" in printed
    if png is not None:
        assert png.stat().st_size > 10_000


def test_readme_table_lists_the_demo_configurations():
    """The docs' demo page has one row per configuration the demo runs, in order, and the
    README's short table names each of them."""
    import pathlib

    root = pathlib.Path(__file__).parent.parent
    page = (root / "docs" / "demo.md").read_text()
    rows = [line.split("|")[1].strip() for line in page.splitlines() if ", lr " in line]
    assert rows == [c.name for c in demo.configs()]
    readme = (root / "README.md").read_text()
    assert all(f"| {c.name}" in readme for c in demo.configs())


def test_no_matplotlib_no_crash(monkeypatch, capsys):
    """Without the demo extra the demo prints its table and says how to get the plot."""
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    monkeypatch.setattr(demo, "train", lambda **kw: [])
    monkeypatch.setattr(demo, "table", lambda results: "TABLE")
    monkeypatch.setattr(demo, "summary", lambda results: {"best_unclipped_lr": 4.0})
    demo.main(["--quick"])
    out = capsys.readouterr().out
    assert "TABLE" in out and "pip install -e '.[demo]'" in out
