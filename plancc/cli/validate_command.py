"""``plancc validate``: schema, globs and model-aware checks; ``--dry-run`` at the real world size."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import Diagnostic, PlanError
from ..job.run_file import is_run_file, plan_of_run_file
from .app import EXIT_PLAN, EXIT_USAGE, Format, FormatOpt, ModelOpt, app, emit, exit_code
from .flag_groups import LayoutFlags, given_sizes, grouped

if TYPE_CHECKING:
    from ..checks.report import ValidationReport


@app.command()
@grouped(layout=LayoutFlags)
def validate(
    plan_paths: Annotated[list[Path], typer.Argument(metavar="PLAN...", help="plan YAML files (one report each)")],
    layout: LayoutFlags,
    model: ModelOpt = None,
    world_size: Annotated[int | None, typer.Option("--world-size", min=1, help="total ranks")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=1, help="training sequence length")] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="parallelize and run fwd+bwd at the real world size with fake ranks and tensors"
        ),
    ] = False,
    fmt: FormatOpt = Format.text,
) -> None:
    """Check plans against a model config (no GPU, no weights) and summarize each.

    With several plans (as pre-commit passes them) every plan is checked and reported; the
    exit code is the worst: 2 for a usage problem (a missing file), else 1 if any plan has an
    error, else 0.
    """
    from ..checks.report import validate_plan  # lazy: loads torch

    worst, diagnostics, summaries, texts = 0, [], [], []
    for plan_path in plan_paths:
        try:
            # a run file: checked itself, then its plan for its model and layout (flags win)
            plan_path, settings = plan_of_run_file(plan_path) if is_run_file(plan_path) else (plan_path, {})
            flags = (
                ("dp", "dp"),
                ("cp", "cp"),
                ("tp", "tp"),
                ("ep", "ep"),
                ("sp", "sequence_parallel"),
                ("pp", "pp"),
                ("dp_replicate", "dp_replicate"),
            )
            from_file = {size: settings[flag] for flag, size in flags if settings.get(flag) is not None}
            if settings.get("dp_shard") is not None:  # the run file's dp as HSDP names it
                from_file["dp"] = settings.get("dp_replicate", 1) * settings["dp_shard"]
            sizes = {**from_file, **given_sizes(layout)}
            report = validate_plan(
                plan_path,
                model=model or settings.get("model"),
                world_size=world_size,
                seq_len=seq_len,
                **{**layout.sizes(), **sizes},
                skeleton=not dry_run,  # a dry run runs the model: the real one, built from its config
            )
        except PlanError as exc:
            diagnostics += exc.diagnostics
            worst = max(worst, exit_code(exc))
            continue
        dry_line, dry_summary = "", None
        too_many = _dry_run_world_problem(report) if dry_run and not report.has_errors else None
        if too_many is not None:  # refused before the dry run starts: it would not finish in minutes
            diagnostics.append(too_many)
            worst = EXIT_USAGE
            continue
        if dry_run and not report.has_errors:
            # before rendering: the verdict line counts the dry run's findings too
            dry_line, dry_found, dry_summary = _dry_run(report, seq_len)
            report = replace(report, diagnostics=report.diagnostics + tuple(dry_found))
        found = list(report.diagnostics)
        summary = report.summary()
        if dry_summary is not None:
            summary["dry_run"] = dry_summary
        text = report.render() + (f"\n{dry_line}" if dry_line else "")
        diagnostics += found
        summaries.append(summary)
        texts.append(text)
        worst = max(worst, EXIT_PLAN if any(d.is_error for d in found) else 0)
    if fmt is Format.json:
        payload: dict[str, Any] = {"diagnostics": [d.to_json() for d in diagnostics]}
        if len(plan_paths) == 1 and summaries:
            payload["summary"] = summaries[0]
        else:
            payload["summaries"] = summaries
        print(json.dumps(payload, indent=2))
    else:
        emit(diagnostics, fmt)
        print("\n".join(texts))
    if worst:
        raise typer.Exit(worst)


def _dry_run_world_problem(report: ValidationReport) -> Diagnostic | None:
    from ..tools.dryrun import world_problem  # lazy: loads torch

    return world_problem(report.layout)


def _dry_run(report: ValidationReport, seq_len: int | None) -> tuple[str, list[Diagnostic], dict[str, Any]]:
    """Run the dry run of a validated plan: (the line that reports it, its findings, its summary)."""
    from ..tools.dryrun import describe_traffic, dry_run  # lazy: loads torch
    from ..tools.explain import human_bytes  # lazy: loads torch

    tokens = seq_len or 256
    result = dry_run(report.plan, report.config, report.layout, seq_len=tokens)
    summary = {
        "world_size": result.world_size,
        "seconds": round(result.seconds, 2),
        "per_rank_bytes": {
            "parameters": result.param_bytes,
            "gradients": result.grad_bytes,
            "adamw_state": result.optimizer_bytes,
        },
        "collectives": {
            "layer_index": result.traffic.index,
            "per_layer": result.traffic.layer.to_json(),
        },
    }
    line = (
        f"dry run: {result.world_size} ranks ({result.layout.describe()}) "
        f"fwd+bwd {'ok' if result.ok else 'FAILED'} in {result.seconds:.1f}s; per rank: parameters "
        f"{human_bytes(result.param_bytes)}, gradients {human_bytes(result.grad_bytes)}, "
        f"AdamW state {human_bytes(result.optimizer_bytes)}"
    )
    if result.ok:
        line = "\n".join([line, *describe_traffic(result, seq_len=tokens)])
    return line, list(result.diagnostics), summary
