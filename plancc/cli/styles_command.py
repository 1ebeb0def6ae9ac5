"""``plancc styles``: the style vocabulary."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .app import Format, FormatOpt, app, table

if TYPE_CHECKING:
    pass


@app.command()
def styles(fmt: FormatOpt = Format.text) -> None:
    """List the style vocabulary with the placements each style sets."""
    from ..compiler.styles import ALIASES, STYLES, default_layouts, format_layout  # lazy: loads torch

    rows = []
    for spec in STYLES.values():
        lay = default_layouts(spec.name)
        weight = "-"
        if lay.weight:
            kinds = sorted(spec.module_kinds & set(lay.weight), key=str)
            weight = ", ".join(f"{k}:{format_layout(lay.weight[k])}" for k in kinds) or "-"
        aliases = ", ".join(a for a, n in ALIASES.items() if n == spec.name)
        rows.append(
            {
                "style": spec.name,
                "weight": weight,
                "input": format_layout(lay.input),
                "output": format_layout(lay.output),
                "local_output": "-" if lay.local_output is None else ("yes" if lay.local_output else "DTensor"),
                "modules": ", ".join(sorted(map(str, spec.module_kinds))) if not spec.fits_any_module else "any",
                "aliases": aliases,
                "summary": spec.summary,
            }
        )
    if fmt is Format.json:
        print(json.dumps(rows, indent=2))
        return
    header = ["style", "weight", "input", "output", "local", "modules", "aliases"]
    print(
        table(
            [
                [r["style"], r["weight"], r["input"], r["output"], r["local_output"], r["modules"], r["aliases"]]
                for r in rows
            ],
            header,
        )
    )
    print()
    for r in rows:
        print(f"{r['style']:<20} {r['summary']}")
