"""The docs' guides run as written, and their generated parts come from their sources.

Every ```python block of a page runs, the page's blocks in order in one namespace (as a
reader runs them top to bottom). The suite has 8 simulated CPU devices (conftest.py), which
the distributed guide needs.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(
    p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "_generated" not in p.parts
)


def _blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
@pytest.mark.slow  # suite budget: the slow step runs it (CI runs both)
def test_python_blocks_run(page: pathlib.Path):
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for i, block in enumerate(_blocks(page)):
            exec(compile(block, f"{page.name} block {i}", "exec"), namespace)


def test_every_guide_has_runnable_code_and_is_in_the_index():
    index = (DOCS / "index.md").read_text()
    for guide in sorted((DOCS / "guides").glob("*.md")):
        assert f"guides/{guide.stem}" in index, f"add guides/{guide.stem} to docs/index.md"
        if guide.stem != "performance":  # its tables are generated, its code is shell
            assert _blocks(guide), f"{guide.name} has no python example"


def test_performance_tables_are_generated_from_the_benchmark_json(tmp_path, monkeypatch):
    sys.path.insert(0, str(DOCS))
    try:
        import perf_tables
    finally:
        sys.path.remove(str(DOCS))
    monkeypatch.setattr(perf_tables, "OUT", tmp_path / "tables.md")
    text = perf_tables.write().read_text()
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    for row in results["rows"]:  # each row's numbers, as the JSON has them
        line = next(
            ln
            for ln in text.splitlines()
            if ln.startswith(f"| {row['tree']} ") and f"`{row['mode']}`" in ln
        )
        assert f"{row['run_ms']:.2f} / {row['counterpart_run_ms']:.2f}" in line, line
        assert f"({row['compile_ratio']:.2f}x)" in line, line
    modes = json.loads((ROOT / "benchmarks" / "results_modes.json").read_text())
    for row in modes["rows"]:
        assert f"| {row['case']} | {row['counterpart']} | {row['ms']:.3g} |" in text
    page = (DOCS / "guides" / "performance.md").read_text()
    assert "```{include} ../_generated/performance_tables.md" in page
    assert "|---" not in page  # no table copied by hand


def test_readme_is_a_first_page_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    commands = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_command = next(c.strip() for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
    assert "not yet on the package index" in readme
    assert "python -m jaxclip.demo" in readme
