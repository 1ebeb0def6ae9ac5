"""``plancc import-hf``: a plan from a model class's own Hugging Face TP plan.

transformers models carry ``base_model_tp_plan`` (config) and ``_tp_plan`` (class) as
``{glob: style name}``; the merged plan of a built model is ``model._tp_plan``. Their style
names map onto plancc's where the meaning is the same; a name with no plancc equivalent is
an ``unsupported-style`` error naming it, not a silently dropped rule.

Two things the HF plan gets wrong for a given config are corrected: rules that match no module
of it (a class's plan covers every variant: MoE rules on a dense config) are left out, and a
module with parameters that reads a tp-sharded activation without an HF style (Apertus'
xIELU activation) gets ``replicated_with_grad_allreduce``, as ``sharded-region-params`` asks.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from torch import nn

from ..checks import check_plan
from ..checks.context import text_config
from ..compiler.globs import generalize, glob_matches
from ..compiler.kinds import is_experts_module
from ..compiler.plan import parse_plan
from ..compiler.styles import ALIASES, HF_UNSUPPORTED, STYLES
from ..errors import Diagnostic, PlanError, SourceLoc
from ..models import architecture_of, build_meta_model, load_config

# HF style name -> plancc style (same layouts; see `plancc styles`)
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_rep",
    "colwise_gather_output": "colwise_rep",
    "rowwise_rep": "rowwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "embedding_rowwise": "embedding_rowwise",
    "replicated_with_grad_allreduce": "qk_norm",
    "sequence_parallel": "sequence_parallel",
    "replicate": "replicate",
    # HF splits each expert's intermediate dim (its weights' own rules: packed_colwise,
    # rowwise); plancc spreads whole experts over tp, one rule on the experts module
    "moe_tp_experts": "moe_experts",
    "mla_kv_a_proj": "mla_kv_a_proj",
    # a fused projection split per block (HF's _StridedShard with split_factor 2): the same
    # arithmetic, the weight kept in the plain layout (plancc.runtime.styles.packed)
    "packed_colwise": "packed_colwise",
    "packed_rowwise": "packed_rowwise",
    # an attention block's own per-head parameters (sinks), sharded with its heads; HF adds a
    # rule for each such parameter (``self_attn.sinks: colwise``), which the style covers
    "local_params": "per_head_params",
}
# HF styles whose module's own parameters HF also names one by one; plancc's style covers them
_OWNS_ITS_PARAMETERS = ("moe_tp_experts", "local_params")


def _fsdp_units(model: nn.Module) -> list[str]:
    """The FSDP units, as the shipped plans have them: the input embedding on its own (its
    weight is freed while the decoder runs; on a tied model plancc leaves it to the root),
    then the modules HF says must not be split (decoder layers)."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_input_embeddings() if callable(get_input_embeddings) else None
    shapes = []
    for name, module in model.named_modules():
        if name and (module is embedding or type(module).__name__ in classes):
            glob = generalize(name)
            if glob not in shapes:
                shapes.append(glob)
    return shapes


def import_hf(model_spec: str) -> str:
    """YAML text of a plancc plan equivalent to the model's HF TP plan."""
    config = load_config(model_spec)
    model = build_meta_model(config)
    hf_plan = dict(getattr(model, "_tp_plan", None) or {})
    if not hf_plan:
        raise PlanError(
            [
                Diagnostic(
                    rule="import-hf",
                    loc=SourceLoc(path=model_spec),
                    message=f"{type(model).__name__} has no Hugging Face TP plan",
                    fix="write a plan by hand; start from plans/llama.yaml",
                )
            ]
        )
    # HF globs name modules or, for fused expert weights, parameters
    modules = dict(model.named_modules())
    parameters = [n for n, _ in model.named_parameters()]
    names = [*modules, *parameters]
    hf_plan = {glob: style for glob, style in hf_plan.items() if any(glob_matches(glob, n) for n in names)}
    experts = [glob for glob, style in hf_plan.items() if style == "moe_tp_experts"]
    owners = [glob for glob, style in hf_plan.items() if style in _OWNS_ITS_PARAMETERS]

    def weight_rule(glob: str) -> bool:  # HF's rules for the experts' own weights (packed_colwise, ...)
        under = glob.startswith(tuple(f"{e}." for e in owners))
        return (
            under and not any(glob_matches(glob, n) for n in modules) and any(glob_matches(glob, n) for n in parameters)
        )

    odd = sorted(
        {
            type(module).__name__
            for glob in experts
            for name, module in modules.items()
            if glob_matches(glob, name) and not is_experts_module(module)
        }
    )
    if odd:
        raise PlanError(
            [
                Diagnostic(
                    rule="unsupported-style",
                    loc=SourceLoc(path=model_spec),
                    message=f"HF style moe_tp_experts on {', '.join(odd)}: not transformers' routed experts "
                    "(called with hidden_states, top_k_index, top_k_weights; every weight with one leading "
                    "experts dim), which is what plancc's moe_experts splits",
                    fix="keep those experts whole ('replicate') and shard the rest by hand with `plancc styles`",
                )
            ]
        )
    hf_plan = {glob: style for glob, style in hf_plan.items() if not weight_rule(glob)}
    unknown = sorted({s for s in hf_plan.values() if s not in HF_STYLES})
    if unknown:
        raise PlanError(
            [
                Diagnostic(
                    rule="unsupported-style",
                    loc=SourceLoc(path=model_spec),
                    message="HF styles with no plancc equivalent: "
                    + "; ".join(f"{u} ({HF_UNSUPPORTED[u]})" if u in HF_UNSUPPORTED else u for u in unknown),
                    fix="write those rules by hand with `plancc styles`",
                )
            ]
        )
    tensor_parallel: dict[str, Any] = {glob: HF_STYLES[style] for glob, style in hf_plan.items()}
    rope = getattr(text_config(config), "qk_rope_head_dim", None)
    for glob, style in tensor_parallel.items():
        if style == "mla_kv_a_proj":  # the rotary key's width is the config's
            tensor_parallel[glob] = {"style": style, "rope_dim": rope}
    assert all(s in STYLES or s in ALIASES for s in map(str, HF_STYLES.values()))
    arch = architecture_of(config)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", arch.removesuffix("ForCausalLM").lower() or "imported")
    plan = {
        "plancc": 1,
        "name": name,
        "description": f"imported from the Hugging Face TP plan of {arch}",
        "architectures": [arch],
        "tensor_parallel": tensor_parallel,
    }
    units = _fsdp_units(model)
    if units:
        plan["fsdp"] = {"units": units}
    header = "# yaml-language-server: $schema=../schemas/plan.schema.json\n"
    text = header + yaml.safe_dump(plan, sort_keys=False, width=120)
    # HF's plans leave some parameters in tp-sharded regions (sharded-region-params) and some
    # per-head outputs all-reduced (per-head-output); the checks' fixes name the rule to write,
    # and one fix can uncover the next (a per-head output sharded: the parameter it meets). Then
    # the blocks whose projections share an input get it once (shared-input), as the shipped plans
    for _ in range(4):
        missing = _rules_the_checks_ask_for(text, model)
        if not missing:
            break
        tensor_parallel.update(missing)
        text = header + yaml.safe_dump(plan, sort_keys=False, width=120)
    return text


# errors whose fix is rules to write, and the one warning whose rule the shipped plans all follow
_FIXABLE = ("sharded-region-params", "per-head-output", "shared-input")


def _rules_the_checks_ask_for(text: str, model: nn.Module) -> dict[str, Any]:
    """glob -> style for what the plan gets wrong at tp=2 that a check suggests as rules to write
    (``Diagnostic.suggestion``); once nothing is wrong, what it sends more than once."""
    found = [d for d in check_plan(parse_plan(text, "<import-hf>"), model, tp=2) if d.rule in _FIXABLE and d.suggestion]
    wanted = [d for d in found if d.is_error] or found  # a block's correctness before its traffic
    return {glob: style for d in wanted for glob, style in (d.suggestion or {}).items()}
