"""Everything about a run that can be checked before a process starts.

A mistake found here costs a user a second, with the file and the reason; found inside the
workers it costs the launch, a model build and a traceback per rank. So every input and
output a run names is checked here first: the data file, the model folder's weights, the
checkpoint to resume (readable without executing anything, and of this model), the
checkpoint folder to save into (writable, not held by another run) and the export target
(never a file, never the folder the model is read from).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..compiler.adapted_modules import adapted_modules
from ..compiler.lora_spec import LoraSpec
from ..engine import checkpoint
from ..errors import Diagnostic, PlanError, Severity, SourceLoc
from ..models import architecture_of, presets
from ..paths import RunPath, is_stdout, overlaps
from ..runtime.hf_folder import check_export_target, check_folder, has_weights, other_weight_files
from ..runtime.mesh import default_device_type
from .config import PARAM_DTYPES, RunConfig
from .data import DataFields, TokenDataset, Tokenizer, read_jsonl, unused_fields_warning
from .loggers import EXTRAS, LOGGERS
from .memory import memory_problems

if TYPE_CHECKING:  # the launcher checks flags without importing transformers' modeling stack
    from transformers import PretrainedConfig

    from .launch import LaunchOptions


def _resume_problems(
    resume: str, model: nn.Module, config: PretrainedConfig, lora: LoraSpec | None = None
) -> list[Diagnostic]:
    shapes = checkpoint.parameter_shapes(model)
    if lora is not None:  # the run adds adapters to the model validate built (on meta, without them)
        shapes = with_adapter_shapes(shapes, adapter_shapes(model, lora))
    try:
        step_dir = checkpoint.find(resume)
        info = checkpoint.read_info(step_dir)
        checkpoint.compatible(info, step_dir, architecture=architecture_of(config), shapes=shapes)
        from ..engine.checkpoint_reader import SafeFileSystemReader  # lazy: DCP only when resuming

        SafeFileSystemReader(str(step_dir)).read_metadata()
    except PlanError as exc:
        return exc.diagnostics
    return []


def adapter_shapes(model: nn.Module, lora: LoraSpec) -> dict[str, list[int]]:
    """The shapes of the LoRA parameters ``runtime.lora.add_adapters`` gives ``model``, by name."""
    modules = dict(model.named_modules())
    shapes = {}
    for name in adapted_modules(model, lora)[0]:
        weight = getattr(modules[name], "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2:
            out_features, in_features = weight.shape
            shapes[f"{name}.lora_A.weight"] = [lora.r, in_features]
            shapes[f"{name}.lora_B.weight"] = [out_features, lora.r]
    return shapes


def with_adapter_shapes(shapes: dict[str, list[int]], adapters: dict[str, list[int]]) -> dict[str, list[int]]:
    """``shapes`` with the adapters' in the order ``named_parameters`` gives them (a module's own
    parameters, then its children's: ``lora_A``, ``lora_B``), which the model's signature hashes."""
    out: dict[str, list[int]] = {}
    names = list(shapes)
    for i, name in enumerate(names):
        out[name] = shapes[name]
        module = name.rsplit(".", 1)[0]
        last_of_module = i + 1 == len(names) or names[i + 1].rsplit(".", 1)[0] != module
        if last_of_module:
            for part in ("lora_A", "lora_B"):
                key = f"{module}.{part}.weight"
                if key in adapters:
                    out[key] = adapters[key]
    return out


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the model takes (logprobs pads a batch to its longest line)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


MAX_TIMEOUT_S = 365 * 24 * 3600


def _flag_problems(cfg: RunConfig) -> list[Diagnostic]:
    def problem(flag: str, message: str, fix: str) -> Diagnostic:
        return Diagnostic(rule="usage", loc=SourceLoc(path=flag), message=message, fix=fix)

    found = []
    if cfg.model.param_dtype is not None and cfg.model.param_dtype not in PARAM_DTYPES:
        found.append(
            problem(
                "--param-dtype",
                f"--param-dtype {cfg.model.param_dtype!r} is not a dtype plancc trains in",
                f"use one of {', '.join(sorted(PARAM_DTYPES))}",
            )
        )
    if not math.isfinite(cfg.optimizer.lr) or cfg.optimizer.lr < 0:
        found.append(
            problem(
                "--lr",
                f"--lr {cfg.optimizer.lr} is not a learning rate: it must be a finite number >= 0",
                "pass a finite, non-negative --lr such as 1e-5",
            )
        )
    if not 0 <= cfg.training.seed < 2**64:  # torch's generators take an unsigned 64-bit seed
        found.append(
            problem("--seed", f"--seed {cfg.training.seed} is not a 64-bit seed", "pass a seed in 0 .. 2**64 - 1")
        )
    if cfg.training.timeout_s > MAX_TIMEOUT_S:  # a timedelta beyond this overflows c10d's milliseconds
        found.append(
            problem(
                "--timeout",
                f"--timeout {cfg.training.timeout_s} is beyond the longest wait plancc sets "
                f"({MAX_TIMEOUT_S} s, a year)",
                f"pass --timeout of at most {MAX_TIMEOUT_S} seconds",
            )
        )
    if cfg.training.mode == "logprobs" and (
        not math.isfinite(cfg.logprobs.temperature) or cfg.logprobs.temperature <= 0
    ):
        found.append(
            problem(
                "--temperature",
                f"--temperature {cfg.logprobs.temperature} is not a sampling temperature: it must be finite and > 0 "
                "(an infinite one makes every token equally likely)",
                "pass the temperature the sampler used, e.g. 0.7 or 1.0",
            )
        )
    dp = cfg.layout.dp
    if cfg.training.mode == "train" and dp and cfg.data.batch_size % dp:
        fits = sorted({dp * max(1, cfg.data.batch_size // dp), dp * -(-cfg.data.batch_size // dp)})
        found.append(
            problem(
                "--batch-size",
                f"--batch-size {cfg.data.batch_size} does not split over dp={dp}: each dp rank trains an equal slice, "
                f"and {cfg.data.batch_size % dp} row(s) of every step would not be trained",
                f"use a multiple of {dp}: {' or '.join(map(str, fits))}",
            )
        )
    if cfg.training.device not in (None, "cpu", "cuda"):
        found.append(
            problem("--device", f"--device {cfg.training.device!r} is neither cpu nor cuda", "pass cpu or cuda")
        )
    elif cfg.training.device == "cuda" and not torch.cuda.is_available():
        found.append(
            problem(
                "--device",
                "--device cuda, but torch sees no CUDA device on this machine",
                "pass --device cpu (gloo), or run on a GPU machine with the CUDA build of torch",
            )
        )
    for flag, value in (("--save-every", cfg.checkpoint.save_every), ("--keep", cfg.checkpoint.keep)):
        if value is not None and not cfg.checkpoint.save:
            found.append(
                problem(
                    flag,
                    f"{flag} {value} without --save: there is no folder to keep checkpoints in",
                    f"add --save DIR, or drop {flag}",
                )
            )
    evaluated = cfg.eval.eval_data or cfg.eval.eval_split
    if cfg.eval.eval_data and cfg.eval.eval_split:
        found.append(problem("--eval-split", "--eval-data and --eval-split both name eval rows", "give one of the two"))
    elif cfg.eval.eval_split and not cfg.data.path:
        found.append(
            problem(
                "--eval-split",
                f"--eval-split {cfg.eval.eval_split} without --data: it names a split of --data's folder",
                "add --data FOLDER (train-*.parquet, test-*.parquet), or pass --eval-data FILE",
            )
        )
    elif cfg.eval.eval_every is not None and not evaluated:
        found.append(
            problem(
                "--eval-every",
                f"--eval-every {cfg.eval.eval_every} without --eval-data or --eval-split: no rows to evaluate",
                "add --eval-data FILE (or --eval-split test), or drop --eval-every",
            )
        )
    for name in cfg.logging.loggers:
        if name not in LOGGERS:
            allowed = ", ".join(LOGGERS)
            found.append(problem("--logger", f"--logger {name!r} is no tracker plancc logs to", f"one of {allowed}"))
        elif importlib.util.find_spec(LOGGERS[name]) is None:
            found.append(
                problem(
                    "--logger",
                    f"--logger {name} needs the {LOGGERS[name]} package, which is not installed",
                    f"pip install '{EXTRAS[name]}', or use --metrics (every step as JSON lines)",
                )
            )
    if (
        cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None
    ):  # torch's SummaryWriter writes with it
        found.append(
            problem(
                "--tensorboard",
                "--tensorboard needs the tensorboard package, which is not installed",
                "pip install 'plancc[tensorboard]' (or pip install tensorboard), or use --metrics",
            )
        )
    return found


def _output_problems(out: Path, flag: str = "--out") -> list[Diagnostic]:
    if is_stdout(out):  # /dev/stdout: where the log-probs go without --out (the log then goes to stderr)
        return []

    def problem(message: str) -> list[Diagnostic]:
        return [
            Diagnostic(
                rule="output",
                loc=SourceLoc(path=str(out)),
                message=message,
                fix=f"pass {flag} a file in an existing, writable folder",
            )
        ]

    if out.is_dir():
        return problem(f"{flag} is a folder, not a file")
    if not out.parent.is_dir():
        return problem(f"{flag} names a file in {out.parent}, which does not exist")
    if not os.access(out.parent, os.W_OK) or os.path.realpath(out).startswith(("/proc", "/sys")):
        return problem(f"{flag} cannot be written ({out.parent} is not writable)")
    return []


_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")
_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>\d+))?$")
CPU_WORKERS_PER_CORE = 4  # gloo workers beyond this per core wait on each other more than they compute


def node_range(nnodes: str) -> tuple[int, int] | None:
    """``--nnodes N`` or ``MIN:MAX`` as (min, max), or None when it is neither."""
    found = _NNODES.match(nnodes.strip())
    if not found:
        return None
    low = int(found.group(1))
    high = int(found.group(2) or low)
    return (low, high) if 1 <= low <= high else None


def launch_problems(opts: LaunchOptions, *, device: str | None) -> list[Diagnostic]:
    """The launcher's flags, each a usage problem (exit 2) where torchrun would trace back or
    wait without end: a node count that is no range, a rendezvous endpoint that is no
    HOST:PORT, several nodes without a rendezvous endpoint to meet at, more workers than the
    machine can run. ``device``: --device (None: the machine's default)."""
    device = device or default_device_type()

    def problem(flag: str, message: str, fix: str) -> Diagnostic:
        return Diagnostic(rule="usage", loc=SourceLoc(path=flag), message=message, fix=fix)

    found = []
    nodes = node_range(opts.nnodes)
    if nodes is None:
        found.append(
            problem(
                "--nnodes",
                f"--nnodes {opts.nnodes!r} is not N or MIN:MAX with 1 <= MIN <= MAX",
                "pass --nnodes 2, or 1:4 for an elastic job",
            )
        )
    endpoint = _ENDPOINT.match(opts.rdzv_endpoint or "")
    port = endpoint.group("port") if endpoint else None
    if opts.rdzv_endpoint is not None and (endpoint is None or (port is not None and not 0 < int(port) < 65536)):
        found.append(
            problem(
                "--rdzv-endpoint",
                f"--rdzv-endpoint {opts.rdzv_endpoint!r} is not HOST:PORT with a port from 1 to 65535",
                "pass the address every node can reach, e.g. --rdzv-endpoint node0.cluster:29400",
            )
        )
    if nodes is not None and nodes[0] > 1 and opts.rdzv_endpoint is None:  # standalone: no other node can join
        found.append(
            problem(
                "--nnodes",
                f"--nnodes {opts.nnodes} without --rdzv-endpoint: each node would start alone and wait for "
                "the others without end",
                "pass --rdzv-endpoint HOST:PORT (the same on every node) and --node-rank, or --nnodes 1",
            )
        )
    if device == "cuda":
        gpus = torch.cuda.device_count()  # none at all: the flag check says --device cuda has no GPU
        if 0 < gpus < opts.nproc_per_node:
            found.append(
                problem(
                    "--nproc-per-node",
                    f"--nproc-per-node {opts.nproc_per_node} on a machine with {gpus} GPU(s): "
                    "each worker needs a GPU of its own",
                    f"pass --nproc-per-node {gpus} or fewer (more ranks: --nnodes)",
                )
            )
    else:
        most = CPU_WORKERS_PER_CORE * (os.cpu_count() or 1)
        if opts.nproc_per_node > most:
            found.append(
                problem(
                    "--nproc-per-node",
                    f"--nproc-per-node {opts.nproc_per_node} CPU workers on {os.cpu_count()} cores: "
                    f"plancc starts at most {most} ({CPU_WORKERS_PER_CORE} a core)",
                    f"pass --nproc-per-node {most} or fewer (more ranks: --nnodes)",
                )
            )
    return found


def run_paths(cfg: RunConfig) -> list[RunPath]:
    """Every path the run reads or writes, named by its flag."""
    model = cfg.model.name if cfg.model.name and os.path.exists(cfg.model.name) else None  # a preset names no path
    return [
        RunPath(flag="PLAN", path=cfg.model.plan, output=False),
        RunPath(flag="--data", path=cfg.data.path or "", output=False),
        RunPath(flag="--eval-data", path=cfg.eval.eval_data or "", output=False),
        RunPath(flag="--model", path=model or "", output=False),
        RunPath(flag="--resume", path=cfg.checkpoint.resume or "", output=False),
        RunPath(flag="--save", path=cfg.checkpoint.save or "", output=True),
        RunPath(flag="--export-hf", path=cfg.checkpoint.export_hf or "", output=True, encloses=True),
        RunPath(flag="--metrics", path=cfg.logging.metrics or "", output=True),
        RunPath(flag="--tensorboard", path=cfg.logging.tensorboard or "", output=True),
        RunPath(flag="--out", path=cfg.logprobs.out or "", output=True),
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class Preflight:
    """What the preflight found: the problems (empty when the run can start) and the data it
    read and checked, which the launcher hands to the workers (they never read ``--data``)."""

    problems: list[Diagnostic]
    dataset: TokenDataset | None = None
    eval_rows: TokenDataset | None = None  # --eval-data / --eval-split, read as --data is


def _budget_problems(cfg: RunConfig, dataset: TokenDataset | None) -> list[Diagnostic]:
    """A row longer than ``--max-tokens``: a row is never split across microbatches, so the run
    would stop at the first batch holding it (perhaps hours in); said before launch instead.
    Training rows are cut to ``--seq-len`` (when given); synthetic rows are that long."""
    if cfg.training.mode != "train" or cfg.data.max_tokens is None or (cfg.data.path and dataset is None):
        return []  # (data that could not be read has its own diagnostics)
    cut = cfg.data.seq_len
    if dataset is not None:
        lengths = [min(n, cut) if cut else n for n in dataset.lengths()]
    else:
        lengths = [cfg.data.synthetic_seq_len]
    longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    if longest is None or lengths[longest] <= cfg.data.max_tokens:
        return []
    row = f"sequence {longest + 1} of the data" if dataset is not None else "every synthetic row"
    return [
        Diagnostic(
            rule="data",
            loc=SourceLoc(path=dataset.path if dataset is not None else "--max-tokens"),
            message=f"{row} has {lengths[longest]} tokens" + (f" (after --seq-len {cut})" if cut else "") + ", "
            f"more than max_tokens={cfg.data.max_tokens}: a row is never split across microbatches",
            fix=f"pass --max-tokens {lengths[longest]} or more, or a smaller --seq-len",
        )
    ]


def preflight(
    cfg: RunConfig,
    model: nn.Module,
    config: PretrainedConfig,
    *,
    local_ranks: int = 1,
    lora: LoraSpec | None = None,
) -> Preflight:
    """Every problem of ``cfg``'s inputs and outputs, for ``model`` of ``config`` (built on
    meta, as ``plancc validate`` builds it), and the data read once. ``local_ranks``: the
    workers this machine starts, which share its memory; ``lora``: the adapters the run adds."""
    problems = _flag_problems(cfg)
    # a run resumes from, and saves into, its own checkpoint folder; the export against the model
    # folder is check_export_target's to say ([export-hf], as the Python API's export says it)
    problems += overlaps(run_paths(cfg), allowed=[("--save", "--resume"), ("--export-hf", "--model")])
    if problems:  # the checks below open the named files and folders: not those of a refused run
        return Preflight(problems=problems)
    dataset = None
    folder = Path(cfg.model.name) if cfg.model.name and Path(cfg.model.name).is_dir() else None
    longest = max_positions(config)
    # --seq-len means one thing with and without --data: a row's length (synthetic rows are that
    # long, data rows are cut to it); beyond the model's positions either way is refused here
    if (
        cfg.training.mode == "train"
        and cfg.data.seq_len is not None
        and longest is not None
        and cfg.data.seq_len > longest
    ):
        problems.append(
            Diagnostic(
                rule="usage",
                loc=SourceLoc(path="--seq-len"),
                message=f"--seq-len {cfg.data.seq_len} is beyond the model's max_position_embeddings ({longest})",
                fix=f"pass --seq-len of at most {longest}",
            )
        )
    if folder is not None:
        problems += check_folder(folder, model)
    if cfg.logprobs.out:
        problems += _output_problems(Path(cfg.logprobs.out))
    if cfg.logging.metrics:
        problems += _output_problems(Path(cfg.logging.metrics), "--metrics")
    if (
        cfg.logging.tensorboard
        and Path(cfg.logging.tensorboard).exists()
        and not Path(cfg.logging.tensorboard).is_dir()
    ):
        problems.append(
            Diagnostic(
                rule="output",
                loc=SourceLoc(path=cfg.logging.tensorboard),
                message="--tensorboard names a file: TensorBoard writes its event files into a folder",
                fix="pass --tensorboard a folder (it is created if missing)",
            )
        )
    # one tokenizer for the training and the held-out rows: loaded once, when a line needs it
    fields, tokenizer = DataFields.of(cfg.data.data_fields), Tokenizer(str(folder) if folder is not None else None)
    if cfg.data.path:
        try:
            dataset = read_jsonl(
                cfg.data.path,
                fields=fields,
                tokenizer=tokenizer,
                vocab_size=config.vocab_size,
                min_tokens=2 if cfg.training.mode == "train" else 1,
                # a row longer than the model takes is refused, by apply as by logprobs, unless
                # --seq-len cuts it (to no more than the model takes: checked above)
                max_tokens=longest if cfg.training.mode == "logprobs" or cfg.data.seq_len is None else None,
                row_length=cfg.row_length,
            )
        except PlanError as exc:
            problems += exc.diagnostics
    eval_rows = None
    if cfg.eval.eval_data or (cfg.eval.eval_split and cfg.data.path):
        try:
            eval_rows = read_jsonl(
                cfg.eval.eval_data or cfg.data.path or "",
                fields=fields,
                tokenizer=tokenizer,
                vocab_size=config.vocab_size,
                min_tokens=2,
                max_tokens=longest if cfg.data.seq_len is None else None,
                row_length=cfg.row_length,
                split=cfg.eval.eval_split,
            )
        except PlanError as exc:
            problems += exc.diagnostics
    problems += _budget_problems(cfg, dataset)
    if cfg.checkpoint.resume:
        problems += _resume_problems(cfg.checkpoint.resume, model, config, lora)
    if cfg.checkpoint.save:
        try:
            checkpoint.check_save_folder(cfg.checkpoint.save)
        except PlanError as exc:
            problems += exc.diagnostics
    if cfg.checkpoint.export_hf:
        problems += check_export_target(cfg.checkpoint.export_hf, folder)
    if not problems:  # the run's lower bound of memory against the machine's
        problems += memory_problems(
            cfg,
            model,
            config,
            local_ranks=local_ranks,
            longest=dataset.longest if dataset else None,
            from_folder=folder is not None and has_weights(folder),
            device=cfg.training.device or default_device_type(),
        )
    return Preflight(problems=problems, dataset=dataset, eval_rows=eval_rows)


def notices(cfg: RunConfig, dataset: TokenDataset | None = None) -> list[Diagnostic]:
    """What the run will do that a user may not expect (warnings, the run still starts)."""
    found = []
    unused = unused_fields_warning(dataset) if dataset is not None else None
    if unused is not None:
        found.append(unused)
    folder = Path(cfg.model.name) if cfg.model.name and Path(cfg.model.name).is_dir() else None
    if folder is not None and not has_weights(folder) and not other_weight_files(folder):
        found.append(
            Diagnostic(
                rule="random-init",
                loc=SourceLoc(path=str(folder)),
                severity=Severity.WARNING,
                message="the folder holds a config but no weights: the model starts from random "
                f"init (seed {cfg.training.seed})",
                fix="add model.safetensors to the folder to start from its weights",
            )
        )
    preset = cfg.model.name is None or cfg.model.name in presets()
    if preset and not cfg.training.verify:  # a run on weights nobody trained: said, not only in a banner
        named = f"preset {cfg.model.name!r}" if cfg.model.name else "the plan's default preset (no --model)"
        found.append(
            Diagnostic(
                rule="random-init",
                loc=SourceLoc(path=cfg.model.name or cfg.model.plan),
                severity=Severity.WARNING,
                message=f"{named} is a config without weights: the model has random weights (seed {cfg.training.seed})",
                fix="pass --model a Hugging Face folder with safetensors to train or evaluate real weights",
            )
        )
    if cfg.training.mode == "train" and not cfg.data.path and not cfg.training.verify:
        found.append(
            Diagnostic(
                rule="synthetic-data",
                loc=SourceLoc(path=cfg.model.plan),
                severity=Severity.WARNING,
                message="no --data: training on synthetic token sequences",
                fix="pass --data: JSONL, parquet, arrow or a saved dataset of input_ids, text, messages or "
                "prompt + completion (README: Your model, your data)",
            )
        )
    return found
