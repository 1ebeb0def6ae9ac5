"""What a layout costs (``plancc suggest``'s models, ``docs/suggest.md``): the shape the cost
model reads off a model, the memory per rank at each end of a step (parameters, gradients,
AdamW, FSDP's buffers, activations by sharding and checkpointing, the lm_head's chunks), the
time of a step (compute and the communication not hidden), and a costed layout (``Candidate``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..checks.context import text_config
from ..compiler.resolve import ResolvedPlan
from ..compiler.styles import canonical_style
from ..layout import Layout
from ..runtime.vocab_stats import default_chunk
from .explain import explain, tensor_parallel_rows
from .suggest_model import BF16, FP32, Hardware, Memory, StepTime, fsdp_span, replicate_time
from .suggest_model import bandwidth as _bandwidth

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
    headroom: float = 0.0  # the share of gpu_memory kept free: a candidate fits in the rest

    @property
    def usable_memory(self) -> int:
        """The bytes a candidate may take: ``gpu_memory`` less the headroom."""
        return usable(self.gpu_memory, self.headroom)

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)


def usable(gpu_memory: int, headroom: float) -> int:
    """``gpu_memory`` less ``headroom`` of it, in integers (a size of any length stays exact)."""
    return gpu_memory * (10_000 - round(headroom * 10_000)) // 10_000


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
        # plancc's CP attention (runtime.cp_context, runtime.block_attention) keeps the keys and values
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
    if layout.fsdp_size > 1 or layout.dp_replicate > 1:
        params = _all_units_params(shape, layout)
        share = (layout.fsdp_size - 1) / layout.fsdp_size
        gathers = 2 if reshard_after_forward else 1  # forward, and again in backward unless kept
        bandwidth = _bandwidth(hardware, fsdp_span(layout), gpus_per_node)
        total = microbatches * params * share * (gathers * BF16 + FP32) / bandwidth
        total += microbatches * replicate_time(params, layout, hardware, gpus_per_node)
        # the first unit's all-gather is exposed either way (nothing computes before it), per pass
        first_unit = params * share * (2 * BF16 + FP32) / bandwidth / max(shape.layers, 1) / 3
        fsdp_time = max(0.0, total - compute) + microbatches * first_unit
    return StepTime(compute=compute, tp=tp_time, cp=cp_time, ep=ep_time, fsdp=fsdp_time), model_flops
