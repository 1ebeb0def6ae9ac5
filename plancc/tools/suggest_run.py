"""The run ``plancc suggest`` costed, as something to launch: every setting the cost assumed --
the layout, the sequence length, bf16 compute, the step's sequences and microbatches, the
nodes -- as ``plancc apply`` flags, and what only a plan can say (activation checkpointing,
FSDP's resharding, the pipeline's schedule) as a plan file written beside a run file.

A command that drops one of them runs something else than what was costed: fp32 compute
doubles the activations, another sequence length changes everything, checkpointing "none"
on a plan that checkpoints recomputes what suggest counted as kept.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from ..compiler.plan import Plan
from ..models import decoder_layers_glob
from .suggest import meta_model
from .suggest_costs import Candidate, Suggestion

COMPUTE_DTYPE = "bf16"  # what the cost model takes activations, gathered weights and logits in
RENDEZVOUS = "$HEAD_NODE:29500"  # a multi-node run's rendezvous: the first node's address, for the user to fill


def nodes(suggestion: Suggestion) -> int:
    return math.ceil(suggestion.gpus / suggestion.gpus_per_node)


def run_settings(suggestion: Suggestion, candidate: Candidate, model: str) -> dict[str, Any]:
    """``plancc apply``'s settings (run-file keys) for ``candidate``: the layout, sequence length,
    compute dtype, global batch and microbatch, and the workers a node."""
    layout = candidate.layout
    settings: dict[str, Any] = {"model": model, "tp": layout.tp}
    for axis in ("cp", "ep", "pp", "dp_replicate"):
        if getattr(layout, axis) > 1:
            settings[axis] = getattr(layout, axis)
    if layout.sequence_parallel:
        settings["sp"] = True
    settings["seq_len"] = suggestion.seq_len
    settings["param_dtype"] = COMPUTE_DTYPE
    settings["batch_size"] = candidate.sequences * layout.dp  # the step's sequences, every dp rank's
    if candidate.microbatches > 1 and layout.pp == 1:  # a rank's rows a pass (a pipeline's: the plan's)
        settings["micro_batch_size"] = candidate.micro_batch_size
    count = nodes(suggestion)
    if count > 1:
        settings["nnodes"] = count
        settings["nproc_per_node"] = suggestion.gpus_per_node
    else:
        settings["nproc_per_node"] = suggestion.gpus
    return settings


def _flag(key: str, value: Any) -> str:
    name = "--" + key.replace("_", "-")
    return name if value is True else f"{name} {value}"


def per_node_flags(suggestion: Suggestion) -> list[str]:
    """What differs from node to node (or names the head node): none on one node."""
    if nodes(suggestion) == 1:
        return []
    return ["--node-rank $NODE_RANK", f"--rdzv-endpoint {RENDEZVOUS}"]


def command_line(plan_path: str, model: str, suggestion: Suggestion, candidate: Candidate) -> str:
    """The ``plancc apply`` line of ``candidate``, every flag the cost assumed (what a plan must
    say besides: ``plan_edits``, or ``write_run``'s plan)."""
    flags = [_flag(k, v) for k, v in run_settings(suggestion, candidate, model).items() if k != "model"]
    return " ".join(["plancc apply", plan_path, "--model", model, *flags, *per_node_flags(suggestion)])


def plan_edits(candidate: Candidate) -> list[str]:
    """What the plan must say for ``candidate`` beyond the command's flags."""
    edits = [] if candidate.checkpointing == "plan" else [f"activation checkpointing: {candidate.checkpointing}"]
    if not candidate.reshard_after_forward:
        edits.append("fsdp: {reshard_after_forward: false}")
    if candidate.layout.pp > 1:
        edits.append(
            f"pipeline: {{schedule: {candidate.schedule}, microbatches: {candidate.microbatches}, "
            f"virtual_stages_per_rank: {candidate.virtual_stages}}}"
        )
    return edits


def edited_plan(plan_path: str, candidate: Candidate, every_layer: str | None) -> dict[str, Any]:
    """The plan file's data with ``candidate``'s edits made: its checkpointing (``every_layer``
    the glob of the decoder layers, for "full"), resharding and pipeline."""
    data = yaml.safe_load(Path(plan_path).read_text())
    if candidate.checkpointing == "none":
        data["activation_checkpointing"] = []
    elif candidate.checkpointing == "full" and every_layer is not None:
        data["activation_checkpointing"] = [every_layer]
    if not candidate.reshard_after_forward:
        data.setdefault("fsdp", {})["reshard_after_forward"] = False
    if candidate.layout.pp > 1:
        pipeline = data.setdefault("pipeline", {})
        pipeline.update(schedule=candidate.schedule, microbatches=candidate.microbatches)
        pipeline["virtual_stages_per_rank"] = candidate.virtual_stages
    return data


def write_best(folder: Path, plan_path: str, plan: Plan, model: str, suggestion: Suggestion) -> tuple[Path, Path, str]:
    """``write_run`` for the best candidate of ``suggestion`` (which has one): the two files and
    the command that launches them (on each node, with its own flags)."""
    assert suggestion.best is not None, "write_best is for a suggestion with a fitting layout"
    every_layer = decoder_layers_glob(meta_model(model))  # the search's meta model (a preset's skeleton)
    plan_file, run_file = write_run(folder, plan_path, plan, model, suggestion, suggestion.best, every_layer)
    return plan_file, run_file, " ".join([f"plancc apply --config {run_file}", *per_node_flags(suggestion)])


def write_run(
    folder: Path,
    plan_path: str,
    plan: Plan,
    model: str,
    suggestion: Suggestion,
    candidate: Candidate,
    every_layer: str | None,
) -> tuple[Path, Path]:
    """``folder/plan.yaml`` (the plan with ``candidate``'s edits) and ``folder/run.yaml`` (every
    other setting, naming that plan): ``plancc apply --config folder/run.yaml`` is the run costed."""
    folder.mkdir(parents=True, exist_ok=True)
    plan_file, run_file = folder / "plan.yaml", folder / "run.yaml"
    edits = plan_edits(candidate)
    header = f"# {plan.name} from {plan_path}, as plancc suggest costed {candidate.describe()}"
    header += f"\n# edited: {'; '.join(edits)}\n" if edits else " (unedited)\n"
    plan_file.write_text(header + yaml.safe_dump(edited_plan(plan_path, candidate, every_layer), sort_keys=False))
    settings = {"plancc_run": 1, "plan": str(plan_file), **run_settings(suggestion, candidate, model)}
    where = f" plus, on each node, {' '.join(per_node_flags(suggestion))}" if per_node_flags(suggestion) else ""
    run_file.write_text(
        f"# plancc apply --config {run_file}{where}: the run plancc suggest costed\n"
        + yaml.safe_dump(settings, sort_keys=False)
    )
    return plan_file, run_file
