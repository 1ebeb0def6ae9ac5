"""What ``apply`` and ``logprobs`` share: a run checked before launch, launched, reported, and
an interruption before or during it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ..compiler.lora_spec import LoraSpec
from ..errors import Diagnostic, PlanError, SourceLoc
from ..layout import Layout, LayoutError
from .app import EXIT_PLAN, EXIT_USAGE, USAGE_RULES, Format, emit, fail
from .flag_groups import LayoutFlags

if TYPE_CHECKING:
    from ..checks.report import ValidationReport
    from ..job.config import RunConfig
    from ..job.data import TokenDataset
    from ..job.launch import LaunchOptions
    from ..runtime.rank_memory import OutOfMemory


def prelaunch(
    plan_path: Path,
    model: str | None,
    nproc_per_node: int,
    nnodes: str,
    flags: LayoutFlags,
    fmt: Format,
    seq_len: int | None = None,
) -> tuple[str, Layout, ValidationReport]:
    """The layout and the plan against the model at this layout, checked before a process
    starts. Returns (model name, layout, the validation report)."""
    from ..checks.report import validate_plan  # lazy: loads torch
    from ..compiler.plan import load_plan  # lazy: loads torch
    from ..job.preflight import node_range  # lazy: loads torch
    from ..models import default_preset  # lazy: loads torch

    nodes = node_range(nnodes)
    assert nodes is not None, "the launcher's flags are checked first (launcher_checked)"
    world = nproc_per_node * nodes[1]
    try:
        layout = Layout.infer(world_size=world, **flags.sizes())
    except LayoutError as exc:
        fit = f"choose --tp/--cp/--dp whose product is {world}"
        emit(
            [
                # the world size comes from --nproc-per-node x --nnodes here, not from --world-size
                replace(
                    d, loc=SourceLoc(path=str(plan_path)), fix=fit if "world_size" in (d.suggestion or {}) else d.fix
                )
                for d in exc.diagnostics
            ],
            fmt,
        )
        raise typer.Exit(EXIT_USAGE) from None
    try:
        plan = load_plan(plan_path)  # read once, here: the workers get its text (Launchable.plan_text)
        model = model or default_preset(plan.architectures, tiny=True)
        report = validate_plan(plan, model=model, layout=layout, seq_len=seq_len)
    except PlanError as exc:
        raise fail(exc, fmt) from None
    if report.has_errors:
        emit(list(report.diagnostics), fmt)
        raise typer.Exit(EXIT_PLAN)
    return report.model_name, layout, report


def preflight(cfg: RunConfig, report: ValidationReport, fmt: Format, local_ranks: int) -> Launchable:
    """The run's inputs and outputs checked before a process starts (plancc.job.preflight);
    the warnings, which text output prints now and JSON output keeps for the end, and what the
    workers get: the plan and the data as read here, once."""
    from ..job.preflight import notices, preflight  # lazy: loads torch

    assert report.meta_model is not None  # a report without errors has its model
    # the model and config validate built; the workers of this machine share its memory
    lora = LoraSpec.of(cfg.model.lora) if cfg.model.lora is not None else report.plan.lora
    checked = preflight(cfg, report.meta_model, report.config, local_ranks=local_ranks, lora=lora)
    if checked.problems:
        emit(checked.problems, fmt)
        raise typer.Exit(EXIT_USAGE if any(d.rule in USAGE_RULES for d in checked.problems) else EXIT_PLAN)
    warnings = (*report.diagnostics, *notices(cfg, checked.dataset))
    if fmt is Format.text:  # on stderr: stdout may carry data; json: into the one final document
        for warning in warnings:
            print(warning.format(), file=sys.stderr)
    return Launchable(
        cfg=cfg, plan_text=report.plan.text, dataset=checked.dataset, eval_rows=checked.eval_rows, warnings=warnings
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Launchable:
    """A checked run: its settings, the plan and data read once, the warnings to report."""

    cfg: RunConfig
    plan_text: str
    dataset: TokenDataset | None
    eval_rows: TokenDataset | None
    warnings: tuple[Diagnostic, ...]


def launch_and_report(opts: LaunchOptions, run: Launchable, fmt: Format) -> None:
    from ..job.launch import launch  # lazy: loads torch

    cfg, warnings = run.cfg, run.warnings
    outcome = launch(opts, cfg, plan_text=run.plan_text, dataset=run.dataset, eval_rows=run.eval_rows)
    if outcome.rendezvous:
        emit(
            [
                Diagnostic(
                    rule="rendezvous",
                    loc=SourceLoc(path=f"--rdzv-endpoint {opts.rdzv_endpoint}"),
                    message=outcome.rendezvous,
                    fix="start the node of --node-rank 0 first and check that every node reaches HOST:PORT "
                    "(firewall, address); --timeout bounds the wait",
                )
            ],
            fmt,
        )
        raise typer.Exit(EXIT_PLAN)
    if outcome.interrupted:
        report_interruption(outcome.interrupted, outcome.result, cfg, fmt)
    stopped = (outcome.result or {}).get("interrupted")
    if stopped:  # a signal reached a worker, not the launcher: the run still stopped early
        import signal

        report_interruption(int(signal.Signals[stopped["signal"]]), outcome.result, cfg, fmt)
    if outcome.result is not None and outcome.result.get("diagnostics"):  # a worker stopped on a diagnosed problem
        emit([Diagnostic.from_json(d) for d in outcome.result["diagnostics"]], fmt)
        raise typer.Exit(EXIT_PLAN)
    run_path = SourceLoc(path=cfg.model.plan)
    if outcome.result is not None and outcome.result.get("ok") is False:
        emit(
            [
                Diagnostic(
                    rule="verify",
                    loc=run_path,
                    message="the sharded model differs from the unsharded one beyond tolerance",
                    fix="see the comparison above; `plancc validate --dry-run` and `plancc explain` show the layouts",
                )
            ],
            fmt,
            summary=outcome.result,
        )
        raise typer.Exit(EXIT_PLAN)
    if outcome.out_of_memory is not None:
        emit([out_of_memory(outcome.out_of_memory, opts, outcome.logs)], fmt)
        raise typer.Exit(EXIT_PLAN)
    if not outcome.ok:
        first = outcome.first_failed if outcome.first_failed in outcome.failures else min(outcome.failures)
        others = [r for r in outcome.failures if r != first]
        stopped = (
            (
                f"; then stopped: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} (every "
                "worker exits when one fails)"
            )
            if others
            else ""
        )
        emit(
            [
                Diagnostic(
                    rule="rank-failed",
                    loc=run_path,
                    message=f"rank {first} failed: {outcome.failures[first]}{stopped}",
                    fix=_trace_hint(first, outcome.logs) + "--timeout bounds how long a collective waits",
                )
            ],
            fmt,
        )
        raise typer.Exit(EXIT_PLAN)
    if fmt is Format.json and outcome.result is not None:
        found = [d.to_json() for d in warnings] + outcome.result.pop("warnings", [])  # the workers' own
        print(json.dumps({**outcome.result, "diagnostics": found}, indent=2))


def out_of_memory(oom: OutOfMemory, opts: LaunchOptions, logs: dict[int, str]) -> Diagnostic:
    """A rank the kernel's OOM killer ended, as what it is (not a bare SIGKILL and a --timeout hint)."""
    from ..job.memory import GIB, host_available  # lazy: loads torch

    peak = f"its peak: {oom.peak / GIB:.1f} GiB of host memory" if oom.peak else "no peak recorded"
    available = host_available()
    share = (
        f"; {available / GIB:.1f} GiB is available here (free host memory, or what a container's memory cgroup "
        f"allows), {available / GIB / opts.nproc_per_node:.1f} GiB for each of its {opts.nproc_per_node} workers"
        if available
        else ""
    )
    how = (
        "was killed by the kernel's OOM killer: out of host memory"
        if oom.oom_killer
        else "was killed by SIGKILL, as the kernel's OOM killer ends a process (the kernel's count of OOM "
        "kills could not be read: see dmesg)"
    )
    return Diagnostic(
        rule="memory",
        loc=SourceLoc(path=f"rank {oom.rank}"),
        message=f"rank {oom.rank} {how} ({peak}{share})",
        fix="give each rank less to hold: a smaller --micro-batch-size, --max-tokens or --seq-len, more ranks "
        "(--nnodes) or fewer workers on this machine (--nproc-per-node); --verify holds the unsharded model too"
        + (f"; the other ranks' logs: {Path(next(iter(logs.values()))).parent}" if logs else ""),
    )


def _trace_hint(first: int, logs: dict[int, str]) -> str:
    """Where the failing rank's full traceback is (the terminal shows its last line only)."""
    if first in logs:
        return f"its full traceback: {logs[first]}; "
    if logs:  # it died without one (a signal): the ranks it took down wrote theirs
        return f"the other ranks' tracebacks: {Path(next(iter(logs.values()))).parent}; "
    return ""


def report_interruption(signum: int, result: dict[str, Any] | None, cfg: RunConfig, fmt: Format) -> None:
    """One line for a run stopped by Ctrl-C / SIGTERM: where it stopped and what is kept."""
    import signal

    from ..engine import checkpoint  # lazy: loads torch

    info = (result or {}).get("interrupted") or {}
    last = info.get("last_checkpoint")
    if last is None and (found := checkpoint.newest(cfg.checkpoint.save)):  # the workers could not say: look
        last = str(found)
    step = info.get("step")
    where = f"at step {step}" if step is not None else "before the workers reported a step"
    line = f"interrupted {where}; last checkpoint: {last or 'none'}"
    if fmt is Format.json:
        name = signal.Signals(signum).name
        print(json.dumps({**(result or {}), "interrupted": {"signal": name, "step": step, "last_checkpoint": last}}))
    else:
        print(line, file=sys.stderr)
    raise typer.Exit(128 + signum)


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM outside a launched job (while checking a plan, before workers start):
    a BaseException, so click does not turn it into "Aborted!" and exit 1."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)
