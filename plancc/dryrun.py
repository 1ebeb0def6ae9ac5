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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import Diagnostic, Severity, SourceLoc
from .plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRunReport:
    world_size: int
    dp: int
    cp: int
    tp: int
    param_bytes: int  # this rank's local parameter shards
    grad_bytes: int
    optimizer_bytes: int  # AdamW: two fp32 moments per local parameter element
    seconds: float
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


class _ModuleTracker:
    """Which module is executing, so an exception can name the innermost one."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.failed_in: str | None = None
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str):
        def hook(module, args) -> None:
            self.stack.append(name)

        return hook

    def _leave(self, module, args, output) -> None:  # must return None: a value would replace the output
        self.stack.pop()

    def innermost(self) -> str:
        return self.stack[-1] if self.stack else "<model>"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def dry_run(plan: Plan, config, *, dp: int, cp: int = 1, tp: int = 1, sequence_parallel: bool = False,
            seq_len: int = 256, batch: int = 1) -> DryRunReport:
    """Parallelize and run fwd+bwd of ``config``'s model at dp*cp*tp fake ranks (as rank 0)."""
    import time

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .mesh import build_mesh
    from .models import build_model
    from .parallelize import parallelize

    import logging

    # fake tensors log every op failure at ERROR; the failure becomes a diagnostic instead
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    world = dp * cp * tp
    started = time.perf_counter()
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    diagnostics: list[Diagnostic] = []
    param_bytes = grad_bytes = 0
    try:
        mesh = build_mesh(dp=dp, cp=cp, tp=tp, device_type="cpu")
        # fp32 master weights, as FSDP mixed-precision training keeps them
        model = build_model(copy.deepcopy(config), device="meta", dtype=torch.float32)
        tracker = _ModuleTracker(model)
        stage = "parallelize"
        try:
            parallelize(model, plan, mesh, sequence_parallel=sequence_parallel)  # on meta: no storage
            with FakeTensorMode(allow_non_fake_inputs=True):
                stage = "materialize"
                model.to_empty(device="cpu")
                param_bytes = sum(_local_bytes(p) for p in model.parameters())
                stage = "forward"
                ids = torch.randint(0, config.vocab_size, (batch, seq_len))
                logits = model(input_ids=ids, use_cache=False).logits
                local = logits.to_local() if hasattr(logits, "to_local") else logits
                stage = "backward"
                local.float().sum().backward()
                grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters())
        except Exception as exc:  # a layout mistake: report where it happened
            where = tracker.innermost() if stage in ("forward", "backward") else "<model>"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            diagnostics.append(Diagnostic(
                rule="dry-run",
                loc=plan.loc,
                message=f"{stage} failed at {world} ranks (dp={dp} cp={cp} tp={tp}) in {where}: "
                f"{type(exc).__name__}: {first[:400]}",
                fix="check the styles of this module and of the modules feeding it "
                "(`plancc explain` shows every layout)",
            ))
        finally:
            tracker.remove()
    finally:
        if owns_group:
            dist.destroy_process_group()
    if not diagnostics and grad_bytes == 0:
        diagnostics.append(Diagnostic(rule="dry-run", severity=Severity.WARNING, loc=SourceLoc(path=plan.path),
                                      message="backward produced no gradients", fix="check requires_grad"))
    return DryRunReport(world_size=world, dp=dp, cp=cp, tp=tp, param_bytes=param_bytes, grad_bytes=grad_bytes,
                        optimizer_bytes=2 * param_bytes,  # fp32 params: AdamW's two moments match them
                        seconds=time.perf_counter() - started, diagnostics=tuple(diagnostics))
