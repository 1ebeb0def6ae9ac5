"""``plancc logprobs``: token log-probs (and entropy) of a data file through a plan's layout."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..job.config import RunConfig
from .app import Format, FormatOpt, ModelOpt, app
from .apply_command import default_nproc, launcher_checked
from .flag_groups import LaunchFlags, LayoutFlags, WorkerFlags, _path, grouped
from .launching import launch_and_report, preflight, prelaunch

if TYPE_CHECKING:
    pass


@app.command()
@grouped(layout=LayoutFlags, launch=LaunchFlags, worker=WorkerFlags)
def logprobs(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan YAML file")],
    data: Annotated[Path, typer.Option("--data", help='pre-tokenized JSONL: {"input_ids": [...]} per line')],
    layout: LayoutFlags,
    launch: LaunchFlags,
    worker: WorkerFlags,
    model: ModelOpt = None,
    out: Annotated[Path | None, typer.Option("--out", help='JSONL output: {"logprobs": [...]} per line')] = None,
    entropy: Annotated[
        bool, typer.Option("--entropy", help='also the entropy of each position\'s distribution: "entropy": [...]')
    ] = False,
    temperature: Annotated[
        float, typer.Option("--temperature", min=1e-6, help="log-probs under the sampler's temperature")
    ] = 1.0,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="sequences per forward pass on each dp rank")
    ] = 4,
    pack: Annotated[
        bool,
        typer.Option("--pack", help="pack each batch's sequences into one row (documents never attend to each other)"),
    ] = False,
    fmt: FormatOpt = Format.text,
) -> None:
    """Per-token log-probs of each input line from the parallelized model."""

    nproc_per_node = default_nproc(launch.nproc_per_node, worker.device)
    opts = launcher_checked(launch, nproc_per_node, worker.device, fmt)
    model, chosen, report = prelaunch(plan_path, model, nproc_per_node, launch.nnodes, layout, fmt)
    cfg = RunConfig.of(
        plan=str(plan_path),
        layout=chosen,
        model=model,
        data=str(data),
        batch_size=batch_size,
        mode="logprobs",
        out=_path(out),
        pack=pack,
        entropy=entropy,
        temperature=temperature,
        json_output=fmt is Format.json,
        **worker.run_config(),
    )
    launch_and_report(opts, preflight(cfg, report, fmt, nproc_per_node), fmt)
