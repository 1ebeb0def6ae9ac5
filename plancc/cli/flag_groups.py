"""Option groups declared once for every command that takes them (layout, launch, workers,
data fields, outputs), and ``grouped``, which hands a command each group as one frozen value."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args, get_origin, get_type_hints

import typer

from ..errors import PlanError
from ..job.loggers import names_of
from ..job.run_file import read_run_file
from ..layout import LayoutError
from .app import Format, fail

if TYPE_CHECKING:
    from ..job.launch import LaunchOptions


# Launch options shared by `apply` and `logprobs`, spelled as torchrun spells them too.
NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc-per-node",
        "--nproc_per_node",
        min=1,
        help="workers on this node (default: one per GPU on CUDA, 2 on CPU)",
    ),
]
# --tp defaults to 1: the ranks --cp and --dp leave go to data parallelism (FSDP), as torchrun
# users expect; a plan's tensor parallelism is asked for by size.
TpOpt = Annotated[
    int, typer.Option("--tp", min=1, help="tensor-parallel degree (default 1: the other ranks go to data parallelism)")
]
EpOpt = Annotated[
    int,
    typer.Option(
        "--ep",
        min=1,
        help="expert-parallel degree: data-parallel ranks that share each layer's experts (moe_experts), "
        "tokens moved by all-to-all; must divide dp",
    ),
]
NnodesOpt = Annotated[str, typer.Option("--nnodes", help="nodes, or MIN:MAX for elastic jobs")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", "--node_rank", min=0, help="this node's rank (multi-node)")]
RdzvEndpointOpt = Annotated[
    str | None, typer.Option("--rdzv-endpoint", "--rdzv_endpoint", help="HOST:PORT of the rendezvous (multi-node)")
]
MasterAddrOpt = Annotated[
    str, typer.Option("--master-addr", "--master_addr", help="rank 0's host when no --rdzv-endpoint is given")
]
MasterPortOpt = Annotated[
    int | None,
    typer.Option(
        "--master-port", "--master_port", min=1, max=65535, help="rank 0's port: rendezvous at --master-addr:PORT"
    ),
]
RdzvIdOpt = Annotated[str | None, typer.Option("--rdzv-id", "--rdzv_id", help="job id shared by all nodes")]
MaxRestartsOpt = Annotated[
    int, typer.Option("--max-restarts", "--max_restarts", min=0, help="restarts of the worker group before failing")
]


CpOpt = Annotated[int, typer.Option("--cp", min=1, help="context-parallel degree")]
PpOpt = Annotated[
    int,
    typer.Option(
        "--pp", min=1, help="pipeline-parallel degree: stages by the plan's pipeline: section (docs/pipeline.md)"
    ),
]
DpOpt = Annotated[int | None, typer.Option("--dp", min=1, help="data-parallel degree (inferred)")]
DpReplicateOpt = Annotated[
    int,
    typer.Option(
        "--dp-replicate",
        min=1,
        help="HSDP: replicas of the FSDP-sharded model among the dp ranks (torchtitan's dp_replicate; "
        "each shards over dp / dp_replicate ranks, gradients all-reduced between replicas)",
    ),
]
DpShardOpt = Annotated[
    int | None,
    typer.Option(
        "--dp-shard",
        min=1,
        help="HSDP: ranks each replica shards over (torchtitan's dp_shard); dp = dp_replicate x dp_shard",
    ),
]
SpOpt = Annotated[bool, typer.Option("--sp", help="sequence parallelism (the plan's overlay)")]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutFlags:
    """--tp --cp --ep --dp --sp --pp --dp-replicate --dp-shard, declared once for every command
    that takes a layout."""

    tp: TpOpt = 1
    cp: CpOpt = 1
    ep: EpOpt = 1
    dp: DpOpt = None
    sp: SpOpt = False
    pp: PpOpt = 1
    dp_replicate: DpReplicateOpt = 1
    dp_shard: DpShardOpt = None

    def sizes(self) -> dict[str, Any]:
        """The layout keywords of ``validate_plan`` and ``Layout.infer`` (--dp-shard names dp as
        dp_replicate x dp_shard). Raises ``LayoutError`` when --dp says otherwise: every command
        that takes a layout (apply, logprobs, validate, explain) refuses it alike."""
        conflict = self.conflict()
        if conflict:
            raise LayoutError.from_message(conflict, "--dp-replicate R --dp-shard S, or --dp-replicate R --dp R*S")
        dp = self.dp_replicate * self.dp_shard if self.dp_shard is not None else self.dp
        return {
            "dp": dp,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
            "sequence_parallel": self.sp,
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
        }

    def conflict(self) -> str | None:
        """Why --dp, --dp-replicate and --dp-shard disagree, or None."""
        if self.dp_shard is not None and self.dp is not None and self.dp != self.dp_replicate * self.dp_shard:
            return (
                f"--dp {self.dp} is not --dp-replicate {self.dp_replicate} x --dp-shard {self.dp_shard}: "
                "give --dp or --dp-shard, not both"
            )
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchFlags:
    """How workers start, spelled as torchrun spells it: declared once, built once."""

    nproc_per_node: NprocOpt = None
    nnodes: NnodesOpt = "1"
    node_rank: NodeRankOpt = 0
    rdzv_endpoint: RdzvEndpointOpt = None
    rdzv_id: RdzvIdOpt = None
    master_addr: MasterAddrOpt = "127.0.0.1"
    master_port: MasterPortOpt = None
    max_restarts: MaxRestartsOpt = 0

    def options(self, nproc_per_node: int) -> LaunchOptions:
        from ..job.launch import LaunchOptions  # lazy: loads torch

        meeting = f"{self.master_addr}:{self.master_port}" if self.master_port else None
        return LaunchOptions(
            nproc_per_node=nproc_per_node,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            # torchrun's --master-addr/--master-port name the same meeting point as --rdzv-endpoint
            rdzv_endpoint=self.rdzv_endpoint or meeting,
            rdzv_id=self.rdzv_id,
            max_restarts=self.max_restarts,
        )


SeedOpt = Annotated[int, typer.Option("--seed", help="seed of the initial weights and the synthetic data")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda if available)")]
TimeoutOpt = Annotated[int, typer.Option("--timeout", min=10, help="seconds before a collective gives up")]
VerifyOpt = Annotated[
    bool,
    typer.Option("--verify", help="compare with the unsharded model; exit 1 beyond tolerance (log-probs: 1e-5)"),
]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFlags:
    """What every launched job's workers take (apply and logprobs): declared once."""

    seed: SeedOpt = 0
    device: DeviceOpt = None
    timeout: TimeoutOpt = 300
    verify: VerifyOpt = False

    def run_config(self) -> dict[str, Any]:
        """The ``RunConfig`` fields these flags set."""
        return {"seed": self.seed, "device": self.device, "timeout_s": self.timeout, "verify": self.verify}


SaveOpt = Annotated[Path | None, typer.Option("--save", help="DCP checkpoint directory")]
ResumeOpt = Annotated[Path | None, typer.Option("--resume", help="checkpoint directory to continue from")]
SaveEveryOpt = Annotated[
    int | None,
    typer.Option(
        "--save-every", min=1, help="also checkpoint every N steps into --save (atomic; resume takes the newest)"
    ),
]
KeepOpt = Annotated[
    int | None,
    typer.Option("--keep", min=0, help="keep the newest K checkpoints in --save (default 3; 0 keeps every one)"),
]
ExportOpt = Annotated[Path | None, typer.Option("--export-hf", help="write final weights with save_pretrained")]
MetricsOpt = Annotated[
    Path | None,
    typer.Option(
        "--metrics",
        help="write one JSON line per step here (loss, grad norm, lr, tok/s, peak memory); a resumed run appends",
    ),
]
TensorboardOpt = Annotated[
    Path | None, typer.Option("--tensorboard", help="TensorBoard event files here (needs the tensorboard extra)")
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFieldFlags:
    """Where --data lines keep their text, when they hold text rather than input_ids: tokenized
    with the model folder's tokenizer (chat with its template; the loss counts the assistant's
    turns, or the completion)."""

    text_field: Annotated[str, typer.Option("--text-field", help="field of plain text (every token counts)")] = "text"
    messages_field: Annotated[
        str, typer.Option("--messages-field", help="field of a chat [{role, content}] (the assistant's turns count)")
    ] = "messages"
    prompt_field: Annotated[str, typer.Option("--prompt-field", help="field of a prompt (not counted)")] = "prompt"
    completion_field: Annotated[
        str, typer.Option("--completion-field", help="field of the prompt's completion (counted)")
    ] = "completion"

    def run_config(self) -> dict[str, Any]:
        names = {
            "text": self.text_field,
            "messages": self.messages_field,
            "prompt": self.prompt_field,
            "completion": self.completion_field,
        }
        changed = {k: v for k, v in names.items() if v != k}
        return {"data_fields": changed or None}


class LrScheduleName(StrEnum):
    """--lr-schedule's choices (``job.lr_schedule``)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    wsd = "wsd"


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleFlags:
    """The learning rate's course, AdamW's weight decay and the gradient clip (``job.lr_schedule``,
    ``engine.param_groups``)."""

    warmup_steps: Annotated[
        int, typer.Option("--warmup-steps", min=0, help="linear warmup over the first N steps (default 1)")
    ] = 1
    lr_schedule: Annotated[
        LrScheduleName,
        typer.Option(
            "--lr-schedule",
            help="after warmup: constant, linear or cosine to --min-lr, or wsd (stable, then linear over the last 20%)",
        ),
    ] = LrScheduleName.cosine
    min_lr: Annotated[
        float | None, typer.Option("--min-lr", min=0.0, help="where linear, cosine and wsd end (default: --lr / 10)")
    ] = None
    weight_decay: Annotated[
        float,
        typer.Option(
            "--weight-decay",
            min=0.0,
            help="AdamW decoupled weight decay of the matrices; norms, biases and embeddings get none (default 0)",
        ),
    ] = 0.0
    max_grad_norm: Annotated[
        float,
        typer.Option(
            "--max-grad-norm",
            min=0.0,
            help="clip the gradients to this global norm over every rank (default 1.0; 0 turns clipping off)",
        ),
    ] = 1.0

    def run_config(self) -> dict[str, Any]:
        """The ``RunConfig`` fields these flags set."""
        return {
            "warmup_steps": self.warmup_steps,
            "lr_schedule": self.lr_schedule.value,
            "min_lr": self.min_lr,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalFlags:
    """Held-out rows a training run scores (``job.evaluation``)."""

    eval_data: Annotated[
        Path | None,
        typer.Option("--eval-data", help="held-out rows (any --data format): their loss at the end of the run"),
    ] = None
    eval_split: Annotated[
        str | None,
        typer.Option("--eval-split", help="the held-out split of --data's folder to evaluate on (e.g. test)"),
    ] = None
    eval_every: Annotated[
        int | None, typer.Option("--eval-every", min=1, help="evaluate every N steps as well as at the end")
    ] = None

    def run_config(self) -> dict[str, Any]:
        """The ``RunConfig`` fields these flags set."""
        return {"eval_data": _path(self.eval_data), "eval_split": self.eval_split, "eval_every": self.eval_every}


@dataclass(frozen=True, kw_only=True, slots=True)
class DataOrderFlags:
    """The order --data's rows are read in, and how long (``job.data_order``)."""

    shuffle: Annotated[
        bool,
        typer.Option(
            "--shuffle/--no-shuffle", help="--data rows in an order drawn from --seed, anew each epoch (default)"
        ),
    ] = True
    epochs: Annotated[
        float | None,
        typer.Option("--epochs", min=0.0, help="train this many passes over --data (instead of --steps)"),
    ] = None

    def run_config(self) -> dict[str, Any]:
        """The ``RunConfig`` fields these flags set."""
        return {"shuffle": self.shuffle, "epochs": self.epochs}


def _path(value: Path | None) -> str | None:
    return str(value) if value else None


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputFlags:
    """Where a training run writes: checkpoints, the final export, per-step metrics."""

    save: SaveOpt = None
    resume: ResumeOpt = None
    save_every: SaveEveryOpt = None
    keep: KeepOpt = None
    export_hf: ExportOpt = None
    export_adapters: Annotated[
        bool,
        typer.Option(
            "--export-adapters", help="with LoRA: --export-hf writes the adapters alone (a PEFT folder), not merged"
        ),
    ] = False
    metrics: MetricsOpt = None
    tensorboard: TensorboardOpt = None
    logger: Annotated[
        str | None,
        typer.Option(
            "--logger",
            help="experiment trackers beside --metrics: wandb, mlflow or both (wandb,mlflow); each its extra "
            "(pip install 'plancc[wandb]') and its own environment (WANDB_MODE=offline, MLFLOW_TRACKING_URI)",
        ),
    ] = None

    def run_config(self) -> dict[str, Any]:
        """The ``RunConfig`` fields these flags set."""
        paths = {name: _path(getattr(self, name)) for name in ("save", "resume", "export_hf", "metrics", "tensorboard")}
        return {
            **paths,
            "save_every": self.save_every,
            "keep": self.keep,
            "export_adapters": self.export_adapters,
            "loggers": names_of(self.logger),
        }


def grouped(**groups: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command that takes option groups (``layout: LayoutFlags``) as one parameter each:
    typer sees every field of each group as an option of its own (in the command's signature),
    the command gets the group back as one frozen value."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(command, eval_str=True)
        hints = {name: get_type_hints(cls, include_extras=True) for name, cls in groups.items()}
        flat = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[name][f.name])
            for name, cls in groups.items()
            for f in dataclass_fields(cls)
        ]
        # ``resolved``: every option's value as the command runs with it (a run file's and the flags')
        kept = [p for name, p in own.parameters.items() if name not in groups and name != "resolved"]
        required = [p for p in kept if p.default is p.empty]
        optional = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in kept if p.default is not p.empty]
        takes_resolved = "resolved" in own.parameters

        @functools.wraps(command)
        def run(**given: Any) -> None:
            if given.get("config") is not None:  # a run file: its values where no flag was given
                _take_run_file(given, {p.name: p.annotation for p in params})
            options = {k: v for k, v in given.items() if k not in ("ctx", "config", "fmt")}
            for name, cls in groups.items():
                given[name] = cls(**{f.name: given.pop(f.name) for f in dataclass_fields(cls)})
            if takes_resolved:
                given["resolved"] = options
            command(**given)

        params = [*required, *flat, *optional]
        run.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # typer reads the signature above, not the command's own
        return run

    return decorate


def _take_run_file(given: dict[str, Any], annotations: dict[str, Any]) -> None:
    """The run file's settings (``--config``, read and checked: ``job.run_file``) into
    ``given``, for every option whose value is the default, not the command line's."""

    ctx, fmt = given["ctx"], given.get("fmt", Format.text)
    try:
        values = read_run_file(given["config"])
    except PlanError as exc:
        raise fail(exc, fmt) from None
    values["plan_path"] = values.pop("plan")
    for name, value in values.items():
        if name not in given:  # the schema names only the command's options (a test holds them equal)
            continue
        source = ctx.get_parameter_source(name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            continue  # the flag given on the command line wins
        kind = get_args(annotations[name])[0] if get_origin(annotations[name]) is Annotated else annotations[name]
        kinds = (kind, *get_args(kind))
        if value is not None and Path in kinds:
            value = Path(value)
        elif value is not None and isinstance(kind, type) and issubclass(kind, Enum):
            value = kind(value)  # --lr-schedule: the schema allowed only its choices
        elif value is not None and str in kinds and not isinstance(value, str):
            value = str(value)  # nnodes: 1 in YAML is the flag's "1"
        given[name] = value


def given_sizes(layout: LayoutFlags) -> dict[str, Any]:
    """The layout flags that differ from their defaults (given on the command line)."""
    defaults = LayoutFlags().sizes()
    return {k: v for k, v in layout.sizes().items() if v != defaults[k]}
