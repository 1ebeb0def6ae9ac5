"""A parallelized model's weights as ``(hf_name, full tensor)``, gathered one bucket at a time.

The names, shapes and values are what ``export_hf`` writes: the model's state dict with tied
weights once (transformers' ``remove_tied_weights_from_state_dict``) and transformers' reverse
weight conversions applied (the checkpoint layout of, e.g., fused MoE experts), bucket by
bucket. No full state dict is ever gathered: NeMo-RL streams its refit tensor by tensor for the
same reason (a full gather of a large model runs out of memory).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from ..errors import quiet_logger
from ..runtime.styles.experts import plain
from . import faults
from .agreement import RefitAgreement


def exported_names(model: nn.Module) -> list[str]:
    """The model's state-dict names that ``save_pretrained`` keeps: one of each tied group."""
    state = model.state_dict()
    local = {name: plain(value) for name, value in state.items()}
    kept = remove_tied_weights_from_state_dict(local, model)  # type: ignore[arg-type]
    return [name for name in state if name in kept]


def buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names whose bytes add up to at most ``bucket_bytes`` (a larger tensor alone)."""
    out: list[list[str]] = []
    load = 0
    for name, size in sizes:
        if out and load + size <= bucket_bytes:
            out[-1].append(name)
            load += size
        else:
            out.append([name])
            load = size
    return out


def full_weights(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of every exported weight, a bucket at a time. Collective: the
    full tensor of a sharded parameter is gathered over its mesh on every rank."""
    for bucket in weight_buckets(model, bucket_bytes=bucket_bytes, dtype=dtype):
        bucket.reverse()
        while bucket:  # handed on one by one, so that none is still held when the next bucket is gathered
            yield bucket.pop()


def _plan(model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None) -> tuple[dict, list[list[str]]]:
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    state = model.state_dict()

    def nbytes(value: torch.Tensor) -> int:
        return value.numel() * (dtype or value.dtype).itemsize

    return state, buckets([(name, nbytes(state[name])) for name in exported_names(model)], bucket_bytes)


def weight_buckets(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None, agreement: RefitAgreement | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The exported weights bucket by bucket: each a list of ``(hf_name, full tensor)``. With an
    ``agreement``, the ranks settle before each bucket's gather (a problem any rank noted is
    raised on every rank there, before anyone enters the gather)."""
    state, plan = _plan(model, bucket_bytes, dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for index, bucket in enumerate(plan):
        if agreement is None:
            faults.inject("gather", rank=rank, step=index + 1)
        else:
            agreement.bucket = index + 1
            try:
                faults.inject("gather", rank=rank, step=index + 1)
            except Exception as exc:
                agreement.note(exc)
            agreement.settle()
        # gathering strided TP x FSDP shards makes torch log a "suboptimal redistribute" warning
        with quiet_logger("torch.distributed.tensor"):
            full = {name: _full(state[name], dtype) for name in bucket}
        converted = list(revert_weight_conversion(model, full).items())  # type: ignore[arg-type]
        del full  # the caller alone holds the bucket: it may free each tensor as it goes
        yield converted


def manifest_buckets(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """What ``weight_buckets`` yields -- names, shapes, dtypes -- without gathering anything
    (transformers' reverse conversion runs on meta tensors of the full shapes)."""
    state, plan = _plan(model, bucket_bytes, dtype)
    out = []
    for bucket in plan:
        meta = {}
        for name in bucket:
            value = state[name]
            wanted = dtype if dtype is not None and value.is_floating_point() else value.dtype
            meta[name] = torch.empty(tuple(value.shape), dtype=wanted, device="meta")
        converted = revert_weight_conversion(model, meta)  # type: ignore[arg-type]
        out.append([(name, tuple(t.shape), t.dtype) for name, t in converted.items()])
    return out


def _full(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = value.full_tensor() if isinstance(value, DTensor) else value.detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
