"""A policy's training state into a checkpoint and back: ``plancc.Policy.save`` / ``load``
(DCP through ``engine.checkpoint``: the model, the optimizer, and the schedule's counters)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..layout import Layout
from ..models import architecture_of
from . import checkpoint


def save_state(
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    step: int,
    config: PretrainedConfig,
    plan: str,
    layout: Layout,
    run: Mapping[str, Any] | None = None,
    files: Mapping[str, str] | None = None,
    whole: nn.Module | None = None,
    base: str | None = None,
) -> Path:
    """A DCP checkpoint of the model, optimizer and schedule at ``step`` (atomic; loadable at
    another layout). Returns the step folder. The caller reshards the model first. ``whole``:
    the model whose structure the checkpoint states where ``model`` holds part of it (a rank's
    pipeline stages: the whole model on meta); keyed by the model's names either way, so it
    loads at any pp, or none. ``base``: where the frozen base came from, when only adapters
    train (LoRA): the checkpoint then holds the adapters and their state alone."""
    whole = whole if whole is not None else model
    info = checkpoint.CheckpointInfo(
        step=step,
        architecture=architecture_of(config),
        model_signature=checkpoint.model_signature(whole),
        plan=plan,
        dp=layout.dp,
        cp=layout.cp,
        tp=layout.tp,
        ep=layout.ep,
        pp=layout.pp,
        dp_replicate=layout.dp_replicate,
        parameters=checkpoint.parameter_shapes(whole),
        schedule=schedule_state(scheduler),
        run=dict(run or {}),
        adapters_only=base is not None,
        base=base or "",
    )
    return checkpoint.save(folder, model, optimizer, info, files)


def load_state(
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    config: PretrainedConfig,
    plan: str,
    whole: nn.Module | None = None,
    base: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> checkpoint.CheckpointInfo:
    """``save_state``'s newest checkpoint in ``folder`` into these objects (any layout): the
    weights, the optimizer's state and the schedule's position; the learning rate stays the
    configured one (``restore_schedule``). The caller reshards the model first."""
    configured = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    shapes = checkpoint.parameter_shapes(whole) if whole is not None else None
    info = checkpoint.load(
        folder,
        model,
        optimizer,
        architecture=architecture_of(config),
        plan=plan,
        shapes=shapes,
        base=base,
        aliases=aliases,
    )
    restore_schedule(optimizer, scheduler, info.schedule, configured, step=info.step)
    return info


def schedule_state(scheduler: Any) -> dict[str, Any]:
    """What of a scheduler's state a checkpoint keeps (JSON: its counters, not its lambdas)."""
    if scheduler is None:
        return {}
    return {k: v for k, v in scheduler.state_dict().items() if isinstance(v, (int, float, list, bool, str))}


def restore_schedule(
    optimizer: torch.optim.Optimizer, scheduler: Any, saved: Mapping[str, Any], configured: list[float], *, step: int
) -> None:
    """After a checkpoint's optimizer state is loaded: the schedule at its saved position, with
    this run's configured base learning rates (the checkpoint's are what an earlier run was
    told). A ``LambdaLR`` (a function of the step, as ``plancc apply``'s) then gives the next
    step's rate from the new base; a schedule without state keeps the configured rate. A
    checkpoint that kept no schedule (an older Policy's, or ``plancc apply``'s before it saved
    through ``Policy.save``) puts a ``LambdaLR`` at the checkpoint's ``step``."""
    for group, base in zip(optimizer.param_groups, configured, strict=True):
        group["initial_lr"] = base
    if scheduler is None:
        for group, base in zip(optimizer.param_groups, configured, strict=True):
            group["lr"] = base
        return
    if saved:
        scheduler.load_state_dict({**saved, "base_lrs": list(configured)})
    elif isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.last_epoch = step
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        lambdas = zip(configured, scheduler.lr_lambdas, strict=True)
        rates: list[float | torch.Tensor] = [base * fn(scheduler.last_epoch) for base, fn in lambdas]
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr() says until the next step
