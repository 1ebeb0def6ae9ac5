"""What checkpoint code refuses with, shared by the folder side (``checkpoint``) and the
DCP side (``checkpoint_reader``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import Diagnostic, PlanError, SourceLoc


class CheckpointError(PlanError):
    """A checkpoint that cannot be saved or resumed here (missing, partial, another model,
    hostile, or a failed write)."""


def refusal(path: str | Path, message: str, fix: str) -> CheckpointError:
    return CheckpointError([Diagnostic(rule="checkpoint", loc=SourceLoc(path=str(path)), message=message, fix=fix)])


def is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
