"""Pipeline schedules by the plan's names, and where each puts a rank's stages. Pure Python:
the plan's checks (``checks.pipeline``) and the runtime (``engine.pipeline.pipeline_stages``) read the same
table.

torch.distributed.pipelining's schedules run one stage a rank (GPipe, 1F1B), several looped
stages (Interleaved 1F1B, interleaved zero bubble: rank r holds r, r + pp, ...), or exactly two
meeting in a V (ZBV, DualPipeV: rank r holds r and 2*pp - 1 - r, so rank 0 holds the first and
the last stage).
"""

from __future__ import annotations

from typing import Final

SCHEDULE_NAMES: Final = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
SINGLE: Final = ("gpipe", "1f1b")
V_SHAPED: Final = ("zbv", "dualpipev")


def schedule_problem(schedule: str, virtual: int) -> str | None:
    """Why ``schedule`` cannot run ``virtual`` stages a rank, or None."""
    if schedule not in SCHEDULE_NAMES:
        return f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULE_NAMES)}"
    if schedule in SINGLE and virtual != 1:
        return f"{schedule} runs one stage a rank, not {virtual}"
    if schedule in V_SHAPED and virtual != 2:
        return f"{schedule} runs exactly two stages a rank (a V), not {virtual}"
    return None


def stages_per_rank(schedule: str, pp: int, layers: int, layers_per_stage: int, first_less: int, last_less: int) -> int:
    """The stages a rank holds when the plan gives ``layers_per_stage`` (torchtitan's
    ``pipeline_parallel_layers_per_stage``): the decoder's layers, plus the first and last
    stage's weights (``first_less`` / ``last_less``: the embedding and the lm_head counted as
    layers), cut ``layers_per_stage`` a stage, over ``pp`` ranks. ``ValueError`` where the count
    is not whole rounds of ``pp`` or not what the schedule runs."""
    if layers_per_stage < 1:
        raise ValueError(f"layers_per_stage {layers_per_stage}: at least 1")
    total = -(-(layers + first_less + last_less) // layers_per_stage)
    if total % pp:
        ends = f" (+{first_less} +{last_less} for the embedding and the lm_head)" if first_less or last_less else ""
        raise ValueError(
            f"{layers} decoder layers{ends} at {layers_per_stage} a stage make {total} stages, "
            f"not a multiple of pp={pp}"
        )
    virtual = total // pp
    why = schedule_problem(schedule, virtual)
    if why is None and schedule not in SINGLE and virtual < 2:
        why = f"{schedule} loops several stages a rank, and layers_per_stage {layers_per_stage} gives 1"
    if why is not None:
        raise ValueError(f"{why} ({total} stages of about {layers_per_stage} layers over pp={pp})")
    return virtual


def rank_stages(rank: int, pp: int, schedule: str, virtual: int) -> list[int]:
    """The stage indices ``rank`` of ``pp`` holds under ``schedule`` with ``virtual`` stages a rank."""
    problem = schedule_problem(schedule, virtual)
    if problem is not None:
        raise ValueError(problem)
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(virtual)]


def stage_layers(layers: int, stages: int, first_less: int = 0, last_less: int = 0) -> list[range]:
    """Decoder layers per stage, contiguous and in order, every layer once. The first stage counts
    as ``first_less`` layers more (it holds the embedding) and the last as ``last_less`` more (the
    final norm and lm_head) -- torchtitan's ``first_stage_less_layers`` / ``last_stage_less_layers``
    -- and the rest is split evenly, the first stages taking one more where it does not divide."""
    units = layers + first_less + last_less
    if not 1 <= stages <= units:
        raise ValueError(f"{stages} pipeline stages for {layers} decoder layers: each stage needs at least one")
    base, extra = divmod(units, stages)
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    counts[0] -= first_less
    counts[-1] -= last_less
    if stages == 1:
        counts = [layers]
    if min(counts) < 0 or (stages > 1 and min(counts[1:-1], default=1) < 1):
        raise ValueError(
            f"{stages} pipeline stages for {layers} decoder layers with the first stage {first_less} and the last "
            f"{last_less} layers lighter: a stage would hold {min(counts)}"
        )
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds
