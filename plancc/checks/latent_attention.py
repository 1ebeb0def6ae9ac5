"""mla-rope-dim: ``mla_kv_a_proj`` must name the width of the rotary key it splits off.

The projection's output is the latent followed by one rotary key shared by every head; the
style sums the gradient of that key over tp. Its width is the config's ``qk_rope_head_dim``:
a different ``rope_dim`` would sum part of the latent (or miss part of the key) and train wrong
without an error.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.styles import canonical_style
from .context import CheckContext, Problem, text_config
from .example import Example

ID = "mla-rope-dim"

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
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    want = getattr(text_config(ctx.config), "qk_rope_head_dim", None)
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
                message=f"{name}: mla_kv_a_proj on a model whose config has no qk_rope_head_dim "
                "(not multi-head latent attention)",
                fix="use 'replicate' or the projection's own colwise/rowwise style",
            )
            continue
        found = "no rope_dim" if given is None else f"rope_dim {given}"
        yield Problem(
            loc=rule.loc,
            message=f"{name}: mla_kv_a_proj with {found}, but the config's qk_rope_head_dim is {want}",
            fix=f"write '{{style: mla_kv_a_proj, rope_dim: {want}}}'",
        )
