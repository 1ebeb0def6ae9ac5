"""``plancc explain``: every parameter's shards and each rank's bytes (per pipeline stage with --pp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import PlanError
from .app import EXIT_PLAN, Format, FormatOpt, ModelOpt, app, emit, fail
from .flag_groups import LayoutFlags, grouped

if TYPE_CHECKING:
    from ..checks.report import ValidationReport


@app.command()
@grouped(layout=LayoutFlags)
def explain(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan YAML file")],
    layout: LayoutFlags,
    model: ModelOpt = None,
    fmt: FormatOpt = Format.text,
) -> None:
    """Every parameter's global shape, its per-rank shard and placements, and per-rank bytes."""
    from ..checks.report import validate_plan  # lazy: loads torch
    from ..tools.explain import explain as explain_plan  # lazy: loads torch
    from ..tools.explain import render  # lazy: loads torch

    try:
        report = validate_plan(plan_path, model=model, skeleton=False, **layout.sizes())
    except PlanError as exc:
        raise fail(exc, fmt) from None
    if report.has_errors or report.meta_model is None:
        emit(list(report.diagnostics), fmt)
        raise typer.Exit(EXIT_PLAN)
    # the model and resolution validate built: nothing is built twice
    exp = explain_plan(report.meta_model, report.resolved_for(layout.sp), report.layout, lora=report.plan.lora)
    stages = _pipeline_stages(report, exp) if layout.pp > 1 else None
    if fmt is Format.json:
        found = {"plan": report.plan.name, "model": report.model_name, **exp.as_dict()}
        if stages is not None:
            found["stages"] = [
                {
                    "stage": s.stage,
                    "pp_rank": ranks[s.stage],
                    "layers": list(s.layers),
                    "parameters": s.parameters,
                    "parameter_bytes": s.param_bytes,
                    "gradient_bytes": s.grad_bytes,
                }  # fmt: skip
                for s, ranks in ((s, stages[1]) for s in stages[0])
            ]
        print(json.dumps(found, indent=2))
        return
    print(f"plan {report.plan.name} on {report.model_name}: {report.layout.describe()}")
    print(render(exp))
    if stages is not None:
        from ..tools.explain_stages import render_stages  # lazy: loads torch

        print(render_stages(*stages))


def _pipeline_stages(report: ValidationReport, exp: Any) -> tuple[list[Any], dict[int, int]]:
    """Each pipeline stage's parameters and bytes (``tools.explain_stages``) and its pp rank."""
    from ..compiler.stage_globs import layers_of_stages  # lazy: loads torch
    from ..tools.explain_stages import rank_of_stage, stage_bytes, stages_of  # lazy: loads torch

    assert report.meta_model is not None, "explain runs on a plan validate passed"
    spec, pp = report.plan.pipeline, report.layout.pp
    modules = dict(report.meta_model.named_modules())
    matched = layers_of_stages(modules, spec) if spec is not None and spec.stages else None
    layers = len(getattr(getattr(report.meta_model, "model", report.meta_model), "layers", []))
    of_layer = stages_of(spec, layers, pp, matched)
    virtual = spec.per_rank(layers, pp) if spec is not None else 1
    return stage_bytes(report.meta_model, exp, of_layer, pp * virtual), rank_of_stage(spec, pp, layers)
