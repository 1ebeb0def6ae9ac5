"""The ``plancc`` command line: thin wrappers that parse flags, call the API and print.

Exit codes: 0 ok (warnings allowed), 1 plan/config problems, 2 usage errors.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import Diagnostic, PlanError, format_json

app = typer.Typer(
    name="plancc",
    help="Declarative parallelization plans for Hugging Face models on DTensor/FSDP2.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_PLAN = 1
EXIT_USAGE = 2


class Format(StrEnum):
    text = "text"
    json = "json"


FormatOpt = Annotated[Format, typer.Option("--format", help="text for people, json for CI tools")]
ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="preset name (see `plancc models`), HF model folder, or config.json"),
]


def _emit(diagnostics: list[Diagnostic], fmt: Format, summary: dict | None = None) -> None:
    if fmt is Format.json:
        payload = json.loads(format_json(diagnostics))
        if summary is not None:
            payload["summary"] = summary
        print(json.dumps(payload, indent=2))
        return
    for diag in diagnostics:
        print(diag.format(), file=sys.stderr if diag.is_error else sys.stdout)


def _fail(exc: PlanError, fmt: Format) -> typer.Exit:
    from .models import ModelSpecError

    _emit(exc.diagnostics, fmt)
    usage = isinstance(exc, ModelSpecError) or any(
        d.rule in ("file-not-found", "file-unreadable") for d in exc.diagnostics
    )
    return typer.Exit(EXIT_USAGE if usage else EXIT_PLAN)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


@app.command()
def validate(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan YAML file")],
    model: ModelOpt = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="tensor-parallel degree")] = 1,
    cp: Annotated[int, typer.Option("--cp", min=1, help="context-parallel degree")] = 1,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, help="data-parallel degree (inferred)")] = None,
    world_size: Annotated[Optional[int], typer.Option("--world-size", min=1, help="total ranks")] = None,
    sp: Annotated[bool, typer.Option("--sp", help="check with the sequence-parallel overlay on")] = False,
    fmt: FormatOpt = Format.text,
) -> None:
    """Check a plan against a model config (no GPU, no weights) and summarize it."""
    from .validate import validate_plan

    try:
        report = validate_plan(
            plan_path, model=model, tp=tp, cp=cp, dp=dp, world_size=world_size, sequence_parallel=sp
        )
    except PlanError as exc:
        raise _fail(exc, fmt) from None
    _emit(report.diagnostics, fmt, summary=report.summary() if fmt is Format.json else None)
    if fmt is Format.text:
        print(report.render())
    if report.has_errors:
        raise typer.Exit(EXIT_PLAN)


@app.command()
def styles(fmt: FormatOpt = Format.text) -> None:
    """List the style vocabulary with the placements each style sets."""
    from .styles import ALIASES, STYLES, format_layout, layouts_of

    rows = []
    for spec in STYLES.values():
        lay = layouts_of(spec.build())
        weight = "-"
        if lay.weight:
            kinds = sorted(spec.module_kinds & set(lay.weight), key=str)
            weight = ", ".join(f"{k}:{format_layout(lay.weight[k])}" for k in kinds) or "-"
        aliases = ", ".join(a for a, n in ALIASES.items() if n == spec.name)
        rows.append({
            "style": spec.name,
            "weight": weight,
            "input": format_layout(lay.input),
            "output": format_layout(lay.output),
            "local_output": "-" if lay.local_output is None else ("yes" if lay.local_output else "DTensor"),
            "modules": ", ".join(sorted(map(str, spec.module_kinds))) if len(spec.module_kinds) < 5 else "any",
            "aliases": aliases,
            "summary": spec.summary,
        })
    if fmt is Format.json:
        print(json.dumps(rows, indent=2))
        return
    header = ["style", "weight", "input", "output", "local", "modules", "aliases"]
    print(_table([[r["style"], r["weight"], r["input"], r["output"], r["local_output"], r["modules"],
                   r["aliases"]] for r in rows], header))
    print()
    for r in rows:
        print(f"{r['style']:<20} {r['summary']}")


@app.command()
def models(fmt: FormatOpt = Format.text) -> None:
    """List the built-in model presets."""
    from .models import presets

    rows = [[p.name, p.architecture, p.summary] for p in presets().values()]
    if fmt is Format.json:
        print(json.dumps([dict(zip(["name", "architecture", "summary"], r)) for r in rows], indent=2))
        return
    print(_table(rows, ["preset", "architecture", "summary"]))


def main() -> None:  # console-script entry point
    app()


if __name__ == "__main__":
    main()
