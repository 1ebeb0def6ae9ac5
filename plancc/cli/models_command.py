"""``plancc models``: the presets."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .app import Format, FormatOpt, app, table

if TYPE_CHECKING:
    pass


@app.command()
def models(fmt: FormatOpt = Format.text) -> None:
    """List the built-in model presets."""
    from ..models import presets  # lazy: loads torch

    rows = [[p.name, p.architecture, p.summary] for p in presets().values()]
    if fmt is Format.json:
        print(json.dumps([dict(zip(["name", "architecture", "summary"], r)) for r in rows], indent=2))
        return
    print(table(rows, ["preset", "architecture", "summary"]))
