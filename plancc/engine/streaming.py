"""A parallelized model's weights as ``(hf_name, full tensor)``, gathered one bucket at a time.

The names, shapes and values are what ``export_hf`` writes: the model's state dict with tied
weights once (transformers' ``remove_tied_weights_from_state_dict``) and transformers' reverse
weight conversions applied (the checkpoint layout of, e.g., fused MoE experts), bucket by
bucket. No full state dict is ever gathered: NeMo-RL streams its refit tensor by tensor for the
same reason (a full gather of a large model runs out of memory).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from ..errors import quiet_logger
from ..runtime import faults
from ..runtime.local_tensors import full_value, local_tensor
from ..runtime.lora import Adapters, adapters_of, merged, peft_name
from .bucket import Bucket
from .refit_agreement import RefitAgreement
from .values import given_or_keywords

# a bucket of weights out (``Policy.weights``, ``send_weights``, ``share_weights``) unless told
DEFAULT_BUCKET_BYTES = 512 * 2**20
# buckets between the refit's failure agreements on a GPU unless told: a failure is reported at
# most 8 buckets (4 GiB at the default size) after it arose, and the host queues 8 buckets'
# gathers between two reads of the device
GPU_AGREE_EVERY = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightFormat:
    """How a policy's weights go out (``weights``, ``weights_manifest``, ``send_weights``,
    ``share_weights``): gathered ``bucket_bytes`` at a time, floating tensors in ``dtype`` (None:
    their own), with LoRA the adapters alone under PEFT's names (``adapters_only``) or merged,
    the ranks agreeing on failures every ``agree_every`` buckets (``engine.refit_agreement``; None:
    before every bucket on the CPU, every ``GPU_AGREE_EVERY``-th on a GPU, where each agreement
    is a read of the device). The same as the keywords of the same names."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    dtype: torch.dtype | None = None
    adapters_only: bool = False
    agree_every: int | None = None

    def __post_init__(self) -> None:
        every = self.agree_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"agree_every={every!r}: a number of buckets, 1 or more (or None for the default)")

    @classmethod
    def of(cls, given: WeightFormat | None, keywords: Mapping[str, Any]) -> WeightFormat:
        """``given``, or the value its fields as keywords spell (``engine.values``)."""
        return given_or_keywords(cls, given, keywords, "weight_format")


def exported_names(model: nn.Module) -> list[str]:
    """The model's state-dict names that ``save_pretrained`` keeps: one of each tied group."""
    state = model.state_dict()
    local = {name: local_tensor(value) for name, value in state.items()}
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


# What a refit plans from a model's structure alone -- the names it streams, a manifest's
# buckets -- found once per model (its modules and their shapes do not change after it is
# built): a state dict and transformers' tied-weight walk per refit cost more host time than
# copying a 1B model's weights on the device.
_STREAMED: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()
_MANIFESTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, list]] = weakref.WeakKeyDictionary()


def _names(model: nn.Module, adapters_only: bool) -> tuple[list[str], Adapters | None]:
    """The state-dict names streamed, and the adapters to merge into them (None: none)."""
    adapters = adapters_of(model)
    if adapters_only:
        if adapters is None:
            raise ValueError("adapters_only=True, but this model has no LoRA adapters (construct it with lora=)")
        return adapters.parameter_names(), None
    if model not in _STREAMED:
        own = set(adapters.parameter_names()) if adapters is not None else set()
        _STREAMED[model] = [name for name in exported_names(model) if name not in own]
    return _STREAMED[model], adapters


def _plan(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None, adapters_only: bool = False
) -> tuple[Mapping[str, torch.Tensor], list[list[str]], Adapters | None]:
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    state = _state(model)
    names, adapters = _names(model, adapters_only)

    def nbytes(value: torch.Tensor) -> int:
        return value.numel() * (dtype or value.dtype).itemsize

    return state, buckets([(name, nbytes(state[name])) for name in names], bucket_bytes), adapters


# model -> whether its parameters and buffers, by name, are its state dict's entries (checked once)
_LIVE_STATE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _state(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """The model's state-dict entries by name: its parameters and buffers themselves where no
    module changes what its state dict holds (no state-dict hook, no ``_save_to_state_dict`` of
    its own: checked once per model), ``state_dict()`` otherwise. ``state_dict()`` detaches every
    tensor -- a DTensor dispatch each, tens of microseconds a tensor on the host, every refit.
    Non-persistent buffers are among them too; only the names a refit streams are looked up."""
    live = _LIVE_STATE.get(model)
    if live is False:
        return model.state_dict()
    entries = dict(state_entries(model))
    if live is None:
        plain = all(
            not m._state_dict_hooks
            and not m._state_dict_pre_hooks
            and type(m)._save_to_state_dict is nn.Module._save_to_state_dict
            for m in model.modules()
        )
        live = _LIVE_STATE[model] = plain and all(name in entries for name in model.state_dict())
    return entries if live else model.state_dict()


def state_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def bucket_count(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None, adapters_only: bool = False
) -> int:
    """How many buckets ``weight_buckets`` yields (local: nothing is gathered or converted)."""
    return len(_plan(model, bucket_bytes, dtype, adapters_only)[1])


# The full tensor of a state-dict name, where the model streamed holds none of its own: a
# pipeline's whole model on meta, whose values its stages' ranks gather (``stage_values``)
ValueOf = Callable[[str], torch.Tensor]


def weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    agreement: RefitAgreement | None = None,
    adapters_only: bool = False,
    values: ValueOf | None = None,
) -> Iterator[Bucket]:
    """The exported weights bucket by bucket: each a ``Bucket`` of ``(hf_name, full tensor)``
    whose tensors are gathered as they are taken (``engine.bucket``) -- all at once where
    transformers' reverse conversions need a bucket whole. What a consumer leaves of a bucket
    is gathered (and dropped) before the next one: every rank runs every gather, in order. With
    an ``agreement``, the ranks settle before the gather of every ``agreement.every``-th bucket
    (a problem any rank noted is raised on every rank there, before anyone enters the gather).
    ``values``: where each full tensor comes from when ``model`` holds only the structure (the
    names, tied weights and conversions are the model's either way)."""
    state, plan, adapters = _plan(model, bucket_bytes, dtype, adapters_only)
    merge = adapters.by_base_weight() if adapters is not None else {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    whole = not adapters_only and _conversions(model) is not None

    def full(name: str) -> torch.Tensor:
        # gathering strided TP x FSDP shards makes torch log a "suboptimal redistribute" warning
        value = state[name]
        gathers = isinstance(value, DTensor) and value.device_mesh.size() > 1
        # no_grad: the entries are the parameters themselves (``_state``), gathered as values
        with quiet_logger("torch.distributed.tensor") if gathers else nullcontext(), torch.no_grad():
            # a pipeline's: each tensor whole from its stage (``values``), merged here as at pp=1
            value_of = values if values is not None else state.__getitem__
            return _full_merged(value_of, name, merge.get(name), adapters, dtype)

    def gathered(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield (peft_name(name) if adapters_only else name), full(name)

    for index, names in enumerate(plan):
        if agreement is None:
            faults.inject("gather", rank=rank, step=index + 1)
        else:
            agreement.bucket = index + 1
            try:
                faults.inject("gather", rank=rank, step=index + 1)
            except Exception as exc:
                agreement.note(exc)
            if agreement.due(index):
                agreement.settle()
        if whole:  # the reverse conversions map a bucket's tensors together: gathered at once
            bucket = Bucket.of(list(reverted(model, {name: full(name) for name in names}).items()))
        else:
            bucket = Bucket([peft_name(n) for n in names] if adapters_only else list(names), gathered(names))
        yield bucket
        bucket.drain()  # what the consumer left: this rank's part in the bucket's gathers


def manifest_buckets(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None, adapters_only: bool = False
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """What ``weight_buckets`` yields -- names, shapes, dtypes -- without gathering anything
    (transformers' reverse conversion runs on meta tensors of the full shapes); found once per
    model and format."""
    known = _MANIFESTS.setdefault(model, {})
    key = (bucket_bytes, dtype, adapters_only)
    if key not in known:
        known[key] = _manifest_buckets(model, bucket_bytes, dtype, adapters_only)
    return [list(bucket) for bucket in known[key]]


def _manifest_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None, adapters_only: bool
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    state, plan, _ = _plan(model, bucket_bytes, dtype, adapters_only)
    out = []
    for bucket in plan:
        meta = {}
        for name in bucket:
            value = state[name]
            wanted = dtype if dtype is not None and value.is_floating_point() else value.dtype
            meta[name] = torch.empty(tuple(value.shape), dtype=wanted, device="meta")
        if adapters_only:
            out.append([(peft_name(name), tuple(t.shape), t.dtype) for name, t in meta.items()])
            continue
        converted = reverted(model, meta)
        out.append([(name, tuple(t.shape), t.dtype) for name, t in converted.items()])
    return out


# model -> its reverse conversions' mapping (None: nothing to convert), found once per model
_CONVERSIONS: weakref.WeakKeyDictionary[nn.Module, list | None] = weakref.WeakKeyDictionary()


def reverted(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' ``revert_weight_conversion(model, state)``, its mapping found once per model:
    for a model not loaded by ``from_pretrained`` transformers finds it again on every call (a
    walk of every module, milliseconds a bucket); found here as it does, then handed to it the
    way ``from_pretrained`` does, on the model's ``_weight_conversions``."""
    conversions = _conversions(model)
    if conversions is None:
        return state  # what transformers returns when there is nothing to convert
    if getattr(model, "_weight_conversions", None) is None:
        model._weight_conversions = conversions  # type: ignore[assignment]  # transformers keeps a list there
    return revert_weight_conversion(model, state)  # type: ignore[arg-type]


def _conversions(model: nn.Module) -> list | None:
    """The model's reverse weight conversions (None: nothing to convert), found once per model."""
    if model not in _CONVERSIONS:
        found = getattr(model, "_weight_conversions", None)
        if found is None:  # transformers' rule for a model it did not load: no PrefixChange
            every = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
            found = [x for x in every if not isinstance(x, PrefixChange)] or None
        _CONVERSIONS[model] = found
    return _CONVERSIONS[model]


def _full_merged(
    value_of: ValueOf,
    name: str,
    pair: tuple[str, str] | None,
    adapters: Adapters | None,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """The full tensor of ``name`` (``value_of``: a state dict's entry, or a pipeline stage's
    whole tensor); a base weight with adapters merged with them first."""
    if pair is None or adapters is None:
        return _full(value_of(name), dtype)
    weight = merged(
        _full(value_of(name), None), _full(value_of(pair[0]), None), _full(value_of(pair[1]), None), adapters.spec.scale
    )
    return weight.to(dtype) if dtype is not None else weight


def _full(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # On a one-rank mesh the local tensor is the whole one, whatever the placement: no gather
    # (a DTensor redistribute costs host time per tensor, more than the copy it makes)
    if isinstance(value, DTensor) and value.device_mesh.size() == 1:
        value = value.to_local()
    tensor = full_value(value).detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
