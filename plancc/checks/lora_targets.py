"""lora-targets / lora-style: the modules a ``lora:`` section adapts must be able to carry
low-rank adapters at this layout.

An adapter is ``scale * B(A(x))`` added to an ``nn.Linear``'s output, laid out with the base
layer's style so that it is exact with no collective of its own: under ``colwise`` A stays
whole and B is sharded by output rows; under ``rowwise`` A is sharded by input columns and B
stays whole (its partial output reduced with the base's). A layer the plan leaves whole
(and every layer at tp = 1) gets plain adapters. Refused, each at its line:

- a target glob matching nothing, or a module that is not an ``nn.Linear`` (attention blocks,
  norms, embeddings, MoE experts' 3-D weights);
- the output embedding (the fused lm_head reads its weight, never its forward);
- a rank ``r`` above a layer's smaller dimension;
- a style other than ``colwise`` / ``rowwise`` (packed projections, per-head and latent
  attention styles) -- ``lora-style``, at the style's rule;
- ``dropout`` above 0 with tp > 1 (a replicated input would need one mask on every tp rank).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from ..compiler.adapted_modules import adapted_modules
from ..compiler.adapter_layouts import adapter_layout
from ..compiler.globs import generalize
from ..compiler.lora_spec import LoraSpec
from ..compiler.resolve import ResolvedPlan
from .context import CheckContext, Problem
from .example import Example

ID = "lora-targets"
IDS = ("lora-targets", "lora-style")

_LORA = {"r": 8, "alpha": 16, "targets": ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj"]}

EXAMPLES = (
    Example(
        verdict="PASS",
        text="qwen3-8b at tp 2, adapters on q_proj (colwise) and o_proj (rowwise)",
        edits=(("lora", None, _LORA),),
        args={"tp": 2},
    ),
    Example(
        verdict="FAIL",
        text="phi-3 at tp 2, adapters on the fused gate_up_proj (packed_colwise: per-block slices of B not supported)",
        plan="phi3.yaml",
        model="phi-3-mini-4k",
        edits=(("lora", None, {**_LORA, "targets": ["model.layers.*.mlp.gate_up_proj"]}),),
        args={"tp": 2},
    ),
    Example(
        verdict="FAIL",
        text="qwen3-8b at tp 2 with lora dropout 0.1 (one dropout mask would be needed on every tp rank)",
        edits=(("lora", None, {**_LORA, "dropout": 0.1}),),
        args={"tp": 2},
    ),
    Example(
        verdict="FAIL",
        text="qwen3-8b, adapters on lm_head (the fused lm_head reads its weight)",
        edits=(("lora", None, {**_LORA, "targets": ["lm_head"]}),),
    ),
    Example(
        verdict="FAIL",
        text="qwen3-8b, adapters on model.layers.*.self_attn (an attention block, not an nn.Linear)",
        edits=(("lora", None, {**_LORA, "targets": ["model.layers.*.self_attn"]}),),
    ),
)


def lora_problems(model: nn.Module, spec: LoraSpec, resolved: ResolvedPlan | None, tp: int) -> list[Problem]:
    """Every reason the spec's targets cannot carry adapters at ``tp`` (see the module doc),
    once per module shape (``model.layers.*.mlp.up_proj``), not once per layer."""
    names, found = adapted_modules(model, spec)
    problems: dict[tuple[str | None, str], Problem] = {
        (d.rule, d.message): Problem(loc=d.loc, message=d.message, fix=d.fix, rule=d.rule) for d in found
    }
    modules = dict(model.named_modules())
    embeddings = getattr(model, "get_output_embeddings", None)
    head = embeddings() if callable(embeddings) else None
    for full_name, loc in names.items():
        module, name = modules[full_name], generalize(full_name)
        if module is head:
            _add(
                problems,
                Problem(
                    loc=loc,
                    message=f"lora target {name!r} is the output embedding (the fused lm_head reads its "
                    "weight, not its forward); allowed: the decoder's linear layers",
                    fix="drop it from the targets",
                ),
            )
            continue
        if type(module) is not nn.Linear:
            _add(
                problems,
                Problem(
                    loc=loc,
                    message=f"lora target {name!r} is a {type(module).__name__}, not an nn.Linear with a 2-D "
                    "weight; allowed: nn.Linear modules (attention and MLP projections)",
                    fix="narrow the glob to the projections, e.g. 'model.layers.*.self_attn.q_proj'",
                ),
            )
            continue
        out_features, in_features = module.weight.shape  # a skeleton Linear keeps no *_features
        smaller = min(in_features, out_features)
        if spec.r > smaller:
            _add(
                problems,
                Problem(
                    loc=loc,
                    message=f"lora r={spec.r} exceeds {name!r}'s dims "
                    f"({in_features} -> {out_features}); allowed: r <= {smaller}",
                    fix=f"lower r to at most {smaller}",
                ),
            )
        layout = adapter_layout(full_name, resolved, tp)
        if layout is not None and layout not in ("colwise", "rowwise"):
            rule = resolved.assignments[full_name] if resolved is not None else None
            _add(
                problems,
                Problem(
                    rule="lora-style",
                    loc=rule.loc if rule is not None else loc,
                    message=f"lora target {name!r} has the style {layout!r}, which cannot carry adapters; "
                    "allowed: 'colwise' and 'rowwise' (and layers the plan leaves whole)",
                    fix="drop the module from the lora targets",
                ),
            )
        elif layout is not None and spec.dropout:
            _add(
                problems,
                Problem(
                    loc=loc,
                    message=f"lora dropout {spec.dropout} with tensor parallelism (tp={tp}); allowed: dropout 0 "
                    "when tp > 1 (a replicated input would need one mask on every tp rank)",
                    fix="set dropout: 0",
                ),
            )
    return list(problems.values())


def _add(problems: dict[tuple[str | None, str], Problem], problem: Problem) -> None:
    problems.setdefault((problem.rule, problem.message), problem)


def check(ctx: CheckContext) -> Iterator[Problem]:
    if ctx.plan.lora is None:
        return
    yield from lora_problems(ctx.model, ctx.plan.lora, ctx.resolved, ctx.tp)
