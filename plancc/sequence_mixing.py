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
    if cls.endswith("Indexer") and not is_indexer(module):
        return (
            f"({cls}) picks each query's keys by its own scores over the whole sequence (sparse attention), "
            "and not through the cache's update_indexer, where the CP form hands it every rank's keys"
        )
    if hasattr(module, "indexer") and not _code_has(type(module), "indices="):
        return f"({cls}) applies its indexer's picks itself instead of passing them to the attention interface"
    if callable(getattr(module, "prepare_dynamic_mask", None)) and not has_dynamic_mask(module):
        return f"({cls}) computes its attention mask from its activations (a dynamic mask), in a form not Doge's"
    return None


def is_indexer(module: nn.Module) -> bool:
    """A DeepSeek-sparse-attention indexer (DeepSeek-V3.2, GLM-MoE-DSA, ...): it scores every key
    for each query, keeps the top ``index_topk``, and takes its keys through a cache's
    ``update_indexer`` -- where ``runtime.cp_key_selection`` hands it the whole sequence's."""
    cls = type(module)
    return cls.__name__.endswith("Indexer") and hasattr(module, "index_topk") and _code_has(cls, "update_indexer(")


def has_dynamic_mask(module: nn.Module) -> bool:
    """Doge's attention: ``prepare_dynamic_mask(hidden_states, dt_states, keep_window_size,
    attention_mask)`` masks from every key's ``dt`` (``runtime.cp_key_selection`` gathers it)."""
    prepare = getattr(type(module), "prepare_dynamic_mask", None)
    if not callable(prepare):
        return False
    try:
        names = list(inspect.signature(prepare).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["self", "hidden_states", "dt_states", "keep_window_size", "attention_mask"]


def _code_has(cls: type, text: str) -> bool:
    key = (cls, text)
    if key not in _HAS:  # read once per class: a decoder repeats its layers' classes in every layer
        try:
            _HAS[key] = text in inspect.getsource(cls)
        except (OSError, TypeError):
            _HAS[key] = False
    return _HAS[key]


_HAS: dict[tuple[type, str], bool] = {}


# The kernels through which transformers' linear-attention and state-space layers mix positions
# (called by name from each model's module): ``runtime.cp_mixers`` gives each a cp form that
# trades sequence shards for head blocks around the call.
CP_KERNELS = (
    "causal_conv1d_fn",
    "torch_chunk_gated_delta_rule",
    "chunk_kimi_delta_attention",
    "mamba2_chunk_scan",
    "mamba_selective_scan",
    "mamba2_split_conv1d_scan_combined",
)
# What a module mixes positions with besides them, read from the same code: a layer that also
# calls these is not one the kernels' cp forms cover.
_OTHER_MIXING = ("torch_recurrent_gated_delta_rule(", "cumsum(", "F.conv1d(", "self.conv1d(", "self.conv(")


def cp_kernels(module: nn.Module) -> tuple[str, ...]:
    """The cp-capable kernels the module's class calls in training (its forward's code), or ()
    -- also () when the forward mixes positions some other way too."""
    cls = type(module)
    if cls not in _KERNELS:
        _KERNELS[cls] = _reads_kernels(cls)
    return _KERNELS[cls]


_KERNELS: dict[type, tuple[str, ...]] = {}


def _reads_kernels(cls: type) -> tuple[str, ...]:
    if cls.__module__.startswith("torch."):
        return ()
    forward = cls.__dict__.get("forward")
    try:
        source = inspect.getsource(forward) if forward is not None else ""
    except (OSError, TypeError):
        return ()
    found = tuple(name for name in CP_KERNELS if f"{name}(" in source)
    if not found:
        return ()
    # the single-token (cached decode) kernels are allowed beside them: they run only with a cache
    training = source.replace("torch_recurrent_gated_delta_rule(", "").replace("recurrent_kimi_delta_attention(", "")
    return () if any(mark in training for mark in _OTHER_MIXING) else found


# MiniMax's lightning attention: a linear attention with a per-head decay whose recurrence runs
# in the layer's own code (no kernel function); ``runtime.cp_mixers`` re-runs that code on a
# block of heads. Known by what the layer keeps.
_LIGHTNING = ("qkv_proj", "out_proj", "output_gate", "slope_rate", "query_decay", "key_decay", "diagonal_decay")


def is_lightning_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in _LIGHTNING) and isinstance(getattr(module, "block_size", None), int)


def shards_by_heads(module: nn.Module) -> bool:
    """A linear-attention / state-space layer context parallelism runs as blocks of heads."""
    return bool(cp_kernels(module)) or is_lightning_attention(module)


def is_cp_attention(module: nn.Module) -> bool:
    """An attention block the context-parallel attention replaces: a layer's attention (it
    has ``layer_idx`` and ``o_proj``) that reaches its kernel through the attention interface."""
    return hasattr(module, "layer_idx") and hasattr(module, "o_proj") and calls_attention_interface(module) is not False
