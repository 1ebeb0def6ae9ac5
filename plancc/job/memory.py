"""Whether a run can fit in the memory of the machine it launches on: a lower bound, checked
before any process starts.

A model or a batch too large for the machine otherwise ends in an allocation failure inside a
worker, after the launch and the model build (or in the kernel's OOM killer, with no message at
all). The bound here counts only what the run certainly holds, so it never refuses a run that
would fit; a run it lets through may still need more (activations between the layers depend on
checkpointing and the attention kernel).

* training state: fp32 weights, fp32 gradients and AdamW's two fp32 moments -- 16 bytes a
  parameter -- split over every rank (FSDP shards over dp x cp, the plan over tp and ep);
  log-probs hold the fp32 weights only (``--param-dtype`` is the compute copy, on top);
* the logits of one microbatch: tokens x vocabulary / tp in the compute dtype, and in training
  their gradient as well;
* random init (no model folder): every rank builds the whole model in fp32 on the host and
  keeps its shards, so each rank needs 4 bytes a parameter of host memory for a moment;
* ``--verify``: the unsharded reference beside the policy on every rank -- its fp32 weights
  and gradients whole, AdamW's moments split over the ranks (8/world bytes a parameter), and
  the logits of the rows it runs at a time (``job.verify_reference``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import Diagnostic, SourceLoc
from ..runtime.rank_memory import cgroup_headroom
from .config import PARAM_DTYPES, RunConfig
from .verify_reference import reference_chunk_rows

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class Need:
    """Bytes one rank needs at least, and for what."""

    state: int  # weights (and in training gradients and optimizer moments), this rank's share
    logits: int  # one microbatch's logits (and their gradient in training)
    init: int  # host bytes the seeded random init holds for a moment (0 with a model folder)
    reference: int = 0  # --verify's unsharded model, its gradients, its share of AdamW and its logits
    offloaded: bool = False  # --cpu-offload on a GPU: the state is in host memory, not the device's

    @property
    def device(self) -> int:
        return (0 if self.offloaded else self.state) + self.logits + self.reference


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def host_available() -> int | None:
    """Bytes the kernel says new allocations can take without swapping (MemAvailable), or what
    this process's memory cgroup still allows where that is less (a container's limit)."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        found = None
    bound = cgroup_headroom()
    if bound is not None:
        return bound if found is None else min(found, bound)
    return found


def device_capacity(device: str) -> int | None:
    """Bytes one GPU holds (``cuda``), None on the CPU (the host's memory is the bound there)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def need(cfg: RunConfig, model: nn.Module, config: object, *, longest: int | None, from_folder: bool) -> Need:
    """The lower bound of one rank's bytes for ``cfg`` on ``model`` (a meta model will do)."""
    params = sum(p.numel() for p in model.parameters())
    layout = cfg.layout
    if layout.pp > 1:  # a weight tied across stages has a copy on the last one (engine.pipeline.pipeline_ties)
        uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        params += sum(p.numel() for p in model.parameters() if uses[id(p)] > 1)
    world = max(1, layout.world_size)
    # logits come out in the compute dtype: --param-dtype's, else fp32
    dtype_bytes = getattr(torch, PARAM_DTYPES[cfg.model.param_dtype]).itemsize if cfg.model.param_dtype else 4
    per_param = 16 if cfg.training.mode == "train" else 4  # FSDP keeps fp32 shards; --param-dtype is the compute copy
    vocab = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", 0) or 0
    dp = max(1, layout.dp)
    if cfg.training.mode == "train":
        rows = cfg.data.micro_batch_size or max(1, cfg.data.batch_size // dp)
        # a data row is as long as it is, cut to --seq-len when given; a synthetic row is --seq-len
        length = longest if longest is not None else cfg.data.synthetic_seq_len
        row = min(length, cfg.data.seq_len) if cfg.data.seq_len else length
        tokens = rows * row
        if cfg.data.max_tokens:
            tokens = min(tokens, max(cfg.data.max_tokens, longest or 0))
        copies = 2  # the logits and their gradient
    else:
        row = longest or 1
        tokens = cfg.data.batch_size * row
        copies = 1
    tokens = math.ceil(tokens / max(1, layout.cp))
    logits = tokens * math.ceil(vocab / max(1, layout.tp)) * dtype_bytes * copies
    reference = 0
    if cfg.training.verify:  # its weights and gradients whole, its share of AdamW, a chunk's logits (3 copies)
        chunk = reference_chunk_rows(cfg.data.batch_size, row, vocab)
        reference = params * 8 + math.ceil(params * 8 / world) + chunk * row * vocab * 4 * 3
    return Need(
        # HSDP: each replica holds the whole state, sharded over its own ranks
        state=math.ceil(params * per_param * layout.dp_replicate / world),
        logits=logits,
        init=0 if from_folder else params * 4,
        reference=reference,
        offloaded=cfg.training.cpu_offload and cfg.training.mode == "train",
    )


def memory_problems(
    cfg: RunConfig,
    model: nn.Module,
    config: object,
    *,
    local_ranks: int,
    longest: int | None,
    from_folder: bool,
    device: str,
    host: int | None = None,
    gpu: int | None = None,
) -> list[Diagnostic]:
    """A problem when one rank's lower bound exceeds what it has: a GPU each on CUDA, the host's
    available memory shared by the ``local_ranks`` workers of this node on the CPU."""
    needed = need(cfg, model, config, longest=longest, from_folder=from_folder)
    host = host_available() if host is None else host
    gpu = device_capacity(device) if gpu is None else gpu
    found = []
    what = "weights, gradients and AdamW's moments" if cfg.training.mode == "train" else "weights"
    layout = f"over {cfg.layout.world_size} rank{'s' if cfg.layout.world_size > 1 else ''}"
    if device == "cuda" and gpu:
        have, where = gpu, f"one GPU holds {_gib(gpu)}"
        host_need = needed.init + (needed.state if needed.offloaded else 0)
    else:
        have = host // max(1, local_ranks) if host else 0
        where = f"this machine has {_gib(host or 0)} available, {_gib(have)} for each of its {local_ranks} workers"
        host_need = needed.device + needed.init
    if have and needed.device > have:
        shares = f"{_gib(needed.state)} of {what} {layout}"
        if needed.reference:
            shares += f", {_gib(needed.reference)} of the unsharded model --verify trains beside it"
        if needed.reference and needed.state + needed.logits <= have:  # the run fits; its check does not
            found.append(
                Diagnostic(
                    rule="memory",
                    loc=SourceLoc(path=cfg.model.name or cfg.model.plan),
                    message=f"--verify needs at least {_gib(needed.device)} per rank: the run's "
                    f"{_gib(needed.state + needed.logits)} and {_gib(needed.reference)} for the unsharded model "
                    f"it trains beside it (its weights and gradients whole on every rank); {where}",
                    fix="verify the plan on a copy of the model's config with fewer layers (num_hidden_layers), "
                    "which exercises every rule the same; the run without --verify fits",
                )
            )
        elif needed.state > have:  # the model itself: another machine, more ranks, or a smaller model
            found.append(
                Diagnostic(
                    rule="memory",
                    loc=SourceLoc(path=cfg.model.name or cfg.model.plan),
                    message=f"the run needs at least {_gib(needed.device)} per rank ({shares}, "
                    f"{_gib(needed.logits)} of logits); {where}",
                    fix="launch more ranks (--nproc-per-node, --nnodes) or a smaller model",
                )
            )
        else:  # the batch: fewer tokens per microbatch
            flag = (
                "--max-tokens"
                if cfg.data.max_tokens
                else "--micro-batch-size"
                if cfg.data.micro_batch_size
                else "--batch-size"
            )
            found.append(
                Diagnostic(
                    rule="usage",
                    loc=SourceLoc(path=flag),
                    message=f"one microbatch's logits need {_gib(needed.logits)} per rank beside {shares}: "
                    f"{_gib(needed.device)} in all; {where}",
                    fix="pass a smaller --micro-batch-size, --max-tokens or --seq-len, or shard the vocabulary (--tp)",
                )
            )
    elif host and needed.offloaded and host_need * max(1, local_ranks) > host:
        found.append(
            Diagnostic(
                rule="memory",
                loc=SourceLoc(path=cfg.model.name or cfg.model.plan),
                message=f"--cpu-offload keeps {_gib(needed.state)} of {what} a rank in host memory, "
                f"{_gib(host_need * max(1, local_ranks))} for {local_ranks} workers; "
                f"the machine has {_gib(host)} available",
                fix="launch more ranks (--nnodes), or drop --cpu-offload where the GPUs hold the state",
            )
        )
    elif host and needed.init and host_need * max(1, local_ranks) > host:
        found.append(
            Diagnostic(
                rule="memory",
                loc=SourceLoc(path=cfg.model.name or cfg.model.plan),
                message=f"random init builds the whole model on each of {local_ranks} workers "
                f"({_gib(needed.init)} each) beside their shares; the machine has {_gib(host)} available",
                fix="pass --model a folder with the weights (each rank then reads only its shard), or fewer workers",
            )
        )
    return found
