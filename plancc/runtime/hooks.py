"""Forward pre-hooks that rewrite a Hugging Face decoder's inputs before it runs.

Both sequence parallelism and context parallelism hand the decoder something other than
what transformers expects (a sequence shard), so both rewrite its arguments by name.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask


def call_arguments(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward call's arguments by name (``**kwargs`` flattened in), so a pre-hook can
    rewrite them and hand them back as keywords."""
    values = dict(signature.bind_partial(*args, **kwargs).arguments)
    values.update(values.pop("kwargs", {}) or {})
    return values


class GlobalSequenceInputs:
    """Forward pre-hook for sequence parallelism on a Hugging Face decoder (``model.model``).

    Under SP the embedding hands the decoder a sequence shard, and transformers derives
    position ids and the causal mask from ``inputs_embeds.shape[1]``, i.e. from the shard.
    This hook computes both from the full ``input_ids`` before the decoder runs: global
    ``position_ids`` (unless given) and the prepared masks, which transformers uses as-is.
    It sits on the decoder, not the causal LM, so that calling the decoder directly (a value
    head on hidden states, a reward model) gets global positions too.
    """

    @staticmethod
    def applies_to(base: nn.Module) -> bool:
        """A Hugging Face decoder: a config, and a forward that takes ``input_ids`` (to derive
        positions and masks from). Any other module under SP gets its inputs as its caller
        gives them: plain PyTorch models (torch's own TP examples) pass positions themselves."""
        try:
            takes_ids = "input_ids" in inspect.signature(base.forward).parameters
        except (TypeError, ValueError):
            takes_ids = False
        return takes_ids and isinstance(getattr(base, "config", None), PretrainedConfig)

    def __init__(self, base: nn.Module):
        self.signature = inspect.signature(base.forward)
        self.base = base
        config: Any = base.config
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.sliding = "sliding_attention" in (getattr(self.config, "layer_types", None) or ())

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[()], dict[str, Any]] | None:
        values = call_arguments(self.signature, args, kwargs)
        input_ids = values.get("input_ids")
        if input_ids is None or isinstance(values.get("attention_mask"), dict):
            return None
        batch, seq = input_ids.shape[:2]
        if values.get("position_ids") is None:
            values["position_ids"] = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, -1)
        values["attention_mask"] = self._masks(input_ids, values.get("attention_mask"), values["position_ids"])
        return (), values

    def _masks(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> Any:
        dtype = next(self.base.parameters()).dtype
        stand_in = torch.empty((*input_ids.shape[:2], 0), dtype=dtype, device=input_ids.device)
        kwargs: dict[str, Any] = {
            "config": self.config,
            "inputs_embeds": stand_in,
            "attention_mask": attention_mask,
            "past_key_values": None,
            "position_ids": position_ids,
        }
        full = create_causal_mask(**kwargs)
        if not self.sliding:
            return full
        return {"full_attention": full, "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
