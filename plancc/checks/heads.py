"""attention-heads-divisible / kv-heads-divisible: colwise attention projections shard whole
heads, so tp must divide the number of attention heads and of key/value heads.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import reduce
from math import gcd

from ..compiler.plain_placements import Shard
from ..models import field_values
from .context import CheckContext, Problem, kind_of, text_config
from .example import Example

ATTN_ID = "attention-heads-divisible"
KV_ID = "kv-heads-divisible"
IDS = (ATTN_ID, KV_ID)


EXAMPLES = (
    Example(verdict="PASS", text="qwen3-8b (32 heads, 8 KV heads) at --tp 8", args={"tp": 8}),
    Example(
        verdict="FAIL",
        text="qwen3-8b at --tp 16: 16 does not divide 8 KV heads (a reshape error deep in attention)",
        args={"tp": 16},
    ),
)


def _shards(ctx: CheckContext, suffixes: tuple[str, ...]) -> bool:
    return any(
        name.endswith(suffixes) and lay.weight is not None and isinstance(lay.weight.get(kind_of(module)), Shard)
        for name, module, _, lay in ctx.assigned()
    )


def check(ctx: CheckContext) -> Iterator[Problem]:
    tp = ctx.tp
    if tp == 1:
        return
    cfg = text_config(ctx.config)
    # per layer where transformers keeps them so (every layer's count must split)
    heads = [int(n) for n in field_values(cfg, "num_attention_heads") if n]
    if not heads:
        return
    kvs = [int(n) for n in field_values(cfg, "num_key_value_heads") if n] or heads
    common = reduce(gcd, heads + kvs)
    valid = [t for t in range(1, common + 1) if common % t == 0]
    bad_heads = [n for n in heads if n % tp]
    if _shards(ctx, ("q_proj",)) and bad_heads:
        yield Problem(
            rule=ATTN_ID,
            loc=ctx.first_rule_loc("q_proj"),
            message=f"tp={tp} does not divide num_attention_heads={bad_heads[0]}",
            fix=f"use tp in {{{', '.join(map(str, valid))}}}",
        )
    bad_kvs = [n for n in kvs if n % tp]
    if _shards(ctx, ("k_proj", "v_proj")) and bad_kvs:
        yield Problem(
            rule=KV_ID,
            loc=ctx.first_rule_loc("k_proj", "v_proj"),
            message=f"tp={tp} does not divide num_key_value_heads={bad_kvs[0]}",
            fix=f"use tp in {{{', '.join(map(str, valid))}}}",
        )
