"""What one ``plancc apply`` / ``plancc logprobs`` job runs: the settings the CLI checks and the
launcher hands every worker (as JSON on its command line).

Its own module, free of torch and transformers, so that the launcher process (which only
checks the flags and starts the workers) does not pay the workers' imports (~3 s a launch).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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
class RunConfig:
    plan: str
    layout: Layout = Layout()
    model: str | None = None
    steps: int = DEFAULT_STEPS
    log_every: int = 1  # train: a step line every N steps (the first and the last always)
    # train: the settings it runs with as a run file's text (job.run_file), saved in each checkpoint
    run_file: str | None = None
    data: str | None = None
    # where --data lines keep their text (DataFields' names: text, messages, prompt, completion)
    data_fields: dict[str, str] | None = None
    batch_size: int = 4  # global, split over dp
    # synthetic rows' length (SYNTHETIC_SEQ_LEN when None); with --data the length rows are cut
    # to (None: as they are, the model's max_position_embeddings the bound, checked before launch)
    seq_len: int | None = None
    lr: float = 1e-3
    warmup_steps: int = 1
    schedule_steps: int | None = None  # LR schedule horizon; default: steps (the run's total)
    lr_schedule: str = "cosine"  # job.lr_schedule.LR_SCHEDULES
    min_lr: float | None = None  # where a decaying schedule ends (None: 10% of lr)
    weight_decay: float = 0.0  # AdamW's decay of the matrices (norms, biases, embeddings: none)
    # train: held-out rows scored at --eval-every steps and at the end (job.evaluation): a file
    # of their own, or a split of the --data folder
    eval_data: str | None = None
    eval_split: str | None = None
    eval_every: int | None = None
    shuffle: bool = True  # --data rows in a seeded order, epoch by epoch (job.data_order)
    epochs: float | None = None  # --epochs: what set steps (said in the data line)
    max_grad_norm: float = 1.0  # the global gradient norm clipped to (0: no clipping)
    seed: int = 0
    save: str | None = None
    resume: str | None = None
    export_hf: str | None = None
    export_adapters: bool = False  # with LoRA: --export-hf writes a PEFT folder of the adapters alone
    verify: bool = False
    mode: Literal["train", "logprobs"] = "train"
    out: str | None = None  # logprobs: JSONL output path
    lora: dict[str, Any] | None = None  # train: LoRA adapters (--lora-*); None: the plan's lora: section, if any
    pack: bool = False  # pack a batch's (train: a microbatch's) sequences into one row (cu_seqlens)
    micro_batch_size: int | None = None  # train: rows per microbatch on each dp rank
    max_tokens: int | None = None  # train: microbatches by a token budget (balanced over dp ranks)
    entropy: bool = False  # logprobs: the entropy of every position's distribution as well
    temperature: float = 1.0  # logprobs: under the sampler's temperature
    device: str | None = None  # cpu or cuda; default: cuda when available
    param_dtype: str | None = None  # e.g. bfloat16 for FSDP mixed precision
    cpu_offload: bool = False  # FSDP's shards, gradients and optimizer state in host memory
    timeout_s: int = 300  # collectives time out instead of hanging a job
    json_output: bool = False  # --format json: the CLI prints one JSON document on stdout
    metrics: str | None = None  # train: one JSON line per step (rank 0), appended when resuming
    save_every: int | None = None  # train: a checkpoint every N steps as well as at the end
    keep: int | None = None  # train: keep the newest K checkpoints in --save (None: DEFAULT_KEEP; 0: all)
    tensorboard: str | None = None  # train: TensorBoard event files (rank 0)
    loggers: tuple[str, ...] = ()  # train: experiment trackers (job.loggers: wandb, mlflow), rank 0
    # the launcher's folder holding the plan and data it read and checked: the workers read
    # those copies, never the user's paths again (a pipe reads once; a file may change)
    inputs: str | None = None
    log_dir: str | None = None  # where a failing rank writes its full traceback (rank-N.log)

    @property
    def row_length(self) -> int | None:
        """A training run's ``--seq-len`` with ``--data``: longer documents become rows of it
        (``records.rows_of``); log-probs keep each line whole (one line of output per line)."""
        return self.seq_len if self.mode == "train" and self.data else None

    @property
    def kept_checkpoints(self) -> int:
        """How many checkpoints ``--save`` keeps (0: every one)."""
        return DEFAULT_KEEP if self.keep is None else self.keep

    @property
    def synthetic_seq_len(self) -> int:
        """The length of a synthetic row (no --data)."""
        return self.seq_len or SYNTHETIC_SEQ_LEN

    @property
    def log_to_stderr(self) -> bool:
        """Whether stdout carries data (a JSON document, or log-probs without --out, or with an
        --out that is this process's stdout: ``/dev/stdout``, or the file stdout is redirected to)."""
        return self.json_output or (self.mode == "logprobs" and (not self.out or is_stdout(self.out)))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        fields = json.loads(text)
        return cls(**{**fields, "layout": Layout(**fields["layout"])})
