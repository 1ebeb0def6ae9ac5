"""context-parallel: combinations the CP attention does not support.

Under context parallelism every module sees only its rank's shard of the sequence. Attention
is exact because the CP attention gathers the keys and values; every other module must work
position by position. A layer that mixes positions some other way -- a linear-attention or
state-space layer (Qwen3-Next, Jamba, Nemotron-H, MiniMax's lightning attention), a causal
convolution, an attention whose mask is computed from the activations (Doge's dynamic mask),
a sparse-attention indexer that picks keys over the whole sequence (DeepSeek-V3.2) -- would
compute on its shard alone, so cp > 1 is refused for such a model. (Whether the length
shards evenly is ``sequence-length``'s.)

This rule reads the layout's cp alone: ``plancc suggest`` walks the model for it once per cp
size, not once per layout (``checks.layout_memo``).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from ..sequence_mixing import calls_attention_interface, is_cp_attention, sequence_mixing
from .context import CheckContext, Problem, text_config
from .example import Example

ID = "context-parallel"


EXAMPLES = (
    Example(verdict="PASS", text="--cp 2 on Qwen3 (every layer's sequence mixing is its attention)", args={"cp": 2}),
    Example(
        verdict="FAIL",
        text="--cp 2 on a model with attention logit soft-capping (the CP attention has none)",
        plan="gemma3.yaml",
        model="gemma-3-1b",
        config={"attn_logit_softcapping": 50.0},
        args={"cp": 2},
    ),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.layout.cp == 1:
        return
    cfg = text_config(ctx.config)
    if getattr(cfg, "attn_logit_softcapping", None):
        yield Problem(
            loc=ctx.plan.loc,
            message=f"context parallelism is not supported with attention logit soft-capping "
            f"(attn_logit_softcapping={cfg.attn_logit_softcapping}): the CP attention uses scaled dot-product "
            "attention, which has no soft-cap",
            fix="use --cp 1 for this model",
        )
    attention = [m for m in ctx.model.modules() if is_cp_attention(m)]
    mixer = next(_sequence_mixers(ctx.model), None)
    if attention and mixer is not None:
        name, why = mixer
        yield Problem(
            loc=ctx.plan.loc,
            message=f"context parallelism is not supported for {type(ctx.model).__name__}: {name} {why}, which "
            "would see only its rank's shard of the sequence (the CP attention gathers keys and values for "
            "attention alone)",
            fix="use --cp 1 for this model (tensor and data parallelism still apply)",
        )
    if not attention:
        yield Problem(
            loc=ctx.plan.loc,
            message=f"context parallelism is not supported for {type(ctx.model).__name__}: it has no attention "
            "modules that call transformers' attention interface, which the CP attention replaces",
            fix="use --cp 1 for this model",
        )


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder's layers: the children of its ``layers`` module list."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module):
            return [(f"{name}.{child}", layer) for child, layer in module.named_children()]
    return []


def _sequence_mixers(model: nn.Module) -> Iterator[tuple[str, str]]:
    """(module name, what it does) for each module of the decoder's layers that mixes positions
    in a way the CP attention does not shard."""
    for layer_name, layer in _decoder_layers(model):
        verdicts = [calls_attention_interface(m) for m in layer.modules()]
        if None not in verdicts and not any(verdicts):
            kind = type(layer).__name__
            yield (
                layer_name,
                f"({kind}) has no attention that calls transformers' attention interface (a "
                "linear-attention or state-space layer)",
            )
        for name, module in layer.named_modules(prefix=layer_name):
            how = sequence_mixing(module)
            if how is not None:
                yield name, how
