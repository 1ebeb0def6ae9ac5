"""``plancc.Policy``'s step executor for pipeline stages (``Layout(pp=N)``): ``build_stages``
builds this rank's stages as the policy's model parts, and ``PipelineSteps`` runs ``train``'s
forward and backward (any loss at global normalization), ``logprobs`` and ``logits`` over them
through torch's schedules (``engine.pipeline.pipeline_stages``). Everything else -- the optimizer and schedule,
the reference, the weights out, checkpoints, offloading -- is ``Policy``'s own code, as at pp=1.

How a step runs. Each rank holds the stages its schedule gives it (``plancc.schedules``), cut
from the model after the plan's TP styles and before FSDP2, which shards each stage over the
data-parallel ranks with the plan's units. The rows of this rank's slice are unpadded and
grouped by length: one schedule step per length, its rows cut into microbatches of equal shape
(a stage's shapes are fixed within a step, pytorch#159942, not across steps). RL's long-tailed
rows therefore cost one pipeline fill and drain per distinct length, never padding
(``bench/pipeline_uneven.py`` measures it). The loss function runs on the last stage, on the
log-probs of its microbatch's rows, and its value is the microbatch's share of the *global*
batch's loss (``BatchTotals``, as ``Policy``): the schedule does not scale gradients, so the gradients
are the whole batch's in one pass. The last stage's results (losses, metrics, log-probs) reach
every rank of the pipeline by one broadcast.

Sequence and context parallelism run inside each stage (a stage sends its tp and cp rank's shard
of the sequence; the last stage gathers its log-probs over cp, ``pipeline_last_stage``).

The weights out (``weights``, ``weights_manifest``, ``send_weights``, ``share_weights``,
``export_hf``) read the whole model's structure on meta, each tensor gathered by its stage
(``engine.pipeline.stage_values``). LoRA's adapters are laid out
on the stages as at pp=1; a weight tied across the first and the last stage is kept tied
(``engine.pipeline.pipeline_ties``). A resharded refit sends each receiver's pieces from the stage that
holds them (``engine.reshard``). Expert parallelism and FSDP CPU offload run inside each stage
(``engine.pipeline.pipeline_stages.parallelize_stages``). Packed rows (``pack=True``) go packed end to end into
rows of one length, one schedule step (``engine.pipeline.pipeline_rows.PackedGroup``). Not yet (refused
with the reason): packing beside context parallelism.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import PretrainedConfig

from ...compiler.plan import PipelineSpec, Plan
from ...compiler.resolve import resolve_plan, tied_parameter_groups
from ...models import MASTER_DTYPE, build_model
from ...runtime.gradient_scale import loss_scale
from ...runtime.gradnorm import scale_to_norm_
from ...runtime.hf_weights import load_hf_weights
from ...runtime.lora import Adapters, LoraSpec, adapters_of, add_adapters, base_shapes, initial_adapter_state
from ...runtime.materialize import materialize
from ...runtime.mesh import ParallelMesh
from ...runtime.parallelize import offloaded
from ..batch_agreement import different_fields, fields_fingerprint
from ..batches import Batch, BatchError, Microbatching, check_batch
from ..loss_contract import BatchTotals, NonFiniteError
from ..parallel_model import from_folder, seeded_model
from ..steps import ModelParts, StepOutcome, TrainStep
from .pipeline_last_stage import LastStageLogits, LastStageLogprobs, LastStageLoss, Recorded, per_token
from .pipeline_rows import PipelineRows, StepRows, fingerprint
from .pipeline_stages import (
    DecoderStage,
    PipelineRunner,
    RankStages,
    parallelize_stages,
    pipeline_grad_norm,
    plan_stage_layers,
)
from .pipeline_ties import StageTies, stage_ties, untie_across_stages
from .stage_values import StageValues


def build_stages(
    plan: Plan,
    source: str | None,
    config: PretrainedConfig,
    mesh: ParallelMesh,
    *,
    lora: LoraSpec | None,
    dtype: torch.dtype | None,
    seed: int,
    cpu_offload: bool,
    device: str,
) -> tuple[ModelParts, PipelineSteps]:
    """This rank's stages of the model as ``Policy``'s parts, filled with the weights (a model
    folder's, or the seeded initial ones), and the executor that steps them."""
    sizes = mesh.layout
    spec = plan.pipeline or PipelineSpec()
    # the whole model on meta (what checkpoints and weights out are shaped by); the stages are cut
    # from it, or from an untied copy when it ties a weight across stages (engine.pipeline.pipeline_ties)
    whole = build_model(copy.deepcopy(config), device="meta", dtype=MASTER_DTYPE)
    body, ties = whole, {}
    if tied_parameter_groups(whole):
        body = build_model(copy.deepcopy(config), device="meta", dtype=MASTER_DTYPE)
        ties = untie_across_stages(body)
        if lora is not None:  # the whole model names the adapters too: the weights out merge them
            resolved = resolve_plan(plan, whole, sequence_parallel=sizes.sequence_parallel)
            add_adapters(whole, lora, resolved, None)
    stage_count = len(plan_stage_layers(body, spec, sizes.pp))
    stages = parallelize_stages(body, plan, mesh, param_dtype=dtype, lora=lora, cpu_offload=cpu_offload)
    model = RankStages([s for _, s in stages])  # this rank's parameters at the model's names
    if cpu_offload:  # its stages' shards are in host memory: so are the rank's
        offloaded(model)
    adapters = adapters_of(whole)
    if adapters is not None:  # the adapters this rank's stages hold, at the model's names
        modules = {name for name, _ in model.named_modules()}
        mine = Adapters(spec=adapters.spec, modules=tuple(m for m in adapters.modules if m in modules))
        model.__dict__["_plancc_adapters"] = mine
    weight_source = _fill(stages, model, whole, config, source, ties, seed, device)
    tied = stage_ties(ties, dict(model.named_parameters()), mesh, spec.schedule, stage_count // sizes.pp)
    runner = PipelineRunner(
        stages,
        sizes.pp,
        microbatches=spec.microbatches or sizes.pp,
        schedule=spec.schedule,
        group=mesh["pp"].get_group(),
        device=torch.device(device),
    )
    values = StageValues(model, whole, mesh["pp"].get_group(), device)
    parts = ModelParts(
        model=model,
        whole=whole,
        weight_source=weight_source,
        values=values,
        aliases=ties,
        copies=frozenset(tied.copies),
    )
    return parts, PipelineSteps(model, mesh, config, device, runner=runner, tied=tied, ties=ties, values=values)


def _fill(
    stages: list[tuple[int, DecoderStage]],
    model: RankStages,
    whole: nn.Module,
    config: PretrainedConfig,
    source: str | None,
    ties: dict[str, str],
    seed: int,
    device: str,
) -> str:
    """The stages' weights: a model folder's safetensors, or the seeded initial weights of
    the whole model (each rank keeps its stages' shards)."""
    adapters = adapters_of(whole)
    # LoRA: every adapter from its seeded initialization, as at pp=1 (build.load_weights)
    initial = {} if adapters is None else initial_adapter_state(adapters, base_shapes(whole, adapters), seed)
    if source is not None and from_folder(source):
        for _, stage in stages:
            materialize(stage, device)
        load_hf_weights(model, source, whole=whole, aliases=ties)
        for _, stage in stages:
            mine = {k: initial[k].to(device) for k in stage.state_dict() if k in initial}
            if mine:
                set_model_state_dict(stage, mine, options=StateDictOptions(full_state_dict=True, strict=False))
        return f"safetensors from {source}"
    full = {**seeded_model(config, seed).state_dict(), **initial}
    for _, stage in stages:
        materialize(stage, device, full_state_dict={k: full[k].to(device) for k in stage.state_dict()})
    return f"random init (seed {seed})"


class PipelineSteps:
    """A step over this rank's stages (see the module's docstring)."""

    def __init__(
        self,
        model: RankStages,
        mesh: ParallelMesh,
        config: PretrainedConfig,
        device: str,
        *,
        runner: PipelineRunner,
        tied: StageTies,
        ties: dict[str, str],
        values: StageValues,
    ) -> None:
        self.model, self.mesh, self.config, self.device = model, mesh, config, device
        self.runner, self.tied, self._ties, self._values = runner, tied, ties, values
        self.layout = mesh.layout
        self.dp_size = self.layout.dp

    def tied_copies_identical(self) -> bool:
        # each side whole, broadcast from the pipeline rank holding it (collective, names in one order)
        return all(torch.equal(self._values(copy), self._values(weight)) for copy, weight in self._ties.items())

    # ------------------------------------------------------------------ training
    def train_step(self, step: TrainStep, optimizer: torch.optim.Optimizer) -> StepOutcome:
        """The forward and backward of this rank's slice over the pipeline, the loss normalized
        over the global batch, then clipped. ``loss_fn(logprobs [rows, L], fields, norm)`` sees a
        microbatch of rows of one length ``L`` (their padding removed, every field cut alike);
        ``token_loss(logprobs [n], tokens, norm)`` its predicted tokens flat."""
        rows, norm, input_tokens = self._prepared(step.batch, step.cut)
        self.model.train()
        recorded = Recorded()
        fn = per_token(step.token_loss) if step.token_loss is not None else step.loss_fn
        assert fn is not None, "one loss is given (Policy.train checked)"
        temperature, entropy = step.temperature, step.entropy
        scale = loss_scale(self.layout)
        try:
            for group in rows.groups():
                loss_of = LastStageLoss(self.runner, fn, group, norm, scale, temperature, entropy, recorded)
                self._run_step(group, loss_of, forward_only=False)
            loss, metrics, problem = self._agreed_outcome(recorded)
            if problem:
                raise BatchError(problem)
            self.tied.sum_gradients()  # before the norm: the tied weight's gradient is the sum of its copies'
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm_value = pipeline_grad_norm(self.tied.counted_once(params), self.mesh["pp"].get_group())
            grad_norm = float(norm_value)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteError(loss=loss, grad_norm=grad_norm, microbatch=None, parameter=None)
            scale_to_norm_(params, grad_norm, step.max_grad_norm or math.inf)
        except BaseException:
            optimizer.zero_grad(set_to_none=True)
            raise
        return StepOutcome(
            loss=loss,
            grad_norm=grad_norm,
            metrics=metrics,
            tokens=norm.tokens,
            sequences=norm.sequences,
            input_tokens=input_tokens,
            microbatches=sum(g.microbatches for g in rows.groups()),
        )

    def _agreed_outcome(self, recorded: Recorded) -> tuple[float, dict[str, float], str]:
        """The loss and metrics summed over the microbatches of the last stage and over dp; a
        refusal of the loss function, on every rank (one broadcast over the pipeline)."""
        values = {"": recorded.loss, **recorded.metrics} if self.runner.holds_last else None
        problem = recorded.problem if self.runner.holds_last else None
        box: list[Any] = [values and {k: float(v) for k, v in values.items()}, problem]
        dist.broadcast_object_list(box, group_src=self.runner.last_rank, group=self.mesh["pp"].get_group())
        found, why = box
        # every dp share's names and refusal: a metric some shares' loss does not give counts 0
        # there, and a refusal on one share is every rank's (no rank goes on to the step alone)
        shares: list[Any] = [None] * self.dp_size
        dist.all_gather_object(shares, (sorted(found), why or ""), group=self.mesh["dp"].get_group())
        names = sorted({name for share_names, _ in shares for name in share_names})
        summed = torch.tensor([found.get(n, 0.0) for n in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed, group=self.mesh["dp"].get_group())
        reduced = dict(zip(names, summed.tolist(), strict=True))
        loss = reduced.pop("")
        return loss, reduced, next((refusal for _, refusal in shares if refusal), "")

    def _prepared(self, batch: Batch, cut: Microbatching) -> tuple[PipelineRows, Any, float]:
        """This rank's rows unpadded and grouped by length, the global batch's ``BatchTotals`` and its
        attended tokens; the same ``BatchError`` on every rank when any rank's batch is refused."""
        problem, rows = "", None
        rows_print: tuple[int, int, tuple[int, ...], int] = (0, 0, (), 0)  # rows, then their other fields
        try:
            micro_batch_size, max_tokens = cut.micro_batch_size, cut.max_tokens
            vocab = getattr(self.config.get_text_config(), "vocab_size", None)
            check_batch(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, vocab_size=vocab)
            on_device = {name: value.to(self.device) for name, value in batch.items()}
            rows = PipelineRows.of(
                on_device,
                micro_batch_size=micro_batch_size,
                max_tokens=max_tokens,
                microbatches=self.runner.microbatches,  # the plan's, or one per stage
                multiple=self.layout.sequence_multiple,
                pack=cut.pack,
            )
            ids, mask = on_device["input_ids"], on_device["attention_mask"]
            rows_print = (*fingerprint(ids, mask), int(fields_fingerprint(on_device, ids.device)))
        except BatchError as exc:
            problem = str(exc)
        # one gather of every rank's verdict, rows' fingerprint, counts and schedule steps
        mine = {
            "problem": problem,
            "print": rows_print,
            "counts": (rows.tokens, rows.sequences, rows.input_tokens) if rows is not None else (0.0, 0.0, 0.0),
            "steps": [g.microbatches for g in rows.groups()] if rows is not None else [],
        }
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        refused = [(r, e["problem"]) for r, e in enumerate(every) if e["problem"]]
        if refused:
            raise BatchError(f"rank {refused[0][0]}: {refused[0][1]}")
        assert rows is not None, "no rank refused, so this rank built its rows"
        # (pp, dp, cp*tp) -- HSDP's (dp_replicate, dp_shard) read as one dp: a rank's dp share is its index on dim 1
        grid = self.mesh.device_mesh.mesh.reshape(self.layout.pp, self.layout.dp, -1)
        share = {int(r): int(d) for d in range(grid.shape[1]) for r in grid[:, d].flatten()}
        shares: dict[int, list[int]] = {}
        for r in range(len(every)):
            shares.setdefault(share[r], []).append(r)
        for ranks in shares.values():
            first = every[ranks[0]]["print"]
            if any(every[r]["print"][:3] != first[:3] for r in ranks):
                raise BatchError(
                    f"the ranks {ranks} of one pipeline / tp group were given different rows: they must pass the "
                    "same rows (pass rows policy.slice_of(global_rows) on each rank)"
                )
            if any(every[r]["print"][3] != first[3] for r in ranks):
                raise BatchError(different_fields(ranks, batch))
        heads = [every[ranks[0]] for ranks in shares.values()]
        tokens, sequences, input_tokens = (sum(h["counts"][i] for h in heads) for i in (0, 1, 2))
        # FSDP gathers a stage's weights over dp for every microbatch: every dp rank runs as many
        # schedule steps, each of as many microbatches (fillers, computed and not counted, where
        # a rank has fewer rows of that length, or no such step)
        rows.align([h["steps"] for h in heads])
        return rows, BatchTotals(tokens=float(tokens), sequences=float(sequences)), float(input_tokens)

    # ------------------------------------------------------------------ log-probs
    def logprobs(
        self, batch: Batch, cut: Microbatching, *, entropy: bool, temperature: float
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[rows, s]`` fp32 log-probs of this rank's rows (0 at position 0 and padding) on
        every rank of the pipeline; with ``entropy=True`` a pair."""
        rows, _, _ = self._prepared(batch, cut)
        shape = tuple(batch["input_ids"].shape)
        out = torch.zeros((2, *shape), dtype=torch.float32, device=self.device)
        self._forward_only(rows, lambda group: LastStageLogprobs(group, out, temperature, entropy, self.runner.cp))
        out = self.runner.from_last_stage(out)  # zeros where no last stage: that rank's values arrive
        return (out[0], out[1]) if entropy else out[0]

    def logits(self, batch: Batch) -> torch.Tensor:
        """``[rows, s, vocab]`` fp32 logits of this rank's rows (0 at padding) on every rank of
        the pipeline, the vocabulary whole: what ``--verify`` compares with the unsharded model."""
        rows, _, _ = self._prepared(batch, Microbatching())
        vocab = self.config.get_text_config().vocab_size
        out = torch.zeros((*batch["input_ids"].shape, vocab), dtype=torch.float32, device=self.device)
        self._forward_only(rows, lambda group: LastStageLogits(group, out, self.runner.cp))
        return self.runner.from_last_stage(out)

    def _forward_only(self, rows: PipelineRows, capture: Callable[[StepRows], Callable[..., torch.Tensor]]) -> None:
        """Every length's rows through the stages without backward, in eval mode; ``capture(group)``
        is the last stage's function that keeps what it computes."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for group in rows.groups():
                    self._run_step(group, capture(group), forward_only=True)
        finally:
            self.model.train(was_training)

    def _run_step(self, group: StepRows, last_stage: Callable[..., torch.Tensor], *, forward_only: bool) -> None:
        """One schedule step of a length's rows (a V schedule's padded to whole rounds)."""
        group.pad_to(self.runner.step_size(group.microbatches))
        self.runner.run(
            group.input_ids,
            group.index,
            last_stage,
            schedule=self.runner.breadth_first(group.microbatches),
            microbatches=group.microbatches,
            forward_only=forward_only,
            positions=group.positions,
        )
