"""What every worker mode of a run starts from: the process group and mesh, the plan and data
as the launcher checked them, the model's config (``setup_job``); each step's global batch in
the run's row order; and the ``plancc.Policy`` a mode drives, with the run's optimizer and
learning-rate schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from ..compiler.plan import Plan, load_plan, parse_plan
from ..engine.policy import Policy
from ..layout import Layout
from ..models import default_preset, load_config
from ..runtime.mesh import ParallelMesh, build_mesh, default_device_type, init_process_group
from .config import DATA_COPY, EVAL_COPY, PARAM_DTYPES, PLAN_COPY, RunConfig
from .data import DataFields, TokenDataset, Tokenizer, dataset_batch, read_jsonl, read_tokens, synthetic_batch
from .data_order import RowOrder
from .lr_schedule import LrSchedule, lr_factor, min_ratio_of


def global_batches(
    cfg: RunConfig, dataset: TokenDataset | None, vocab_size: int, start: int, count: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The global batch of each step: ``input_ids``, ``attention_mask`` and, for data with
    loss masks, ``token_mask``."""
    order = row_order(cfg, dataset)
    for step in range(start, start + count):
        if dataset is None:
            ids = synthetic_batch(
                step,
                seed=cfg.training.seed,
                batch_size=cfg.data.batch_size,
                seq_len=cfg.data.synthetic_seq_len,
                vocab_size=vocab_size,
            )
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            yield dataset_batch(dataset, step, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, order=order)


def row_order(cfg: RunConfig, dataset: TokenDataset | None) -> RowOrder | None:
    """The order the run reads ``--data``'s rows in (None: synthetic rows)."""
    return (
        RowOrder(rows=len(dataset.sequences), seed=cfg.training.seed, shuffle=cfg.data.shuffle)
        if dataset is not None
        else None
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """What every worker mode starts from: process group, mesh, plan, model config."""

    device: str
    mesh: ParallelMesh  # rebuilt once from the layout the CLI serialised into the run config
    plan: Plan
    model_name: str
    config: PretrainedConfig
    dataset: TokenDataset | None = None  # the --data file, read and validated once
    eval_rows: TokenDataset | None = None  # --eval-data / --eval-split, likewise

    @property
    def layout(self) -> Layout:
        return self.mesh.layout


def _inputs(cfg: RunConfig) -> tuple[Plan, TokenDataset | None, TokenDataset | None]:
    """The plan, data and eval rows as the launcher read and checked them (its copies), shown
    by the user's paths; without a launcher (a runner started by hand), the paths themselves."""
    if cfg.training.inputs is None:
        return load_plan(cfg.model.plan), None, None
    folder = Path(cfg.training.inputs)
    plan = parse_plan(folder.joinpath(PLAN_COPY).read_text(encoding="utf-8"), path=cfg.model.plan)
    data, held_out = folder / DATA_COPY, folder / EVAL_COPY
    return (
        plan,
        read_tokens(data) if data.is_file() else None,
        read_tokens(held_out) if held_out.is_file() else None,
    )


def setup_job(cfg: RunConfig) -> Job:
    device = cfg.training.device or default_device_type()
    init_process_group(device, cfg.training.timeout_s)  # the one init (Policy finds it made)
    layout = cfg.layout
    if layout.world_size != dist.get_world_size():  # an elastic job (--nnodes MIN:MAX) got another size
        layout = Layout.infer(
            world_size=dist.get_world_size(),
            cp=layout.cp,
            tp=layout.tp,
            ep=layout.ep,
            sequence_parallel=layout.sequence_parallel,
            pp=layout.pp,
            dp_replicate=layout.dp_replicate,
        )
    mesh = build_mesh(layout, device_type=device)
    plan, dataset, eval_rows = _inputs(cfg)
    model_name = cfg.model.name or default_preset(plan.architectures, tiny=True)
    assert model_name is not None, "the CLI resolves the model before launching"
    config = load_config(model_name)
    # one tokenizer for the training and the held-out rows: loaded once, when a line needs it
    fields, tokenizer = (
        DataFields.of(cfg.data.data_fields),
        Tokenizer(model_name if Path(model_name).is_dir() else None),
    )
    if cfg.data.path and dataset is None:  # a runner started by hand: validate the whole file before any step
        dataset = read_jsonl(
            cfg.data.path,
            vocab_size=config.vocab_size,
            min_tokens=2 if cfg.training.mode == "train" else 1,
            fields=fields,
            tokenizer=tokenizer,
            row_length=cfg.row_length,
        )
    if (cfg.eval.eval_data or cfg.eval.eval_split) and eval_rows is None:  # likewise
        eval_rows = read_jsonl(
            cfg.eval.eval_data or cfg.data.path or "",
            vocab_size=config.vocab_size,
            min_tokens=2,
            fields=fields,
            tokenizer=tokenizer,
            row_length=cfg.row_length,
            split=cfg.eval.eval_split,
        )
    return Job(
        device=device,
        mesh=mesh,
        plan=plan,
        model_name=model_name,
        config=config,
        dataset=dataset,
        eval_rows=eval_rows,
    )


def lr_scheduler_of(cfg: RunConfig) -> Callable[[torch.optim.Optimizer], Any]:
    """Warmup, then --lr-schedule to --min-lr over --schedule-steps (default: --steps, the run's
    total), as a function of the global step (``job.lr_schedule``): ``Policy.load`` restores the
    position on --resume, so a resumed run's rate at every step is the uninterrupted run's."""
    schedule = partial(
        lr_factor,
        schedule=cast(LrSchedule, cfg.optimizer.lr_schedule),
        warmup=cfg.optimizer.warmup_steps,
        total=cfg.optimizer.schedule_steps or cfg.training.steps,
        min_ratio=min_ratio_of(cfg.optimizer.lr, cfg.optimizer.min_lr),
    )
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def job_policy(cfg: RunConfig, job: Job) -> Policy:
    """The engine every mode of a run drives."""
    return Policy(
        job.plan,
        cfg.model.name or job.model_name,
        layout=job.mesh,
        optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.optimizer.lr),
        lr_scheduler=lr_scheduler_of(cfg) if cfg.training.mode == "train" else None,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        weight_decay=cfg.optimizer.weight_decay,
        param_dtype=getattr(torch, PARAM_DTYPES[cfg.model.param_dtype]) if cfg.model.param_dtype else None,
        cpu_offload=cfg.training.cpu_offload,
        lora=cfg.model.lora,
        seed=cfg.training.seed,
        device=job.device,
    )
