"""``plancc suggest``: which layout, offline."""

from __future__ import annotations

import json
from dataclasses import asdict
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import PlanError
from .app import EXIT_PLAN, Format, FormatOpt, ModelOpt, app, emit, fail, usage_error

if TYPE_CHECKING:
    from ..compiler.plan import Plan
    from ..tools.suggest_costs import Suggestion


def _bytes_of(text: str) -> int | None:
    """``80GiB``, ``141 GB``, ``80`` (GiB) as bytes; None when it is none of those."""
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|tib|tb|t)?\s*", text.lower())
    if found is None:
        return None
    unit = {"gib": 2**30, "g": 2**30, None: 2**30, "gb": 10**9, "tib": 2**40, "t": 2**40, "tb": 10**12}[found.group(2)]
    # exact (a 400-digit size is a size: suggest says it is more than any GPU has, no OverflowError)
    return int(Decimal(found.group(1)) * unit)


def _written(
    folder: Path, plan_path: Path, plan: Plan, model: str, result: Suggestion, fmt: Format
) -> tuple[Path, Path, str]:
    """The best layout's plan and run file in ``folder`` and the command that launches them (a
    usage error where they cannot be written)."""
    from ..tools.suggest_run import write_best  # lazy: loads torch

    try:
        return write_best(folder, str(plan_path), plan, model, result)
    except OSError as exc:
        usage_error(f"--write {folder}: {exc.strerror or exc}", fmt, fix="name a folder that can be written")
        raise


@app.command()
def suggest(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan YAML file")],
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs the job gets")],
    model: ModelOpt = None,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (NVLink domain)")] = 8,
    gpu_memory: Annotated[
        str | None, typer.Option("--gpu-memory", help="memory per GPU, e.g. 80GiB (default: the hardware's)")
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per sequence")] = 4096,
    tokens_per_step: Annotated[
        int | None,
        typer.Option("--tokens-per-step", help="global tokens per optimizer step (default: one sequence per GPU)"),
    ] = None,
    hardware: Annotated[str, typer.Option("--hardware", help="h100, h200, a100 or b200 (docs/suggest.md)")] = "h100",
    allow: Annotated[
        str,
        typer.Option("--allow", help="axes beside tp and dp to search: any of sp,cp,ep,pp,hsdp (HSDP's dp_replicate)"),
    ] = "sp,cp,ep",
    top: Annotated[int, typer.Option("--top", min=1, help="candidates to print")] = 10,
    verify_top: Annotated[
        int,
        typer.Option(
            "--verify-top",
            min=0,
            help="measure the peak memory of the K best with one training step in a fake world (slow)",
        ),
    ] = 0,
    headroom: Annotated[
        float,
        typer.Option(
            "--headroom",
            min=0.0,
            max=0.5,
            help="share of each GPU's memory a layout must leave free (fragmentation, NCCL buffers, "
            "the CUDA context: the cost counts none of them)",
        ),
    ] = 0.05,
    write: Annotated[
        Path | None,
        typer.Option(
            "--write",
            help="write the best layout's run here: plan.yaml (the plan with its edits) and run.yaml "
            "(plancc apply --config DIR/run.yaml)",
        ),
    ] = None,
    fmt: FormatOpt = Format.text,
) -> None:
    """The layouts the plan allows for the model on N GPUs, with per-GPU memory and estimated step
    time, fastest fitting first, and the command line of the best (no GPU is touched)."""
    from ..tools.suggest import render_verified  # lazy: loads torch
    from ..tools.suggest import suggest as suggest_layouts  # lazy: loads torch
    from ..tools.suggest import verify_top as verify  # lazy: loads torch
    from ..tools.suggest_report import as_dict, no_fit_problem, render  # lazy: loads torch

    axes = [a.strip() for a in allow.split(",") if a.strip()]
    unknown = [a for a in axes if a not in ("sp", "cp", "ep", "pp", "hsdp")]
    memory = _bytes_of(gpu_memory) if gpu_memory is not None else None
    if unknown:
        usage_error(f"--allow {allow!r}: unknown axis {unknown[0]!r}", fmt, fix="--allow takes any of sp,cp,ep,pp,hsdp")
    if gpu_memory is not None and not memory:
        usage_error(f"--gpu-memory {gpu_memory!r} is not a size", fmt, fix="write it like 80GiB or 141GB")
    from ..compiler.plan import load_plan  # lazy: loads torch
    from ..models import default_preset  # lazy: loads torch

    try:
        plan = load_plan(plan_path)
        name = model or default_preset(plan.architectures)
        if name is None:
            usage_error("the plan's architectures have no published preset", fmt, fix="pass --model")
        assert name is not None
        result = suggest_layouts(
            plan,
            name,
            gpus=gpus,
            gpus_per_node=gpus_per_node,
            gpu_memory=memory,
            seq_len=seq_len,
            tokens_per_step=tokens_per_step,
            hardware=hardware,
            allow=axes,
            headroom=headroom,
        )
    except PlanError as exc:
        raise fail(exc, fmt) from None
    problem = no_fit_problem(result, plan)
    verified = verify(result, plan, name, verify_top) if verify_top else []
    written = _written(write, plan_path, plan, name, result, fmt) if write is not None and result.best else None
    if fmt is Format.json:
        found = {"plan": plan.name, "model": name, **as_dict(result, str(plan_path), name)}
        if verified:
            found["verified"] = [
                {
                    "layout": v.candidate.layout.to_json(),
                    "checkpointing": v.candidate.checkpointing,
                    "reshard_after_forward": v.candidate.reshard_after_forward,
                    "predicted_bytes": v.predicted.total,  # for the measurement's device, the CPU
                    "predicted_cuda_bytes": v.candidate.memory.total,
                    "measured_bytes": v.measured.total,
                    "measured": asdict(v.measured),
                }
                for v in verified
            ]
        if problem is not None:
            found["diagnostics"] = [problem.to_json()]
        if written is not None:
            found["written"] = {"plan": str(written[0]), "run": str(written[1])}
        print(json.dumps(found, indent=2))
    else:
        print(render(result, str(plan_path), name, top=top) + (render_verified(verified) if verified else ""))
        if written is not None:
            launch = written[2]
            print(f"\nwritten: {written[0]} and {written[1]}:\n  {launch}")
        if problem is not None:
            emit([problem], fmt)
    if problem is not None:
        raise typer.Exit(EXIT_PLAN)
