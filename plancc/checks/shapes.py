"""shape-divisible: every dimension a style shards must be divisible by tp.

Vocab dimensions (embedding rows, lm_head rows) may split unevenly: DTensor and the logprob
evaluator handle uneven shards, at the cost of padding one rank's shard; that is a warning.
Any other uneven split (FFN width, hidden size) is an error: HF reshapes assume equal shards.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..compiler.plain_placements import Shard
from ..compiler.styles import ModuleKind
from ..errors import Severity
from .context import CheckContext, Problem, kind_of
from .example import Example

ID = "shape-divisible"


EXAMPLES = (
    Example(verdict="PASS", text="qwen3-8b at --tp 8 (intermediate 12288, vocab 151936)", args={"tp": 8}),
    Example(
        verdict="FAIL",
        text="a Qwen3 config with intermediate_size 11000 at --tp 16 (gate/up/down_proj)",
        config={"intermediate_size": 11000},
        args={"tp": 16},
    ),
    Example(
        verdict="WARN",
        text="a vocab of 255 at --tp 2 (shards of 128 and 127)",
        model="tiny-qwen3",
        config={"vocab_size": 255},
        args={"tp": 2},
    ),
)


def _divisors_up_to(n: int, limit: int = 64) -> list[int]:
    return [t for t in range(1, min(n, limit) + 1) if n % t == 0]


def check(ctx: CheckContext) -> Iterator[Problem]:
    tp = ctx.tp
    if tp == 1:
        return
    reported: set[str] = set()  # one diagnostic per rule, not one per repeated layer
    for name, module, rule, lay in ctx.assigned():
        if rule.pattern in reported:
            continue
        kind = kind_of(module)
        placement = lay.weight.get(kind) if lay.weight is not None else None
        weight = getattr(module, "weight", None)
        if kind is ModuleKind.EXPERTS:  # fused experts: 3-D weights, the experts on dim 0
            weight = next((p for p in module.parameters(recurse=False) if p.dim() == 3), None)
        if not isinstance(placement, Shard) or weight is None:
            continue
        dim = placement.dim
        size = weight.shape[dim]
        if size % tp == 0:
            continue
        if kind is ModuleKind.EXPERTS:
            if ctx.layout.ep > 1:
                continue  # expert-parallel reports experts over ep*tp ranks
            reported.add(rule.pattern)
            yield Problem(
                loc=rule.loc,
                message=f"{name}: {size} experts do not split over tp={tp} (moe_experts gives each rank whole experts)",
                fix=f"use tp in {{{', '.join(map(str, _divisors_up_to(size)))}}}, or keep the experts whole "
                "('replicate')",
            )
            continue
        vocab = (kind is ModuleKind.EMBEDDING and dim == 0) or (
            kind is ModuleKind.LINEAR and dim == 0 and name.endswith("lm_head")
        )
        per_rank = -(-size // tp)
        reported.add(rule.pattern)
        if vocab:
            yield Problem(
                severity=Severity.WARNING,
                loc=rule.loc,
                message=f"{name}: vocab dim {size} splits unevenly over tp={tp} "
                f"(shards of {per_rank} and {size - per_rank * (tp - 1)}); the last rank idles on padding",
                fix=f"pad the vocab to a multiple of {tp} for even shards",
            )
        else:
            yield Problem(
                loc=rule.loc,
                message=f"{name}: dim {dim} of weight {tuple(weight.shape)} is {size}, not divisible by tp={tp}",
                fix=f"use tp in {{{', '.join(map(str, _divisors_up_to(size)))}}}, or keep this module whole",
            )
