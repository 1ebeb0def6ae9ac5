"""The figures ``plancc suggest`` costs with: the hardware, a rank's memory by kind and a step's
time by kind (``tools.suggest`` searches with them, ``tools.suggest_pipeline`` adds the
pipeline's share)."""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout

GiB = 2**30
BF16, FP32 = 2, 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One accelerator's figures: dense bf16 peak, memory, and the bandwidth one GPU gets in one
    direction inside a node (NVLink / NVSwitch) and across nodes (its NIC)."""

    name: str
    peak_flops: float  # bf16 dense, FLOP/s
    memory: int  # bytes
    intra_node: float  # bytes/s per GPU
    inter_node: float  # bytes/s per GPU
    # the fraction of peak large matmuls reach in training (what MFU tops out near in published
    # runs of dense models); the step's compute time is FLOPs / (peak * this)
    achievable: float = 0.5


# Vendor datasheets (dense bf16, no sparsity); NVLink per GPU and direction; one 400 Gb/s NIC
# per GPU (50 GB/s) for H100/H200/B200, 200 Gb/s for A100. docs/suggest.md cites them.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(name="H100 SXM", peak_flops=989e12, memory=80 * GiB, intra_node=450e9, inter_node=50e9),
    "h200": Hardware(name="H200 SXM", peak_flops=989e12, memory=141 * GiB, intra_node=450e9, inter_node=50e9),
    "a100": Hardware(name="A100 SXM 80GB", peak_flops=312e12, memory=80 * GiB, intra_node=300e9, inter_node=25e9),
    "b200": Hardware(name="B200", peak_flops=2250e12, memory=180 * GiB, intra_node=900e9, inter_node=50e9),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """Bytes per rank at the step's peak, by kind, and which moment of the step that is (``at``,
    one of ``step_ends``': "forward", "backward start", "backward end", "optimizer step")."""

    parameters: int
    gradients: int
    optimizer: int  # AdamW's state, and at the optimizer step its temporaries
    fsdp_buffers: int
    activations: int
    logits: int
    at: str = "forward"

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.fsdp_buffers + self.activations + self.logits

    def largest(self) -> str:
        parts = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "AdamW state": self.optimizer,
            "FSDP buffers": self.fsdp_buffers,
            "activations": self.activations,
            "logit buffers": self.logits,
        }
        return max(parts, key=lambda k: parts[k])


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Seconds per step: the compute, and the communication not hidden behind it (per kind)."""

    compute: float
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    fsdp: float = 0.0  # FSDP's exposed part only
    pipeline: float = 0.0  # pipeline parallelism: the schedule's bubble and the stages' sends

    @property
    def exposed_comm(self) -> float:
        return self.tp + self.cp + self.ep + self.fsdp

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.pipeline


def bandwidth(hardware: Hardware, span: int, gpus_per_node: int) -> float:
    """A group of ``span`` consecutive-stride ranks stays inside a node when it fits one."""
    return hardware.intra_node if span <= gpus_per_node else hardware.inter_node


def fsdp_span(layout: Layout) -> int:
    """The ranks FSDP's all-gathers and reduce-scatters span, consecutive ones: under HSDP one
    replica's (its dp_shard x cp x tp ranks: a node, when the replicas are the nodes). Without
    HSDP the whole world, as the cost model has always counted it (a pipeline stage's FSDP
    spans only its own ranks; counting that would move suggest's pp rankings, unmeasured)."""
    if layout.dp_replicate == 1:
        return layout.world_size
    return layout.world_size // layout.pp // layout.dp_replicate


def replicate_time(params: float, layout: Layout, hardware: Hardware, gpus_per_node: int) -> float:
    """HSDP's all-reduce of each rank's fp32 gradient shard between the replicas, a backward:
    a ring all-reduce moves 2 (R-1)/R of it, over the link that joins the replicas."""
    if layout.dp_replicate == 1:
        return 0.0
    replicas = layout.dp_replicate
    wire = 2 * (replicas - 1) / replicas * params / layout.fsdp_size * FP32
    return wire / bandwidth(hardware, layout.world_size // layout.pp, gpus_per_node)
