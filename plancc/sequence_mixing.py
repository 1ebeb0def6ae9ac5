"""What a module's code does with the sequence, as the context-parallel check needs to know it:
whether an attention class reaches its kernel through transformers' attention interface (which
plancc's CP attention replaces), and whether a module mixes positions some other way.

Read from the class's code, and recorded with the shipped skeletons (which have no code): one
module below the compiler and the skeletons, so that both read the same answers.
"""

from __future__ import annotations

import inspect

from torch import nn

# How a transformers attention class reaches its kernel: through the attention interface
# (eager / SDPA / flash, chosen by ``config._attn_implementation``), which is what plancc's
# context-parallel attention registers itself as.
_INTERFACE_MARKS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")
# A shipped skeleton's module has no code to read: what these functions say of the real class is
# recorded with it (``plancc.skeleton``) under these attribute names.
RECORDED_INTERFACE = "_plancc_attention_interface"
RECORDED_MIXING = "_plancc_sequence_mixing"


def calls_attention_interface(module: nn.Module) -> bool | None:
    """Whether the module's class calls transformers' attention interface (its source says so);
    None where that cannot be known (a class without source)."""
    if RECORDED_INTERFACE in module.__dict__:
        recorded: bool | None = module.__dict__[RECORDED_INTERFACE]
        return recorded
    cls = type(module)
    if cls not in _READ:  # read once per class: a decoder repeats each layer's classes in every layer
        _READ[cls] = _reads_attention_interface(cls)
    return _READ[cls]


_READ: dict[type, bool | None] = {}


def _reads_attention_interface(cls: type) -> bool | None:
    if cls.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return None
    return any(mark in source for mark in _INTERFACE_MARKS)


def sequence_mixing(module: nn.Module) -> str | None:
    """How the module mixes positions other than by attention through the interface (what a
    sequence shard alone cannot compute), or None."""
    if RECORDED_MIXING in module.__dict__:
        recorded: str | None = module.__dict__[RECORDED_MIXING]
        return recorded
    cls = type(module).__name__
    if isinstance(module, nn.Conv1d) or "Conv" in cls:
        return f"({cls}) is a convolution over the sequence"
    if cls.endswith("Indexer"):
        return f"({cls}) picks each query's keys by its own scores over the whole sequence (sparse attention)"
    if callable(getattr(module, "prepare_dynamic_mask", None)):
        return f"({cls}) computes its attention mask from its activations (a dynamic mask)"
    return None


def is_cp_attention(module: nn.Module) -> bool:
    """An attention block the context-parallel attention replaces: a layer's attention (it
    has ``layer_idx`` and ``o_proj``) that reaches its kernel through the attention interface."""
    return hasattr(module, "layer_idx") and hasattr(module, "o_proj") and calls_attention_interface(module) is not False
