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
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checks.context import text_config
from ..checks.engine import check_at
from ..checks.layout_memo import LayoutMemo
from ..compiler.plan import Plan, load_plan
from ..compiler.resolve import ResolvedPlan, resolve_sections
from ..compiler.styles import canonical_style
from ..errors import Diagnostic, PlanError, SourceLoc
from ..layout import Layout, LayoutError, divisors_of
from ..models import build_meta_model, load_config
from ..runtime.vocab_stats import default_chunk
from ..skeleton import load_skeleton
from .explain import explain, tensor_parallel_rows
from .suggest_model import BF16, FP32, HARDWARE, GiB, Hardware, Memory, StepTime
from .suggest_model import bandwidth as _bandwidth
from .suggest_pipeline import costed_schedules, stage_memory, stage_time

if TYPE_CHECKING:  # the search itself never measures: see verify_top
    from .measured_memory import MeasuredMemory

# per element, what transformers' RMSNorm keeps for backward: its input in fp32 and the normalized
# bf16 tensor (its weight's gradient); a norm over the hidden states also hands its bf16 output to
# the projections that follow, which keep it (measured: tools.measured_memory, docs/suggest.md)
HEAD_NORM = FP32 + BF16
HIDDEN_NORM = FP32 + 2 * BF16


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    layout: Layout
    checkpointing: str  # "plan": the plan's activation_checkpointing; "none"; "full": every layer
    memory: Memory
    time: StepTime
    fits: bool
    tokens_per_s: float
    mfu: float
    # False: FSDP keeps each unit gathered from its forward to its backward (one all-gather per
    # unit a step instead of two, every unit's bf16 weights held at the start of backward)
    reshard_after_forward: bool = True
    # gradient accumulation: a rank's sequences of the step in ``microbatches`` passes of at most
    # ``micro_batch_size`` (1 pass: the whole local batch at once, ``micro_batch_size`` its rows)
    micro_batch_size: int = 1
    microbatches: int = 1
    sequences: int = 1  # a dp rank's sequences of the step
    # pipeline parallelism (layout.pp > 1): the schedule and the stages a rank holds
    schedule: str = ""
    virtual_stages: int = 1

    def describe(self) -> str:
        kept = "" if self.reshard_after_forward else " reshard=off"
        accumulated = f" micro={self.micro_batch_size}x{self.microbatches}" if self.microbatches > 1 else ""
        staged = f" {self.schedule}" if self.schedule else ""
        return f"{self.layout.describe()}{staged} ac={self.checkpointing}{kept}{accumulated}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Suggestion:
    hardware: Hardware
    gpus: int
    gpus_per_node: int
    gpu_memory: int
    seq_len: int
    tokens_per_step: int
    candidates: tuple[Candidate, ...]  # legal layouts, the fitting ones first, fastest first
    rejected: tuple[tuple[Layout, str], ...] = ()  # layouts the plan's checks refuse, with the first reason

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Shape:
    """What the cost model reads off a model: sizes and parameter counts."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # per token through the MLP: intermediate size, or top_k x the experts' size
    top_k: int  # experts per token (0: a dense model)
    vocab: int
    active_params: int  # matmul parameters a token goes through (experts: top_k of them)
    layer_params: int  # the largest decoder layer's parameters (all experts): the unit FSDP gathers
    layer_expert_params: int = 0  # of them, the experts' (spread over ep x tp, not tp alone)
    layers_params: int = 0  # every decoder layer's together (0: layers x the largest)
    layers_expert_params: int = 0  # of them, the experts'
    checkpointed_share: float = 1.0  # of a layer's activations, what the plan's targets recompute
    hidden_norms: int = 2  # RMSNorms of a layer over the hidden states (each keeps its input in fp32)
    head_norm_width: int = 0  # per token, the elements a layer's per-head norms (q_norm, k_norm) see
    root_params: int = 0  # parameters outside the decoder layers (embeddings, lm_head, final norm)


def _shape(model: nn.Module, resolved: ResolvedPlan | None, checkpointed: Iterable[str]) -> _Shape:
    config = text_config(model.config)  # type: ignore[arg-type]
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    experts = int(getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", None) or 0)
    moe_ffn = int(getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None) or 0)
    ffn = top_k * moe_ffn if experts and top_k else int(getattr(config, "intermediate_size", 4 * hidden))
    layers = int(config.num_hidden_layers)
    expert_modules = {
        name
        for name, rule in (resolved.assignments.items() if resolved is not None else ())
        if canonical_style(rule.style.name).name == "moe_experts"
    }
    active = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue  # a lookup, not a matmul (a tied lm_head counts where it multiplies)
        share = top_k / experts if name in expert_modules and experts else 1.0
        for param in module.parameters(recurse=False):
            if id(param) in seen or param.dim() < 2:
                continue
            seen.add(id(param))
            active += int(param.numel() * share)
    lists = [(f"{n}.{c}" if n else c, m) for n, p in model.named_modules() for c, m in p.named_children()]
    prefix, layer_list = max(
        ((n, m) for n, m in lists if isinstance(m, nn.ModuleList)), key=lambda found: len(found[1]), default=("", None)
    )
    # each layer's parameters and, of them, its experts': layers differ (DeepSeek-V3's first three
    # are dense), so the largest is the unit FSDP gathers at a time, and their sum is its traffic
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layer_list] if layer_list is not None else [0]
    expert_sizes = [0] * len(sizes)
    for name, module in model.named_modules():
        index = name[len(prefix) + 1 :].split(".", 1)[0] if name.startswith(f"{prefix}.") else ""
        if name in expert_modules and index.isdigit():
            expert_sizes[int(index)] += sum(p.numel() for p in module.parameters())
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    layer_names = {f"{prefix}.{i}" for i in range(len(layer_list))} if layer_list is not None else set()
    in_layers = sum(p.numel() for p in layer_list.parameters()) if layer_list is not None else 0
    hidden_norms, head_norm_width = _norms(layer_list[0] if layer_list is not None else None, hidden, heads, kv_heads)
    targets = list(checkpointed)
    if not targets:
        share = 0.0
    elif any(t in layer_names for t in targets):  # whole layers
        share = 1.0
    else:  # selective (a layer's MLP): the MLP's part of a layer's activations
        replicated, attention, mlp, routed = _layer_bytes(
            hidden, heads, kv_heads, head_dim, ffn, hidden_norms, head_norm_width, top_k if experts else 0
        )
        share = (mlp + routed) / (replicated + attention + mlp + routed)
    return _Shape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        top_k=top_k if experts else 0,
        vocab=int(config.vocab_size),
        active_params=active,
        layer_params=sizes[largest],
        layer_expert_params=expert_sizes[largest],
        layers_params=sum(sizes),
        layers_expert_params=sum(expert_sizes),
        checkpointed_share=share,
        hidden_norms=hidden_norms,
        head_norm_width=head_norm_width,
        root_params=sum(p.numel() for p in model.parameters()) - in_layers,
    )


def _layer_bytes(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    hidden_norms: int,
    head_norm_width: int,
    top_k: int = 0,
) -> tuple[float, float, float, float]:
    """Bytes per token one decoder layer keeps for backward, unsharded, in four parts: the
    hidden-state norms' (sharded only by SP); q, k, v, the attention output (bf16) and the
    per-head norms' (sharded by tp); a dense MLP's gate, up, activation and product (bf16,
    sharded by tp); a MoE block's (``top_k`` > 0), which no axis shards: each token's ``top_k``
    copies of the hidden state three times over (dispatched, sorted by expert, the experts'
    output) and of the experts' gate, up, activation and product. What one transformers decoder
    layer keeps, measured (``tools.measured_memory``: 227 KB a token against 226 KB predicted
    for a Qwen3-30B-A3B layer at ep=8, 204 against 203 at tp=2 x ep=4)."""
    replicated = HIDDEN_NORM * hidden_norms * hidden
    attention = BF16 * (2 * heads + 2 * kv_heads) * head_dim + HEAD_NORM * head_norm_width
    if top_k:
        return replicated, attention, 0.0, BF16 * (4 * ffn + 3 * top_k * hidden)
    return replicated, attention, BF16 * 4 * ffn, 0.0


def _norms(layer: nn.Module | None, hidden: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """(norms over the hidden states, elements per token the per-head norms see) in a decoder
    layer; what each keeps per element is ``HIDDEN_NORM`` and ``HEAD_NORM``."""
    if layer is None:
        return 2, 0
    hidden_norms, head_width = 0, 0
    for name, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if "norm" not in type(module).__name__.lower() or weight is None or weight.dim() != 1:
            continue
        if weight.numel() == hidden:
            hidden_norms += 1
        else:  # a per-head norm: q's over every head, k's over the KV heads
            head_width += weight.numel() * (kv_heads if name.rsplit(".", 1)[-1].startswith("k") else heads)
    return hidden_norms or 2, head_width


def activation_bytes(
    shape: _Shape, layout: Layout, seq_len: int, checkpointing: str, sequences: int = 1
) -> tuple[int, int]:
    """(what the decoder layers keep for backward, what backward recomputes at once), one
    sequence per rank (``seq_len / cp`` of its tokens): per layer the norms' inputs (fp32) and
    outputs (bf16; the hidden-state norms sharded by SP), q, k, v and the attention output, and
    the MLP's (``_layer_bytes``) -- what one transformers decoder layer keeps, measured.
    Checkpointed layers keep their input only, and backward recomputes one layer at a time.
    ``sequences``: per microbatch on each dp rank (a step's local batch in one pass)."""
    tokens = sequences * seq_len // layout.cp
    tp = layout.tp
    sequence = tp if layout.sequence_parallel else 1
    replicated, attention, mlp, routed = _layer_bytes(
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.ffn,
        shape.hidden_norms,
        shape.head_norm_width,
        shape.top_k,
    )
    replicated, attention, mlp = replicated / sequence, attention / tp, mlp / tp
    if layout.cp > 1:
        # plancc's CP attention (runtime.cp, runtime.block_attention) keeps the keys and values
        # gathered over the whole sequence, at their own head count, in place of the local ones;
        # no mask: nothing grows with seq_len squared (bench/cp_long.py)
        local_kv = BF16 * 2 * shape.kv_heads * shape.head_dim / tp
        gathered_kv = local_kv * layout.cp
        attention += gathered_kv - local_kv
    per_layer = tokens * (replicated + attention + mlp + routed)
    layer_input = BF16 * tokens * shape.hidden / sequence
    if checkpointing == "none":
        return int(shape.layers * per_layer), 0
    kept_share = 1.0 if checkpointing == "full" else shape.checkpointed_share
    kept = per_layer * (1 - kept_share) + layer_input * kept_share
    return int(shape.layers * kept), int(per_layer * kept_share)


def local_sequences(tokens: int, layout: Layout, seq_len: int) -> int:
    """A rank's share of a step of ``tokens`` (whole sequences) in one pass: the largest dp
    slice's sequences (no gradient accumulation) -- the busiest rank's memory, as the step's time
    counts every token."""
    return max(1, -(-tokens // (layout.dp * seq_len)))


def micro_batch_sizes(local: int) -> list[int]:
    """The microbatch sizes worth costing for ``local`` sequences a rank: the whole batch, then
    halves (rounded up) down to one sequence -- fewest passes first."""
    sizes, size = [], local
    while True:
        if size not in sizes:
            sizes.append(size)
        if size == 1:
            return sizes
        size = -(-size // 2)


def accumulated(ends: tuple[Memory, ...]) -> tuple[Memory, ...]:
    """``step_ends`` of one microbatch when the step takes several: from the second microbatch on,
    every gradient is already held while the next one's activations are kept."""
    grads = max(e.gradients for e in ends)
    return tuple(replace(e, gradients=grads) if e.at in ("forward", "backward start") else e for e in ends)


def peak(ends: Iterable[Memory]) -> Memory:
    """The step's peak: the largest of ``step_ends`` (the first of equals: the end of forward)."""
    return max(ends, key=lambda m: m.total)


def step_ends(
    model: nn.Module,
    resolved: ResolvedPlan | None,
    layout: Layout,
    shape: _Shape,
    seq_len: int,
    checkpointing: str,
    explained: dict[tuple[Any, ...], Any] | None = None,
    sequences: int = 1,
    device: str = "cuda",
    reshard_after_forward: bool = True,
) -> tuple[Memory, ...]:
    """What a rank holds at the moments one of which is a training step's peak (between them
    memory moves one way: forward keeps activations, backward frees them as gradients arrive):

    - the end of forward, inside the fused token loss: every activation kept for backward, the
      lm_head's fp32 gradient (formed in forward), a chunk of fp32 logits and their gradient,
      on the PyTorch path (the CPU's) an fp32 copy of the lm_head weight; the root unit and the
      last layer's unit gathered in bf16 (every layer's with ``reshard_after_forward`` off);
    - the start of backward: the first layer recomputed (with checkpointing), its unit and the
      next gathered in bf16 and its fp32 gradients, the lm_head's gradient still held, no
      other gradient yet;
    - the end of backward: every gradient, the first layer's unit and its gradients' buffers;
    - AdamW's step: every gradient and its state, and the update's temporaries: on CUDA
      (``foreach``) one fp32 tensor as large as the trained parameters, on the CPU (one
      parameter at a time) two as large as the largest.

    ``device``: CUDA for suggestions; the CPU's beside a measurement in the dry run's fake world,
    which runs on it (its lm_head chunking, its fused-loss path, its optimizer). Checked against a
    real CUDA step's allocator (docs/gpu.md) and the fake world's tracker (docs/suggest.md)."""
    # explain reads tp, ep and the plan's section (the same for many layouts), then the FSDP ranks
    by_tp = (layout.tp, layout.ep, layout.expert_ranks, layout.sequence_parallel)
    key = (*by_tp, layout.fsdp_size, layout.expert_fsdp_size)
    exp = explained.get(key) if explained is not None else None
    if exp is None:
        tp_rows = explained.get(by_tp) if explained is not None else None
        if tp_rows is None:
            tp_rows = tensor_parallel_rows(model, resolved, layout)
        exp = explain(model, resolved, layout, tensor_parallel=tp_rows)
        if explained is not None:
            explained[by_tp], explained[key] = tp_rows, exp
    unit = _unit_params(shape, layout)
    root = shape.root_params / layout.tp * BF16
    tokens, v_local = sequences * seq_len // layout.cp, -(-shape.vocab // layout.tp)
    chunk = min(tokens, default_chunk(tokens, v_local, torch.device(device), grad=True)) * v_local * FP32
    lm_head = v_local * shape.hidden * FP32
    kernels = device == "cuda"  # the fused loss's kernels take the bf16 weight as it is
    kept, recomputed = activation_bytes(shape, layout, seq_len, checkpointing, sequences)
    gathered = BF16 * (unit if reshard_after_forward else _all_units_params(shape, layout))
    held = {"parameters": exp.param_bytes, "optimizer": exp.optimizer_bytes}
    forward = Memory(
        **held,
        gradients=0,
        fsdp_buffers=int(gathered + root),
        activations=kept,
        logits=int(2 * chunk + lm_head + (0 if kernels else lm_head)),
        at="forward",
    )
    in_use = 2 * unit * BF16 if reshard_after_forward else gathered  # computing and prefetched, or all kept
    backward_start = Memory(
        **held,
        gradients=0,
        fsdp_buffers=int(unit * FP32 + in_use + root),
        activations=kept + recomputed,
        logits=int(lm_head),
        at="backward start",
    )
    backward_end = Memory(
        **held,
        gradients=exp.grad_bytes,
        fsdp_buffers=int(unit * (2 * BF16 + FP32) + root),
        activations=0,
        logits=0,
        at="backward end",
    )
    trained = [math.prod(r.local_shape) * FP32 for r in exp.rows if r.trainable]
    temporaries = exp.grad_bytes if kernels else 2 * max(trained, default=0)
    optimizer = replace(backward_end, optimizer=exp.optimizer_bytes + temporaries, fsdp_buffers=0, at="optimizer step")
    return forward, backward_start, backward_end, optimizer


def _unit_params(shape: _Shape, layout: Layout) -> float:
    """The largest decoder layer's parameters a rank gathers: the experts' share is spread over
    ep x tp (each rank gathers only its own experts), the rest over tp."""
    experts = shape.layer_expert_params
    return (shape.layer_params - experts) / layout.tp + experts / (layout.tp * layout.ep)


def _all_units_params(shape: _Shape, layout: Layout) -> float:
    """Every decoder layer's parameters a rank gathers over a step's pass, as ``_unit_params``."""
    if not shape.layers_params:
        return _unit_params(shape, layout) * shape.layers
    experts = shape.layers_expert_params
    return (shape.layers_params - experts) / layout.tp + experts / (layout.tp * layout.ep)


def time_of(
    shape: _Shape,
    layout: Layout,
    hardware: Hardware,
    *,
    seq_len: int,
    tokens: int,
    gpus_per_node: int,
    checkpointing: str,
    reshard_after_forward: bool = True,
    microbatches: int = 1,
) -> tuple[StepTime, float]:
    """(the step's time, its model FLOPs). With ``microbatches`` passes FSDP gathers the weights
    and reduce-scatters the gradients in every one of them (plancc syncs every microbatch); the
    compute and the activations' traffic are the step's tokens either way."""
    recompute = {"none": 0.0, "full": 1.0, "plan": shape.checkpointed_share}[checkpointing]
    attention = 6 * seq_len * shape.heads * shape.head_dim * shape.layers  # per token, causal, fwd + bwd
    model_flops = tokens * (6 * shape.active_params + attention)
    executed = model_flops * (1 + recompute / 3)  # a recomputed forward is a third of fwd + bwd
    compute = executed / layout.world_size / (hardware.peak_flops * hardware.achievable)
    per_rank = tokens / (layout.dp * layout.cp)  # tokens each rank's activations carry
    passes = 2 + recompute  # forward, backward, recomputed forward
    tp_time = cp_time = ep_time = 0.0
    if layout.tp > 1:  # two collectives of the layer's activations per pass (all-reduce, or AG + RS)
        wire = 2 * (layout.tp - 1) / layout.tp * per_rank * shape.hidden * BF16
        tp_time = shape.layers * passes * 2 * wire / _bandwidth(hardware, layout.tp, gpus_per_node)
    if layout.cp > 1:  # keys and values gathered in forward, their gradients reduce-scattered in backward
        kv = per_rank * 2 * shape.kv_heads * shape.head_dim / layout.tp * BF16
        wire = (layout.cp - 1) * kv
        cp_time = shape.layers * (1 + recompute + 1) * wire / _bandwidth(hardware, layout.tp * layout.cp, gpus_per_node)
    if layout.ep > 1:  # dispatch and combine all-to-alls per pass: each token's top_k copies
        wire = (layout.ep - 1) / layout.ep * per_rank * max(shape.top_k, 1) * shape.hidden * BF16
        span = layout.tp * layout.cp * layout.ep
        ep_time = shape.layers * passes * 2 * wire / _bandwidth(hardware, span, gpus_per_node)
    fsdp_time = 0.0
    if layout.fsdp_size > 1:
        params = _all_units_params(shape, layout)
        share = (layout.fsdp_size - 1) / layout.fsdp_size
        gathers = 2 if reshard_after_forward else 1  # forward, and again in backward unless kept
        bandwidth = _bandwidth(hardware, layout.world_size, gpus_per_node)
        total = microbatches * params * share * (gathers * BF16 + FP32) / bandwidth
        # the first unit's all-gather is exposed either way (nothing computes before it), per pass
        first_unit = params * share * (2 * BF16 + FP32) / bandwidth / max(shape.layers, 1) / 3
        fsdp_time = max(0.0, total - compute) + microbatches * first_unit
    return StepTime(compute=compute, tp=tp_time, cp=cp_time, ep=ep_time, fsdp=fsdp_time), model_flops


def layouts_for(gpus: int, *, allow: Iterable[str], max_tp: int) -> list[Layout]:
    """Every layout of ``gpus`` ranks with the allowed axes (tp always; sp, cp, ep when allowed)."""
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
                    for sp in (False, True) if "sp" in allowed and tp > 1 else (False,):
                        try:
                            found.append(Layout(dp=dp, cp=cp, tp=tp, ep=ep, sequence_parallel=sp, pp=pp))
                        except LayoutError:  # sizes plancc has no mesh for (ep with cp)
                            continue
    return found


def _meta_model(model: Any) -> nn.Module:
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
) -> Suggestion:
    """The legal layouts of ``plan`` (a path or a ``Plan``) for ``model`` (anything ``--model``
    takes, or a module) on ``gpus`` GPUs, costed and ranked: ``Suggestion.best`` is the fastest
    that fits. ``accumulate``: a layout whose step does not fit in one pass is costed with
    gradient accumulation (the fewest microbatches that fit). A ``PlanError`` (one diagnostic per
    problem) for input no layout can serve."""
    plan = plan if isinstance(plan, Plan) else load_plan(str(plan))
    model = _meta_model(model)
    chosen = _hardware(hardware)
    memory_cap = gpu_memory or chosen.memory
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
        gpu_memory=memory_cap,
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
    meta = _meta_model(model)  # what the search costed (a preset's skeleton)
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


def command_line(plan_path: str, model: str, candidate: Candidate) -> str:
    """The ``plancc apply`` line of a candidate (checkpointing and resharding are the plan's to
    say: ``plan_edits``)."""
    layout = candidate.layout
    flags = [f"--tp {layout.tp}"]
    if layout.cp > 1:
        flags.append(f"--cp {layout.cp}")
    if layout.ep > 1:
        flags.append(f"--ep {layout.ep}")
    if layout.sequence_parallel:
        flags.append("--sp")
    if layout.pp > 1:
        flags.append(f"--pp {layout.pp}")
    if candidate.microbatches > 1 and layout.pp == 1:  # the step's sequences, a rank's rows per pass
        flags.append(f"--batch-size {candidate.sequences * layout.dp} --micro-batch-size {candidate.micro_batch_size}")
    return f"plancc apply {plan_path} --model {model} {' '.join(flags)}"


def plan_edits(candidate: Candidate) -> list[str]:
    """What the plan must say for ``candidate`` beyond the command's flags."""
    edits = [] if candidate.checkpointing == "plan" else [f"activation checkpointing: {candidate.checkpointing}"]
    if not candidate.reshard_after_forward:
        edits.append("fsdp: {reshard_after_forward: false}")
    if candidate.layout.pp > 1:
        edits.append(
            f"pipeline: {{schedule: {candidate.schedule}, microbatches: {candidate.microbatches}, "
            f"virtual_stages_per_rank: {candidate.virtual_stages}}}"
        )
    return edits


def no_fit_problem(suggestion: Suggestion, plan: Plan) -> Diagnostic | None:
    """An error when no legal layout fits the memory: the smallest, and what dominates it."""
    if suggestion.best is not None:
        return None
    smallest = min(suggestion.candidates, key=lambda c: c.memory.total)
    return Diagnostic(
        rule="suggest-no-fit",
        loc=plan.loc,
        message=f"no layout of {suggestion.gpus} GPUs fits {suggestion.gpu_memory / GiB:.0f} GiB per GPU: the "
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
        "seq_len": suggestion.seq_len,
        "tokens_per_step": suggestion.tokens_per_step,
        "best": row(best) if best else None,
        "command": command_line(plan_path, model, best) if best else None,
        "plan_edits": plan_edits(best) if best else [],
        "candidates": [row(c) for c in suggestion.candidates],
        "rejected": [{"layout": lay.to_json(), "why": why} for lay, why in suggestion.rejected],
    }


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
    cap = suggestion.gpu_memory
    width = max([24, *(len(_staged(c)) for c in suggestion.candidates[:top])])
    lines = [
        f"{suggestion.gpus} x {suggestion.hardware.name} ({cap / GiB:.0f} GiB, {suggestion.gpus_per_node} per node), "
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
            f"  {command_line(plan_path, model, best)}"
            + (f"   # in the plan: {'; '.join(edits)}" if (edits := plan_edits(best)) else ""),
        ]
    return "\n".join(lines)


__all__ = ["HARDWARE", "Candidate", "Hardware", "Memory", "StepTime", "Suggestion", "Verified", "suggest", "verify_top"]
