"""``plancc apply``: train (or ``--verify``) a plan on a model, workers started by torch's elastic launcher."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..compiler.lora_spec import LoraSpec
from ..errors import Diagnostic, PlanError, SourceLoc
from ..job.config import DEFAULT_STEPS, SYNTHETIC_SEQ_LEN, RunConfig
from ..job.data_order import steps_for_epochs
from ..job.run_file import run_file_text
from ..layout import Layout
from .app import EXIT_PLAN, EXIT_USAGE, Format, FormatOpt, ModelOpt, app, emit, usage_error
from .flag_groups import (
    DataFieldFlags,
    DataOrderFlags,
    EvalFlags,
    LaunchFlags,
    LayoutFlags,
    OutputFlags,
    ScheduleFlags,
    WorkerFlags,
    _path,
    grouped,
)
from .launching import launch_and_report, preflight, prelaunch

if TYPE_CHECKING:
    from ..checks.report import ValidationReport
    from ..job.launch import LaunchOptions


@app.command()
@grouped(
    layout=LayoutFlags,
    launch=LaunchFlags,
    worker=WorkerFlags,
    output=OutputFlags,
    fields=DataFieldFlags,
    schedule=ScheduleFlags,
    order=DataOrderFlags,
    held_out=EvalFlags,
)
def apply(
    ctx: typer.Context,
    layout: LayoutFlags,
    launch: LaunchFlags,
    worker: WorkerFlags,
    output: OutputFlags,
    fields: DataFieldFlags,
    schedule: ScheduleFlags,
    order: DataOrderFlags,
    held_out: EvalFlags,
    resolved: dict[str, Any],
    plan_path: Annotated[
        Path | None, typer.Argument(metavar="PLAN", help="plan YAML file (or the run file's plan)")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="a run file (YAML: apply's flags as keys, schemas/run.schema.json); flags override it"
        ),
    ] = None,
    model: ModelOpt = None,
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            min=0,
            help="the run's total optimizer steps (default 5, or what --epochs makes; with --resume: trains on "
            "to this step)",
        ),
    ] = None,
    log_every: Annotated[
        int, typer.Option("--log-every", min=1, help="a step line every N steps (the first and last always)")
    ] = 1,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help='JSONL: {"input_ids": [...]} (with labels or loss_mask), or text, messages, prompt + completion '
            "tokenized with the model folder's tokenizer",
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="global batch, split over dp (default: 4, or dp if larger)"),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            min=2,
            help="tokens per row: synthetic rows are this long (default 32); --data rows are cut to it "
            "(default: as they are, none past the model's max_position_embeddings)",
        ),
    ] = None,
    lr: Annotated[
        float, typer.Option("--lr", help="peak learning rate (AdamW: --warmup-steps, then --lr-schedule to --min-lr)")
    ] = 1e-3,
    schedule_steps: Annotated[
        int | None,
        typer.Option("--schedule-steps", min=1, help="LR schedule horizon (default: --steps)"),
    ] = None,
    param_dtype: Annotated[
        str | None,
        typer.Option(
            "--param-dtype",
            help="compute dtype (FSDP mixed precision), e.g. bfloat16; default fp32. Master weights and "
            "AdamW state are fp32 whatever the model's dtype",
        ),
    ] = None,
    cpu_offload: Annotated[
        bool,
        typer.Option(
            "--cpu-offload",
            help="FSDP CPU offload: the parameter shards, their gradients and AdamW's state live in host "
            "memory (copied to the device unit by unit for the gathers; the optimizer steps on the host)",
        ),
    ] = False,
    micro_batch_size: Annotated[
        int | None,
        typer.Option("--micro-batch-size", min=1, help="rows per microbatch on each dp rank (gradient accumulation)"),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", min=1, help="microbatches by a token budget, balanced over dp ranks"),
    ] = None,
    pack: Annotated[
        bool,
        typer.Option(
            "--pack",
            help="pack a microbatch's sequences into one row, without padding (under --pp: the rank's rows into "
            "rows of one length, one schedule step)",
        ),
    ] = False,
    lora_r: Annotated[
        int | None, typer.Option("--lora-r", help="train LoRA adapters of this rank (the plan's lora: section else)")
    ] = None,
    lora_alpha: Annotated[
        float | None, typer.Option("--lora-alpha", help="LoRA alpha: adapters scaled by alpha / r (default r)")
    ] = None,
    lora_targets: Annotated[
        str | None,
        typer.Option(
            "--lora-targets", help="comma-separated module globs to adapt (e.g. 'model.layers.*.self_attn.*_proj')"
        ),
    ] = None,
    fmt: FormatOpt = Format.text,
) -> None:
    """Train with the plan: launch workers (torchrun machinery), parallelize, train, checkpoint.

    The loss is the mean next-token NLL over the global batch's tokens, however the batch is cut
    (over dp ranks, into microbatches): one step equals the unsharded model on the whole batch."""

    if plan_path is None:
        usage_error("apply needs a PLAN, or --config RUN.yaml that names one", fmt, fix="plancc apply plans/qwen3.yaml")
    assert plan_path is not None
    if order.epochs is not None and (steps is not None or data is None or order.epochs <= 0):
        usage_error(
            f"--epochs {order.epochs:g} "
            + ("with --steps" if steps is not None else "without --data" if data is None else "trains nothing"),
            fmt,
            fix="--epochs N (N > 0, e.g. 1.5) counts passes over --data; give it or --steps, not both",
        )
    nproc_per_node = default_nproc(launch.nproc_per_node, worker.device)
    opts = launcher_checked(launch, nproc_per_node, worker.device, fmt)
    model, chosen, report = prelaunch(
        plan_path,
        model,
        nproc_per_node,
        launch.nnodes,
        layout,
        fmt,
        seq_len=None if data else (seq_len or SYNTHETIC_SEQ_LEN),
    )
    if batch_size is None:  # the smallest multiple of dp that is at least 4: every dp divides it
        batch_size = chosen.dp * -(-4 // chosen.dp)
    lora = lora_flags(plan_path, report, chosen, fmt, r=lora_r, alpha=lora_alpha, targets=lora_targets)
    if output.export_adapters and (lora is None and report.plan.lora is None or not output.export_hf):
        usage_error(
            "--export-adapters without " + ("--export-hf" if not output.export_hf else "LoRA"),
            fmt,
            fix="--export-adapters writes the LoRA adapters of --export-hf DIR: give both, with "
            "--lora-r/--lora-targets or a plan with a lora: section",
        )
    if worker.verify:
        from ..job.verify import unverifiable  # lazy: loads torch

        outputs = {"--save": output.save, "--export-hf": output.export_hf}
        why = unverifiable(
            lora=lora is not None or report.plan.lora is not None, param_dtype=param_dtype, outputs=outputs
        )
        if why:
            usage_error(why, fmt, fix="drop --verify, or the flags it names (verify first, then run with them)")
    cfg = RunConfig.of(
        plan=str(plan_path),
        layout=chosen,
        model=model,
        steps=steps if steps is not None else DEFAULT_STEPS,
        log_every=log_every,
        data=_path(data),
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        schedule_steps=schedule_steps,
        param_dtype=param_dtype,
        cpu_offload=cpu_offload,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        pack=pack,
        lora=lora,
        json_output=fmt is Format.json,
        **worker.run_config(),
        **output.run_config(),
        **fields.run_config(),
        **schedule.run_config(),
        **order.run_config(),
        **held_out.run_config(),
    )
    if output.save:  # the settings it runs with, in each checkpoint: --config SAVE/step-N/run.yaml
        ran = {"plan": str(plan_path), **resolved, "model": model}
        cfg = cfg.with_flags(run_file=run_file_text(ran))  # (it keeps the run file's keys only: no plan_path)
    run = preflight(cfg, report, fmt, nproc_per_node)
    if order.epochs is not None and run.dataset is not None:  # the rows are counted now: steps from epochs
        total = steps_for_epochs(order.epochs, rows=len(run.dataset.sequences), batch_size=batch_size)
        run = replace(run, cfg=run.cfg.with_flags(steps=total))
    launch_and_report(opts, run, fmt)


def lora_flags(
    plan_path: Path,
    report: ValidationReport,
    layout: Layout,
    fmt: Format,
    *,
    r: int | None,
    alpha: float | None,
    targets: str | None,
) -> dict[str, Any] | None:
    """``--lora-*`` as a ``lora`` spec over the plan's ``lora:`` section (None: no flag given),
    checked against the model at this layout before anything launches (exit 1 with the
    diagnostics of ``plancc rules``' lora-targets)."""
    from ..checks.compiled_blocks import with_lora  # lazy: loads torch
    from ..checks.lora_targets import lora_problems  # lazy: loads torch

    if r is None and alpha is None and targets is None:
        return None
    base = report.plan.lora
    spec: dict[str, Any] = (
        {"r": base.r, "alpha": base.alpha, "targets": list(base.targets), "dropout": base.dropout} if base else {}
    )
    if r is not None:
        spec["r"] = r
    if alpha is not None:
        spec["alpha"] = alpha
    if targets is not None:
        spec["targets"] = [t.strip() for t in targets.split(",") if t.strip()]
    if "r" not in spec or "targets" not in spec:
        usage_error(
            "LoRA needs a rank and targets: --lora-r and --lora-targets, or a plan with a lora: section",
            fmt,
            fix="add --lora-r 16 --lora-targets 'model.layers.*.self_attn.q_proj,model.layers.*.self_attn.v_proj'",
        )
    flags = SourceLoc(path="--lora-r/--lora-alpha/--lora-targets")
    try:
        checked = LoraSpec.of(spec, loc=flags)
    except PlanError as exc:
        emit(exc.diagnostics, fmt)
        raise typer.Exit(EXIT_PLAN) from None
    assert checked is not None
    compiled = report.plan.compile
    if compiled is not None:  # the answer the plan's lora: section gets (checks.compiled_blocks)
        problem = with_lora(compiled.loc, "--lora-r/--lora-targets")
        emit([Diagnostic(rule="compile", loc=problem.loc, message=problem.message, fix=problem.fix)], fmt)
        raise typer.Exit(EXIT_PLAN)
    if report.meta_model is not None:
        found = lora_problems(report.meta_model, checked, report.resolved_for(layout.sequence_parallel), layout.tp)
        if found:
            emit(
                [Diagnostic(rule=p.rule or "lora-targets", loc=p.loc, message=p.message, fix=p.fix) for p in found], fmt
            )
            raise typer.Exit(EXIT_PLAN)
    return spec


def default_nproc(given: int | None, device: str | None) -> int:
    """--nproc-per-node when not given: one worker per visible GPU (so a 1-GPU machine runs
    the bare command), 2 on CPU (enough for a 2-rank mesh anywhere)."""
    if given is not None:
        return given
    if device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def launcher_checked(launch: LaunchFlags, nproc_per_node: int, device: str | None, fmt: Format) -> LaunchOptions:
    """The launcher's options, their flags checked by the preflight before anything starts."""
    from ..job.preflight import launch_problems  # lazy: loads torch

    opts = launch.options(nproc_per_node)
    problems = launch_problems(opts, device=device)
    if problems:
        emit(problems, fmt)
        raise typer.Exit(EXIT_USAGE)
    return opts
