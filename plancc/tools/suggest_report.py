"""``plancc suggest``'s answer as people and tools read it: the table, the JSON, the ``plancc
apply`` line and plan edits of a layout, and why none fits."""

from __future__ import annotations

from typing import Any

from ..compiler.plan import Plan
from ..errors import Diagnostic
from .suggest_costs import Candidate, Suggestion
from .suggest_model import GiB
from .suggest_run import command_line, plan_edits

__all__ = ["as_dict", "command_line", "no_fit_problem", "plan_edits", "render"]


def no_fit_problem(suggestion: Suggestion, plan: Plan) -> Diagnostic | None:
    """An error when no legal layout fits the memory: the smallest, and what dominates it."""
    if suggestion.best is not None:
        return None
    smallest = min(suggestion.candidates, key=lambda c: c.memory.total)
    return Diagnostic(
        rule="suggest-no-fit",
        loc=plan.loc,
        message=f"no layout of {suggestion.gpus} GPUs fits {_usable(suggestion)} a GPU: the "
        f"smallest, {smallest.describe()}, needs {smallest.memory.total / GiB:.1f} GiB, most of it "
        f"{smallest.memory.largest()}",
        fix="more GPUs, a shorter --seq-len (one sequence a pass is the smallest microbatch costed), or "
        "activation checkpointing on every layer",
    )


_moment = {
    "forward": "the end of forward",
    "backward start": "the start of backward",
    "backward end": "the end of backward",
    "optimizer step": "AdamW's step",
}


def as_dict(suggestion: Suggestion, plan_path: str, model: str) -> dict[str, Any]:
    def row(c: Candidate) -> dict[str, Any]:
        return {
            "layout": c.layout.to_json(),
            "activation_checkpointing": c.checkpointing,
            "reshard_after_forward": c.reshard_after_forward,
            "micro_batch_size": c.micro_batch_size,
            "microbatches": c.microbatches,
            "schedule": c.schedule or None,
            "virtual_stages_per_rank": c.virtual_stages,
            "fits": c.fits,
            "memory_bytes": {
                "parameters": c.memory.parameters,
                "gradients": c.memory.gradients,
                "optimizer": c.memory.optimizer,
                "fsdp_buffers": c.memory.fsdp_buffers,
                "activations": c.memory.activations,
                "logits": c.memory.logits,
                "total": c.memory.total,
                "peak_at": c.memory.at,
            },
            "step_seconds": {
                "compute": c.time.compute,
                "tp": c.time.tp,
                "cp": c.time.cp,
                "ep": c.time.ep,
                "fsdp_exposed": c.time.fsdp,
                "pipeline": c.time.pipeline,
                "total": c.time.total,
            },
            "tokens_per_s": c.tokens_per_s,
            "mfu": c.mfu,
        }

    best = suggestion.best
    return {
        "hardware": suggestion.hardware.name,
        "gpus": suggestion.gpus,
        "gpus_per_node": suggestion.gpus_per_node,
        "gpu_memory_bytes": suggestion.gpu_memory,
        "headroom": suggestion.headroom,
        "usable_memory_bytes": suggestion.usable_memory,
        "seq_len": suggestion.seq_len,
        "tokens_per_step": suggestion.tokens_per_step,
        "best": row(best) if best else None,
        "command": command_line(plan_path, model, suggestion, best) if best else None,
        "plan_edits": plan_edits(best) if best else [],
        "candidates": [row(c) for c in suggestion.candidates],
        "rejected": [{"layout": lay.to_json(), "why": why} for lay, why in suggestion.rejected],
    }


def _usable(suggestion: Suggestion) -> str:
    """The memory a layout may take, and the headroom it leaves."""
    whole = f"{suggestion.gpu_memory / GiB:.0f} GiB"
    if not suggestion.headroom:
        return whole
    return f"{whole} ({suggestion.usable_memory / GiB:.1f} GiB usable: --headroom {suggestion.headroom:.0%} kept free)"


def _reshard(c: Candidate) -> str:
    """FSDP's reshard after forward: "yes", "no" (kept gathered), or "-" (no FSDP ranks)."""
    if c.layout.fsdp_size == 1:
        return "-"
    return "yes" if c.reshard_after_forward else "no"


def _staged(c: Candidate) -> str:
    """The layout, and the schedule of a pipeline's."""
    return c.layout.describe() + (f" {c.schedule}" if c.schedule else "")


def _micro(c: Candidate) -> str:
    """Gradient accumulation: "-" (one pass), or sequences per pass x passes."""
    return f"{c.micro_batch_size}x{c.microbatches}" if c.microbatches > 1 else "-"


def render(suggestion: Suggestion, plan_path: str, model: str, top: int = 10) -> str:
    cap = suggestion.usable_memory
    width = max([24, *(len(_staged(c)) for c in suggestion.candidates[:top])])
    lines = [
        f"{suggestion.gpus} x {suggestion.hardware.name}, {suggestion.gpus_per_node} per node, {_usable(suggestion)}, "
        f"sequences of {suggestion.seq_len}, {suggestion.tokens_per_step:,} tokens per step: "
        f"{len(suggestion.candidates)} costed, {len(suggestion.rejected)} refused by the plan's checks",
        "",
        f"{'#':>3}  {'layout':<{width}} {'ac':<5} {'reshard':<7} {'micro':>7} {'memory/GPU':>11} {'fits':>5} "
        f"{'step':>9} {'compute':>9} {'exposed comm':>13} {'tokens/s':>11} {'MFU':>6}",
    ]
    for i, c in enumerate(suggestion.candidates[:top], 1):
        over = "" if c.fits else f" (+{(c.memory.total - cap) / GiB:.1f})"
        lines.append(
            f"{i:>3}  {_staged(c):<{width}} {c.checkpointing:<5} {_reshard(c):<7} {_micro(c):>7} "
            f"{c.memory.total / GiB:>8.1f} GiB "
            f"{'yes' if c.fits else 'no':>5} {c.time.total:>8.3f}s {c.time.compute:>8.3f}s "
            f"{c.time.exposed_comm:>12.3f}s "
            f"{c.tokens_per_s:>11,.0f} {c.mfu:>6.1%}{over}"
        )
    best = suggestion.best
    if best is not None:
        m = best.memory
        lines += [
            "",
            f"best: {best.describe()}: at its peak ({_moment[m.at]}) parameters {m.parameters / GiB:.1f} GiB, "
            f"gradients {m.gradients / GiB:.1f}, "
            f"AdamW {m.optimizer / GiB:.1f}, FSDP buffers {m.fsdp_buffers / GiB:.1f}, activations "
            f"{m.activations / GiB:.1f}, logit buffers {m.logits / GiB:.1f}",
            f"  {command_line(plan_path, model, suggestion, best)}",
        ]
        if edits := plan_edits(best):
            lines.append(f"  in the plan: {'; '.join(edits)} (--write DIR writes the plan with them and a run file)")
    return "\n".join(lines)
