"""Runs every rule over one context and stamps each problem with its rule id, as yamllint's
linter does: a rule module only says what it found and where."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from ..compiler.plan import Plan
from ..compiler.resolve import ResolvedPlan, resolve_sections
from ..errors import Diagnostic
from ..layout import Layout
from ..models import build_meta_model
from . import (
    architecture,
    checkpointing,
    compiled_blocks,
    context_parallel,
    expert_parallel,
    flow_memo,
    fsdp_units,
    heads,
    latent_attention,
    lora_targets,
    mesh_sizes,
    module_kinds,
    packed_projections,
    pairing,
    per_head_outputs,
    pipeline,
    sequence_length,
    sequence_parallel,
    shapes,
    sharded_params,
    sharded_reads,
    tied_embeddings,
)
from .context import CheckContext
from .layout_memo import LayoutMemo

RULES: tuple[ModuleType, ...] = (
    mesh_sizes,
    architecture,
    heads,
    shapes,
    tied_embeddings,
    module_kinds,
    pairing,
    sharded_reads,
    packed_projections,
    per_head_outputs,
    sharded_params,
    latent_attention,
    expert_parallel,
    sequence_parallel,
    context_parallel,
    sequence_length,
    fsdp_units,
    checkpointing,
    lora_targets,
    pipeline,
    compiled_blocks,
)

if TYPE_CHECKING:  # transformers' modeling stack is not imported to check a plan
    from transformers import PretrainedConfig


def rule_ids(rule: ModuleType) -> tuple[str, ...]:
    """The ids a rule module reports under: its ``ID``, or its ``IDS`` when it owns several."""
    return tuple(getattr(rule, "IDS", None) or (rule.ID,))


def run_rules(
    ctx: CheckContext, rules: Iterable[ModuleType] = RULES, memo: LayoutMemo | None = None
) -> Iterator[Diagnostic]:
    """Every rule's problems at ``ctx``; with a ``memo``, a rule's answer at an earlier layout of
    the same values it reads is reused (``checks.layout_memo``)."""
    for rule in rules:
        ids = rule_ids(rule)
        for problem in memo.problems(rule, ctx) if memo is not None else rule.check(ctx):
            rule_id = problem.rule or ids[0]
            assert rule_id in ids, f"{rule.__name__} reported {rule_id!r}, not one of its ids {ids}"
            yield Diagnostic(
                rule=rule_id,
                loc=problem.loc,
                message=problem.message,
                fix=problem.fix,
                severity=problem.severity,
                suggestion=problem.suggestion,
            )


def _config_of(model: nn.Module) -> PretrainedConfig:
    config: Any = model.config  # every Hugging Face model carries its config
    return config


def check_plan(
    plan: Plan,
    model_or_config: Any,
    layout: Layout | None = None,
    *,
    seq_len: int | None = None,
    resolved: Iterable[ResolvedPlan] | None = None,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dp: int | None = None,
    world_size: int | None = None,
    sequence_parallel: bool = False,
    pp: int = 1,
    dp_replicate: int = 1,
) -> list[Diagnostic]:
    """Every problem of ``plan`` on this model at ``layout``, errors and warnings.

    Glob problems (``glob-no-match``, ``rule-conflict``) come from resolving and are included;
    rules whose globs failed are not checked further. Without a ``layout``, the sizes (``tp``,
    ``cp``, ``ep``, ``dp``, ``world_size``, ``sequence_parallel``: plancc 0.1's keywords) build
    one; sizes that do not fit are a ``mesh-sizes`` problem and the other rules still run.
    """
    layout, layout_problems = layout_for(
        plan,
        layout,
        world_size=world_size,
        dp=dp,
        cp=cp,
        tp=tp,
        ep=ep,
        sequence_parallel=sequence_parallel,
        pp=pp,
        dp_replicate=dp_replicate,
    )
    return check_at(plan, model_or_config, layout, layout_problems, seq_len=seq_len, resolved=resolved)


def layout_for(plan: Plan, layout: Layout | None, **sizes: Any) -> tuple[Layout, list[Diagnostic]]:
    """``layout``, or the one the sizes (``Layout.diagnose``'s keywords) build, with why they did
    not fit as diagnostics at the plan (``mesh-sizes``): the other rules still run on it."""
    if layout is not None:
        return layout, []
    return Layout.diagnose(loc=plan.loc, **sizes)


def check_at(
    plan: Plan,
    model_or_config: Any,
    layout: Layout,
    layout_problems: Iterable[Diagnostic] = (),
    *,
    seq_len: int | None = None,
    resolved: Iterable[ResolvedPlan] | None = None,
    memo: LayoutMemo | None = None,
) -> list[Diagnostic]:
    """``check_plan`` at a layout already diagnosed (``validate_plan`` diagnoses it once and
    reports both the layout and why the sizes did not fit). ``memo``: one per plan, model and
    ``seq_len``, shared by the checks of many layouts (``plancc suggest``)."""
    problems: list[Diagnostic] = []
    built = not isinstance(model_or_config, nn.Module)
    model = build_meta_model(model_or_config) if built else model_or_config
    if built:
        flow_memo.attach(model, model_or_config)
    if resolved is None:
        resolved, problems = resolve_sections(plan, model)
    by_sp = {r.sequence_parallel: r for r in resolved}
    ctx = CheckContext(
        plan=plan,
        model=model,
        config=_config_of(model),
        layout=layout,
        seq_len=seq_len,
        resolved=by_sp.get(layout.sequence_parallel) or by_sp.get(False),
        layout_problems=tuple(layout_problems),
    )
    problems += run_rules(ctx, memo=memo)
    if built:
        flow_memo.keep(model, model_or_config)
    return problems
