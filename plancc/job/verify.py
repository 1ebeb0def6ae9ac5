"""Numerical verification: a parallelized model against the same model unsharded.

Run on every rank of a job. Each rank also builds the unsharded reference (same seed, same
weights) and runs it on the whole global batch, then compares its own slice: logits, loss,
every parameter's gradient (gathered to full tensors), and the loss after each optimizer
step. Replicated parameters must also stay bitwise identical across tp ranks.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from transformers import PretrainedConfig

from ..compiler.plan import Plan
from ..errors import quiet_logger
from ..models import build_model, load_config
from ..runtime.cp import load_balanced_indices
from ..runtime.gradnorm import clip_grad_norm_
from ..runtime.loss import batch_slice, masked_next_token_loss, reported_loss, sharded_loss
from ..runtime.materialize import materialize
from ..runtime.parallelize import parallelize

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    logits_max_abs: float = 0.0
    logits_max_rel: float = 0.0
    loss_abs: float = 0.0
    grad_max_rel: float = 0.0  # max over parameters of max|g - g_ref| / max|g_ref|
    worst_grad: str = ""
    step_loss_abs: list[float] = field(default_factory=list)
    replicas_identical: bool = True
    params_compared: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def full(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    # Gathering FSDP+TP gradients (_StridedShard on dp, Shard on tp) takes two all-gathers
    # and torch warns about it on every call; verification accepts the cost.
    with quiet_logger("torch.distributed.tensor._redistribute"):
        return t.full_tensor()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


# fp32 bars; see tests/test_numerics.py for why losses after Adam steps get a looser one.
TOLERANCES = {"logits_rel": 1e-5, "loss_abs": 1e-5, "grad_rel": 1e-5, "step_loss_rel": 1e-4}


def within_tolerance(report: VerifyReport, reference_loss: float = 5.0) -> bool:
    return (
        report.logits_max_rel <= TOLERANCES["logits_rel"]
        and report.loss_abs <= TOLERANCES["loss_abs"]
        and report.grad_max_rel <= TOLERANCES["grad_rel"]
        and all(d <= TOLERANCES["step_loss_rel"] * reference_loss for d in report.step_loss_abs)
        and report.replicas_identical
    )


def _replicas_identical(model: torch.nn.Module, mesh: DeviceMesh) -> bool:
    """Parameters replicated over tp must hold the same values on every tp rank."""
    tp = mesh["tp"]
    if tp.size() == 1:
        return True
    group = tp.get_group()
    ok = True
    for _, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        if "tp" in names and not isinstance(p.placements[names.index("tp")], Replicate):
            continue
        local = p.to_local().detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(tp.size())]
        dist.all_gather(gathered, local, group=group)
        ok &= all(torch.equal(g, gathered[0]) for g in gathered)
    return ok


def build_pair(
    plan: Plan,
    model_spec: Any,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.nn.Module, torch.nn.Module, PretrainedConfig]:
    """(parallelized model, unsharded reference, config) with the same seeded weights."""
    config = load_config(model_spec)
    torch.manual_seed(seed)
    # Initialized on the CPU (as the runner does), so a seed means the same weights everywhere.
    reference = build_model(config, device="cpu").to(device)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    # A config of its own: cp switches the attention implementation on the model's config.
    model = build_model(copy.deepcopy(config), device="meta")
    parallelize(model, plan, mesh, sequence_parallel=sequence_parallel)
    materialize(model, device, full_state_dict=state)
    return model, reference, config


def _random_batches(config: PretrainedConfig, *, count: int, global_batch: int, seq_len: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (global_batch, seq_len), generator=gen)
        out.append((ids, torch.ones_like(ids)))
    return out


def _reference_loss(ref_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, dp: int) -> torch.Tensor:
    """FSDP averages gradients over dp ranks: the reference loss is the mean of the per-rank
    means (equal to the global token mean when ranks hold equal tokens)."""
    per = ids.shape[0] // dp
    rows = [slice(r * per, (r + 1) * per) for r in range(dp)]
    return sum((masked_next_token_loss(ref_logits[s], ids[s], mask[s]) for s in rows), torch.zeros(())) / dp


def _worst_gradient(model: torch.nn.Module, reference: torch.nn.Module, report: VerifyReport) -> None:
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        ref_grad = ref_params[name].grad
        assert ref_grad is not None, name  # the reference runs the same loss on the same parameters
        rel = _rel(full(p.grad), ref_grad)
        report.params_compared += 1
        if rel >= report.grad_max_rel:
            report.grad_max_rel, report.worst_grad = rel, name


def verify_against_unsharded(
    plan: Plan,
    model_spec: Any,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    steps: int = 3,
    global_batch: int = 4,
    seq_len: int = 16,
    seed: int = 0,
    lr: float = 1e-3,
    max_grad_norm: float = 1.0,
    device: str = "cpu",
    batches: list[Batch] | None = None,
) -> VerifyReport:
    """Train the parallelized model and its unsharded twin side by side for ``steps`` steps
    and compare: logits, loss and every gradient at the first step, the loss after each."""
    model, reference, config = build_pair(
        plan, model_spec, mesh, sequence_parallel=sequence_parallel, seed=seed, device=device
    )
    if batches is None:
        batches = _random_batches(config, count=steps + 1, global_batch=global_batch, seq_len=seq_len, seed=seed)
    mine = batch_slice(mesh, batches[0][0].shape[0])
    cp = mesh["cp"].size()
    local_index = (
        load_balanced_indices(batches[0][0].shape[1], cp, mesh["cp"].get_local_rank()).to(device) if cp > 1 else None
    )
    report = VerifyReport()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    for step, (ids, mask) in enumerate(batches[: steps + 1]):
        ids, mask = ids.to(device), mask.to(device)
        loss = sharded_loss(model, ids[mine], mask[mine], mesh)
        ref_full = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ref_loss = _reference_loss(ref_full, ids, mask, mesh["dp"].size())
        dp_loss = reported_loss(loss, mesh)
        if step == 0:
            # this rank's rows and (under cp) positions
            ref_logits = (ref_full if local_index is None else ref_full.index_select(1, local_index))[mine].detach()
            with torch.no_grad():  # the logits the loss never built, for comparison
                logits = full(model(input_ids=ids[mine], attention_mask=mask[mine], use_cache=False).logits)
            report.logits_max_abs = (logits - ref_logits).abs().max().item()
            report.logits_max_rel = _rel(logits, ref_logits)
            report.loss_abs = abs(dp_loss - ref_loss.item())
        else:
            report.step_loss_abs.append(abs(dp_loss - ref_loss.item()))
        if step == steps:
            break
        loss.backward()
        ref_loss.backward()
        if step == 0:
            _worst_gradient(model, reference, report)
        clip_grad_norm_(model.parameters(), max_grad_norm)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    report.replicas_identical = _replicas_identical(model, mesh)
    return report
