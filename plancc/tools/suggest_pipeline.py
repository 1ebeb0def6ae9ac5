"""``suggest``'s cost model for pipeline parallelism: a layout with pp > 1 and its schedule.

A rank holds ``1/pp`` of the decoder layers (and, on the first and the last stage, the
embedding and the lm_head: counted whole, the busiest stage). A dp rank's sequences of the step
go through the pipeline one sequence a microbatch (the most microbatches: the smallest bubble).

- **Memory**: parameters, gradients and AdamW state of the busiest stage; the activations of one
  microbatch of its layers times the microbatches in flight on the first stage (``min(pp, m)``,
  ``min(pp + 1, m)`` under DualPipeV); FSDP's buffers and the logit buffers as without pp.
- **Time**: the compute of the step's tokens over every GPU, plus the schedule's bubble
  (``bubble``: the zero-bubble papers' formulas with a microbatch's forward, input-gradient and
  weight-gradient passes equal, ``F = B = W``, as the 6N-flops accounting makes them); TP/CP/EP
  traffic for the rank's ``L / pp`` layers; FSDP's gather and reduce-scatter of the stage's
  weights once a step (torch's stages sync gradients at the last microbatch only), hidden behind
  the compute where they fit; and the point-to-point sends of one microbatch's hidden states
  across each stage boundary, forward and backward, exposed.
"""

from __future__ import annotations

from dataclasses import replace

from ..layout import Layout
from .suggest_model import BF16, FP32, Hardware, Memory, StepTime, bandwidth, fsdp_span, replicate_time

# schedules suggest costs, with their stages a rank
COSTED = (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2))
V_SHAPED = ("zbv", "dualpipev")


def bubble(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """The idle share the schedule adds to the compute of ``m`` microbatches on ``pp`` ranks with
    ``v`` stages a rank, a microbatch's passes ``F = B = W`` (forward, input gradient, weight
    gradient: 2N flops a token each):

    - 1F1B: ``(pp - 1)(F + B + W) / (m (F + B + W)) = (pp - 1) / m``;
    - Interleaved 1F1B: the same over ``v`` stages a rank, ``(pp - 1) / (v m)``;
    - interleaved zero bubble (B and W split, W filling the bubble; Qi et al. 2023, ZB-H1):
      ``(pp - 1)(F + B - W) / (v m (F + B + W)) = (pp - 1) / (3 v m)``;
    - ZBV and DualPipeV: ``(pp - 1)(F + B - 2W)`` and ``(pp/2 - 1)(F&B + B - 3W)`` (the papers'
      bubbles) are 0 at ``F = B = W``; costed as half ZB-H1's, ``(pp - 1) / (6 m)``: an
      assumption, not a measurement, so that no schedule is estimated free of a warm-up and a
      cool-down."""
    if schedule == "1f1b" or schedule == "gpipe":
        return (pp - 1) / microbatches
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (virtual * microbatches)
    if schedule == "zero_bubble":
        return (pp - 1) / (3 * virtual * microbatches)
    return (pp - 1) / (6 * microbatches)


def stage_memory(
    ends_peak: Memory,
    layout: Layout,
    root_share: float,
    microbatches: int,
    *,
    kept_gathered: bool = False,
    schedule: str = "1f1b",
) -> Memory:
    """The busiest stage's holding at one moment of the step from the whole model's at one
    microbatch (``ends_peak``, one of ``step_ends``): its share of the weights and their state,
    the in-flight microbatches' activations of its layers; with FSDP's units ``kept_gathered``
    from forward to backward, its layers' units."""
    pp = layout.pp
    share = (1 - root_share) / pp + root_share  # its layers, and the embedding or lm_head whole
    # the first stage's microbatches in flight: pp under 1F1B and its variants; DualPipeV's
    # two directions keep one more (DeepSeek-V3's report, Table 2: PP + 1)
    in_flight = min(pp + (1 if schedule == "dualpipev" else 0), microbatches)
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
    if layout.fsdp_size > 1 or layout.dp_replicate > 1:
        share = (layout.fsdp_size - 1) / layout.fsdp_size
        wire = bandwidth(hardware, fsdp_span(layout), gpus_per_node)
        total = layers_params / pp * share * (BF16 + FP32) / wire  # gathered once, reduced once a step
        total += replicate_time(layers_params / pp, layout, hardware, gpus_per_node)
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
    """The schedules a pp layout is costed with: 1F1B; the two-stages-a-rank ones (Interleaved
    1F1B, interleaved zero bubble, ZBV, DualPipeV) where the layers give each rank two stages and
    the microbatches come in whole rounds of pp."""
    found = []
    for schedule, virtual in COSTED:
        if layers < layout.pp * virtual or microbatches < layout.pp:
            continue
        if virtual > 1 and microbatches % layout.pp:
            continue
        if schedule == "dualpipev" and microbatches < 2 * layout.pp:  # torch's order needs two a rank
            continue
        found.append((schedule, virtual))
    return found


__all__ = ["COSTED", "V_SHAPED", "bubble", "costed_schedules", "stage_memory", "stage_time"]
