"""``plancc.logprobs``, the documented path of the log-prob evaluator (``plancc.runtime.logprobs``)."""

from .runtime.logprobs import (
    packed_position_ids,
    per_position,
    token_logprobs,
    vocab_layout,
    vocab_parallel_logprobs,
)

__all__ = ["packed_position_ids", "per_position", "token_logprobs", "vocab_layout", "vocab_parallel_logprobs"]
