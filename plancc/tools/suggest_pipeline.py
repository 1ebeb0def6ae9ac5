"""``suggest``'s cost model for pipeline parallelism: a layout with pp > 1 and its schedule.

A rank holds ``1/pp`` of the decoder layers (and, on the first and the last stage, the
embedding and the lm_head: counted whole, the busiest stage). A dp rank's sequences of the step
go through the pipeline one sequence a microbatch (the most microbatches: the smallest bubble).

- **Memory**: parameters, gradients and AdamW state of the busiest stage; the activations of one
  microbatch of its layers times the microbatches in flight on the first stage (``min(pp, m)``
  under 1F1B and Interleaved 1F1B); FSDP's buffers and the logit buffers as without pp.
- **Time**: the compute of the step's tokens over every GPU, plus the schedule's bubble:
  ``(pp - 1) / m`` of it for 1F1B, ``(pp - 1) / (v * m)`` for Interleaved 1F1B with ``v`` stages
  a rank; TP/CP/EP traffic for the rank's ``L / pp`` layers; FSDP's gather and reduce-scatter of
  the stage's weights once a step (torch's stages sync gradients at the last microbatch only),
  hidden behind the compute where they fit; and the point-to-point sends of one microbatch's
  hidden states across each stage boundary, forward and backward, exposed.
"""

from __future__ import annotations

from dataclasses import replace

from ..layout import Layout
from .suggest_model import BF16, FP32, Hardware, Memory, StepTime, bandwidth

# schedules suggest costs, with their stages a rank (the V schedules and zero bubble: not yet)
COSTED = (("1f1b", 1), ("interleaved_1f1b", 2))


def bubble(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """The idle share the schedule adds to the compute: (pp - 1) / m for 1F1B, divided by the
    stages a rank for the interleaved one."""
    return (pp - 1) / (microbatches * (virtual if schedule == "interleaved_1f1b" else 1))


def stage_memory(
    ends_peak: Memory, layout: Layout, root_share: float, microbatches: int, *, kept_gathered: bool = False
) -> Memory:
    """The busiest stage's holding at one moment of the step from the whole model's at one
    microbatch (``ends_peak``, one of ``step_ends``): its share of the weights and their state,
    the in-flight microbatches' activations of its layers; with FSDP's units ``kept_gathered``
    from forward to backward, its layers' units."""
    pp = layout.pp
    share = (1 - root_share) / pp + root_share  # its layers, and the embedding or lm_head whole
    in_flight = min(pp, microbatches)
    return replace(
        ends_peak,
        parameters=int(ends_peak.parameters * share),
        gradients=int(ends_peak.gradients * share),
        optimizer=int(ends_peak.optimizer * share),
        activations=int(ends_peak.activations * in_flight / pp),
        fsdp_buffers=int(ends_peak.fsdp_buffers / pp) if kept_gathered else ends_peak.fsdp_buffers,
    )


def stage_time(
    one_pass: StepTime,
    layout: Layout,
    hardware: Hardware,
    *,
    layers: int,
    layers_params: float,
    hidden: int,
    seq_len: int,
    schedule: str,
    microbatches: int,
    virtual: int,
    gpus_per_node: int,
) -> StepTime:
    """``one_pass`` (the layout's step as ``time_of`` costs it, every layer on every rank's
    traffic) for a rank of a pipeline stage."""
    pp = layout.pp
    fsdp = 0.0
    if layout.fsdp_size > 1:
        share = (layout.fsdp_size - 1) / layout.fsdp_size
        wire = bandwidth(hardware, layout.world_size, gpus_per_node)
        total = layers_params / pp * share * (BF16 + FP32) / wire  # gathered once, reduced once a step
        first_unit = layers_params / max(layers, 1) * share * (BF16 + FP32) / wire
        fsdp = max(0.0, total - one_pass.compute) + first_unit
    # one sequence's hidden states across each stage boundary, forward and backward, between nodes
    # once a stage spans them
    p2p = 2 * (pp - 1) * seq_len * hidden * BF16 / bandwidth(hardware, layout.world_size, gpus_per_node)
    return StepTime(
        compute=one_pass.compute,
        tp=one_pass.tp / pp,
        cp=one_pass.cp / pp,
        ep=one_pass.ep / pp,
        fsdp=fsdp,
        pipeline=p2p + one_pass.compute * bubble(schedule, pp, microbatches, virtual),
    )


def costed_schedules(layers: int, layout: Layout, microbatches: int) -> list[tuple[str, int]]:
    """The schedules a pp layout is costed with: 1F1B; Interleaved 1F1B where the layers give
    each rank two stages and the microbatches come in whole rounds of pp."""
    found = []
    for schedule, virtual in COSTED:
        if layers < layout.pp * virtual or microbatches < layout.pp:
            continue
        if virtual > 1 and microbatches % layout.pp:
            continue
        found.append((schedule, virtual))
    return found


__all__ = ["COSTED", "bubble", "costed_schedules", "stage_memory", "stage_time"]
