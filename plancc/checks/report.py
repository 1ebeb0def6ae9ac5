"""``plancc validate``: load a plan, bind it to a model config, run every check, summarize.

All problems found are reported together; nothing here needs a process group or weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..compiler.globs import ModuleTree
from ..compiler.plan import PartialPlan, PipelineSpec, Plan, load_plan_partially
from ..compiler.resolve import ResolvedPlan, outside_users, resolve_sections
from ..errors import Diagnostic
from ..layout import Layout
from ..models import ModelSpecError, architecture_of, build_meta_model, default_preset, load_config
from ..skeleton import load_skeleton
from .rule_runner import check_at, layout_for

ROOT_SHOWN = '"" (the model)'


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationReport:
    plan: Plan
    model_name: str
    layout: Layout
    diagnostics: tuple[Diagnostic, ...]
    resolved: tuple[ResolvedPlan, ...] = ()
    meta_model: nn.Module | None = None  # the model the plan was checked on (meta device)
    config: Any = None  # its PretrainedConfig, as read from --model

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    def resolved_for(self, sequence_parallel: bool) -> ResolvedPlan | None:
        return next((r for r in self.resolved if r.sequence_parallel == sequence_parallel), None)

    @property
    def has_errors(self) -> bool:
        return any(d.is_error for d in self.diagnostics)

    def rule_rows(self) -> list[dict[str, Any]]:
        rows = []
        for resolved in self.resolved:
            for r in resolved.rules:
                if r.rule.section == "sequence_parallel" or not resolved.sequence_parallel:
                    rows.append(
                        {
                            "section": r.rule.section,
                            "pattern": r.rule.pattern,
                            "style": r.rule.style.describe(),
                            "matched": len(r.modules),
                            "line": r.rule.loc.line,
                        }
                    )
        return rows

    def _units_left_to_root(self) -> int:
        """Units the runtime leaves to the root: a module outside them uses one of their
        weights (tied embeddings; ``fsdp-units`` explains)."""
        if not self.resolved or self.meta_model is None:
            return 0
        return len(outside_users(self.meta_model, self.resolved[0].fsdp_units))

    def summary(self) -> dict[str, Any]:
        errors = sum(d.is_error for d in self.diagnostics)
        left = self._units_left_to_root()
        return {
            "plan": self.plan.name,
            "path": self.plan.path,
            "model": self.model_name,
            "tp": self.tp,
            "ep": self.layout.ep,
            "pp": self.layout.pp,
            "sequence_parallel": self.sequence_parallel,
            "rules": self.rule_rows(),
            "pipeline": None if self.plan.pipeline is None else _pipeline_summary(self.plan.pipeline),
            # None when the globs could not be bound (a typo): a count of 0 would read as "no units"
            "fsdp_units": len(self.resolved[0].fsdp_units) - left if self.resolved else None,
            "fsdp_units_left_to_root": left,
            "fsdp_reshard_after_forward": self.plan.fsdp_reshard_after_forward,
            "activation_checkpointing": len(self.resolved[0].activation_checkpointing) if self.resolved else None,
            "selective_checkpointing": len(self.resolved[0].checkpoint_saves) if self.resolved else None,
            "errors": errors,
            "warnings": len(self.diagnostics) - errors,
        }

    def render(self) -> str:
        s = self.summary()
        lines = [
            f"plan {s['plan']} ({s['path']}) on {s['model']}, tp={s['tp']}"
            + (f" ep={s['ep']}" if s["ep"] > 1 else "")
            + (f" pp={s['pp']}" if s["pp"] > 1 else "")
            + (" +sp" if s["sequence_parallel"] else "")
        ]
        rows = s["rules"]
        if rows:
            w_pat = max(len(r["pattern"] or ROOT_SHOWN) for r in rows)
            w_sty = max(len(r["style"]) for r in rows)
            section = None
            for r in rows:
                if r["section"] != section:
                    section = r["section"]
                    lines.append(f"  {section}:")
                plural = "" if r["matched"] == 1 else "s"
                pattern = r["pattern"] or ROOT_SHOWN  # torch's key for the model itself
                lines.append(f"    {pattern:<{w_pat}}  {r['style']:<{w_sty}}  {r['matched']:>4} module{plural}")
        kept = "" if s["fsdp_reshard_after_forward"] else " (kept gathered from forward to backward)"
        selective = f" ({s['selective_checkpointing']} selective)" if s["selective_checkpointing"] else ""
        if s["fsdp_units"] is None:
            lines.append("  fsdp units, activation checkpointing: not resolved (the plan's globs have errors)")
        else:
            tied = (
                f" (+{s['fsdp_units_left_to_root']} left to the root: a tied weight)"
                if s["fsdp_units_left_to_root"]
                else ""
            )
            lines.append(
                f"  fsdp units: {s['fsdp_units']}{tied}{kept}   "
                f"activation checkpointing: {s['activation_checkpointing']}{selective}"
            )
        verdict = "FAILED" if s["errors"] else "ok"
        lines.append(f"{verdict}: {s['errors']} error(s), {s['warnings']} warning(s)")
        return "\n".join(lines)


def _model_or_default(plan: Plan, model: Any) -> Any:
    if model is not None:
        return model
    preset = default_preset(plan.architectures)
    if preset is None:
        raise ModelSpecError(
            [
                Diagnostic(
                    rule="unknown-model",
                    loc=plan.loc,
                    message=f"no built-in preset for {', '.join(plan.architectures)}",
                    fix="pass --model with a Hugging Face model folder or config.json",
                )
            ]
        )
    return preset


def validate_plan(
    plan_path: str | Path | Plan,
    *,
    model: Any = None,
    layout: Layout | None = None,
    world_size: int | None = None,
    dp: int | None = None,
    cp: int = 1,
    tp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    skeleton: bool = True,
    pp: int = 1,
    dp_replicate: int = 1,
) -> ValidationReport:
    """Everything ``plancc validate`` reports: schema, globs and every model-aware check at
    ``layout`` (or at the sizes given). Raises ``PlanError`` when the plan file itself cannot
    be read or is not a valid plan, ``ModelSpecError`` when ``model`` names nothing.

    A built-in preset is checked on its shipped skeleton (``plancc.skeleton``: the same tree,
    shapes and config, without importing transformers' modeling code) unless ``skeleton`` is
    false; the report's model and config are then that skeleton's, which cannot run."""
    if isinstance(plan_path, Plan):
        partial = PartialPlan(plan=plan_path, problems=(), left_out=())
    else:  # the schema's refusals inside rules leave those rules out; the rest is checked
        partial = load_plan_partially(plan_path)
    plan = partial.plan
    model = _model_or_default(plan, model)
    loaded = load_skeleton(model) if skeleton and isinstance(model, str) else None
    config: Any  # a transformers PretrainedConfig, or a skeleton's stand-in for one
    if loaded is not None:
        config, meta = loaded
    else:
        config = load_config(model)
        meta = build_meta_model(config)
    resolved, problems = resolve_sections(plan, meta)
    # diagnosed here, once: the report shows this layout and why the sizes did not fit
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
    problems += check_at(plan, meta, layout, layout_problems, seq_len=seq_len, resolved=resolved)
    problems = [*partial.problems, *independent_of(problems, _unbound_globs(plan, meta, partial.left_out))]
    problems.sort(key=lambda d: (not d.is_error, d.path, d.line, d.column))
    name = model if isinstance(model, str) else architecture_of(config)
    return ValidationReport(
        plan=plan,
        model_name=str(name),
        layout=layout,
        diagnostics=tuple(problems),
        resolved=tuple(resolved),
        meta_model=meta,
        config=config,
    )


# what is found once the plan is bound to the model: a rule refused before (a typo in its style
# or its glob) may be the cause, not a problem of its own
_DOWNSTREAM = frozenset({"glob-no-match", "rule-conflict", "mesh-sizes", "architecture-mismatch"})


def _unbound_globs(plan: Plan, meta: nn.Module, left_out: tuple[tuple[str, str], ...]) -> set[str]:
    """The globs of the rules that did not reach the model: left out by the schema, or matching
    nothing (then the glob they were meant to be, where one is close)."""
    tree = ModuleTree.of(meta)
    found = {glob for _, glob in left_out}
    for rule in (*plan.tensor_parallel, *plan.sequence_parallel):
        if not rule.optional and not tree.match(rule.pattern):
            found.update(tree.suggest(rule.pattern)[:1])
    return found


def independent_of(problems: list[Diagnostic], unbound: set[str]) -> list[Diagnostic]:
    """The problems that do not name a module of a rule that never reached the model: those
    are what its absence caused, and go once the rule is mended (reported: the rule itself)."""
    if not unbound:
        return problems
    return [
        d for d in problems if d.rule in _DOWNSTREAM or not any(glob in (d.message + (d.fix or "")) for glob in unbound)
    ]


def _pipeline_summary(spec: PipelineSpec) -> dict[str, Any]:
    return {
        "schedule": spec.schedule,
        "microbatches": spec.microbatches,
        "virtual_stages_per_rank": spec.virtual_stages_per_rank,
        "layers_per_stage": spec.layers_per_stage,
        "stages": [list(globs) for globs in spec.stages],
    }
