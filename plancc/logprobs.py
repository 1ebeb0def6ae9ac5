"""``plancc.logprobs``, the documented path of the log-prob evaluator (``plancc.runtime.vocab_parallel_logprobs``
and ``plancc.runtime.fused_logprobs``)."""

from .runtime.fused_logprobs import fused_logprobs, fused_nll_loss, fused_token_loss
from .runtime.vocab_parallel_logprobs import (
    IGNORE_INDEX,
    fusable,
    packed_position_ids,
    per_position,
    token_logprobs,
    vocab_layout,
    vocab_parallel_logprobs,
)

__all__ = [
    "IGNORE_INDEX",
    "fusable",
    "fused_logprobs",
    "fused_nll_loss",
    "fused_token_loss",
    "packed_position_ids",
    "per_position",
    "token_logprobs",
    "vocab_layout",
    "vocab_parallel_logprobs",
]
