"""attention-heads-divisible / kv-heads-divisible: colwise attention projections shard whole
heads, so tp must divide the number of attention heads and of key/value heads.

PASS  qwen3-8b (32 heads, 8 KV heads) at --tp 8
FAIL  qwen3-8b at --tp 16: 16 does not divide 8 KV heads (a reshape error deep in attention)
"""

from __future__ import annotations

from math import gcd
from typing import Iterator

from torch.distributed.tensor import Shard

from ..errors import Diagnostic
from .context import CheckContext, kind_of, text_config

ATTN_ID = "attention-heads-divisible"
KV_ID = "kv-heads-divisible"


def _shards(ctx: CheckContext, suffixes: tuple[str, ...]) -> bool:
    return any(
        name.endswith(suffixes) and lay.weight is not None and isinstance(lay.weight.get(kind_of(module)), Shard)
        for name, module, _, lay in ctx.assigned()
    )


def check(ctx: CheckContext) -> Iterator[Diagnostic]:
    tp = ctx.tp
    if tp == 1:
        return
    cfg = text_config(ctx.config)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if not heads:
        return
    valid = [t for t in range(1, gcd(heads, kv) + 1) if gcd(heads, kv) % t == 0]
    if _shards(ctx, ("q_proj",)) and heads % tp:
        yield Diagnostic(
            rule=ATTN_ID,
            loc=ctx.first_rule_loc("q_proj"),
            message=f"tp={tp} does not divide num_attention_heads={heads}",
            fix=f"use tp in {{{', '.join(map(str, valid))}}}",
        )
    if _shards(ctx, ("k_proj", "v_proj")) and kv % tp:
        yield Diagnostic(
            rule=KV_ID,
            loc=ctx.first_rule_loc("k_proj", "v_proj"),
            message=f"tp={tp} does not divide num_key_value_heads={kv}",
            fix=f"use tp in {{{', '.join(map(str, valid))}}}",
        )
