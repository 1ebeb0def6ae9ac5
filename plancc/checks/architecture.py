"""architecture-mismatch: the model's architecture must be one the plan serves.

PASS  plans/qwen3.yaml (architectures: [Qwen3ForCausalLM, Qwen2ForCausalLM]) on qwen3-8b
FAIL  plans/qwen3.yaml on llama-3.1-8b (LlamaForCausalLM)
"""

from __future__ import annotations

from typing import Iterator

from ..errors import Diagnostic
from .context import CheckContext

ID = "architecture-mismatch"


def check(ctx: CheckContext) -> Iterator[Diagnostic]:
    arch = type(ctx.model).__name__
    if arch not in ctx.plan.architectures:
        yield Diagnostic(
            rule=ID,
            loc=ctx.plan.loc,
            message=f"model architecture {arch} is not served by plan {ctx.plan.name!r}; "
            f"it serves: {', '.join(ctx.plan.architectures)}",
            fix=f"use a plan for {arch}, or add it to 'architectures' once the plan fits it",
        )
