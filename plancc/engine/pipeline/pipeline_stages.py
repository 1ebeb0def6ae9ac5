"""Pipeline stages of a Hugging Face decoder and torch's schedules, with the step's loss normalized
over the whole batch (``Policy``'s step executor for stages, ``engine.pipeline.pipeline_steps``,
drives them; ``apply --pp`` through it).

A stage is a module of its own built from the model: the embedding on the first stage, a
contiguous run of decoder layers (each with the rotary embedding it needs), the final norm and
the lm_head on the last. ``torch.distributed.pipelining``'s schedules (GPipe, 1F1B, Interleaved
1F1B, ...) move the hidden states between stages and run forward and backward per microbatch.

Exactness as plancc means it: the loss of a microbatch is its share of the *global* batch's loss
(``engine.pipeline.pipeline_last_stage``: its tokens' terms over the global batch's count), and
the schedule is told not to scale gradients (``scale_grads=False``): the gradients are then those
of the mean NLL over the whole batch in one pass, whatever the number of microbatches. Gradient
norms are summed over the pipeline group (``pipeline_grad_norm``). Rows are unpadded: whole rows
of one length attend by the masks the model's own forward makes (none where SDPA masks causally
by itself; an eager attention's or a sliding window's where it needs one), or under context
parallelism by the cp attention over its cp rank's load-balanced shard of the row
(``runtime.cp_context``), laid out from the microbatch's shape; packed rows come with their
positions (``DecoderStage.forward``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ...compiler.plan import PipelineSpec, Plan
from ...compiler.resolve import resolve_plan
from ...compiler.stage_globs import layers_of_stages
from ...runtime.activation_checkpointing import apply_activation_checkpointing
from ...runtime.compile import compile_blocks
from ...runtime.cp_context import CPContext, CPState, cp_attention_context
from ...runtime.cp_key_selection import select_keys_over_the_sequence
from ...runtime.gradient_scale import fsdp_divisor
from ...runtime.gradnorm import global_grad_norm
from ...runtime.lora import LoraSpec, add_adapters
from ...runtime.mesh import ParallelMesh
from ...runtime.parallelize import apply_fsdp, apply_tensor_parallel, offloaded
from ...runtime.vocab_parallel_logprobs import IGNORE_INDEX
from ...schedules import SCHEDULE_NAMES, SINGLE, V_SHAPED, rank_stages, stage_layers

# torch.distributed.pipelining's schedules by the plan's names (``plancc.schedules`` says where
# each puts a rank's stages)
SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES, "every schedule the plan names runs"


class _DecoderPart(nn.Module):
    """The modules of a transformers decoder (``model.model``) that a stage holds, under their
    own names: ``layers`` keyed by the model's layer index, so a stage's parameter names are the
    model's (``model.layers.7.mlp.up_proj.weight`` on whichever stage holds layer 7)."""

    def __init__(self, decoder: Any, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm if last else None


class DecoderStage(nn.Module):
    """One pipeline stage of a transformers causal LM: ``input_ids`` -> hidden states on the
    first stage, hidden states -> hidden states in between, -> logits on the last. Its modules
    sit at the model's names (``model.layers.N``, ``lm_head``): checkpoints, Hugging Face folders
    and the plan's globs name a stage's parameters as they name the whole model's."""

    def __init__(self, model: nn.Module, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.model = _DecoderPart(getattr(model, "model", model), layers, first=first, last=last)
        self.lm_head = getattr(model, "lm_head", None) if last else None
        self.config = getattr(model, "config", None)  # what packed rows' masks are built for
        # under sequence parallelism a stage receives and sends its tp rank's shard of the
        # sequence: the positions (rotary) are those of the whole sequence, this many shards long
        self.sequence_shards = 1
        # under context parallelism its cp rank's load-balanced shard (``runtime.cp_context``): the first
        # stage takes whole rows and keeps its shard's tokens, the others receive shards
        self.cp: CPContext | None = None
        # the model's name of each of the stage's parameters (the same names, by construction)
        named = {id(p): n for n, p in model.named_parameters()}
        self.model_names = {n: named[id(p)] for n, p in self.named_parameters()}

    @property
    def layers(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: packed rows' (each document's from 0); each document then attends to
        itself alone, by the mask transformers builds from them (``create_causal_mask``: dense
        ``[T, T]``, where ``Policy`` without stages attends per document without one), or under
        context parallelism by the document ids the cp attention reads from them."""
        part = self.model
        embed = part.embed_tokens
        first = embed is not None
        packed = positions is not None  # packed rows' own positions come with the microbatch
        if positions is None:
            positions, x = self._whole_row_positions(x, first)
        elif self.cp is not None:  # the cp attention finds the documents from the whole rows' positions
            positions, x = self._packed_row_positions(x, positions, first)
        hidden = embed(x) if embed is not None else x
        kind_of = {index: self._layer_kind(index, layer) for index, layer in part.layers.items()}
        kinds = set(kind_of.values())
        rotary = self._rotary(hidden, positions, kinds)
        # the cp attention masks by itself; else the masks the model's own forward would make
        masks = self._masks(hidden, positions, kinds) if self.cp is None else {}
        for index, layer in part.layers.items():
            kind = kind_of[index]
            out = layer(
                hidden,
                attention_mask=masks.get(kind),
                position_ids=positions,
                position_embeddings=rotary[kind],
                use_cache=False,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        if packed and self.cp is not None and hidden.requires_grad:
            # this microbatch's layout back in place before its layers' backward (and their
            # recomputation): the schedule may have laid out other microbatches since
            hidden.register_hook(_restoring(self.cp, self.cp.state()))
        if part.norm is not None:
            hidden = part.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden

    def _whole_row_positions(self, x: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the positions of rows that are one document each, ``x``); under context parallelism
        this cp rank's shard of them, and on the first stage its shard's tokens of ``x``."""
        if self.cp is None:
            length = x.shape[1] if first else x.shape[1] * self.sequence_shards
            return torch.arange(length, device=x.device).unsqueeze(0), x
        # the rows' whole length: what this rank's shard is of
        length = x.shape[1] if first else x.shape[1] * self.sequence_shards * self.cp.size
        positions = self.cp.unpadded(x.shape[0], length, x.device)
        return positions, x.index_select(1, positions[0]) if first else x

    def _packed_row_positions(
        self, x: torch.Tensor, positions: torch.Tensor, first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows under context parallelism: (this cp rank's positions of them, ``x``, on
        the first stage its shard's tokens). The rows are laid out as whole rows are (head and
        tail chunks), each document attending to itself by the ids the cp attention reads from
        the restarting positions (``CPContext.lay_out``), as without stages."""
        assert self.cp is not None
        index = self.cp.lay_out(positions)
        batch = self.cp.batch
        assert batch is not None
        return batch.q_positions, x.index_select(1, index) if first else x

    def _layer_kind(self, index: str, layer: nn.Module) -> str:
        """A layer's attention type as the model's forward reads it: the config's ``layer_types``
        at its index (Gemma 3's layers do not carry it), else the layer's own ``attention_type``."""
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return str(types[int(index)])
        return str(getattr(layer, "attention_type", "full_attention"))

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
        """Each layer type's rotary embedding: one for every layer, or one per type where the
        model's rotary takes the layer type (Gemma 3: its sliding layers have their own base)."""
        rotary = self.model.rotary_emb
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            return {kind: rotary(hidden, positions, kind) for kind in kinds}
        shared = rotary(hidden, positions)
        return dict.fromkeys(kinds, shared)

    def _masks(self, hidden: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
        """Each layer type's mask as the model's own forward makes it, in its attention's format:
        transformers finds packed rows' documents from the restarting positions, and gives None
        where the kernel masks causally by itself (SDPA's ``is_causal`` on whole rows), so a
        dense mask exists only where the model's own forward would make one (an eager attention,
        gpt-oss's for its sinks; Doge's dynamic mask; a sliding window)."""
        rows, length = positions.shape  # the whole rows: under sequence parallelism ``hidden`` is a shard
        like = torch.empty((rows, length, 1), dtype=hidden.dtype, device=positions.device)
        kwargs: dict[str, Any] = {
            "config": self.config,
            "inputs_embeds": like,
            "attention_mask": None,
            "past_key_values": None,
            "position_ids": positions,
        }
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: makers[kind](**kwargs) for kind in kinds if kind in makers}


def _restoring(cp: CPContext, state: CPState) -> Callable[[torch.Tensor], None]:
    """A gradient hook that puts a microbatch's cp layout back (``CPContext.restore``)."""

    def hook(_grad: torch.Tensor) -> None:
        cp.restore(state)

    return hook


class RankStages(nn.Module):
    """Every stage a rank holds as one module at the model's names (for a V schedule the first
    and the last stage together): what its checkpoints, weights and optimizer state are keyed
    by, the same keys a whole model's state dict has."""

    def __init__(self, stages: Sequence[DecoderStage]) -> None:
        super().__init__()
        first = next((s for s in stages if s.first), None)
        last = next((s for s in stages if s.last), None)
        layers = {name: layer for s in stages for name, layer in s.model.layers.items()}
        part = _DecoderPart.__new__(_DecoderPart)
        nn.Module.__init__(part)
        part.embed_tokens = first.model.embed_tokens if first is not None else None
        part.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        part.rotary_emb = stages[0].model.rotary_emb
        part.norm = last.model.norm if last is not None else None
        self.model = part
        self.lm_head = last.lm_head if last is not None else None


def plan_stage_layers(model: nn.Module, spec: PipelineSpec, pp: int) -> list[list[int]]:
    """The decoder layers of every stage: the plan's stage globs where it names them
    (``checks.pipeline`` checked that they cover every layer once, in order), else an even split
    over ``pp x`` the stages a rank holds (``PipelineSpec.per_rank``) with the first and last stages lighter by the
    plan's ``first_stage_less_layers`` / ``last_stage_less_layers``."""
    if spec.stages:
        return layers_of_stages(dict(model.named_modules()), spec)
    decoder: Any = getattr(model, "model", model)
    total = pp * spec.per_rank(len(decoder.layers), pp)
    split = stage_layers(len(decoder.layers), total, spec.first_stage_less_layers, spec.last_stage_less_layers)
    return [list(r) for r in split]


def parallelize_stages(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    lora: LoraSpec | None = None,
    cpu_offload: bool = False,
) -> list[tuple[int, DecoderStage]]:
    """This rank's stages of ``model`` (on meta: materialize them after), laid out as a pipeline
    rank of ``mesh``: the plan's TP styles (its experts over ep, ``mesh.expert_mesh``) and
    activation checkpointing on the whole model, the stages its schedule gives this pipeline rank
    cut from it, each FSDP2-sharded over dp x cp with the plan's units inside it (experts over
    edp; gradients summed and divided as ``runtime.gradient_scale`` says) as ``parallelize``
    shards a whole model; ``cpu_offload``: FSDP2's CPU offload, as there."""
    layout = mesh.layout
    spec = plan.pipeline or PipelineSpec()
    resolved = resolve_plan(plan, model, sequence_parallel=layout.sequence_parallel)
    experts = apply_tensor_parallel(model, resolved, mesh["tp"], expert_mesh=mesh.expert_mesh)
    if mesh.expert_mesh is not None and not experts:
        raise ValueError(f"ep={layout.ep} but the plan spreads no experts (no 'moe_experts' rule matched this model)")
    if lora is not None:  # after the tp styles (they shard the base), before FSDP (it shards both): as parallelize
        add_adapters(model, lora, resolved, mesh["tp"])
    apply_activation_checkpointing(model, resolved.activation_checkpointing, resolved.checkpoint_saves)
    compile_blocks(model, plan.compile)
    layers = plan_stage_layers(model, spec, layout.pp)
    total = len(layers)
    held = rank_stages(mesh["pp"].get_local_rank(), layout.pp, spec.schedule, total // layout.pp)
    stages = [(i, DecoderStage(model, layers[i], first=i == 0, last=i == total - 1)) for i in held]
    cp = cp_attention_context(model, mesh["cp"]) if layout.cp > 1 else None
    if cp is not None:
        select_keys_over_the_sequence(model, cp)
    for _, stage in stages:
        stage.sequence_shards = layout.tp if layout.sequence_parallel else 1
        stage.cp = cp
    names = {id(m): n for n, m in model.named_modules()}
    units = {names[id(model.get_submodule(u))] for u in resolved.fsdp_units}
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for _, stage in stages:
        modules = dict(stage.named_modules())  # a stage's modules sit at the model's names
        apply_fsdp(
            stage,
            [n for n, m in modules.items() if n and names.get(id(m)) in units],
            mesh.fsdp,
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
            offload_policy=offload,
            reshard_after_forward=plan.fsdp_reshard_after_forward,
            experts=[name for name in experts if name in modules],
            expert_mesh=mesh.expert_mesh,
            gradient_divide_factor=fsdp_divisor(layout),
            shard_dims=resolved.fsdp_shard_dims,
        )
        if cpu_offload:
            offloaded(stage)
    return stages


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """What each position predicts; the last predicts nothing."""
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


class PipelineRunner:
    """A rank's stages, their schedule and the pipeline group: ``run`` puts one schedule step of
    microbatches through them (``engine.pipeline.pipeline_steps`` says what the last stage computes)."""

    def __init__(
        self,
        stages: list[tuple[int, DecoderStage]],
        pp: int,
        *,
        microbatches: int,
        schedule: str = "1f1b",
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
        if microbatches < pp:
            # torch's 1F1B waits for microbatches that never come (torchtitan#775)
            raise ValueError(f"{microbatches} microbatches for {pp} pipeline ranks: at least one per rank")
        if schedule == "dualpipev" and microbatches < 2 * pp:
            raise ValueError(f"{microbatches} microbatches for DualPipeV on {pp} pipeline ranks: at least two per rank")
        self.stages, self.pp, self.total = stages, pp, pp * len(stages)
        self.group = group or dist.group.WORLD
        self.microbatches, self.schedule_name = microbatches, schedule
        self.device = device or next(stages[0][1].parameters()).device
        self.inferring = False  # inside torch's shape inference (``run``'s loss wrapper says why)
        # the stages' context parallelism: the last stage's output is this cp rank's positions
        self.cp: CPContext | None = getattr(stages[0][1], "cp", None) if stages else None
        self._last_rank: int | None = None

    @property
    def holds_last(self) -> bool:
        return any(i == self.total - 1 for i, _ in self.stages)

    def run(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        schedule: str,
        microbatches: int,
        forward_only: bool = False,
        positions: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """One schedule step over ``input_ids`` [B, S] cut into ``microbatches`` along B, with
        ``loss_fn(last stage's output, target's rows of the microbatch)``; ``schedule`` one of
        the plan's, or ``looped_bfs`` (breadth first, several stages a rank). ``forward_only``:
        no backward (the loss function still sees every microbatch's output). ``positions``
        [B, S]: packed rows' positions (each document's from 0), handed to every stage of this
        rank with its microbatch (torch splits a step's keyword inputs as it splits the rows;
        every rank of the pipeline holds them, so nothing travels between stages). Returns the
        last stage's losses, one per microbatch, on the rank that holds it ([] elsewhere)."""
        extra = {"positions": positions.to(self.device)} if positions is not None else {}
        if forward_only and schedule in V_SHAPED:
            # torch 2.13's V schedules cannot run without backward (their order sends a stage's
            # output to the same rank's next stage through the backward's buffers): every
            # stage in order instead, one microbatch at a time
            return self._forward_in_order(input_ids, target, loss_fn, microbatches, extra)
        pipe = [PipelineStage(m, i, self.total, self.device, group=self.group) for i, m in self.stages]
        kind = SCHEDULES.get(schedule, ScheduleLoopedBFS)
        runner: Any = None

        def real(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # torch infers a new stage's shapes by one dry forward on empty activations and calls
            # the loss on its output (for the input gradients' shapes only): that call is marked,
            # so that a loss which records what it saw skips it
            self.inferring = not _initialized(runner, forward_only)
            try:
                return loss_fn(output, target)
            finally:
                self.inferring = False

        runner = kind(
            pipe[0] if schedule in SINGLE else pipe, n_microbatches=microbatches, loss_fn=real, scale_grads=False
        )
        held = [i for i, _ in self.stages]
        losses: list[torch.Tensor] = []
        args = (input_ids.to(self.device),) if 0 in held else ()
        last_target = target.to(self.device) if self.holds_last else None
        if forward_only:
            runner.eval(*args, target=last_target, losses=losses, **extra)
            return losses
        # torch clears the FSDP stages' gradients after a new stage's shape inference (its dry
        # backward accumulates into them): a step of several schedule steps (one per length of
        # RL's rows) keeps what the earlier ones accumulated aside, and adds it back after
        params = [p for _, module in self.stages for p in module.parameters()]
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        runner.step(*args, target=last_target, losses=losses, **extra)
        for p, earlier in zip(params, kept, strict=True):
            if earlier is not None:
                p.grad = earlier if p.grad is None else earlier.add_(p.grad)
        return losses

    def _forward_in_order(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        microbatches: int,
        extra: dict[str, torch.Tensor],
    ) -> list[torch.Tensor]:
        """Forward only, stage after stage: each microbatch's rows through stage 0, 1, ... on the
        ranks that hold them, an activation sent to the next stage's rank where it is another
        (a header of its shape and dtype first: the receiver allocates what it is told, not a
        guess). No overlap between ranks: log-probs under a V schedule pay its bubble whole."""
        held = dict(self.stages)
        per_rank = self.total // self.pp
        owner = {i: r for r in range(self.pp) for i in rank_stages(r, self.pp, self.schedule_name, per_rank)}
        me = dist.get_rank(self.group)
        losses: list[torch.Tensor] = []
        ids, targets = input_ids.to(self.device).chunk(microbatches), target.to(self.device).chunk(microbatches)
        pieces = {name: value.chunk(microbatches) for name, value in extra.items()}
        for m in range(microbatches):
            mine = {name: chunks[m] for name, chunks in pieces.items()}
            x: torch.Tensor | None = ids[m] if 0 in held else None
            for i in range(self.total):
                if owner[i] != me:
                    continue
                if x is None:  # the previous stage is another rank's
                    x = _receive_activation(self.group, owner[i - 1], self.device)
                out = held[i](x, **mine)
                x = None
                if i == self.total - 1:
                    losses.append(loss_fn(out, targets[m]))
                elif owner[i + 1] == me:
                    x = out
                else:
                    _send_activation(out, self.group, owner[i + 1])
        return losses

    def breadth_first(self, microbatches: int) -> str:
        """The schedule a step of ``microbatches`` runs: the plan's, or breadth first (GPipe, or
        looped BFS for several stages a rank) where there are too few for its steady state, or,
        for the looped schedules of several stages a rank, a count that is not whole rounds of
        the pipeline's ranks (their orders are built for rounds: a step of RL's rows of one
        length may hold any count). V-shaped schedules have no breadth-first twin (looped BFS
        assumes looped placement): ``step_size`` pads their steps instead."""
        if self.schedule_name in SINGLE:
            return self.schedule_name if microbatches >= self.pp else "gpipe"
        if self.schedule_name in V_SHAPED:
            return self.schedule_name
        return self.schedule_name if microbatches >= self.pp and microbatches % self.pp == 0 else "looped_bfs"

    def step_size(self, microbatches: int) -> int:
        """The microbatches a step of ``microbatches`` runs as: as many, or for the V-shaped
        schedules the next count their orders are built for -- whole rounds of the pipeline's
        ranks, at least one round (ZBV) or two (DualPipeV: at fewer torch's order deadlocks) --
        the difference run as fillers the loss does not count."""
        if self.schedule_name not in V_SHAPED:
            return microbatches
        least = self.pp * (2 if self.schedule_name == "dualpipev" else 1)
        return max(least, -(-microbatches // self.pp) * self.pp)

    @property
    def last_rank(self) -> int:
        """The pipeline group's rank that holds the last stage: found once (one all-reduce, every
        rank calling it alike), the same for every step."""
        if self._last_rank is None:
            holder = torch.tensor([dist.get_rank(self.group) if self.holds_last else -1], device=self.device)
            dist.all_reduce(holder, op=dist.ReduceOp.MAX, group=self.group)
            self._last_rank = int(holder.item())
        return self._last_rank

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """The last stage's ``value`` on every rank of the pipeline, in place: every rank passes a
        tensor of the same shape (its own, or zeros where it holds no last stage), one broadcast."""
        out = value.float().contiguous()
        dist.broadcast(out, group_src=self.last_rank, group=self.group)
        return out


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _send_activation(x: torch.Tensor, group: dist.ProcessGroup | None, to: int) -> None:
    local = x.to_local() if isinstance(x, DTensor) else x
    if local.dtype not in _DTYPES:
        raise TypeError(f"a stage's activation of dtype {local.dtype}: one of {_DTYPES} expected")
    fields = [_DTYPES.index(local.dtype), local.dim(), *local.shape]
    header = torch.tensor(fields + [0] * (8 - len(fields)), dtype=torch.int64, device=local.device)
    dist.send(header, group_dst=to, group=group)
    dist.send(local.contiguous(), group_dst=to, group=group)


def _receive_activation(group: dist.ProcessGroup | None, source: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, group_src=source, group=group)
    dtype, dims, *shape = header.tolist()
    x = torch.empty(shape[:dims], dtype=_DTYPES[dtype], device=device)
    dist.recv(x, group_src=source, group=group)
    return x


def _initialized(schedule: Any, forward_only: bool) -> bool:
    """Whether torch's schedule has inferred its stages' shapes (its own flags: the single-stage
    schedules name them ``_stage_*``, the multi-stage ones ``_stages_*``)."""
    forward = getattr(schedule, "_stage_forward_initialized", getattr(schedule, "_stages_forward_initialized", True))
    backward = getattr(schedule, "_stage_backward_initialized", getattr(schedule, "_stages_backward_initialized", True))
    return bool(forward) and (forward_only or bool(backward))


def pipeline_grad_norm(parameters: Sequence[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of every stage's gradients together: within a rank's stages as plancc counts
    it over the axes each gradient is sharded on (``runtime.gradnorm``: tp and dp shards summed,
    replicas once), then summed over the pipeline's ranks, each of which holds other parameters."""
    if not any(p.grad is not None for p in parameters):
        raise ValueError("no gradients on this rank's stages: run a step first")
    square = global_grad_norm(parameters).pow(2)
    dist.all_reduce(square, group=pp_group or dist.group.WORLD)
    return square.sqrt()
