"""The demo: unclipped training diverges, every clipping mode stays finite."""

import importlib.util

import numpy as np
import pytest

from jaxclip import demo


@pytest.mark.slow
def test_demo_quick(tmp_path, capsys):
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    out = tmp_path / "demo.png"
    args = ["--quick", "--out", str(out)] + ([] if has_mpl else ["--no-plot"])
    traces = demo.main(args)
    assert np.sum(~np.isfinite(traces["none"].loss)) > 0  # plain SGD diverges
    for name, t in traces.items():
        if name != "none":
            assert np.all(np.isfinite(t.loss)), name
            assert t.clipped.any(), name
    printed = capsys.readouterr().out
    assert "| none |" in printed and "steps clipped" in printed
    if has_mpl:
        assert out.stat().st_size > 10_000
