"""``plancc suggest``: the layouts a plan allows for a model on N GPUs, each with its per-rank
memory and estimated step time, ranked -- before any GPU is touched.

Every (tp, cp, ep, dp, sequence parallelism) whose product is the GPU count is checked with
the plan's own rules (``checks``: heads, KV heads, experts, vocabulary, packed blocks...); the
legal ones are costed with the models below, which ``docs/suggest.md`` states with their
assumptions:

- **memory per rank**: parameters, gradients and AdamW state from ``plancc explain`` (fp32
  master weights, the plan's TP shards, FSDP over dp*cp); FSDP's working buffers (two units'
  gathered bf16 parameters and one unit's unsharded fp32 gradients); activations of one
  microbatch of one sequence per rank (bf16, what each decoder layer keeps for backward, by
  sharding and activation checkpointing); the fused lm_head's chunk buffers.
- **time per step**: model FLOPs (6 per parameter per token, active experts only, plus causal
  attention) at the hardware's peak times an achievable fraction, plus the communication that
  is not hidden: TP/SP, CP and EP collectives are on the critical path; FSDP's gathers and
  reduce-scatters overlap the compute and only their excess (and the first unit's gather) show.

Not modelled (said in the output where it matters): kernel efficiency by shape, pipeline
parallelism, stragglers, the optimizer step's own time, communication/compute contention.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..checks.layout_memo import LayoutMemo
from ..checks.rule_runner import check_at
from ..compiler.plan import Plan, load_plan
from ..compiler.resolve import ResolvedPlan, resolve_sections
from ..compiler.styles import canonical_style
from ..errors import Diagnostic, PlanError, SourceLoc
from ..layout import Layout, LayoutError, divisors_of
from ..models import build_meta_model, load_config
from ..skeleton import load_skeleton
from .suggest_costs import (
    Candidate,
    Suggestion,
    _all_units_params,
    _Shape,
    _shape,
    accumulated,
    local_sequences,
    micro_batch_sizes,
    peak,
    step_ends,
    time_of,
    usable,
)
from .suggest_model import HARDWARE, GiB, Hardware, Memory, StepTime
from .suggest_pipeline import costed_schedules, stage_memory, stage_time

DEFAULT_HEADROOM = 0.05  # of each GPU's memory, left free for what the cost model does not count

if TYPE_CHECKING:  # the search itself never measures: see verify_top
    from .measured_memory import MeasuredMemory


def layouts_for(gpus: int, *, allow: Iterable[str], max_tp: int) -> list[Layout]:
    """Every layout of ``gpus`` ranks with the allowed axes (tp always; sp, cp, ep, pp and HSDP's
    dp_replicate when allowed)."""
    allowed = set(allow)
    found = []
    for pp in divisors_of(gpus) if "pp" in allowed else [1]:
        ranks = gpus // pp  # each pipeline rank's (dp, cp, tp) layout
        for tp in divisors_of(ranks):
            if tp > max_tp:
                continue
            for cp in divisors_of(ranks // tp) if "cp" in allowed else [1]:
                dp = ranks // (tp * cp)
                for ep in divisors_of(dp) if "ep" in allowed else [1]:
                    replicas = divisors_of(dp) if "hsdp" in allowed and ep == 1 else [1]
                    sps = (False, True) if "sp" in allowed and tp > 1 else (False,)
                    for sp, dp_replicate in itertools.product(sps, replicas):
                        try:
                            found.append(
                                Layout(
                                    dp=dp, cp=cp, tp=tp, ep=ep, sequence_parallel=sp, pp=pp, dp_replicate=dp_replicate
                                )
                            )
                        except LayoutError:  # sizes plancc has no mesh for (ep with cp)
                            continue
    return found


def meta_model(model: Any) -> nn.Module:
    """A built-in preset's shipped skeleton (its tree, shapes, config and recorded wiring: no
    import of transformers' modeling code and no trace, seconds of a search), else the meta model
    of anything ``--model`` takes. ``tests/test_suggest.py`` pins that both give the same search."""
    loaded = load_skeleton(model) if isinstance(model, str) else None
    return loaded[1] if loaded is not None else build_meta_model(model)


def _by_sequence_parallel(
    sections: Iterable[ResolvedPlan],
) -> tuple[dict[bool, ResolvedPlan], tuple[str, ...]]:
    """The plan's sections by sequence parallelism, and the targets of its activation
    checkpointing (the section without SP holds them)."""
    by_sp = {r.sequence_parallel: r for r in sections}
    return by_sp, by_sp[False].activation_checkpointing if False in by_sp else ()


def _section(by_sp: dict[bool, ResolvedPlan], layout: Layout) -> ResolvedPlan | None:
    """The section a layout runs: its SP overlay, or the plan without SP."""
    return by_sp.get(layout.sequence_parallel) or by_sp.get(False)


@dataclass(frozen=True, slots=True)
class _Costing:
    """What costing one layout of a search reads (the search's model, hardware and step)."""

    model: nn.Module
    resolved: ResolvedPlan | None
    shape: _Shape
    hardware: Hardware
    seq_len: int
    tokens: int
    gpus_per_node: int
    explained: dict[tuple[Any, ...], Any]
    memory_cap: int


def _pipeline_candidate(
    c: _Costing, layout: Layout, ac: str, reshard: bool, local: int, schedule: str, virtual: int
) -> Candidate:
    """A pp layout with ``schedule``: one sequence a microbatch, ``local`` of them a step
    (``tools.suggest_pipeline`` states the model)."""
    shape = c.shape
    ends = step_ends(c.model, c.resolved, layout, shape, c.seq_len, ac, c.explained, 1, reshard_after_forward=reshard)
    layers_params = shape.layers_params or shape.layer_params * shape.layers
    root_share = shape.root_params / max(1, shape.root_params + layers_params)
    held = accumulated(ends) if local > 1 else ends
    memory = peak(
        stage_memory(end, layout, root_share, local, kept_gathered=not reshard, schedule=schedule) for end in held
    )
    one_pass, flops = time_of(
        shape,
        layout,
        c.hardware,
        seq_len=c.seq_len,
        tokens=c.tokens,
        gpus_per_node=c.gpus_per_node,
        checkpointing=ac,
        reshard_after_forward=reshard,
    )
    time = stage_time(
        one_pass,
        layout,
        c.hardware,
        layers=shape.layers,
        layers_params=_all_units_params(shape, layout),
        hidden=shape.hidden,
        seq_len=c.seq_len,
        schedule=schedule,
        microbatches=local,
        virtual=virtual,
        gpus_per_node=c.gpus_per_node,
    )
    return Candidate(
        layout=layout,
        checkpointing=ac,
        reshard_after_forward=reshard,
        memory=memory,
        time=time,
        fits=memory.total <= c.memory_cap,
        tokens_per_s=c.tokens / time.total,
        mfu=flops / time.total / (layout.world_size * c.hardware.peak_flops),
        micro_batch_size=1,
        microbatches=local,
        sequences=local,
        schedule=schedule,
        virtual_stages=virtual,
    )


def suggest(
    plan: str | Path | Plan,
    model: Any,
    *,
    gpus: int,
    gpus_per_node: int = 8,
    gpu_memory: int | None = None,
    seq_len: int = 4096,
    tokens_per_step: int | None = None,
    hardware: str | Hardware = "h100",
    allow: Iterable[str] = ("sp", "cp", "ep"),
    checkpointing: Iterable[str] = ("plan", "none", "full"),
    reshard_after_forward: Iterable[bool] = (True, False),
    accumulate: bool = True,
    headroom: float = DEFAULT_HEADROOM,
) -> Suggestion:
    """The legal layouts of ``plan`` (a path or a ``Plan``) for ``model`` (anything ``--model``
    takes, or a module) on ``gpus`` GPUs, costed and ranked: ``Suggestion.best`` is the fastest
    that fits. ``accumulate``: a layout whose step does not fit in one pass is costed with
    gradient accumulation (the fewest microbatches that fit). ``headroom``: the share of each
    GPU's memory a candidate must leave free (the allocator's fragmentation, NCCL's buffers,
    the CUDA context: the cost model counts none of them). A ``PlanError`` (one diagnostic per
    problem) for input no layout can serve."""
    plan = plan if isinstance(plan, Plan) else load_plan(str(plan))
    model = meta_model(model)
    chosen = _hardware(hardware)
    memory_cap = usable(gpu_memory or chosen.memory, headroom)
    tokens = gpus * seq_len if tokens_per_step is None else tokens_per_step  # 0 is refused, not a default
    _refuse(_input_problems(gpus, gpus_per_node, seq_len, tokens, gpu_memory))
    resolved_sections, problems = resolve_sections(plan, model)
    if any(d.is_error for d in problems):
        raise PlanError(problems)
    by_sp, ac_targets = _by_sequence_parallel(resolved_sections)
    ac_ways = [a for a in checkpointing if a != "plan" or ac_targets]
    candidates, rejected = [], []
    shape_cache: dict[bool, _Shape] = {}
    explained: dict[tuple[Any, ...], Any] = {}
    memo = LayoutMemo()  # a rule's answer at one layout holds at every layout of the sizes it reads
    has_experts = any(
        canonical_style(rule.style.name).name == "moe_experts"
        for section in resolved_sections
        for rule in section.assignments.values()
    )
    axes = [a for a in allow if a != "ep" or has_experts]  # ep spreads experts: none to spread here
    for layout in layouts_for(gpus, allow=axes, max_tp=gpus_per_node):
        found = check_at(plan, model, layout, resolved=resolved_sections, seq_len=seq_len, memo=memo)
        errors = [d for d in found if d.is_error]
        if errors:
            rejected.append((layout, f"{errors[0].rule}: {errors[0].message}"))
            continue
        resolved = _section(by_sp, layout)
        if layout.sequence_parallel not in shape_cache:
            shape_cache[layout.sequence_parallel] = _shape(model, resolved, ac_targets)
        shape = shape_cache[layout.sequence_parallel]
        local = local_sequences(tokens, layout, seq_len)
        # without FSDP there is nothing to reshard: one candidate, not two equal ones
        reshard_ways = [r for r in reshard_after_forward if r or layout.fsdp_size > 1] or [True]
        if layout.pp > 1:
            costing = _Costing(model, resolved, shape, chosen, seq_len, tokens, gpus_per_node, explained, memory_cap)
            staged = [
                _pipeline_candidate(costing, layout, ac, reshard, local, schedule, virtual)
                for ac, reshard in itertools.product(ac_ways, reshard_ways)
                for schedule, virtual in costed_schedules(shape.layers, layout, local)
            ]
            if not staged:
                why = f"pipeline: {local} sequences a dp rank for pp={layout.pp}: fewer than one a pipeline rank"
                rejected.append((layout, why))
            candidates += staged
            continue
        for ac, reshard in itertools.product(ac_ways, reshard_ways):
            # gradient accumulation: the fewest passes that fit (each pass gathers FSDP's weights
            # again), else the smallest microbatch as the layout's closest miss
            for micro in micro_batch_sizes(local) if accumulate else [local]:
                passes = -(-local // micro)
                ends = step_ends(
                    model, resolved, layout, shape, seq_len, ac, explained, micro, reshard_after_forward=reshard
                )
                memory = peak(accumulated(ends) if passes > 1 else ends)
                if memory.total <= memory_cap:
                    break
            time, flops = time_of(
                shape,
                layout,
                chosen,
                seq_len=seq_len,
                tokens=tokens,
                gpus_per_node=gpus_per_node,
                checkpointing=ac,
                reshard_after_forward=reshard,
                microbatches=passes,
            )
            candidates.append(
                Candidate(
                    layout=layout,
                    checkpointing=ac,
                    reshard_after_forward=reshard,
                    memory=memory,
                    time=time,
                    fits=memory.total <= memory_cap,
                    tokens_per_s=tokens / time.total,
                    mfu=flops / time.total / (gpus * chosen.peak_flops),
                    micro_batch_size=micro,
                    microbatches=passes,
                    sequences=local,
                )
            )
    if not candidates:
        reasons = sorted({why for _, why in rejected})
        raise PlanError(
            [
                Diagnostic(
                    rule="suggest-no-layout",
                    loc=plan.loc,
                    message=f"no layout of {gpus} GPUs passes the plan's checks for this model: "
                    + "; ".join(reasons[:3]),
                    fix="try a GPU count whose divisors match the model's heads and KV heads (8, 16, 32, ...)",
                )
            ]
        )
    # equal times (FSDP's traffic hidden either way): the smaller memory first
    ranked = sorted(candidates, key=lambda c: (not c.fits, c.time.total if c.fits else c.memory.total, c.memory.total))
    return Suggestion(
        hardware=chosen,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        gpu_memory=gpu_memory or chosen.memory,
        headroom=headroom,
        seq_len=seq_len,
        tokens_per_step=tokens,
        candidates=tuple(ranked),
        rejected=tuple(rejected),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Verified:
    """A candidate's predicted per-rank peak beside the one a fake-world training step measured.
    ``predicted``: the prediction for the measurement's device, the CPU (its lm_head chunking,
    its fused-loss path, its optimizer), which ``ratio`` compares; the candidate's own figure is
    CUDA's."""

    candidate: Candidate
    measured: MeasuredMemory
    predicted: Memory

    @property
    def ratio(self) -> float:
        return self.predicted.total / max(self.measured.total, 1)


def predicted_memory(
    plan: Plan,
    model: nn.Module,
    layout: Layout,
    seq_len: int,
    checkpointing: str,
    *,
    sequences: int = 1,
    device: str = "cuda",
    reshard_after_forward: bool = True,
) -> Memory:
    """The peak of one layout of ``model`` (a meta model) under ``plan``, the way the search
    costs it: the plan's section for the layout's sequence parallelism."""
    by_sp, targets = _by_sequence_parallel(resolve_sections(plan, model)[0])
    resolved = _section(by_sp, layout)
    shape = _shape(model, resolved, targets)
    return peak(
        step_ends(
            model,
            resolved,
            layout,
            shape,
            seq_len,
            checkpointing,
            None,
            sequences,
            device=device,
            reshard_after_forward=reshard_after_forward,
        )
    )


def verify_top(suggestion: Suggestion, plan: Plan, model: str, k: int) -> list[Verified]:
    """Measure the per-rank peak of the ``k`` fastest fitting candidates (or the smallest ones
    when none fits) with one training step in the dry run's fake world (``measured_memory``):
    seconds to minutes each, by the layout's layer count and ranks."""
    fitting = [c for c in suggestion.candidates if c.fits] or sorted(
        suggestion.candidates, key=lambda c: c.memory.total
    )
    # a measurement needs FSDP's memory tracker, DTensor and dynamo: 2 s of imports that the
    # search alone (docs/suggest.md: "under 10 s") does not pay
    from .measured_memory import measure_step_memory  # lazy: FSDP's memory tracker only for --verify-top

    config = load_config(model)
    meta = meta_model(model)  # what the search costed (a preset's skeleton)
    verified = []
    for candidate in fitting[:k]:
        sequences = local_sequences(suggestion.tokens_per_step, candidate.layout, suggestion.seq_len)
        measured = measure_step_memory(
            plan,
            config,
            candidate.layout,
            seq_len=suggestion.seq_len,
            sequences=sequences,
            checkpointing=candidate.checkpointing,
            reshard_after_forward=candidate.reshard_after_forward,
        )
        here = predicted_memory(
            plan,
            meta,
            candidate.layout,
            suggestion.seq_len,
            candidate.checkpointing,
            sequences=sequences,
            device="cpu",
            reshard_after_forward=candidate.reshard_after_forward,
        )
        verified.append(Verified(candidate=candidate, measured=measured, predicted=here))
    return verified


def render_verified(verified: list[Verified]) -> str:
    lines = [
        "",
        "predicted against measured (one training step in a fake world of the layout's ranks, on the CPU: "
        "predicted for the CPU's lm_head path and optimizer, beside the table's CUDA figure):",
    ]
    for v in verified:
        c, m = v.candidate, v.measured
        lines.append(
            f"  {c.describe():<30} predicted {v.predicted.total / GiB:6.1f} GiB (CUDA {c.memory.total / GiB:.1f})  "
            f"measured {m.total / GiB:6.1f} GiB "
            f"({v.ratio:.2f}x; measured parameters {m.parameters / GiB:.1f}, gathered {m.gathered / GiB:.1f}, "
            f"gradients {m.gradients / GiB:.1f}, AdamW {m.optimizer / GiB:.1f}, activations {m.activations / GiB:.1f})"
        )
    return "\n".join(lines)


def _hardware(hardware: str | Hardware) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    found = HARDWARE.get(hardware.lower())
    if found is None:
        raise PlanError(
            [
                Diagnostic(
                    rule="suggest-hardware",
                    loc=SourceLoc(path="--hardware"),
                    message=f"unknown hardware {hardware!r}; allowed: {', '.join(sorted(HARDWARE))}",
                    fix="pass one of those, or --gpu-memory with the closest of them",
                )
            ]
        )
    return found


# The largest inputs a search can use (round 4 of the adversarial pass: a billion GPUs never
# answered, a 400-digit memory or length ended in OverflowError). Each is far past any real job:
# the largest training clusters are ~10^5 GPUs, the longest contexts ~10^7 tokens.
MAX_GPUS = 2**17  # 131,072
MAX_SEQ_LEN = 2**24  # 16,777,216 tokens
MAX_TOKENS_PER_STEP = 2**40
MAX_GPU_MEMORY = 2**50  # 1 PiB per GPU


def _input_problems(
    gpus: int, gpus_per_node: int, seq_len: int, tokens: int, gpu_memory: int | None = None
) -> list[Diagnostic]:
    problems = []
    for flag, value in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node), ("--seq-len", seq_len)):
        if value < 1:
            problems.append(_usage(flag, f"{flag} is {value}", f"{flag} 1 or more"))
    bounds = [
        ("--gpus", gpus, MAX_GPUS),
        ("--gpus-per-node", gpus_per_node, MAX_GPUS),
        ("--seq-len", seq_len, MAX_SEQ_LEN),
        ("--gpu-memory", gpu_memory or 0, MAX_GPU_MEMORY),
    ]
    for flag, value, most in bounds:
        if value > most:
            problems.append(_usage(flag, f"{flag} is {_shown(value)}, more than any job can use", f"at most {most:,}"))
    if not problems and tokens > MAX_TOKENS_PER_STEP:  # (a product of the sizes above when not given)
        problems.append(
            _usage("--tokens-per-step", f"{_shown(tokens)} tokens per step", f"at most {MAX_TOKENS_PER_STEP:,}")
        )
    if problems:  # the checks below assume sizes a search can use
        return problems
    if tokens % seq_len:
        problems.append(
            _usage(
                "--tokens-per-step",
                f"{tokens:,} tokens is not whole sequences of {seq_len:,}",
                "a multiple of --seq-len",
            )
        )
    if gpus >= 1 and gpus_per_node >= 1 and gpus > gpus_per_node and gpus % gpus_per_node:
        problems.append(  # no layout uses it: exit 1, as a plan no layout serves
            replace(
                _usage("--gpus", f"{gpus} GPUs is not whole nodes of {gpus_per_node}", "a multiple of --gpus-per-node"),
                rule="suggest-gpus",
            )
        )
    if seq_len >= 1 and tokens < seq_len:
        problems.append(
            _usage("--tokens-per-step", f"{tokens} tokens per step is less than one sequence", "at least --seq-len")
        )
    return problems


def _shown(value: int) -> str:
    """A count as a person reads it: ``131,072``, or ``a 400-digit number``."""
    digits = len(str(value))
    return f"{value:,}" if digits <= 18 else f"a {digits}-digit number"


def _usage(flag: str, found: str, allowed: str) -> Diagnostic:
    return Diagnostic(
        rule="usage", loc=SourceLoc(path=flag), message=f"{found}; allowed: {allowed}", fix=f"pass {allowed}"
    )


def _refuse(problems: list[Diagnostic]) -> None:
    if problems:
        raise PlanError(problems)


__all__ = ["HARDWARE", "Candidate", "Hardware", "Memory", "StepTime", "Suggestion", "Verified", "suggest", "verify_top"]
