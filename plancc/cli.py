"""The ``plancc`` command line: thin wrappers that parse flags, call the API and print.

Exit codes: 0 ok (warnings allowed), 1 plan/config problems, 2 usage errors.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args, get_origin, get_type_hints

import typer

from .errors import Diagnostic, PlanError, SourceLoc, format_json
from .layout import Layout, LayoutError

if TYPE_CHECKING:
    from .checks.report import ValidationReport
    from .job.config import RunConfig
    from .job.data import TokenDataset
    from .job.launch import LaunchOptions

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
SpOpt = Annotated[bool, typer.Option("--sp", help="sequence parallelism (the plan's overlay)")]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutFlags:
    """--tp --cp --ep --dp --sp --pp, declared once for every command that takes a layout."""

    tp: TpOpt = 1
    cp: CpOpt = 1
    ep: EpOpt = 1
    dp: DpOpt = None
    sp: SpOpt = False
    pp: PpOpt = 1

    def sizes(self) -> dict[str, Any]:
        """The layout keywords of ``validate_plan`` and ``Layout.infer``."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep, "sequence_parallel": self.sp, "pp": self.pp}


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
        from .job.launch import LaunchOptions

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
KeepOpt = Annotated[int | None, typer.Option("--keep", min=1, help="keep only the newest K checkpoints in --save")]
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
    metrics: MetricsOpt = None
    tensorboard: TensorboardOpt = None

    def run_config(self) -> dict[str, Any]:
        """The ``RunConfig`` fields these flags set."""
        paths = {name: _path(getattr(self, name)) for name in ("save", "resume", "export_hf", "metrics", "tensorboard")}
        return {**paths, "save_every": self.save_every, "keep": self.keep}


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
    from .job.run_file import read_run_file

    ctx, fmt = given["ctx"], given.get("fmt", Format.text)
    try:
        values = read_run_file(given["config"])
    except PlanError as exc:
        raise _fail(exc, fmt) from None
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
        elif value is not None and str in kinds and not isinstance(value, str):
            value = str(value)  # nnodes: 1 in YAML is the flag's "1"
        given[name] = value


def _emit(diagnostics: list[Diagnostic], fmt: Format, summary: dict | None = None) -> None:
    if fmt is Format.json:
        payload = json.loads(format_json(diagnostics))
        if summary is not None:
            payload["summary"] = summary
        print(json.dumps(payload, indent=2))
        return
    for diag in diagnostics:
        print(diag.format(), file=sys.stderr if diag.is_error else sys.stdout)


def _given_sizes(layout: LayoutFlags) -> dict[str, Any]:
    """The layout flags that differ from their defaults (given on the command line)."""
    defaults = LayoutFlags().sizes()
    return {k: v for k, v in layout.sizes().items() if v != defaults[k]}


def _exit_code(exc: PlanError) -> int:
    from .models import ModelSpecError

    usage = isinstance(exc, ModelSpecError) or any(d.rule in USAGE_RULES for d in exc.diagnostics)
    return EXIT_USAGE if usage else EXIT_PLAN


def _fail(exc: PlanError, fmt: Format) -> typer.Exit:
    _emit(exc.diagnostics, fmt)
    return typer.Exit(_exit_code(exc))


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


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
    from .checks.report import validate_plan  # imports in commands keep `plancc --help` fast
    from .job.run_file import is_run_file, plan_of_run_file

    worst, diagnostics, summaries, texts = 0, [], [], []
    for plan_path in plan_paths:
        try:
            # a run file: checked itself, then its plan for its model and layout (flags win)
            plan_path, settings = plan_of_run_file(plan_path) if is_run_file(plan_path) else (plan_path, {})
            flags = (("dp", "dp"), ("cp", "cp"), ("tp", "tp"), ("ep", "ep"), ("sp", "sequence_parallel"), ("pp", "pp"))
            from_file = {size: settings[flag] for flag, size in flags if settings.get(flag) is not None}
            sizes = {**from_file, **_given_sizes(layout)}
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
            worst = max(worst, _exit_code(exc))
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
        _emit(diagnostics, fmt)
        print("\n".join(texts))
    if worst:
        raise typer.Exit(worst)


def _dry_run_world_problem(report: ValidationReport) -> Diagnostic | None:
    from .tools.dryrun import world_problem

    return world_problem(report.layout)


def _dry_run(report: ValidationReport, seq_len: int | None) -> tuple[str, list[Diagnostic], dict[str, Any]]:
    """Run the dry run of a validated plan: (the line that reports it, its findings, its summary)."""
    from .tools.dryrun import describe_traffic, dry_run
    from .tools.explain import human_bytes

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


@app.command()
@grouped(layout=LayoutFlags)
def explain(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan YAML file")],
    layout: LayoutFlags,
    model: ModelOpt = None,
    fmt: FormatOpt = Format.text,
) -> None:
    """Every parameter's global shape, its per-rank shard and placements, and per-rank bytes."""
    from .checks.report import validate_plan
    from .tools.explain import explain as explain_plan
    from .tools.explain import render

    try:
        report = validate_plan(plan_path, model=model, skeleton=False, **layout.sizes())
    except PlanError as exc:
        raise _fail(exc, fmt) from None
    if report.has_errors or report.meta_model is None:
        _emit(list(report.diagnostics), fmt)
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
        from .tools.explain_stages import render_stages

        print(render_stages(*stages))


def _pipeline_stages(report: ValidationReport, exp: Any) -> tuple[list[Any], dict[int, int]]:
    """Each pipeline stage's parameters and bytes (``tools.explain_stages``) and its pp rank."""
    from .checks.pipeline import layers_of_stages
    from .tools.explain_stages import rank_of_stage, stage_bytes, stages_of

    assert report.meta_model is not None, "explain runs on a plan validate passed"
    spec, pp = report.plan.pipeline, report.layout.pp
    modules = dict(report.meta_model.named_modules())
    matched = layers_of_stages(modules, spec) if spec is not None and spec.stages else None
    layers = len(getattr(getattr(report.meta_model, "model", report.meta_model), "layers", []))
    of_layer = stages_of(spec, layers, pp, matched)
    virtual = spec.per_rank(layers, pp) if spec is not None else 1
    return stage_bytes(report.meta_model, exp, of_layer, pp * virtual), rank_of_stage(spec, pp, layers)


def _bytes_of(text: str) -> int | None:
    """``80GiB``, ``141 GB``, ``80`` (GiB) as bytes; None when it is none of those."""
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|tib|tb|t)?\s*", text.lower())
    if found is None:
        return None
    unit = {"gib": 2**30, "g": 2**30, None: 2**30, "gb": 10**9, "tib": 2**40, "t": 2**40, "tb": 10**12}[found.group(2)]
    # exact (a 400-digit size is a size: suggest says it is more than any GPU has, no OverflowError)
    return int(Decimal(found.group(1)) * unit)


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
        str, typer.Option("--allow", help="axes beside tp and dp to search: any of sp,cp,ep,pp")
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
    fmt: FormatOpt = Format.text,
) -> None:
    """The layouts the plan allows for the model on N GPUs, with per-GPU memory and estimated step
    time, fastest fitting first, and the command line of the best (no GPU is touched)."""
    from .tools.suggest import as_dict, no_fit_problem, render, render_verified
    from .tools.suggest import suggest as suggest_layouts
    from .tools.suggest import verify_top as verify

    axes = [a.strip() for a in allow.split(",") if a.strip()]
    unknown = [a for a in axes if a not in ("sp", "cp", "ep", "pp")]
    memory = _bytes_of(gpu_memory) if gpu_memory is not None else None
    if unknown:
        _usage_error(f"--allow {allow!r}: unknown axis {unknown[0]!r}", fmt, fix="--allow takes any of sp,cp,ep,pp")
    if gpu_memory is not None and not memory:
        _usage_error(f"--gpu-memory {gpu_memory!r} is not a size", fmt, fix="write it like 80GiB or 141GB")
    from .compiler.plan import load_plan
    from .models import default_preset

    try:
        plan = load_plan(plan_path)
        name = model or default_preset(plan.architectures)
        if name is None:
            _usage_error("the plan's architectures have no published preset", fmt, fix="pass --model")
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
        )
    except PlanError as exc:
        raise _fail(exc, fmt) from None
    problem = no_fit_problem(result, plan)
    verified = verify(result, plan, name, verify_top) if verify_top else []
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
        print(json.dumps(found, indent=2))
    else:
        print(render(result, str(plan_path), name, top=top) + (render_verified(verified) if verified else ""))
        if problem is not None:
            _emit([problem], fmt)
    if problem is not None:
        raise typer.Exit(EXIT_PLAN)


@app.command()
def plot(
    metrics_file: Annotated[Path, typer.Argument(metavar="METRICS.jsonl", help="a file plancc apply --metrics wrote")],
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write")] = Path("metrics.png"),
) -> None:
    """Draw loss, gradient norm and throughput per step from a --metrics file."""
    from .paths import RunPath, overlaps
    from .tools.plot import plot as draw

    problems = overlaps(
        [
            RunPath(flag="METRICS.jsonl", path=str(metrics_file), output=False),
            RunPath(flag="-o", path=str(out), output=True),
        ]
    )
    if problems:
        _emit(problems, Format.text)
        raise typer.Exit(EXIT_USAGE)
    try:
        steps = draw(metrics_file, out)
    except PlanError as exc:
        raise _fail(exc, Format.text) from None
    print(f"plotted {steps} step{'s' if steps != 1 else ''} of {metrics_file} -> {out}")


@app.command("import-hf")
def import_hf_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="preset, HF model folder or config.json")],
) -> None:
    """Write a plan from the model's own Hugging Face TP plan (to stdout)."""
    from .tools.import_hf import import_hf

    try:
        print(import_hf(model), end="")
    except PlanError as exc:
        raise _fail(exc, Format.text) from None


@app.command()
def styles(fmt: FormatOpt = Format.text) -> None:
    """List the style vocabulary with the placements each style sets."""
    from .compiler.styles import ALIASES, STYLES, default_layouts, format_layout

    rows = []
    for spec in STYLES.values():
        lay = default_layouts(spec.name)
        weight = "-"
        if lay.weight:
            kinds = sorted(spec.module_kinds & set(lay.weight), key=str)
            weight = ", ".join(f"{k}:{format_layout(lay.weight[k])}" for k in kinds) or "-"
        aliases = ", ".join(a for a, n in ALIASES.items() if n == spec.name)
        rows.append(
            {
                "style": spec.name,
                "weight": weight,
                "input": format_layout(lay.input),
                "output": format_layout(lay.output),
                "local_output": "-" if lay.local_output is None else ("yes" if lay.local_output else "DTensor"),
                "modules": ", ".join(sorted(map(str, spec.module_kinds))) if not spec.fits_any_module else "any",
                "aliases": aliases,
                "summary": spec.summary,
            }
        )
    if fmt is Format.json:
        print(json.dumps(rows, indent=2))
        return
    header = ["style", "weight", "input", "output", "local", "modules", "aliases"]
    print(
        _table(
            [
                [r["style"], r["weight"], r["input"], r["output"], r["local_output"], r["modules"], r["aliases"]]
                for r in rows
            ],
            header,
        )
    )
    print()
    for r in rows:
        print(f"{r['style']:<20} {r['summary']}")


@app.command()
def rules() -> None:
    """The model-aware checks, each with its documentation and PASS/FAIL examples."""
    from .checks import RULES
    from .checks.example import render_rule

    for module in RULES:
        print(render_rule(module.__doc__ or "", module.EXAMPLES))
        print()


@app.command()
def models(fmt: FormatOpt = Format.text) -> None:
    """List the built-in model presets."""
    from .models import presets

    rows = [[p.name, p.architecture, p.summary] for p in presets().values()]
    if fmt is Format.json:
        print(json.dumps([dict(zip(["name", "architecture", "summary"], r)) for r in rows], indent=2))
        return
    print(_table(rows, ["preset", "architecture", "summary"]))


@app.command()
@grouped(layout=LayoutFlags, launch=LaunchFlags, worker=WorkerFlags, output=OutputFlags, fields=DataFieldFlags)
def apply(
    ctx: typer.Context,
    layout: LayoutFlags,
    launch: LaunchFlags,
    worker: WorkerFlags,
    output: OutputFlags,
    fields: DataFieldFlags,
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
        int,
        typer.Option("--steps", min=0, help="the run's total optimizer steps (with --resume: trains on to this step)"),
    ] = 5,
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
    lr: Annotated[float, typer.Option("--lr", help="peak learning rate (AdamW, warmup then cosine)")] = 1e-3,
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
    micro_batch_size: Annotated[
        int | None,
        typer.Option("--micro-batch-size", min=1, help="rows per microbatch on each dp rank (gradient accumulation)"),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", min=1, help="microbatches by a token budget, balanced over dp ranks"),
    ] = None,
    pack: Annotated[
        bool, typer.Option("--pack", help="pack a microbatch's sequences into one row, without padding")
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
    from .job.config import SYNTHETIC_SEQ_LEN, RunConfig

    if plan_path is None:
        _usage_error(
            "apply needs a PLAN, or --config RUN.yaml that names one", fmt, fix="plancc apply plans/qwen3.yaml"
        )
    assert plan_path is not None
    nproc_per_node = _default_nproc(launch.nproc_per_node, worker.device)
    opts = _launcher_checked(launch, nproc_per_node, worker.device, fmt)
    model, chosen, report = _prelaunch(
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
    lora = _lora_flags(plan_path, report, chosen, fmt, r=lora_r, alpha=lora_alpha, targets=lora_targets)
    if chosen.pp > 1 and (output.export_hf or lora is not None):
        _usage_error(
            f"--pp {chosen.pp} with {'--export-hf' if output.export_hf else 'LoRA'}: not supported yet",
            fmt,
            fix="train with --pp and --save, then `plancc apply PLAN --resume SAVE --steps N --export-hf DIR` "
            "without --pp",
        )
    if worker.verify:
        from .job.verify import unverifiable

        outputs = {"--save": output.save, "--export-hf": output.export_hf}
        why = unverifiable(
            lora=lora is not None or report.plan.lora is not None, param_dtype=param_dtype, outputs=outputs
        )
        if why:
            _usage_error(why, fmt, fix="drop --verify, or the flags it names (verify first, then run with them)")
    cfg = RunConfig(
        plan=str(plan_path),
        layout=chosen,
        model=model,
        steps=steps,
        log_every=log_every,
        data=_path(data),
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        schedule_steps=schedule_steps,
        param_dtype=param_dtype,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        pack=pack,
        lora=lora,
        json_output=fmt is Format.json,
        **worker.run_config(),
        **output.run_config(),
        **fields.run_config(),
    )
    if output.save:  # the settings it runs with, in each checkpoint: --config SAVE/step-N/run.yaml
        from .job.run_file import run_file_text

        ran = {"plan": str(plan_path), **resolved, "model": model}
        cfg = replace(cfg, run_file=run_file_text(ran))  # (it keeps the run file's keys only: no plan_path)
    _launch_and_report(opts, _preflight(cfg, report, fmt, nproc_per_node), fmt)


def _usage_error(message: str, fmt: Format, fix: str | None = None) -> None:
    """A flag combination that cannot run: one diagnostic, exit 2."""
    _emit([Diagnostic(rule="usage", loc=SourceLoc(path="<command line>"), message=message, fix=fix)], fmt)
    raise typer.Exit(EXIT_USAGE)


def _lora_flags(
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
    from .checks.lora_targets import lora_problems
    from .compiler.lora import LoraSpec

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
        _usage_error(
            "LoRA needs a rank and targets: --lora-r and --lora-targets, or a plan with a lora: section",
            fmt,
            fix="add --lora-r 16 --lora-targets 'model.layers.*.self_attn.q_proj,model.layers.*.self_attn.v_proj'",
        )
    flags = SourceLoc(path="--lora-r/--lora-alpha/--lora-targets")
    try:
        checked = LoraSpec.of(spec, loc=flags)
    except PlanError as exc:
        _emit(exc.diagnostics, fmt)
        raise typer.Exit(EXIT_PLAN) from None
    assert checked is not None
    if report.meta_model is not None:
        found = lora_problems(report.meta_model, checked, report.resolved_for(layout.sequence_parallel), layout.tp)
        if found:
            _emit(
                [Diagnostic(rule=p.rule or "lora-targets", loc=p.loc, message=p.message, fix=p.fix) for p in found], fmt
            )
            raise typer.Exit(EXIT_PLAN)
    return spec


def _default_nproc(given: int | None, device: str | None) -> int:
    """--nproc-per-node when not given: one worker per visible GPU (so a 1-GPU machine runs
    the bare command), 2 on CPU (enough for a 2-rank mesh anywhere)."""
    if given is not None:
        return given
    if device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _launcher_checked(launch: LaunchFlags, nproc_per_node: int, device: str | None, fmt: Format) -> LaunchOptions:
    """The launcher's options, their flags checked by the preflight before anything starts."""
    from .job.preflight import launch_problems

    opts = launch.options(nproc_per_node)
    problems = launch_problems(opts, device=device)
    if problems:
        _emit(problems, fmt)
        raise typer.Exit(EXIT_USAGE)
    return opts


def _prelaunch(
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
    from .checks.report import validate_plan
    from .compiler.plan import load_plan
    from .job.preflight import node_range
    from .models import default_preset

    nodes = node_range(nnodes)
    assert nodes is not None, "the launcher's flags are checked first (_launcher_checked)"
    world = nproc_per_node * nodes[1]
    try:
        layout = Layout.infer(world_size=world, **flags.sizes())
    except LayoutError as exc:
        fit = f"choose --tp/--cp/--dp whose product is {world}"
        _emit(
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
        raise _fail(exc, fmt) from None
    if report.has_errors:
        _emit(list(report.diagnostics), fmt)
        raise typer.Exit(EXIT_PLAN)
    return report.model_name, layout, report


def _preflight(cfg: RunConfig, report: ValidationReport, fmt: Format, local_ranks: int) -> Launchable:
    """The run's inputs and outputs checked before a process starts (plancc.job.preflight);
    the warnings, which text output prints now and JSON output keeps for the end, and what the
    workers get: the plan and the data as read here, once."""
    from .job.preflight import notices, preflight

    assert report.meta_model is not None  # a report without errors has its model
    # the model and config validate built; the workers of this machine share its memory
    checked = preflight(cfg, report.meta_model, report.config, local_ranks=local_ranks)
    if checked.problems:
        _emit(checked.problems, fmt)
        raise typer.Exit(EXIT_USAGE if any(d.rule in USAGE_RULES for d in checked.problems) else EXIT_PLAN)
    warnings = (*report.diagnostics, *notices(cfg, checked.dataset))
    if fmt is Format.text:  # on stderr: stdout may carry data; json: into the one final document
        for warning in warnings:
            print(warning.format(), file=sys.stderr)
    return Launchable(cfg=cfg, plan_text=report.plan.text, dataset=checked.dataset, warnings=warnings)


@dataclass(frozen=True, kw_only=True, slots=True)
class Launchable:
    """A checked run: its settings, the plan and data read once, the warnings to report."""

    cfg: RunConfig
    plan_text: str
    dataset: TokenDataset | None
    warnings: tuple[Diagnostic, ...]


def _launch_and_report(opts: LaunchOptions, run: Launchable, fmt: Format) -> None:
    from .job.launch import launch

    cfg, warnings = run.cfg, run.warnings
    outcome = launch(opts, cfg, plan_text=run.plan_text, dataset=run.dataset)
    if outcome.rendezvous:
        _emit(
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
        _report_interruption(outcome.interrupted, outcome.result, cfg, fmt)
    stopped = (outcome.result or {}).get("interrupted")
    if stopped:  # a signal reached a worker, not the launcher: the run still stopped early
        import signal

        _report_interruption(int(signal.Signals[stopped["signal"]]), outcome.result, cfg, fmt)
    if outcome.result is not None and outcome.result.get("diagnostics"):  # a worker stopped on a diagnosed problem
        _emit([Diagnostic.from_json(d) for d in outcome.result["diagnostics"]], fmt)
        raise typer.Exit(EXIT_PLAN)
    run_path = SourceLoc(path=cfg.plan)
    if outcome.result is not None and outcome.result.get("ok") is False:
        _emit(
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
        _emit(
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


def _trace_hint(first: int, logs: dict[int, str]) -> str:
    """Where the failing rank's full traceback is (the terminal shows its last line only)."""
    if first in logs:
        return f"its full traceback: {logs[first]}; "
    if logs:  # it died without one (a signal): the ranks it took down wrote theirs
        return f"the other ranks' tracebacks: {Path(next(iter(logs.values()))).parent}; "
    return ""


def _report_interruption(signum: int, result: dict[str, Any] | None, cfg: RunConfig, fmt: Format) -> None:
    """One line for a run stopped by Ctrl-C / SIGTERM: where it stopped and what is kept."""
    import signal

    from .engine import checkpoint

    info = (result or {}).get("interrupted") or {}
    last = info.get("last_checkpoint")
    if last is None and (found := checkpoint.newest(cfg.save)):  # the workers could not say: look
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
    from .job.config import RunConfig

    nproc_per_node = _default_nproc(launch.nproc_per_node, worker.device)
    opts = _launcher_checked(launch, nproc_per_node, worker.device, fmt)
    model, chosen, report = _prelaunch(plan_path, model, nproc_per_node, launch.nnodes, layout, fmt)
    cfg = RunConfig(
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
    _launch_and_report(opts, _preflight(cfg, report, fmt, nproc_per_node), fmt)


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM outside a launched job (while checking a plan, before workers start):
    a BaseException, so click does not turn it into "Aborted!" and exit 1."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def main() -> None:  # console-script entry point
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        app()
    except Interrupted as stop:  # nothing was launched yet: nothing to stop or report but the fact
        print("interrupted before any worker started", file=sys.stderr)
        sys.exit(128 + stop.signum)
    finally:
        # The command is done: what it built (a meta model of 80 layers for suggest or validate)
        # is left to the interpreter's exit, whose collector would walk it again for over a second.
        # Frozen, it is not walked; atexit handlers and module teardown still run.
        import gc

        gc.freeze()


if __name__ == "__main__":
    main()
