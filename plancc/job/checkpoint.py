"""Checkpoints with torch.distributed.checkpoint (DCP), saved atomically, resumable at
another (dp, cp, tp) layout.

Layout of a checkpoint directory::

    DIR/step-000005/      DCP shards + .metadata, plus plancc.json (what was saved, how)
    DIR/latest            the name of the newest complete step directory

A step is written into ``DIR/.partial-step-000005`` and renamed only after every rank has
finished writing, then ``latest`` is replaced atomically: a crash mid-save leaves the
previous step and the previous ``latest`` untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import Diagnostic, PlanError, SourceLoc
from . import faults

META = "plancc.json"


class CheckpointError(PlanError):
    """A checkpoint that cannot be resumed here (missing, partial, or another model)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    step: int
    architecture: str
    model_signature: str  # shapes of every parameter: refuses a checkpoint of another model
    plan: str
    dp: int
    cp: int
    tp: int


def model_signature(model: torch.nn.Module) -> str:
    """Names and global shapes of the parameters, as one string (layout independent)."""
    parts = [f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save(root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: CheckpointInfo) -> Path:
    """Collective: every rank calls it. Returns the finished step directory."""
    root = Path(root)
    final = _step_dir(root, info.step)
    partial = root / f".partial-{final.name}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    faults.inject("save", rank=dist.get_rank())
    dist.barrier()
    if dist.get_rank() == 0:
        (partial / META).write_text(json.dumps(asdict(info), indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        tmp = root / ".latest.tmp"
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / "latest")
    dist.barrier()
    return final


def _error(path: str, message: str, fix: str) -> CheckpointError:
    return CheckpointError([Diagnostic(rule="checkpoint", loc=SourceLoc(path=path), message=message, fix=fix)])


def find(root: str | Path) -> Path:
    """The newest complete step directory under ``root`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if (root / META).is_file():
        return root
    latest = root / "latest"
    if latest.is_file():
        step = root / latest.read_text().strip()
        if (step / META).is_file():
            return step
    raise _error(
        str(root),
        "no complete checkpoint here (no 'latest' pointing at a finished step)",
        "pass the --save directory of an earlier run",
    )


def read_info(step_dir: Path) -> CheckpointInfo:
    try:
        return CheckpointInfo(**json.loads((step_dir / META).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise _error(str(step_dir), f"unreadable checkpoint metadata: {exc}", "resume from another step") from None


def load(
    root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, architecture: str, plan: str
) -> CheckpointInfo:
    """Collective: load model and optimizer state saved at any layout into this one."""
    step_dir = find(root)
    info = read_info(step_dir)
    if info.architecture != architecture or info.model_signature != model_signature(model):
        raise _error(
            str(step_dir),
            f"checkpoint is of {info.architecture} (signature {info.model_signature}), this run builds "
            f"{architecture} (signature {model_signature(model)})",
            "resume with the --model the checkpoint was saved with",
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:  # DCP loads in place, into the tensors of these two state dicts
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(step_dir))
    except Exception as exc:  # DCP reports mismatches deep inside; say what it means
        raise _error(
            str(step_dir),
            f"checkpoint does not fit this model/plan: {str(exc).splitlines()[0][:300]}",
            f"resume with the plan the checkpoint was saved with ({info.plan})",
        ) from None
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return info
