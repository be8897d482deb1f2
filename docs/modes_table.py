"""Writes the table of jaxclip's modes from the library's registry (``jaxclip._registry``).

Called by ``conf.py`` at every docs build: ``docs/_generated/modes_table.md``, which the
selection and logging guide includes. A new registry entry changes the docs with no edit.
"""

from __future__ import annotations

import pathlib

from jaxclip._registry import MODES

OUT = pathlib.Path(__file__).parent / "_generated" / "modes_table.md"


def write() -> None:
    rows = [
        "| mode | state | fields `clip_stats` reports | scheduled hyperparameter | gradients |",
        "|---|---|---|---|---|",
    ]
    for m in MODES:
        logged = ", ".join(f"`{f}`" for f in m.logged) or "none (stateless)"
        kind = "per example (batch axis leading)" if m.batched else "one per parameter"
        if m.needs_params:
            kind += ", with params"
        rows.append(
            f"| `jaxclip.{m.name}` | `{m.state.__name__}` | {logged} | `{m.scheduled}` | {kind} |"
        )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    write()
