"""Tied weights across pipeline stages: Qwen3-0.6B, Llama 3.2 1B and Gemma tie the lm_head to the
input embedding, which live on the first and the last stage.

The tie is kept as Megatron keeps it: the last stage gets its own copy of the weight
(``untie_across_stages``, on the meta model the stages are cut from: both copies filled with the
same values), and after every backward the two gradients are summed between the pipeline ranks
that hold them (``StageTies.sum_gradients``) -- the same (dp, cp, tp) coordinates, so their local
shards are the same slice of the weight. Both copies then take the same optimizer step from the
same state and stay equal; the unsharded model's gradient of the one weight is that sum. The
global gradient norm counts the weight once (``counted_once``). Under a V schedule one rank
holds the first and the last stage, and the sum is local.

Checkpoints, weights out and exports read the whole (tied) model's names: the copy is the
embedding's value, written once (``engine.pipeline.stage_values``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...compiler.resolve import tied_parameter_groups
from ...layout import LayoutError
from ...runtime.mesh import ParallelMesh
from ...schedules import rank_stages


def untie_across_stages(model: nn.Module) -> dict[str, str]:
    """Give every tied parameter's later names their own Parameter (meta, the same shape):
    ``{copy name: the name it copies}``, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``."""
    ties: dict[str, str] = {}
    for (kept_module, kept_param), *copies in tied_parameter_groups(model):
        kept = f"{kept_module}.{kept_param}" if kept_module else kept_param
        for owner, attr in copies:
            module = model.get_submodule(owner)
            original = getattr(module, attr)
            setattr(module, attr, nn.Parameter(torch.empty_like(original), requires_grad=original.requires_grad))
            ties[f"{owner}.{attr}" if owner else attr] = kept
    config = getattr(model, "config", None)
    if ties and config is not None:
        # transformers re-ties on tie_weights() (post_init, resize, from_pretrained): not here
        config.tie_word_embeddings = False
    return ties


@dataclass
class StageTies:
    """The tied pairs this rank holds a side of, and how their gradients meet."""

    # (the weight, its copy): a side another pipeline rank holds is None
    pairs: list[tuple[nn.Parameter | None, nn.Parameter | None]] = field(default_factory=list)
    group: dist.ProcessGroup | None = None  # the two pipeline ranks of this rank's coordinates

    @property
    def copies(self) -> set[int]:
        return {id(copy) for _, copy in self.pairs if copy is not None}

    def counted_once(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without the copies: the norm counts each tied weight once."""
        copies = self.copies
        return [p for p in params if id(p) not in copies]

    def sum_gradients(self) -> None:
        """Each tied weight's gradient, summed over its copies, on every copy (collective over
        ``group``; local where one rank holds both)."""
        for weight, copy in self.pairs:
            # frozen (LoRA trains adapters alone, on every rank alike) or a middle stage's rank
            held = [p for p in (weight, copy) if p is not None and p.requires_grad]
            if not held:
                continue
            grads = [_local(p.grad) for p in held if p.grad is not None]
            if len(grads) != len(held):
                raise RuntimeError("a tied weight's copy has no gradient: run a backward first")
            if len(held) == 2:
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
            else:
                dist.all_reduce(grads[0], group=self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def stage_ties(
    ties: dict[str, str], held: dict[str, nn.Parameter], mesh: ParallelMesh, schedule: str, virtual: int
) -> StageTies:
    """This rank's ``StageTies`` for ``ties`` (``untie_across_stages``'s), ``held`` its stages'
    parameters by the model's names. Collective over every rank (the pairs' groups are made
    here); refuses a plan that lays the two copies out differently (their gradients' local
    shards would not be the same slice)."""
    if not ties:
        return StageTies()
    pp = mesh.layout.pp
    holders = [rank_stages(r, pp, schedule, virtual) for r in range(pp)]
    last_stage = pp * virtual - 1
    first = next(r for r, stages in enumerate(holders) if 0 in stages)
    last = next(r for r, stages in enumerate(holders) if last_stage in stages)
    found = StageTies(pairs=[(held.get(weight), held.get(copy)) for copy, weight in ties.items()])
    # every side's layout, compared between the pipeline ranks holding them
    mine = [
        tuple((str(p.placements), tuple(p.to_local().shape)) if isinstance(p, DTensor) else ("", tuple(p.shape)))
        if p is not None
        else None
        for pair in found.pairs
        for p in pair
    ]
    every: list[list[tuple[str, tuple[int, ...]] | None]] = [[] for _ in range(pp)]
    dist.all_gather_object(every, mine, group=mesh["pp"].get_group())
    for i, (copy, weight) in enumerate(ties.items()):
        sides = (every[first][2 * i], every[last][2 * i + 1])
        if sides[0] != sides[1]:
            raise LayoutError.from_message(
                f"{copy} is tied to {weight}, which the plan lays out as {sides[0]} on the first stage and "
                f"{sides[1]} on the last: their gradients cannot be summed shard by shard",
                f"give {weight.rpartition('.')[0]} and {copy.rpartition('.')[0]} styles that shard the "
                "weight alike (embedding_rowwise and colwise_logits shard both on the vocabulary)",
            )
    if first != last:
        grid = mesh.device_mesh.mesh.reshape(pp, -1)
        me = dist.get_rank()
        for column in range(grid.shape[1]):  # every rank makes every pair's group, in one order
            ranks = [int(grid[first, column]), int(grid[last, column])]
            group = dist.new_group(ranks)
            if me in ranks:
                found.group = group
    return found
