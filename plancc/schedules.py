"""Pipeline schedules by the plan's names, and where each puts a rank's stages. Pure Python:
the plan's checks (``checks.pipeline``) and the runtime (``runtime.pipeline``) read the same
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


def rank_stages(rank: int, pp: int, schedule: str, virtual: int) -> list[int]:
    """The stage indices ``rank`` of ``pp`` holds under ``schedule`` with ``virtual`` stages a rank."""
    problem = schedule_problem(schedule, virtual)
    if problem is not None:
        raise ValueError(problem)
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(virtual)]


def stage_layers(layers: int, stages: int) -> list[range]:
    """Decoder layers per stage, contiguous and in order; the first stages take one more where
    they do not divide evenly (every layer once)."""
    if not 1 <= stages <= layers:
        raise ValueError(f"{stages} pipeline stages for {layers} decoder layers: each stage needs at least one")
    base, extra = divmod(layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds
