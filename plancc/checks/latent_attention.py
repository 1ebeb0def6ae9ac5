"""mla-rope-dim: ``mla_kv_a_proj`` must name the width of the rotary key it splits off.

mla-shared-key: where the heads are split over tp (a colwise ``q_b_proj`` / ``kv_b_proj``), MLA's
``kv_a_proj_with_mqa`` must be ``mla_kv_a_proj``: its rotary key meets every rank's heads, so each
rank's gradient of it holds its own heads alone. Left whole, or given a linear style, the replicas
drift apart (exit 0, trained wrong).


The projection's output is the latent followed by one rotary key shared by every head; the
style sums the gradient of that key over tp. Its width is the config's ``qk_rope_head_dim``:
a different ``rope_dim`` would sum part of the latent (or miss part of the key) and train wrong
without an error.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.globs import generalize
from ..compiler.plain_placements import Shard
from ..compiler.styles import canonical_style
from .context import CheckContext, Problem, flow_of, text_config
from .example import Example

IDS = ("mla-rope-dim", "mla-shared-key")

EXAMPLES = (
    Example(
        verdict="PASS",
        text="deepseek-v3: kv_a_proj_with_mqa: {style: mla_kv_a_proj, rope_dim: 64}",
        plan="deepseek_v3.yaml",
        model="deepseek-v3",
        args={"tp": 8},
    ),
    Example(
        verdict="FAIL",
        text="deepseek-v3 with rope_dim: 32 (qk_rope_head_dim is 64)",
        plan="deepseek_v3.yaml",
        model="deepseek-v3",
        args={"tp": 8},
        edits=(
            (
                "tensor_parallel",
                "model.layers.*.self_attn.kv_a_proj_with_mqa",
                {"style": "mla_kv_a_proj", "rope_dim": 32},
            ),
        ),
    ),
    Example(
        verdict="FAIL",
        text="deepseek-v3 with kv_a_proj_with_mqa left whole -> its rotary key's gradient one rank's heads only",
        plan="deepseek_v3.yaml",
        model="deepseek-v3",
        args={"tp": 8},
        edits=(("tensor_parallel", "model.layers.*.self_attn.kv_a_proj_with_mqa", None),),
    ),
)


def _unshared_keys(ctx: CheckContext, want: int | None) -> Iterator[Problem]:
    """An MLA latent projection (its output split off a ``qk_rope_head_dim``-wide key, by the
    recorded wiring) beside split heads, without mla_kv_a_proj."""
    flow = flow_of(ctx)
    if isinstance(flow, str) or want is None or ctx.resolved is None:
        return
    reported: set[str] = set()
    for name, widths in flow.splits:
        rule = ctx.rule_for(name)
        styled = rule is not None and canonical_style(rule.style.name).name == "mla_kv_a_proj"
        if styled or len(widths) != 2 or widths[-1] != want or generalize(name) in reported:
            continue
        if not _heads_split_beside(ctx, name):
            continue
        reported.add(generalize(name))
        loc = rule.loc if rule is not None else ctx.first_rule_loc(".self_attn.q_b_proj", ".self_attn.kv_b_proj")
        yield Problem(
            rule="mla-shared-key",
            loc=loc,
            message=f"{generalize(name)} ({rule.style.describe() if rule else 'left whole'}) makes MLA's latent and "
            f"its rotary key ({want} wide), which every head shares; with the heads split over tp each rank's "
            "gradient of it holds its own heads alone, so the tp replicas drift apart",
            fix=f"write '{generalize(name)}: {{style: mla_kv_a_proj, rope_dim: {want}}}'",
            suggestion={generalize(name): {"style": "mla_kv_a_proj", "rope_dim": want}},
        )


def _heads_split_beside(ctx: CheckContext, name: str) -> bool:
    parent = name.rpartition(".")[0]
    for other, _module, _rule, lay in ctx.assigned():
        beside = other.rpartition(".")[0] == parent and lay.weight is not None
        if beside and isinstance(lay.output, Shard) and lay.output.dim != 1:
            return True
    return False


def check(ctx: CheckContext) -> Iterator[Problem]:
    want = getattr(text_config(ctx.config), "qk_rope_head_dim", None)
    yield from _unshared_keys(ctx, want)
    reported: set[str] = set()
    for name, _module, rule, _ in ctx.assigned():
        if canonical_style(rule.style.name).name != "mla_kv_a_proj" or rule.pattern in reported:
            continue
        given = rule.style.overrides.get("rope_dim")
        if given == want and want is not None:
            continue
        reported.add(rule.pattern)
        if want is None:
            yield Problem(
                loc=rule.loc,
                rule="mla-rope-dim",
                message=f"{name}: mla_kv_a_proj on a model whose config has no qk_rope_head_dim "
                "(not multi-head latent attention)",
                fix="use 'replicate' or the projection's own colwise/rowwise style",
            )
            continue
        found = "no rope_dim" if given is None else f"rope_dim {given}"
        yield Problem(
            loc=rule.loc,
            rule="mla-rope-dim",
            message=f"{name}: mla_kv_a_proj with {found}, but the config's qk_rope_head_dim is {want}",
            fix=f"write '{{style: mla_kv_a_proj, rope_dim: {want}}}'",
        )
