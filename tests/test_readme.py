"""The README's Python examples run as written."""

import contextlib
import io
import pathlib
import re
import types

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(README), "exec"), {})
    assert "30.0" in out.getvalue()  # the quickstart's printed norm: 10 x 10 weights of 3


def test_every_public_name_is_in_the_api_reference():
    import jaxclip

    api = (pathlib.Path(__file__).parent.parent / "docs" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class):: (\w+)", api, re.M))
    missing = {n for n in jaxclip.__all__ if callable(getattr(jaxclip, n))} - documented
    assert not missing, f"add to docs/api.rst: {sorted(missing)}"


def test_all_is_every_public_name():
    import jaxclip

    public = {
        n
        for n in dir(jaxclip)
        if not n.startswith("_") and not isinstance(getattr(jaxclip, n), types.ModuleType)
    }
    assert set(jaxclip.__all__) == public
    assert all(hasattr(jaxclip, n) for n in jaxclip.__all__)
