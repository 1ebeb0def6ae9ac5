"""Diagnostics: every user-facing problem is a value, printed as
``path:line:col: severity: message [rule]`` followed by ``  fix: ...``.

Stages collect diagnostics and raise one ``PlanError`` holding all of them, so a
user sees every problem in a plan at once rather than fixing them one run at a time.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceLoc:
    """A 1-based line and column in a file; line 0 means "the file as a whole"."""

    path: str
    line: int = 0
    column: int = 0

    def __str__(self) -> str:
        if self.line <= 0:
            return self.path
        return f"{self.path}:{self.line}:{self.column}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnostic:
    rule: str
    message: str
    loc: SourceLoc = field(default_factory=lambda: SourceLoc(path="<plan>"))
    fix: str | None = None
    severity: Severity = Severity.ERROR
    # the fix as data, where it is rules to write: {glob: style}, a style a name or a mapping
    # (``{"style": "rowwise", "output_layouts": "shard(-1)"}``), or the facts a fix is made of
    # (``mesh-sizes``: the world size and its divisors); tools read it, never the text of ``fix``
    suggestion: Mapping[str, Any] | None = None

    @property
    def path(self) -> str:
        return self.loc.path

    @property
    def line(self) -> int:
        return self.loc.line

    @property
    def column(self) -> int:
        return self.loc.column

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        text = f"{self.loc}: {self.severity}: {self.message} [{self.rule}]"
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text

    def to_json(self) -> dict[str, Any]:
        """The stable JSON shape documented in docs/diagnostics.md."""
        data = asdict(self)
        loc = data.pop("loc")
        data["severity"] = str(self.severity)
        if self.suggestion is None:
            data.pop("suggestion")
        else:
            data["suggestion"] = dict(self.suggestion)
        return {**loc, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Diagnostic:
        """The inverse of ``to_json`` (diagnostics a worker reports back to the launcher)."""
        return cls(
            rule=data["rule"],
            message=data["message"],
            fix=data.get("fix"),
            severity=Severity(data.get("severity", "error")),
            loc=SourceLoc(path=data.get("path", "<run>"), line=data.get("line", 0), column=data.get("column", 0)),
            suggestion=data.get("suggestion"),
        )


class PlanError(Exception):
    """A plan (or the plan against a model) has one or more error diagnostics."""

    def __init__(self, diagnostics: Sequence[Diagnostic]):
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(d.format() for d in self.diagnostics))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]


def raise_if_errors(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Return the diagnostics when none is an error; otherwise raise them all."""
    found = list(diagnostics)
    if any(d.is_error for d in found):
        raise PlanError(found)
    return found


def format_json(diagnostics: Iterable[Diagnostic]) -> str:
    return json.dumps({"diagnostics": [d.to_json() for d in diagnostics]}, indent=2)


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The choices nearest to a misspelt word, best first (for "did you mean")."""
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    near = closest(word, choices)
    if not near:
        return ""
    return "did you mean " + " or ".join(repr(c) for c in near) + "?"


class _AtLeast(logging.Filter):
    """Lets through the records of ``level`` and above."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Drop one logger's records below ``level`` (and its descendants': torch logs through each
    module's own logger, and a logger's filter sees only its own records) for the duration of
    a block, never process-wide: for torch messages that a plancc diagnostic replaces or that
    an accepted cost repeats. A filter, not ``setLevel``: each ``setLevel`` clears the cache of
    every logger in the process (hundreds once transformers is imported), milliseconds that a
    refit paid once a bucket."""
    names = [name] + [n for n in logging.Logger.manager.loggerDict if n.startswith(name + ".")]
    loggers = [logging.getLogger(n) for n in names]
    quiet = _AtLeast(level)
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
