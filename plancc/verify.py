"""Numerical verification: a parallelized model against the same model unsharded.

Run on every rank of a job. Each rank also builds the unsharded reference (same seed, same
weights) and runs it on the whole global batch, then compares its own slice: logits, loss,
every parameter's gradient (gathered to full tensors), and the loss after each optimizer
step. Replicated parameters must also stay bitwise identical across tp ranks.
"""

from __future__ import annotations

import copy
import logging

from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .gradnorm import clip_grad_norm_
from .models import build_model, load_config
from .parallelize import materialize, parallelize
from .plan import Plan


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

    def as_dict(self) -> dict:
        return asdict(self)


# Gathering FSDP+TP gradients (_StridedShard on dp, Shard on tp) for comparison takes two
# all-gathers; torch warns about it on every call. Verification accepts the cost.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


# fp32 bars; see tests/test_numerics.py for why losses after Adam steps get a looser one.
TOLERANCES = {"logits_rel": 1e-5, "loss_abs": 1e-5, "grad_rel": 1e-5, "step_loss_rel": 1e-4}


def within_tolerance(report: "VerifyReport", reference_loss: float = 5.0) -> bool:
    return (
        report.logits_max_rel <= TOLERANCES["logits_rel"]
        and report.loss_abs <= TOLERANCES["loss_abs"]
        and report.grad_max_rel <= TOLERANCES["grad_rel"]
        and all(d <= TOLERANCES["step_loss_rel"] * reference_loss for d in report.step_loss_abs)
        and report.replicas_identical
    )


def masked_next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross entropy over the positions whose target is not padding."""
    targets = input_ids[:, 1:].clone()
    if mask is not None:
        targets[mask[:, 1:] == 0] = -100
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def sharded_loss(model, ids: torch.Tensor, mask: torch.Tensor, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, the model's logits as it returned them) for one dp slice.

    The loss is the masked next-token mean, computed from vocab-parallel logits where the
    plan leaves them sharded (``plancc.logprobs``): the full ``[B, S, V]`` logits are never
    gathered, as ``F.cross_entropy`` would need. With cp each rank holds a load-balanced
    shard of the positions: targets are shifted on the whole sequence, then sharded, and the
    rank's sum is scaled by cp / (valid targets of the slice); FSDP's average over the dp_cp
    ranks then yields exactly the gradient of the slice's mean loss.
    """
    from .logprobs import vocab_layout, vocab_parallel_logprobs

    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    local, group, start = vocab_layout(logits, model, mesh)
    cp = mesh["cp"].size()
    targets = torch.roll(ids, -1, dims=1)
    valid = mask.clone()
    valid[:, :-1] = mask[:, 1:]  # a position counts when the token it predicts is real
    valid[:, -1] = 0  # the last position predicts nothing
    if cp > 1:
        from .cp import load_balanced_indices

        index = load_balanced_indices(ids.shape[1], cp, mesh["cp"].get_local_rank()).to(ids.device)
        targets, local_valid = targets.index_select(1, index), valid.index_select(1, index)
    else:
        local_valid = valid
    logprobs = vocab_parallel_logprobs(local, targets, group=group, vocab_start=start)
    total = -(logprobs * local_valid.to(logprobs.dtype)).sum()
    return total * cp / valid.sum().clamp(min=1), logits


def reported_loss(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    """The mean loss over the global batch, from every rank's share of it."""
    value = loss.detach().clone()
    dist.all_reduce(value, group=dp_cp_group(mesh))
    return value.item() / (mesh["dp"].size() * mesh["cp"].size())


def dp_cp_group(mesh: DeviceMesh):
    from .mesh import dp_cp_mesh

    return dp_cp_mesh(mesh).get_group()


def batch_slice(mesh: DeviceMesh, global_batch: int) -> slice:
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    per = global_batch // dp
    return slice(rank * per, (rank + 1) * per)


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


def build_pair(plan: Plan, model_spec, mesh: DeviceMesh, *, sequence_parallel: bool = False, seed: int = 0,
               device: str = "cpu"):
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


def verify_against_unsharded(
    plan: Plan,
    model_spec,
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
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> VerifyReport:
    model, reference, config = build_pair(plan, model_spec, mesh, sequence_parallel=sequence_parallel,
                                          seed=seed, device=device)

    if batches is None:
        gen = torch.Generator().manual_seed(seed + 1)
        batches = []
        for _ in range(steps + 1):
            ids = torch.randint(0, config.vocab_size, (global_batch, seq_len), generator=gen)
            batches.append((ids, torch.ones_like(ids)))
    global_batch = batches[0][0].shape[0]
    mine = batch_slice(mesh, global_batch)
    dp = mesh["dp"].size()
    report = VerifyReport()

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    ref_params = dict(reference.named_parameters())
    cp = mesh["cp"].size()
    if cp > 1:
        from .cp import load_balanced_indices

        local_index = load_balanced_indices(batches[0][0].shape[1], cp, mesh["cp"].get_local_rank()).to(device)
    for step, (ids, mask) in enumerate(batches):
        ids, mask = ids.to(device), mask.to(device)
        loss, logits = sharded_loss(model, ids[mine], mask[mine], mesh)
        ref_full = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ref_logits = ref_full.index_select(1, local_index) if cp > 1 else ref_full  # this rank's positions
        # FSDP averages gradients over dp ranks: the reference loss is the mean of the
        # per-rank means (equal to the global token mean when ranks hold equal tokens).
        per = global_batch // dp
        ref_loss = sum(masked_next_token_loss(ref_full[r * per:(r + 1) * per], ids[r * per:(r + 1) * per],
                                              mask[r * per:(r + 1) * per]) for r in range(dp)) / dp
        dp_loss = reported_loss(loss, mesh)
        if step == 0:
            logits = full(logits.detach())
            report.logits_max_abs = (logits - ref_logits[mine]).abs().max().item()
            report.logits_max_rel = _rel(logits, ref_logits[mine].detach())
            report.loss_abs = abs(dp_loss - ref_loss.item())
        else:
            report.step_loss_abs.append(abs(dp_loss - ref_loss.item()))
        if step == steps:
            break
        loss.backward()
        ref_loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                rel = _rel(full(p.grad), ref_params[name].grad)
                report.params_compared += 1
                if rel >= report.grad_max_rel:
                    report.grad_max_rel, report.worst_grad = rel, name
        clip_grad_norm_(model.parameters(), max_grad_norm)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    report.replicas_identical = _replicas_identical(model, mesh)
    return report
