"""``plancc validate``: load a plan, bind it to a model config, run every check, summarize.

All problems found are reported together; nothing here needs a process group or weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from .checks import check_plan
from .errors import Diagnostic, PlanError
from .models import ModelSpecError, architecture_of, build_meta_model, default_preset, load_config
from .plan import Plan, load_plan
from .resolve import ResolvedPlan, resolve_plan


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationReport:
    plan: Plan
    model_name: str
    tp: int
    sequence_parallel: bool
    diagnostics: list[Diagnostic]
    resolved: tuple[ResolvedPlan, ...] = field(default_factory=tuple)

    @property
    def has_errors(self) -> bool:
        return any(d.is_error for d in self.diagnostics)

    def rule_rows(self) -> list[dict]:
        rows = []
        for resolved in self.resolved:
            for r in resolved.rules:
                if r.rule.section == "sequence_parallel" or not resolved.sequence_parallel:
                    rows.append({
                        "section": r.rule.section,
                        "pattern": r.rule.pattern,
                        "style": r.rule.style.describe(),
                        "matched": len(r.modules),
                        "line": r.rule.loc.line,
                    })
        return rows

    def summary(self) -> dict:
        errors = sum(d.is_error for d in self.diagnostics)
        return {
            "plan": self.plan.name,
            "path": self.plan.path,
            "model": self.model_name,
            "tp": self.tp,
            "sequence_parallel": self.sequence_parallel,
            "rules": self.rule_rows(),
            "fsdp_units": len(self.resolved[0].fsdp_units) if self.resolved else 0,
            "fsdp_reshard_after_forward": self.plan.fsdp_reshard_after_forward,
            "activation_checkpointing": len(self.resolved[0].activation_checkpointing) if self.resolved else 0,
            "selective_checkpointing": len(self.resolved[0].checkpoint_saves) if self.resolved else 0,
            "errors": errors,
            "warnings": len(self.diagnostics) - errors,
        }

    def render(self) -> str:
        s = self.summary()
        lines = [f"plan {s['plan']} ({s['path']}) on {s['model']}, tp={s['tp']}"
                 + (" +sp" if s["sequence_parallel"] else "")]
        rows = s["rules"]
        if rows:
            w_pat = max(len(r["pattern"]) for r in rows)
            w_sty = max(len(r["style"]) for r in rows)
            section = None
            for r in rows:
                if r["section"] != section:
                    section = r["section"]
                    lines.append(f"  {section}:")
                lines.append(f"    {r['pattern']:<{w_pat}}  {r['style']:<{w_sty}}  {r['matched']:>4} modules")
        kept = "" if s["fsdp_reshard_after_forward"] else " (kept gathered from forward to backward)"
        selective = f" ({s['selective_checkpointing']} selective)" if s["selective_checkpointing"] else ""
        lines.append(f"  fsdp units: {s['fsdp_units']}{kept}   "
                     f"activation checkpointing: {s['activation_checkpointing']}{selective}")
        verdict = "FAILED" if s["errors"] else "ok"
        lines.append(f"{verdict}: {s['errors']} error(s), {s['warnings']} warning(s)")
        return "\n".join(lines)


def resolve_both(plan: Plan, model: nn.Module) -> tuple[list[ResolvedPlan], list[Diagnostic]]:
    """Resolve the TP section and, when present, TP+SP overlay; collect every problem."""
    resolved, problems = [], []
    for sp in (False, True) if plan.sequence_parallel else (False,):
        try:
            resolved.append(resolve_plan(plan, model, sequence_parallel=sp))
        except PlanError as exc:
            for d in exc.diagnostics:
                if d not in problems:
                    problems.append(d)
    return resolved, problems


def validate_plan(
    plan_path: str | Path,
    *,
    model=None,
    tp: int = 1,
    cp: int = 1,
    dp: int | None = None,
    world_size: int | None = None,
    sequence_parallel: bool = False,
    seq_len: int | None = None,
) -> ValidationReport:
    """Everything ``plancc validate`` reports. Raises ``PlanError`` when the plan file itself
    cannot be read or is not a valid plan, ``ModelSpecError`` when --model names nothing."""
    plan = load_plan(plan_path)
    if model is None:
        model = default_preset(plan.architectures)
        if model is None:
            raise ModelSpecError([Diagnostic(
                rule="unknown-model", loc=plan.loc,
                message=f"no built-in preset for {', '.join(plan.architectures)}",
                fix="pass --model with a Hugging Face model folder or config.json",
            )])
    config = load_config(model)
    meta = build_meta_model(config)
    resolved, problems = resolve_both(plan, meta)
    problems += check_plan(plan, meta, tp=tp, cp=cp, dp=dp, world_size=world_size,
                           sequence_parallel=sequence_parallel, seq_len=seq_len, resolved=resolved)
    problems.sort(key=lambda d: (not d.is_error, d.path, d.line, d.column))
    name = model if isinstance(model, str) else architecture_of(config)
    return ValidationReport(plan=plan, model_name=str(name), tp=tp, sequence_parallel=sequence_parallel,
                            diagnostics=problems, resolved=tuple(resolved))
