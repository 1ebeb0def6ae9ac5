"""``plancc explain --pp N``: each pipeline stage's parameters and the bytes a rank holds for it.

The stages are the plan's (``pipeline.stages``: the layers its globs match, ``checks.pipeline``)
or the even split (``schedules.stage_layers``: the first stages take the remainder); the
embedding is on the first stage, the final norm and lm_head on the last. A parameter's bytes
are its row's in ``explain`` (fp32 master weights, the plan's TP shard, FSDP over the pipeline
rank's dp x cp), so a stage's are exact, not a share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..compiler.globs import generalize
from ..compiler.plan import PipelineSpec
from ..schedules import rank_stages, stage_layers
from .explain import Explanation, human_bytes

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageBytes:
    stage: int
    layers: tuple[int, ...]
    parameters: int  # elements, unsharded
    param_bytes: int  # per rank: fp32 masters; gradients the same where trained, AdamW twice that
    grad_bytes: int


def stage_bytes(model: nn.Module, exp: Explanation, stage_of_layer: dict[int, int], stages: int) -> list[StageBytes]:
    """Every stage's parameters and per-rank bytes, parameter by parameter. A weight tied across
    two stages (the embedding and lm_head) is held by both: the last stage keeps a copy
    (``engine.pipeline.pipeline_ties``), counted there at the weight's size."""
    per_instance = {(r.group, r.param): (r.local_bytes // max(r.count, 1), r.trainable) for r in exp.rows}
    params, held, grads = [0] * stages, [0] * stages, [0] * stages
    layers: list[set[int]] = [set() for _ in range(stages)]
    first_seen: dict[int, tuple[int, tuple[int, bool]]] = {}  # id -> (its stage, its size and trained)
    for name, p in model.named_parameters(remove_duplicate=False):
        module, _, param = name.rpartition(".")
        layer = _LAYER.search(f".{name}")
        if layer is not None:
            stage = stage_of_layer[int(layer[1])]
            layers[stage].add(int(layer[1]))
        else:  # the embedding on the first stage; the final norm and lm_head on the last
            stage = 0 if "embed" in module else stages - 1
        seen = first_seen.get(id(p))
        if seen is not None and seen[0] == stage:
            continue  # tied within one stage: one tensor
        size, trained = seen[1] if seen is not None else per_instance.get((generalize(module), param), (0, True))
        first_seen.setdefault(id(p), (stage, (size, trained)))
        params[stage] += p.numel()
        held[stage] += size
        grads[stage] += size if trained else 0
    return [
        StageBytes(
            stage=i, layers=tuple(sorted(layers[i])), parameters=params[i], param_bytes=held[i], grad_bytes=grads[i]
        )  # fmt: skip
        for i in range(stages)
    ]


def stages_of(spec: PipelineSpec | None, layers: int, pp: int, matched: list[list[int]] | None) -> dict[int, int]:
    """Each decoder layer's stage: the plan's globs' (``matched``), else the even split."""
    virtual = spec.per_rank(layers, pp) if spec is not None else 1
    lighter = (spec.first_stage_less_layers, spec.last_stage_less_layers) if spec is not None else (0, 0)
    split = matched if matched else [list(r) for r in stage_layers(layers, pp * virtual, *lighter)]
    return {layer: stage for stage, group in enumerate(split) for layer in group}


def rank_of_stage(spec: PipelineSpec | None, pp: int, layers: int) -> dict[int, int]:
    schedule = spec.schedule if spec is not None else "1f1b"
    virtual = spec.per_rank(layers, pp) if spec is not None else 1
    return {stage: rank for rank in range(pp) for stage in rank_stages(rank, pp, schedule, virtual)}


def render_stages(found: list[StageBytes], ranks: dict[int, int]) -> str:
    lines = ["", "pipeline stages (per rank: fp32 masters; gradients; AdamW state twice the gradients):"]
    for s in found:
        span = f"layers {s.layers[0]}-{s.layers[-1]}" if s.layers else "no layers"
        total = s.param_bytes + 3 * s.grad_bytes
        lines.append(
            f"  stage {s.stage} (pp rank {ranks.get(s.stage, s.stage)}): {span}, {s.parameters:,} parameters; "
            f"parameters {human_bytes(s.param_bytes)}, gradients {human_bytes(s.grad_bytes)}, "
            f"AdamW {human_bytes(2 * s.grad_bytes)}, total {human_bytes(total)}"
        )
    return "\n".join(lines)
