"""The lines a run logs before its first step (and the time left after each): what trains, on
which rows in which order, with which learning rate and weight decay, in which dtype and how
much recomputed -- what a user checks before a long run, from the log alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ..engine.param_groups import decay_split
from ..engine.policy import Policy
from ..runtime.activation_checkpointing import checkpointed_count
from ..runtime.local_tensors import local_tensor
from ..runtime.lora import adapters_of
from ..runtime.parallelize import params_on_host
from .config import PARAM_DTYPES, RunConfig
from .data import TokenDataset, truncated
from .hf_datasets import split_note
from .lr_schedule import LrSchedule, describe

if TYPE_CHECKING:
    from .run_setup import Job


def lora_note(policy: Policy) -> str:
    """What trains, when it is adapters: their rank, modules and share of the parameters."""
    adapters = adapters_of(policy.model)
    if adapters is None:
        return ""
    trained = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.model.parameters())
    return f" | LoRA r={adapters.spec.r} on {len(adapters.modules)} modules ({trained / total:.2%} of parameters train)"


def eta_of(elapsed: float, done: int, left: int) -> str:
    """The time the ``left`` steps will take at this run's mean step so far, as ``H:MM:SS``."""
    seconds = round(elapsed / max(1, done) * left)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def data_note(cfg: RunConfig, dataset: TokenDataset | None) -> str:
    """What each step trains on: its rows, their length, what the loss counts."""
    if dataset is None:
        return f"data: synthetic, {cfg.data.batch_size} rows of {cfg.data.synthetic_seq_len} tokens a step"
    if cfg.row_length is not None:
        documents = dataset.documents or len(dataset.sequences)
        length = (
            f"{documents} documents as {len(dataset.sequences)} rows of at most --seq-len {cfg.data.seq_len} tokens"
            + (" (a longer document cut into rows, every token kept)" if dataset.documents else "")
        )
    elif cfg.data.seq_len is not None:
        longer = truncated(dataset, cfg.data.seq_len)
        length = f"rows cut to --seq-len {cfg.data.seq_len} ({longer} of {len(dataset.sequences)} longer)"
    else:
        length = f"rows as they are (the longest {dataset.longest} tokens; --seq-len cuts them)"
    counted = (
        "the tokens its masks count (labels / loss_mask, a chat's assistant turns, a completion)"
        if dataset.masks is not None
        else "every token after the first"
    )
    split = split_note(dataset.path)
    return (
        f"data: {dataset.path}{split}, {cfg.data.batch_size} rows a step, {length}; the loss counts {counted}; "
        f"{order_note(cfg, len(dataset.sequences))}"
    )


def order_note(cfg: RunConfig, rows: int) -> str:
    """The rows' order and the run's length in epochs (``job.data_order``)."""
    order = (
        f"shuffled by --seed {cfg.training.seed}, anew each epoch"
        if cfg.data.shuffle
        else "in file order (--no-shuffle)"
    )
    per_epoch = rows / cfg.data.batch_size
    length = (
        f"--epochs {cfg.data.epochs:g}"
        if cfg.data.epochs is not None
        else f"{cfg.training.steps * cfg.data.batch_size / rows:.3g} epochs"
    )
    return f"{order}; an epoch is {rows} rows ({per_epoch:.3g} steps), {cfg.training.steps} steps are {length}"


def optimizer_note(cfg: RunConfig, policy: Policy) -> str:
    """The learning rate's course and what weight decay reaches (``engine.param_groups``)."""
    course = describe(
        cast(LrSchedule, cfg.optimizer.lr_schedule),
        lr=cfg.optimizer.lr,
        min_lr=cfg.optimizer.min_lr,
        warmup=cfg.optimizer.warmup_steps,
        total=cfg.optimizer.schedule_steps or cfg.training.steps,
    )
    clip = (
        f"gradients clipped to norm {cfg.optimizer.max_grad_norm:g}"
        if cfg.optimizer.max_grad_norm
        else "no gradient clipping"
    )
    if not cfg.optimizer.weight_decay:
        return f"optimizer: AdamW, {course}; no weight decay; {clip}"
    split = decay_split(policy.model)
    return (
        f"optimizer: AdamW, {course}; weight decay {cfg.optimizer.weight_decay:g} on {split.decayed} matrices, "
        f"none on {split.excluded} norm, bias and embedding tensors; {clip}"
    )


def memory_note(cfg: RunConfig, job: Job, policy: Policy) -> str:
    """What decides the run's memory beside the layout: the compute dtype, checkpointing and
    FSDP's resharding (the settings ``plancc suggest`` costs a layout with)."""
    compute = f"{PARAM_DTYPES[cfg.model.param_dtype]} over fp32 masters" if cfg.model.param_dtype else "fp32"
    checkpointed = checkpointed_count(policy.model)
    reshard = "on" if job.plan.fsdp_reshard_after_forward else "off (weights kept gathered from forward to backward)"
    offload = ""
    if params_on_host(policy.model):  # what left the device: 16 bytes an fp32 element (weight, grad, 2 moments)
        shard = sum(local_tensor(p).numel() for p in policy.model.parameters() if p.requires_grad)
        offload = (
            f"; FSDP CPU offload: {shard * 16 / 2**20:.1f} MiB a rank of parameter shards, gradients and AdamW "
            "state in host memory (each unit copied to the device for its gather)"
        )
    return (
        f"memory: compute in {compute}; activation checkpointing on {checkpointed} "
        f"module{'' if checkpointed == 1 else 's'}; FSDP resharding after forward {reshard}{offload}"
    )
