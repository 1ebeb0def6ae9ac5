"""A dry run at the real world size, in one process, with no GPU and no memory.

A fake process group (every collective returns at once) stands in for ``dp*cp*tp`` ranks,
and fake tensors carry shapes, dtypes and placements without storage. The real
architecture is built on meta, parallelized with the compiled plan and FSDP2 exactly as
``plancc.parallelize`` does in a job, then runs a forward and a backward pass: layout
mistakes that static checks cannot see fail here, and the failure is reported as a
diagnostic naming the module that raised. The per-rank bytes of parameters and gradients
are read off the resulting local shards (rank 0).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import PretrainedConfig

from ..compiler.plan import Plan
from ..compiler.resolve import resolve_plan
from ..dataflow import batched_experts
from ..engine.pipeline.pipeline_stages import parallelize_stages
from ..errors import Diagnostic, PlanError, Severity, SourceLoc, quiet_logger
from ..layout import Layout
from ..models import build_model, decoder_layers
from ..runtime.collectives import CountCollectives, Traffic, mesh_axes
from ..runtime.failures import ModuleTracker, failure_diagnostic
from ..runtime.mesh import ParallelMesh, build_mesh
from ..runtime.parallelize import parallelize
from .explain import human_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRunReport:
    layout: Layout
    param_bytes: int  # this rank's local parameter shards
    grad_bytes: int
    optimizer_bytes: int  # AdamW: two fp32 moments per local parameter element
    seconds: float
    diagnostics: tuple[Diagnostic, ...] = ()
    # one forward and one backward of a decoder layer: its collectives
    traffic: LayerTraffic = field(default_factory=lambda: LayerTraffic())
    layers: int = 0

    @property
    def layer_traffic(self) -> Traffic:
        return self.traffic.layer

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


@contextmanager
def _fake_process_group(world: int) -> Iterator[None]:
    """A fake process group of ``world`` ranks (this process is rank 0), unless one exists."""
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        if owns_group:
            dist.destroy_process_group()
            _forget_meshes()


def _forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions, which hold the device meshes they were made
    on: a mesh equals another of the same ranks and names whatever its process groups, so a
    second fake world (suggest's --verify-top, a test's second layout) would be handed the first
    world's meshes, whose groups are gone (an HSDP world after a plain one: 'Could not resolve
    the process group')."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own
    if native is not None:
        native()


@dataclass(kw_only=True, slots=True)
class _Measured:
    param_bytes: int = 0
    grad_bytes: int = 0
    stage: str = "parallelize"
    traffic: Traffic = field(default_factory=Traffic)


def _forward_backward(
    model: torch.nn.Module,
    plan: Plan,
    layout: Layout,
    config: PretrainedConfig,
    *,
    seq_len: int,
    batch: int,
    measured: _Measured,
    count: bool = False,
) -> None:
    """Parallelize on meta, then materialize, forward and backward on fake tensors; with
    ``count``, the collectives of each pass too (every op then goes through Python once more:
    the small copies of ``_one_layer`` count, the full-size run does not)."""
    mesh = build_mesh(layout, device_type="cpu")
    if layout.pp > 1:
        _stages_forward_backward(model, plan, mesh, config, seq_len=seq_len, batch=batch, measured=measured)
        return
    parallelize(model, plan, mesh)  # on meta: no storage
    # the expert mesh reuses the mesh's groups where their ranks agree; a collective on none of
    # the mesh's axes is ep's
    counter = CountCollectives(mesh_axes(mesh.device_mesh), unknown="ep" if layout.ep > 1 else "other")
    # batched_mm experts: grouped_mm has no fp32 kernel for fake tensors (same shapes and memory)
    with FakeTensorMode(allow_non_fake_inputs=True), batched_experts(model):
        measured.stage = "materialize"
        model.to_empty(device="cpu")
        measured.param_bytes = sum(_local_bytes(p) for p in model.parameters())
        measured.stage = "forward"
        ids = torch.randint(0, config.vocab_size, (batch, seq_len))
        with counter if count else contextlib.nullcontext():
            logits = model(input_ids=ids, use_cache=False).logits
            local = logits.to_local() if isinstance(logits, DTensor) else logits
            measured.stage = counter.phase = "backward"
            local.float().sum().backward()
        measured.grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters())
    measured.traffic = counter.traffic()


def _stages_forward_backward(
    model: torch.nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    config: PretrainedConfig,
    *,
    seq_len: int,
    batch: int,
    measured: _Measured,
) -> None:
    """Rank 0's pipeline stages laid out as a job lays them out (``parallelize_stages``), then
    each run forward and backward on its own: token ids into the first stage, a hidden state of
    the model's width into the others (what the previous stage sends), the last stage's logits
    summed. The pipeline's own sends and receives are not simulated."""
    stages = parallelize_stages(model, plan, mesh)
    hidden = config.get_text_config().hidden_size
    with FakeTensorMode(allow_non_fake_inputs=True), batched_experts(model):
        measured.stage = "materialize"
        for _, stage in stages:
            stage.to_empty(device="cpu")
        params = [p for _, stage in stages for p in stage.parameters()]
        measured.param_bytes = sum(_local_bytes(p) for p in params)
        for index, stage in stages:
            measured.stage = f"forward of pipeline stage {index}"
            if stage.first:
                x = torch.randint(0, config.vocab_size, (batch, seq_len))
            else:
                x = torch.randn(batch, seq_len, hidden, requires_grad=True)
            out = stage(x)
            local = out.to_local() if isinstance(out, DTensor) else out
            measured.stage = f"backward of pipeline stage {index}"
            local.float().sum().backward()
        measured.grad_bytes = sum(_local_bytes(p.grad) for p in params)


def _cut(model: torch.nn.Module, keep: list[int]) -> torch.nn.Module:
    """A copy of an unparallelized meta ``model`` with only its decoder layers ``keep`` (the
    list swapped while copying: a 64-layer model is not built, or copied, again)."""
    found = decoder_layers(model)
    assert found is not None, "the caller found the layers"
    parent, name, layers = found
    setattr(parent, name, torch.nn.ModuleList([layers[i] for i in keep]))
    try:
        return copy.deepcopy(model)
    finally:
        setattr(parent, name, layers)


def _traffic_of(
    model: torch.nn.Module, plan: Plan, layout: Layout, config: PretrainedConfig, *, seq_len: int, batch: int
) -> Traffic | None:
    """The collectives of a (cut) model, or None when the plan does not fit it (a MoE plan on a
    model left with only its dense layer)."""
    measured = _Measured()
    try:
        _forward_backward(model, plan, layout, config, seq_len=seq_len, batch=batch, measured=measured, count=True)
    except PlanError:
        return None
    return measured.traffic


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerTraffic:
    """One decoder layer's collectives (``layer``), and which layer (``index``; -1: not measured)."""

    layer: Traffic = field(default_factory=Traffic)
    index: int = -1


Cuts = dict[tuple[int, ...], torch.nn.Module]


def _layer_cuts(model: torch.nn.Module) -> Cuts:
    """Copies of an unparallelized meta ``model`` with its first and last layers, with only the
    first, and with only the last (empty for a model of fewer than two layers)."""
    found = decoder_layers(model)
    if found is None or len(found[2]) < 2:
        return {}
    first, last = 0, len(found[2]) - 1
    return {keep: _cut(model, list(keep)) for keep in ((first, last), (first,), (last,))}


def _one_layer(
    cuts: Cuts, plan: Plan, layout: Layout, config: PretrainedConfig, *, seq_len: int, batch: int
) -> LayerTraffic:
    """The copy with the first and last layers less a copy without one of them -- the last, or the
    first where the plan needs the last (MoE layers after dense ones) -- is that layer's traffic.
    Two small models, counted, instead of the whole one."""
    if not cuts:
        return LayerTraffic()
    (first, last), *_ = cuts
    both = _traffic_of(cuts[(first, last)], plan, layout, config, seq_len=seq_len, batch=batch)
    if both is None:
        return LayerTraffic()
    for measured, rest in ((last, (first,)), (first, (last,))):
        without = _traffic_of(cuts[rest], plan, layout, config, seq_len=seq_len, batch=batch)
        if without is not None:
            return LayerTraffic(layer=both.minus(without), index=measured)
    return LayerTraffic()


def layer_traffic(
    plan: Plan, config: PretrainedConfig, layout: Layout, *, seq_len: int = 256, batch: int = 1
) -> LayerTraffic:
    """One decoder layer's collectives at ``layout``, from two small copies of the model (first
    and last layers; one of them): ``dry_run``'s figure alone."""
    cuts = _layer_cuts(build_model(copy.deepcopy(config), device="meta", dtype=torch.float32))
    with _fake_process_group(layout.world_size), _quiet():
        return _one_layer(cuts, plan, layout, config, seq_len=seq_len, batch=batch)


@contextmanager
def _quiet() -> Iterator[None]:
    """Fake tensors log every op failure at ERROR and torch warns of what a fake world does (a
    meta init, a fake group's collectives): here a failure becomes one diagnostic, nothing else."""
    with quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# The most fake ranks the dry run simulates: its cost grows with dp (FSDP cuts every parameter
# into dp shards, fake ones included): 16384 ranks of Qwen3-8B at tp=2 take 76 s on a 2-core CPU.
MAX_WORLD = 16384


def world_problem(layout: Layout) -> Diagnostic | None:
    """A usage problem for a world the dry run would not finish in minutes."""
    if layout.world_size <= MAX_WORLD:
        return None
    return Diagnostic(
        rule="usage",
        loc=SourceLoc(path="--world-size"),
        message=f"--dry-run simulates at most {MAX_WORLD} ranks; this layout has {layout.world_size}",
        fix=f"drop --dry-run (validate checks the plan at any size), or dry-run {MAX_WORLD} ranks or fewer",
    )


def dry_run(
    plan: Plan, config: PretrainedConfig, layout: Layout, *, seq_len: int = 256, batch: int = 1
) -> DryRunReport:
    """Parallelize and run fwd+bwd of ``config``'s model at ``layout``'s fake ranks (as rank 0)."""
    started = time.perf_counter()
    diagnostics: list[Diagnostic] = []
    measured = _Measured()
    with _fake_process_group(layout.world_size), _quiet():
        # fp32 master weights, as FSDP mixed-precision training keeps them
        model = build_model(copy.deepcopy(config), device="meta", dtype=torch.float32)
        cuts = _layer_cuts(model)  # before parallelize changes ``model``
        with ModuleTracker() as tracker:
            try:
                _forward_backward(model, plan, layout, config, seq_len=seq_len, batch=batch, measured=measured)
            except PlanError:
                raise
            except Exception as exc:  # a layout mistake: report where it happened, at the rule that styles it
                diagnostics.append(
                    failure_diagnostic(
                        exc,
                        where=tracker.where(model, exc),
                        resolved=resolve_plan(plan, model, sequence_parallel=layout.sequence_parallel),
                        stage=f"{measured.stage} at {layout.world_size} ranks ({layout.describe()})",
                        fallback=plan.loc,
                        rule_id="dry-run",
                    )
                )
        layers = len(found[2]) if (found := decoder_layers(model)) is not None else 0
        traffic = LayerTraffic()
        if not diagnostics and layout.pp == 1:
            traffic = _one_layer(cuts, plan, layout, config, seq_len=seq_len, batch=batch)
    if not diagnostics and layout.pp > 1:  # a layer's collectives within its stage: those of (dp, cp, tp)
        traffic = layer_traffic(plan, config, replace(layout, pp=1), seq_len=seq_len, batch=batch)
    if not diagnostics and measured.grad_bytes == 0:
        diagnostics.append(
            Diagnostic(
                rule="dry-run",
                severity=Severity.WARNING,
                loc=SourceLoc(path=plan.path),
                message="backward produced no gradients",
                fix="check requires_grad",
            )
        )
    return DryRunReport(
        layout=layout,
        param_bytes=measured.param_bytes,
        grad_bytes=measured.grad_bytes,
        optimizer_bytes=2 * measured.param_bytes,  # fp32 params: AdamW's two moments match them
        seconds=time.perf_counter() - started,
        diagnostics=tuple(diagnostics),
        traffic=traffic,
        layers=layers,
    )


def describe_traffic(report: DryRunReport, *, seq_len: int, batch: int = 1) -> list[str]:
    """Lines for people: what one decoder layer and the whole step send, per pass and axis."""

    def passes(traffic: Traffic) -> str:
        parts = []
        for phase in ("forward", "backward"):
            axes = sorted({c.axis for c in traffic.collectives if c.phase == phase})
            calls = "; ".join(
                ", ".join(f"{n} {kind.replace('_', '-')}" for kind, n in sorted(traffic.counts(phase, axis).items()))
                + f" on {axis}"
                for axis in axes
            )
            parts.append(f"{phase} {calls or 'nothing'} ({human_bytes(traffic.wire_bytes(phase))})")
        return "; ".join(parts)

    if report.traffic.index < 0:
        return []
    return [
        f"  on the wire per rank, decoder layer {report.traffic.index} of {report.layers} "
        f"(batch {batch} x {seq_len} tokens): {passes(report.traffic.layer)}"
    ]
