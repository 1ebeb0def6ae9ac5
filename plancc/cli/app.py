"""The ``plancc`` command line's app: its formats, exit codes, and how problems are printed
(``plancc.cli``'s commands are one module each).

Exit codes: 0 ok (warnings allowed), 1 plan/config problems, 2 usage errors.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import Diagnostic, PlanError, SourceLoc, format_json

if TYPE_CHECKING:
    pass


app = typer.Typer(
    name="plancc",
    help="Declarative parallelization plans for Hugging Face models on DTensor/FSDP2.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"plancc {version('plancc')}")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Declarative parallelization plans for Hugging Face models on DTensor/FSDP2."""


EXIT_PLAN = 1
EXIT_USAGE = 2
# problems of the command line itself (exit 2), not of the plan, the config or the data
USAGE_RULES = frozenset(
    {"file-not-found", "file-unreadable", "file-too-large", "file-no-writer", "usage", "path-overlap"}
)


class Format(StrEnum):
    text = "text"
    json = "json"


FormatOpt = Annotated[Format, typer.Option("--format", help="text for people, json for CI tools")]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="preset name (see `plancc models`), HF model folder, or config.json"),
]


def emit(diagnostics: list[Diagnostic], fmt: Format, summary: dict | None = None) -> None:
    if fmt is Format.json:
        payload = json.loads(format_json(diagnostics))
        if summary is not None:
            payload["summary"] = summary
        print(json.dumps(payload, indent=2))
        return
    for diag in diagnostics:
        print(diag.format(), file=sys.stderr if diag.is_error else sys.stdout)


def exit_code(exc: PlanError) -> int:
    from ..models import ModelSpecError  # lazy: loads torch

    usage = isinstance(exc, ModelSpecError) or any(d.rule in USAGE_RULES for d in exc.diagnostics)
    return EXIT_USAGE if usage else EXIT_PLAN


def fail(exc: PlanError, fmt: Format) -> typer.Exit:
    emit(exc.diagnostics, fmt)
    return typer.Exit(exit_code(exc))


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def usage_error(message: str, fmt: Format, fix: str | None = None) -> None:
    """A flag combination that cannot run: one diagnostic, exit 2."""
    emit([Diagnostic(rule="usage", loc=SourceLoc(path="<command line>"), message=message, fix=fix)], fmt)
    raise typer.Exit(EXIT_USAGE)
