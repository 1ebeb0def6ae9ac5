"""``plancc plot``: a metrics file as a chart."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import PlanError
from ..paths import RunPath, overlaps
from ..tools.plot import plot as draw
from .app import EXIT_USAGE, Format, app, emit, fail

if TYPE_CHECKING:
    pass


@app.command()
def plot(
    metrics_file: Annotated[Path, typer.Argument(metavar="METRICS.jsonl", help="a file plancc apply --metrics wrote")],
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write")] = Path("metrics.png"),
) -> None:
    """Draw loss, gradient norm and throughput per step from a --metrics file."""

    problems = overlaps(
        [
            RunPath(flag="METRICS.jsonl", path=str(metrics_file), output=False),
            RunPath(flag="-o", path=str(out), output=True),
        ]
    )
    if problems:
        emit(problems, Format.text)
        raise typer.Exit(EXIT_USAGE)
    try:
        steps = draw(metrics_file, out)
    except PlanError as exc:
        raise fail(exc, Format.text) from None
    print(f"plotted {steps} step{'s' if steps != 1 else ''} of {metrics_file} -> {out}")
