"""architecture-mismatch: the model's architecture must be one the plan serves."""

from __future__ import annotations

from collections.abc import Iterator

from .context import CheckContext, Problem
from .example import Example

ID = "architecture-mismatch"


EXAMPLES = (
    Example(verdict="PASS", text="plans/qwen3.yaml (architectures: [Qwen3ForCausalLM, Qwen2ForCausalLM]) on qwen3-8b"),
    Example(verdict="FAIL", text="plans/qwen3.yaml on llama-3.1-8b (LlamaForCausalLM)", model="llama-3.1-8b"),
)


def check(ctx: CheckContext) -> Iterator[Problem]:
    arch = type(ctx.model).__name__
    if arch not in ctx.plan.architectures:
        yield Problem(
            loc=ctx.plan.loc,
            message=f"model architecture {arch} is not served by plan {ctx.plan.name!r}; "
            f"it serves: {', '.join(ctx.plan.architectures)}",
            fix=f"use a plan for {arch}, or add it to 'architectures' once the plan fits it",
        )
