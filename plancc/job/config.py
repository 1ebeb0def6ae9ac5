"""What one ``plancc apply`` / ``plancc logprobs`` job runs: the settings the CLI checks and the
launcher hands every worker (as JSON on its command line).

Its own module, free of torch and transformers, so that the launcher process (which only
checks the flags and starts the workers) does not pay the workers' imports (~3 s a launch).
"""

from __future__ import annotations

import json
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any, Literal

from ..layout import Layout
from ..paths import is_stdout

# --param-dtype: torch's names and the short ones people type
PARAM_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}

# the launcher's copies of what it read and checked (in ``RunConfig.inputs``)
PLAN_COPY = "plan.yaml"
DATA_COPY = "data.tokens"
EVAL_COPY = "eval.tokens"
DEFAULT_KEEP = 3  # --keep unset: the newest three checkpoints stay (the last is the final one)
DEFAULT_STEPS = 5  # --steps when neither it nor --epochs is given
SYNTHETIC_SEQ_LEN = 32  # tokens per synthetic row when --seq-len is not given


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSettings:
    """What is trained: the plan, the model it is applied to, its adapters and precision."""

    plan: str
    name: str | None = field(default=None, metadata={"flag": "model"})  # a preset or a Hugging Face folder
    lora: dict[str, Any] | None = None  # train: LoRA adapters (--lora-*); None: the plan's lora: section, if any
    param_dtype: str | None = None  # e.g. bfloat16 for FSDP mixed precision


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSettings:
    """The rows a step reads, and how they are cut into microbatches."""

    path: str | None = field(default=None, metadata={"flag": "data"})  # --data: a file or a folder
    # where --data lines keep their text (DataFields' names: text, messages, prompt, completion)
    data_fields: dict[str, str] | None = None
    batch_size: int = 4  # global, split over dp
    # synthetic rows' length (SYNTHETIC_SEQ_LEN when None); with --data the length rows are cut
    # to (None: as they are, the model's max_position_embeddings the bound, checked before launch)
    seq_len: int | None = None
    shuffle: bool = True  # --data rows in a seeded order, epoch by epoch (job.data_order)
    epochs: float | None = None  # --epochs: what set steps (said in the data line)
    pack: bool = False  # pack a batch's (train: a microbatch's) sequences into one row (cu_seqlens)
    micro_batch_size: int | None = None  # train: rows per microbatch on each dp rank
    max_tokens: int | None = None  # train: microbatches by a token budget (balanced over dp ranks)

    @property
    def synthetic_seq_len(self) -> int:
        """The length of a synthetic row (no --data)."""
        return self.seq_len or SYNTHETIC_SEQ_LEN


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSettings:
    """train: held-out rows scored at --eval-every steps and at the end (job.evaluation): a file
    of their own, or a split of the --data folder."""

    eval_data: str | None = None
    eval_split: str | None = None
    eval_every: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    """AdamW, its learning-rate schedule and the gradient clip."""

    lr: float = 1e-3
    lr_schedule: str = "cosine"  # job.lr_schedule.LR_SCHEDULES
    warmup_steps: int = 1
    schedule_steps: int | None = None  # LR schedule horizon; default: steps (the run's total)
    min_lr: float | None = None  # where a decaying schedule ends (None: 10% of lr)
    weight_decay: float = 0.0  # AdamW's decay of the matrices (norms, biases, embeddings: none)
    max_grad_norm: float = 1.0  # the global gradient norm clipped to (0: no clipping)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSettings:
    """The job itself: what it does, for how long, where, and how it fails."""

    mode: Literal["train", "logprobs"] = "train"
    steps: int = DEFAULT_STEPS
    seed: int = 0
    verify: bool = False
    device: str | None = None  # cpu or cuda; default: cuda when available
    cpu_offload: bool = False  # FSDP's shards, gradients and optimizer state in host memory
    timeout_s: int = 300  # collectives time out instead of hanging a job
    # the launcher's folder holding the plan and data it read and checked: the workers read
    # those copies, never the user's paths again (a pipe reads once; a file may change)
    inputs: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobsSettings:
    """plancc logprobs: where the log-probs go and what comes with them."""

    out: str | None = None  # JSONL output path
    entropy: bool = False  # the entropy of every position's distribution as well
    temperature: float = 1.0  # under the sampler's temperature


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSettings:
    """train: checkpoints, resuming and the final export."""

    save: str | None = None
    resume: str | None = None
    save_every: int | None = None  # a checkpoint every N steps as well as at the end
    keep: int | None = None  # keep the newest K checkpoints in --save (None: DEFAULT_KEEP; 0: all)
    export_hf: str | None = None
    export_adapters: bool = False  # with LoRA: --export-hf writes a PEFT folder of the adapters alone
    # the settings it runs with as a run file's text (job.run_file), saved in each checkpoint
    run_file: str | None = None

    @property
    def kept_checkpoints(self) -> int:
        """How many checkpoints ``--save`` keeps (0: every one)."""
        return DEFAULT_KEEP if self.keep is None else self.keep


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingSettings:
    """What a run says, and where."""

    log_every: int = 1  # train: a step line every N steps (the first and the last always)
    metrics: str | None = None  # train: one JSON line per step (rank 0), appended when resuming
    tensorboard: str | None = None  # train: TensorBoard event files (rank 0)
    loggers: tuple[str, ...] = ()  # train: experiment trackers (job.loggers: wandb, mlflow), rank 0
    json_output: bool = False  # --format json: the CLI prints one JSON document on stdout
    log_dir: str | None = None  # where a failing rank writes its full traceback (rank-N.log)


# RunConfig's sections, in the order the run is described (torchtitan's JobConfig groups so)
SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "data": DataSettings,
    "eval": EvalSettings,
    "optimizer": OptimizerSettings,
    "training": TrainingSettings,
    "logprobs": LogprobsSettings,
    "checkpoint": CheckpointSettings,
    "logging": LoggingSettings,
}


def _flag_of(f: Field[Any]) -> str:
    return str(f.metadata.get("flag", f.name))


# every setting by its flag's name: (section, field)
SETTINGS: dict[str, tuple[str, str]] = {
    _flag_of(f): (section, f.name) for section, kind in SECTIONS.items() for f in fields(kind)
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A job's settings in sections. ``RunConfig.of(**flags)`` builds one from flag names (what
    the CLI's options are called), ``with_flags`` changes some; the sections are read by name
    (``cfg.optimizer.lr``). Every setting is one field here plus its option: a test holds them
    to each other, and the run schema is made from the options."""

    model: ModelSettings
    layout: Layout = Layout()
    data: DataSettings = DataSettings()
    eval: EvalSettings = EvalSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    training: TrainingSettings = TrainingSettings()
    logprobs: LogprobsSettings = LogprobsSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    logging: LoggingSettings = LoggingSettings()

    @classmethod
    def of(cls, *, plan: str, layout: Layout | None = None, **flags: Any) -> RunConfig:
        """The settings named by their flags (``lr=1e-4, save="ckpt"``), the rest their defaults;
        an unknown name is a TypeError, as a misspelled keyword is."""
        return cls(model=ModelSettings(plan=plan), layout=layout or Layout()).with_flags(**flags)

    def with_flags(self, **flags: Any) -> RunConfig:
        """This run with some settings changed, named by their flags."""
        changed: dict[str, Any] = {}
        for flag, value in flags.items():
            if flag not in SETTINGS:
                raise TypeError(f"RunConfig has no setting {flag!r}")
            section, name = SETTINGS[flag]
            changed[section] = replace(changed.get(section, getattr(self, section)), **{name: value})
        return replace(self, **changed)

    @classmethod
    def flag_names(cls) -> set[str]:
        """Every setting's flag name, the layout's as ``layout``."""
        return set(SETTINGS) | {"layout"}

    @property
    def row_length(self) -> int | None:
        """A training run's ``--seq-len`` with ``--data``: longer documents become rows of it
        (``records.rows_of``); log-probs keep each line whole (one line of output per line)."""
        return self.data.seq_len if self.training.mode == "train" and self.data.path else None

    @property
    def log_to_stderr(self) -> bool:
        """Whether stdout carries data (a JSON document, or log-probs without --out, or with an
        --out that is this process's stdout: ``/dev/stdout``, or the file stdout is redirected to)."""
        out = self.logprobs.out
        return self.logging.json_output or (self.training.mode == "logprobs" and (not out or is_stdout(out)))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        found = json.loads(text)
        sections = {section: SECTIONS[section](**found[section]) for section in SECTIONS}
        sections["logging"] = replace(sections["logging"], loggers=tuple(found["logging"]["loggers"]))  # JSON: a list
        return cls(layout=Layout(**found["layout"]), **sections)
