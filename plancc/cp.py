"""``plancc.cp``, the documented path of context parallelism (``plancc.runtime.cp_context``)."""

from .runtime.cp_context import (
    CPContext,
    all_gather,
    enable_context_parallel,
    load_balanced_indices,
    load_balanced_indices_packed,
    pad_amount,
    pad_documents,
    pad_to_multiple,
    register_attention,
    shard,
    shard_packed,
    unshard,
    unshard_packed,
)

__all__ = [
    "CPContext",
    "all_gather",
    "enable_context_parallel",
    "load_balanced_indices",
    "load_balanced_indices_packed",
    "pad_amount",
    "pad_documents",
    "pad_to_multiple",
    "register_attention",
    "shard",
    "shard_packed",
    "unshard",
    "unshard_packed",
]
