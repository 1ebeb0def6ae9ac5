"""``plancc import-hf``: a Hugging Face ``base_model_tp_plan`` as a plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import PlanError
from .app import Format, app, fail

if TYPE_CHECKING:
    pass


@app.command("import-hf")
def import_hf_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="preset, HF model folder or config.json")],
) -> None:
    """Write a plan from the model's own Hugging Face TP plan (to stdout)."""
    from ..tools.import_hf import import_hf  # lazy: loads torch

    try:
        print(import_hf(model), end="")
    except PlanError as exc:
        raise fail(exc, Format.text) from None
