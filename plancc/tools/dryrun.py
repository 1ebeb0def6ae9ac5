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

import copy
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import PretrainedConfig

from ..compiler.plan import Plan
from ..compiler.resolve import resolve_plan
from ..dataflow import batched_experts
from ..errors import Diagnostic, PlanError, Severity, SourceLoc, quiet_logger
from ..layout import Layout
from ..models import build_model
from ..runtime.failures import ModuleTracker, failure_diagnostic
from ..runtime.mesh import build_mesh
from ..runtime.parallelize import parallelize


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRunReport:
    layout: Layout
    param_bytes: int  # this rank's local parameter shards
    grad_bytes: int
    optimizer_bytes: int  # AdamW: two fp32 moments per local parameter element
    seconds: float
    diagnostics: tuple[Diagnostic, ...] = ()

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


@dataclass(kw_only=True, slots=True)
class _Measured:
    param_bytes: int = 0
    grad_bytes: int = 0
    stage: str = "parallelize"


def _forward_backward(
    model: torch.nn.Module,
    plan: Plan,
    layout: Layout,
    config: PretrainedConfig,
    *,
    seq_len: int,
    batch: int,
    measured: _Measured,
) -> None:
    """Parallelize on meta, then materialize, forward and backward on fake tensors."""
    mesh = build_mesh(layout, device_type="cpu")
    parallelize(model, plan, mesh, sequence_parallel=layout.sequence_parallel, ep=layout.ep)  # on meta: no storage
    # batched_mm experts: grouped_mm has no fp32 kernel for fake tensors (same shapes and memory)
    with FakeTensorMode(allow_non_fake_inputs=True), batched_experts(model):
        measured.stage = "materialize"
        model.to_empty(device="cpu")
        measured.param_bytes = sum(_local_bytes(p) for p in model.parameters())
        measured.stage = "forward"
        ids = torch.randint(0, config.vocab_size, (batch, seq_len))
        logits = model(input_ids=ids, use_cache=False).logits
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        measured.stage = "backward"
        local.float().sum().backward()
        measured.grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters())


def dry_run(
    plan: Plan, config: PretrainedConfig, layout: Layout, *, seq_len: int = 256, batch: int = 1
) -> DryRunReport:
    """Parallelize and run fwd+bwd of ``config``'s model at ``layout``'s fake ranks (as rank 0)."""
    started = time.perf_counter()
    diagnostics: list[Diagnostic] = []
    measured = _Measured()
    # fake tensors log every op failure at ERROR; here the failure becomes a diagnostic instead
    with _fake_process_group(layout.world_size), quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL):
        # fp32 master weights, as FSDP mixed-precision training keeps them
        model = build_model(copy.deepcopy(config), device="meta", dtype=torch.float32)
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
    )
