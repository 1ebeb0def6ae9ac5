"""``plancc rules``: every check with its examples."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .app import app

if TYPE_CHECKING:
    pass


@app.command()
def rules() -> None:
    """The model-aware checks, each with its documentation and PASS/FAIL examples."""
    from ..checks import RULES  # lazy: loads torch
    from ..checks.example import render_rule  # lazy: loads torch

    for module in RULES:
        print(render_rule(module.__doc__ or "", module.EXAMPLES))
        print()
