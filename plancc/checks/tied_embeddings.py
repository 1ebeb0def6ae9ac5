"""tied-embeddings: when the input embedding and lm_head share one weight, the plan must
shard that weight the same way in both places (or keep it whole in both).

The embedding's weight is [vocab, hidden]; so is lm_head's. ``embedding_rowwise`` shards
vocab (Shard(0)) and ``colwise_logits`` on lm_head shards vocab too: consistent, and plancc
re-ties the two after sharding. ``colwise`` on lm_head with the embedding left whole would
give two different tensors for one parameter: a crash, or logits from a stale copy.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from ..compiler.plain_placements import Placement, Replicate
from ..compiler.plan import Rule
from ..compiler.styles import format_layout, style_layouts
from .context import CheckContext, Problem, kind_of, text_config
from .example import Example

ID = "tied-embeddings"


EXAMPLES = (
    Example(
        verdict="PASS",
        text="qwen3-0.6b (tied) with plans/qwen3.yaml: embedding_rowwise + colwise_logits",
        model="qwen3-0.6b",
        args={"tp": 2},
    ),
    Example(
        verdict="FAIL",
        text="llama-3.2-1b (tied) with lm_head: colwise and model.embed_tokens unlisted",
        plan="llama.yaml",
        model="llama-3.2-1b",
        args={"tp": 2},
        edits=(("tensor_parallel", "lm_head", "colwise"), ("tensor_parallel", "model.embed_tokens", None)),
    ),
)


def _placement(ctx: CheckContext, name: str | None, module: nn.Module) -> tuple[Placement, Rule | None]:
    rule = ctx.rule_for(name) if name is not None else None
    if rule is None:
        return Replicate(), None
    lay = style_layouts(rule.style)
    if lay.weight is None:
        return Replicate(), rule
    return lay.weight.get(kind_of(module), Replicate()), rule


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.tp == 1 or not getattr(text_config(ctx.config), "tie_word_embeddings", False):
        return
    get_in = getattr(ctx.model, "get_input_embeddings", None)
    get_out = getattr(ctx.model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return
    emb, head = get_in(), get_out()
    if emb is None or head is None:
        return
    names = {id(m): n for n, m in ctx.model.named_modules()}
    emb_name, head_name = names.get(id(emb)), names.get(id(head))
    emb_p, emb_rule = _placement(ctx, emb_name, emb)
    head_p, head_rule = _placement(ctx, head_name, head)
    if emb_p == head_p:
        return
    decided = head_rule or emb_rule
    assert decided is not None  # two unlisted modules both stay whole: equal placements, returned above
    loc = decided.loc
    yield Problem(
        loc=loc,
        message=f"{emb_name} and {head_name} share one weight (tie_word_embeddings) but the plan "
        f"places it as {format_layout(emb_p)} in {emb_name} and {format_layout(head_p)} in {head_name}",
        fix=f"shard both on the vocab: '{emb_name}: embedding_rowwise' and '{head_name}: colwise_logits', "
        "or keep both whole with 'replicate'",
    )
