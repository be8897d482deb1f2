"""Sphinx configuration: the API reference from the docstrings, the notebooks rendered.

Build with ``bash docs/build.sh`` (warnings are errors), after ``pip install -e ".[docs]"``.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # document this checkout's jaxclip, installed or not

import jaxclip  # noqa: E402

project = "jaxclip"
author = "jaxclip developers"
copyright = "jaxclip developers"
release = version = jaxclip.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style Args / Returns / Example sections
    "sphinx.ext.viewcode",
    "myst_nb",  # Markdown pages and the notebooks
]

# The notebooks are committed executed (notebooks/build.py runs them): render, don't run.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

exclude_patterns = ["_build", "_generated", "build.sh", "README.md"]
html_theme = "sphinx_book_theme"
html_title = f"jaxclip {release}"
html_theme_options = {"show_toc_level": 2}


# The notebooks and the demo's plot live in notebooks/ (outside this source tree): copy
# them in at every build (docs/notebooks/ is generated and ignored by git).
def _copy_notebooks() -> None:
    out = HERE / "notebooks"
    out.mkdir(exist_ok=True)
    notebooks = ROOT / "notebooks"
    for src in [*sorted(notebooks.glob("*.ipynb")), notebooks / "jaxclip_demo.png"]:
        shutil.copyfile(src, out / src.name)


_copy_notebooks()

# The performance guide's tables, from the benchmarks' JSON (docs/_generated/, ignored by git).
sys.path.insert(0, str(HERE))
import modes_table  # noqa: E402
import perf_tables  # noqa: E402

perf_tables.write()
modes_table.write()  # the modes' table, from jaxclip's registry
