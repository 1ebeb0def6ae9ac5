"""What a run keeps of its settings in each checkpoint, and what a resume compares with them:
the settings that fix its learning rate at every step, the rows each step takes, the data
itself -- each difference one ``note:`` line, so a resume that is not the saved run's says so --
and what an experiment tracker records as the run's configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import RunConfig
from .data import SYNTHETIC

if TYPE_CHECKING:
    from .run_setup import Job


def tracked_settings(cfg: RunConfig, job: Job) -> dict[str, Any]:
    """What a tracker records as the run's configuration: the plan, model, layout and the settings
    that shape the curve."""
    return {
        "plan": job.plan.name,
        "model": job.model_name,
        "layout": job.layout.describe(),
        "batch_size": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "micro_batch_size": cfg.data.micro_batch_size,
        "param_dtype": cfg.model.param_dtype,
        "seed": cfg.training.seed,
        "data": cfg.data.path,
        **run_settings(cfg),
    }


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """What of a run fixes its learning rate at every step: kept in each checkpoint, so that a
    resume with other settings says so (``schedule_changes``)."""
    return {
        "steps": cfg.training.steps,
        "warmup_steps": cfg.optimizer.warmup_steps,
        "schedule_steps": cfg.optimizer.schedule_steps or cfg.training.steps,
        "lr": cfg.optimizer.lr,
        "lr_schedule": cfg.optimizer.lr_schedule,
        "min_lr": cfg.optimizer.min_lr,
        "weight_decay": cfg.optimizer.weight_decay,
        "max_grad_norm": cfg.optimizer.max_grad_norm,
    }


def schedule_changes(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """One line naming each setting a resumed run changed (``--steps 200 -> 300``), or "" when
    none did or the checkpoint kept none (a ``Policy.save`` of the caller's own loop)."""
    flags = {
        "steps": "--steps",
        "warmup_steps": "--warmup-steps",
        "schedule_steps": "--schedule-steps",
        "lr": "--lr",
        "lr_schedule": "--lr-schedule",
        "min_lr": "--min-lr",
        "weight_decay": "--weight-decay",
        "max_grad_norm": "--max-grad-norm",
    }
    changed = [
        f"{flag} {saved[key]} -> {now[key]}" for key, flag in flags.items() if key in saved and saved[key] != now[key]
    ]
    return ", ".join(changed)


def batch_shape(cfg: RunConfig) -> dict[str, Any]:
    """Which rows a step takes besides the data itself: the global batch's rows and how long they
    are cut (a resume with another --batch-size or --seq-len trains on other batches)."""
    seq_len = cfg.data.seq_len if cfg.data.path else cfg.data.synthetic_seq_len
    return {
        "batch_size": cfg.data.batch_size,
        "seq_len": seq_len,
        "seed": cfg.training.seed,
        "shuffle": cfg.data.shuffle,
    }


def shape_changes(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """``--batch-size 4 -> 8`` for each of them a resumed run changed ("" for a checkpoint that kept none)."""
    flags = {"batch_size": "--batch-size", "seq_len": "--seq-len", "seed": "--seed", "shuffle": "--shuffle"}

    def said(value: Any) -> str:
        return "unset (rows as they are)" if value is None else str(value).lower()

    return ", ".join(
        f"{flag} {said(saved[key])} -> {said(now[key])}"
        for key, flag in flags.items()
        if key in saved and saved[key] != now[key]
    )


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between the rows a checkpoint's run trained on and this run's ("" when the
    same, or when the checkpoint kept none: one of an older plancc, or of a caller's own loop)."""
    if saved.get("data_digest", now["data_digest"]) == now["data_digest"]:
        return ""
    if SYNTHETIC in (saved["data_digest"], now["data_digest"]):

        def said(run: dict[str, Any]) -> str:
            return "synthetic rows" if run["data_digest"] == SYNTHETIC else f"--data ({run.get('data_rows')} rows)"

        return f"the checkpoint's run trained on {said(saved)}, this one on {said(now)}"
    counts = (saved.get("data_rows"), saved.get("data_tokens")), (now["data_rows"], now["data_tokens"])
    if counts[0] == counts[1]:
        return f"the data holds other rows than the checkpoint's run's ({now['data_rows']} rows either way)"
    (rows, tokens), (rows_now, tokens_now) = counts
    return f"the data differs from the checkpoint's run's: {rows} rows of {tokens} tokens -> {rows_now} of {tokens_now}"
