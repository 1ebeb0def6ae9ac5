"""A training step's per-rank peak memory, measured in one process with no GPU and no memory.

The dry run's world (a fake process group of the layout's ranks, fake tensors, the real model
code parallelized by the plan) runs one step the way ``plancc apply`` trains: bf16 compute over
fp32 master weights (FSDP mixed precision), the plan's activation checkpointing or the one
asked for, the fused lm_head token loss (no logits tensor), and AdamW, whose state exists
before the measured step as it does in every step after the first. torch's
``FSDPMemTracker`` follows every tensor the step allocates and frees and reports the peak by
kind: what ``plancc suggest --verify-top`` sets beside its predictions.

Fake tensors on the CPU run torch's CPU attention (flash-style: it keeps the output and the
log-sum-exp, as the GPU kernels do); allocator effects (fragmentation, the caching
allocator's reserve) are not in the figure.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from transformers import PretrainedConfig, masking_utils

from ..compiler.plan import Plan, TargetList
from ..dataflow import batched_experts
from ..errors import quiet_logger
from ..layout import Layout
from ..models import build_model, decoder_layers_glob
from ..runtime.fused_logprobs import targets_checked
from ..runtime.mesh import build_mesh
from ..runtime.parallelize import parallelize
from ..runtime.token_loss import evaluated_positions, model_token_loss
from .dryrun import _fake_process_group


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredMemory:
    """Bytes one rank holds at the step's peak, by kind (``FSDPMemTracker``'s categories)."""

    total: int
    parameters: int  # the fp32 shards FSDP keeps
    gathered: int  # unsharded bf16 parameters and all-gather buffers of the units in use
    gradients: int
    optimizer: int
    activations: int  # kept for backward (and recomputed ones), with backward's temporaries
    other: int  # buffers and inputs

    @classmethod
    def of(cls, snapshot: dict) -> MeasuredMemory:
        by = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
        kinds = {
            "parameters": by.get("Sharded Param", 0),
            "gathered": by.get("Unsharded Param", 0) + by.get("All Gather", 0),
            "gradients": by.get("Sharded Grad", 0) + by.get("Unsharded Grad", 0) + by.get("Reduce Scatter", 0),
            "optimizer": by.get("OptState", 0),
            "activations": by.get("Activation", 0) + by.get("Temp", 0),
            "other": by.get("Buffer", 0) + by.get("Inputs", 0),
        }
        return cls(total=by.get("Total", sum(kinds.values())), **kinds)


def _with_checkpointing(plan: Plan, model: torch.nn.Module, checkpointing: str) -> tuple[Plan, bool | None]:
    """The plan and ``parallelize``'s switch for ``checkpointing``: "plan" as written, "none",
    or "full" (every decoder layer recomputed)."""
    if checkpointing == "none":
        return plan, False
    if checkpointing == "plan":
        return plan, None
    glob = decoder_layers_glob(model)
    if glob is None:
        return plan, False
    every_layer = TargetList(patterns=(glob,), locs=(plan.loc,), saves=((),))
    return replace(plan, activation_checkpointing=every_layer), True


@contextmanager
def _rows_without_padding() -> Iterator[None]:
    """The measured rows are whole sequences: no padding, one document each. In a real run
    transformers then leaves the causal mask to SDPA's ``is_causal`` (no ``[s, s]`` mask, and the
    KV heads are not repeated: SDPA's own GQA). Under fake tensors it cannot read the position ids'
    or the padding mask's values, takes the rows for packed ones and builds the mask instead
    (with the KV heads repeated to every head), 48 MiB a Qwen3-0.6B layer at 4k tokens that the
    real run never holds. Here both decisions are made as the real run makes them for such rows."""
    decide, find_packed = masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices

    def without_padding(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> bool:
        return decide(None, *args, **kwargs)

    masking_utils._ignore_causal_mask_sdpa = without_padding
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = decide
        masking_utils.find_packed_sequence_indices = find_packed


def adamw_with_state(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters with its state made, as every step after the first holds it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    mark: Callable[[str], None] = lambda moment: None,
) -> None:
    """The measured step over whole rows ``ids``: the fused token loss at every position,
    backward, AdamW; ``mark`` is called after each of "forward", "backward" and "optimizer"."""
    where = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
    evaluated = evaluated_positions(model, where, attention_mask=None, cu_seqlens=None)
    loss = model_token_loss(model, ids, evaluated, lambda lp, _: -lp.sum(), attention_mask=None, cu_seqlens=None)
    mark("forward")
    loss.backward()
    mark("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")


def measure_step_memory(
    plan: Plan,
    config: PretrainedConfig,
    layout: Layout,
    *,
    seq_len: int,
    sequences: int = 1,
    checkpointing: str = "plan",
    param_dtype: torch.dtype = torch.bfloat16,
    reshard_after_forward: bool | None = None,
) -> MeasuredMemory:
    """Rank 0's peak over one training step of ``sequences`` rows of ``seq_len`` tokens (the
    whole sequence: context parallelism splits it) at ``layout``; ``reshard_after_forward``
    overrides the plan's ``fsdp.reshard_after_forward`` when given."""
    quiet = quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL)
    with _fake_process_group(layout.world_size), quiet:
        model = build_model(copy.deepcopy(config), device="meta", dtype=torch.float32)
        plan, ac = _with_checkpointing(plan, model, checkpointing)
        if reshard_after_forward is not None:
            plan = replace(plan, fsdp_reshard_after_forward=reshard_after_forward)
        mesh = build_mesh(layout, device_type="cpu")
        parallelize(model, plan, mesh, param_dtype=param_dtype, activation_checkpointing=ac)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # Experts run as a real bf16 step runs them (grouped_mm: each token through its top_k
        # experts only, which fake tensors take in bf16); the dry run's stand-in, which runs
        # every expert on every token, only where the compute is not bf16
        experts = nullcontext() if param_dtype == torch.bfloat16 else batched_experts(model)
        with fake, experts, targets_checked(), _rows_without_padding():
            model.to_empty(device="cpu")
            optimizer = adamw_with_state(model)
            ids = torch.randint(0, int(config.vocab_size), (sequences, seq_len))
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((ids,))
            with tracker:
                training_step(model, optimizer, ids)
            peak = tracker.get_tracker_snapshot("peak")
    return MeasuredMemory.of(next(iter(peak.values())))
