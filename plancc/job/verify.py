"""Numerical verification: a parallelized model against the same model unsharded.

Run on every rank of a job. The parallelized side is a ``plancc.Policy`` trained with
``Policy.train`` -- the engine ``plancc apply`` runs, with its loss, microbatching, clipping and
optimizer -- so ``--verify`` checks the code a run executes. Each rank also builds the
unsharded reference (same seed, same weights) and trains it on the whole global batch in one
pass, then compares: its own slice's logits, the global loss, every parameter's gradient
(gathered to full tensors, as the optimizer is about to step), and the loss after each optimizer
step. Replicated parameters must also stay bitwise identical across tp ranks.

Two things make the comparison about the plan and nothing else: dropout is off in both
models (with it on, the two draw different masks: a correct plan would fail), and the bars are
the fp32 ones (1e-5) or twice what fp32 itself misses on this model, whichever is larger --
measured on the first batch as the unsharded fp32 model against the same model in fp64 (deep
models with large activations are off fp64 by more than 1e-5 before any sharding).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from transformers import PretrainedConfig

from ..compiler.plan import Plan
from ..compiler.resolve import tied_parameter_groups
from ..engine.batches import default_token_mask
from ..engine.losses import token_nll
from ..engine.parallel_model import seeded_model
from ..engine.policy import Policy
from ..errors import quiet_logger
from ..models import MASTER_DTYPE, build_model, load_config
from ..runtime.cp_context import load_balanced_indices
from ..runtime.hf_weights import load_hf_weights
from ..runtime.local_tensors import full_value_quietly
from ..runtime.materialize import materialize
from ..runtime.mesh import MeshLike, ParallelMesh, require_parallel_mesh
from ..runtime.parallelize import parallelize
from ..runtime.vocab_parallel_logprobs import token_logprobs
from .verify_reference import (
    SplitAdamW,
    chunked_backward,
    chunked_logits,
    chunked_loss,
    clip_exactly,
    clip_scale,
    fp64_floor,
    reference_chunk_rows,
)

Batch = dict[str, torch.Tensor]  # input_ids, attention_mask and, for masked data, token_mask


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    logits_max_abs: float = 0.0
    logits_max_rel: float = 0.0
    loss_abs: float = 0.0
    grad_max_rel: float = 0.0  # max over parameters of max|g - g_ref| / max|g_ref|
    worst_grad: str = ""
    step_loss_abs: list[float] = field(default_factory=list)
    replicas_identical: bool = True
    # the tied weights' copies on the last pipeline stage equal to their weights after the steps
    # (None: nothing tied across stages)
    tied_identical: bool | None = None
    params_compared: int = 0
    # what fp32 alone misses (the unsharded model, fp32 against fp64), on the first batch
    logits_floor: float = 0.0
    grad_floor: float = 0.0
    # the sharded model's worst gradient against fp64 (0: not measured)
    grad_exact_rel: float = 0.0
    dropout_off: list[str] = field(default_factory=list)  # config fields set to 0 for the comparison
    # where both models' weights came from: the seeded init, a folder's safetensors, a checkpoint
    weights: str = ""
    first_loss: float = 0.0  # the unsharded model's loss on the first batch (what the weights give)
    reference_chunk_rows: int = 0  # the rows the reference ran at a time (its gradients summed)
    floor_measured: bool = False  # fp32 missed a fixed bar, so its distance from fp64 was measured

    def tolerance(self, key: str) -> float:
        """The bar for ``key`` of TOLERANCES: the fp32 one, or twice fp32's own error."""
        floor = {"logits_rel": self.logits_floor, "grad_rel": self.grad_floor}.get(key, 0.0)
        return max(TOLERANCES[key], 2 * floor)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# the whole of a sharded value, for comparison (tests import it by this name)
full = full_value_quietly


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


# fp32 bars; see tests/test_numerics.py for why losses after Adam steps get a looser one.
TOLERANCES = {"logits_rel": 1e-5, "loss_abs": 1e-5, "grad_rel": 1e-5, "step_loss_rel": 1e-4}


def within_tolerance(report: VerifyReport, reference_loss: float = 5.0) -> bool:
    return (
        report.logits_max_rel <= report.tolerance("logits_rel")
        and report.loss_abs <= TOLERANCES["loss_abs"]
        and _gradients_within(report)
        and all(d <= TOLERANCES["step_loss_rel"] * reference_loss for d in report.step_loss_abs)
        and report.replicas_identical
        and report.tied_identical is not False
    )


def _gradients_within(report: VerifyReport) -> bool:
    """Within fp32's bar of the fp32 reference -- or, where fp32 itself is further off than
    that (a sum with cancellation: Doge's dynamic-mask ``A``), no further from the exact (fp64)
    gradients than ``EXACT_FACTOR`` times the fp32 reference is. Only a distance from exact
    tells rounding from a bug: a doubled or missing gradient is off by its whole size."""
    if report.grad_max_rel <= report.tolerance("grad_rel"):
        return True
    return 0 < report.grad_exact_rel <= EXACT_FACTOR * report.grad_floor


# A sharded sum adds tp partial sums and then the ranks' results: more roundings than the
# one-device sum, each as large. Measured: Doge at tp=2 sits 1.97x fp32's distance (1.55e-5 vs 7.9e-6).
EXACT_FACTOR = 4.0


def _replicas_identical(model: torch.nn.Module, mesh: MeshLike) -> bool:
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


def unverifiable(*, lora: bool, param_dtype: str | None, outputs: dict[str, Any]) -> str | None:
    """Why ``--verify`` cannot check the run these flags ask for (None: it can). It checks the
    run the user asked for -- the model folder's weights, the checkpoint of ``--resume``, the
    microbatching -- and refuses what it would otherwise drop: LoRA, a compute dtype other than
    fp32 (the reference's bars are fp32's), and outputs a verification does not write."""
    if lora:
        return "--verify compares full fine-tuning with the unsharded model; it does not run with LoRA yet"
    if param_dtype is not None:
        return (
            f"--verify compares in fp32 against fp32 bars (1e-5); it does not check --param-dtype {param_dtype} "
            "compute (tests/test_master_weights.py checks bf16 compute keeps fp32 masters)"
        )
    written = [flag for flag, value in outputs.items() if value]
    if written:
        return f"--verify trains a comparison and writes nothing: {', '.join(written)} would be ignored"
    return None


def without_dropout(config: PretrainedConfig) -> tuple[PretrainedConfig, list[str]]:
    """A copy of ``config`` with every dropout probability and router jitter 0 (both draw random
    numbers, which a data-parallel rank draws for its own rows only), and the fields that were not."""
    config = copy.deepcopy(config)
    dropped = []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in {id(c): c for c in (config, text)}.values():
        for key, value in vars(cfg).items():
            is_rate = "dropout" in key or key.endswith(("pdrop", "jitter_noise"))
            if is_rate and isinstance(value, float) and value > 0:
                setattr(cfg, key, 0.0)
                dropped.append(f"{key}={value:g}")
    return config, dropped


def build_pair(
    plan: Plan,
    model_spec: Any,
    mesh: ParallelMesh,
    *,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.nn.Module, torch.nn.Module, PretrainedConfig]:
    """(parallelized model at ``mesh``'s layout, unsharded reference, config) with the same seeded weights."""
    config = load_config(model_spec)
    reference = seeded_model(config, seed).to(device)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    # A config of its own: cp switches the attention implementation on the model's config.
    model = build_model(copy.deepcopy(config), device="meta", dtype=MASTER_DTYPE)
    parallelize(model, plan, mesh)
    materialize(model, device, full_state_dict=state)
    return model, reference, config


def _random_batches(config: PretrainedConfig, *, count: int, global_batch: int, seq_len: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (global_batch, seq_len), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def _compare_gradients(
    grads: dict[str, torch.Tensor],
    reference: torch.nn.Module,
    grads64: dict[str, torch.Tensor] | None,
    report: VerifyReport,
) -> None:
    """How far fp32 itself is from exact (the floor: the fp32 reference's worst gradient against
    the fp64 one), and how far the sharded gradients kept as beyond the fixed bar are."""
    if grads64 is None:
        return
    for name, ref_param in reference.named_parameters():
        if ref_param.grad is not None and name in grads64:
            report.grad_floor = max(report.grad_floor, _rel(ref_param.grad.double(), grads64[name]))
    for name, sharded in grads.items():
        if name in grads64:
            report.grad_exact_rel = max(report.grad_exact_rel, _rel(sharded.double(), grads64[name]))


class _FirstGradients:
    """The policy's gradients as its optimizer is about to take its first step (after clipping),
    each gathered whole and compared with the reference's at once (an optimizer step pre-hook,
    so ``Policy.train`` runs exactly as in ``apply``). Only those beyond the fixed fp32 bar are
    kept, for the fp64 look; the rest are dropped as soon as they are compared."""

    def __init__(self, policy: Policy, reference: torch.nn.Module, report: VerifyReport):
        self.beyond: dict[str, torch.Tensor] | None = None
        self.policy, self.report = policy, report
        # every name of a tied weight (pipeline stages hold a copy of it at its other name)
        self.reference = dict(reference.named_parameters(remove_duplicate=False))
        self.handle = policy.optimizer.register_step_pre_hook(self._capture)

    def _capture(self, *_: Any) -> None:
        if self.beyond is not None:
            return
        self.beyond = {}
        for name, p in self.policy.model.named_parameters():  # collective: every rank steps alike
            if p.grad is None:
                continue
            sharded = full(p.grad)
            ref_grad = self.reference[name].grad
            assert ref_grad is not None, name  # the reference ran the same loss on the same parameters
            rel = _rel(sharded, ref_grad)
            self.report.params_compared += 1
            if rel >= self.report.grad_max_rel:
                self.report.grad_max_rel, self.report.worst_grad = rel, name
            if rel > TOLERANCES["grad_rel"]:
                self.beyond[name] = sharded
        self.handle.remove()


def _global_loss(policy: Policy, whole: Batch) -> float:
    """The global batch's mean token NLL under the policy's current weights, without a step."""
    mine = policy.slice_of(whole["input_ids"].shape[0])
    batch = {name: value[mine] for name, value in whole.items()}
    lp = policy.logprobs(batch)
    assert isinstance(lp, torch.Tensor), "log-probs without entropy are one tensor"
    counted = batch["token_mask"] if "token_mask" in batch else default_token_mask(batch["attention_mask"])
    counted = counted.to(lp.dtype)
    sums = torch.stack([-(lp * counted).sum().double(), counted.sum().double()])
    dist.all_reduce(sums, group=policy.mesh["dp"].get_group())
    return float(sums[0] / sums[1])


def logprobs_difference(
    reference: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, got: torch.Tensor, *, temperature: float
) -> float:
    """The largest difference between ``got`` (a policy's log-probs of these rows) and the
    unsharded ``reference``'s, over the attended positions."""
    with torch.no_grad():
        want = token_logprobs(reference, ids, attention_mask=mask, temperature=temperature)
    return (got - want)[mask.bool()].abs().max().item()


def unsharded_reference(
    config: PretrainedConfig, *, seed: int, device: str, folder: str | None = None
) -> torch.nn.Module:
    """The unsharded model with the weights a ``Policy`` of the same model and seed starts from:
    a folder's, or the seeded init (built on the CPU, so a seed means the same weights on every
    device; a config of its own, since cp switches the attention implementation)."""
    if folder is not None:
        from transformers import AutoModelForCausalLM

        reference: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            folder, config=copy.deepcopy(config), dtype=MASTER_DTYPE
        )
        return reference.to(device)
    return seeded_model(copy.deepcopy(config), seed).to(device)


def verify_against_unsharded(
    plan: Plan,
    model_spec: Any,
    mesh: ParallelMesh,
    *,
    steps: int = 3,
    global_batch: int = 4,
    seq_len: int = 16,
    seed: int = 0,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    device: str = "cpu",
    batches: list[Batch] | None = None,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    pack: bool = False,
    weights: str | None = None,
    resume: str | None = None,
) -> VerifyReport:
    """Train a ``plancc.Policy`` of the plan (what ``plancc apply`` runs: the same loss,
    microbatching, clipping and AdamW with its weight decay) and the unsharded model on the whole batch side by side
    for ``steps`` steps, and compare: logits, loss and every (clipped) gradient at the first
    step, the loss after each.

    Both start from the weights the run would: the seeded init, or ``weights`` (a Hugging Face
    folder's safetensors), or the checkpoint ``resume`` names -- then the optimizer's state too,
    so the steps compared are the resumed run's."""
    config, dropped = without_dropout(load_config(model_spec))
    mesh = require_parallel_mesh(mesh, "verify_against_unsharded")
    policy = Policy(
        plan,
        config,
        layout=mesh,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        max_grad_norm=max_grad_norm,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
    )
    source = policy.weight_source
    if weights is not None:
        load_hf_weights(policy.model, weights, whole=policy.whole_model, aliases=policy.weight_aliases)
        source = f"safetensors from {weights}"
    ref_opt_state = None
    if resume is not None:
        info = policy.load(resume)
        source = f"the checkpoint of step {info.step} in {resume}"
        ref_opt_state = _whole_optimizer_state(policy)
    reference = unsharded_reference(config, seed=seed, device=device)
    if weights is not None or resume is not None:  # the policy's own weights, whole, on every rank
        state = _whole_state(policy)
        load_tied(reference, {k: v.to(device) for k, v in state.items() if isinstance(v, torch.Tensor)})
        del state
    if batches is None:
        batches = _random_batches(config, count=steps + 1, global_batch=global_batch, seq_len=seq_len, seed=seed)
    rows = batches[0]["input_ids"].shape[0]
    mine = policy.slice_of(rows)
    chunk = reference_chunk_rows(rows, batches[0]["input_ids"].shape[1], config.get_text_config().vocab_size)
    cp = mesh["cp"].size()
    local_index = (  # the positions this rank's logits hold (the pipeline's last stage gathers them whole)
        load_balanced_indices(batches[0]["input_ids"].shape[1], cp, mesh["cp"].get_local_rank()).to(device)
        if cp > 1 and policy.layout.pp == 1
        else None
    )
    report = VerifyReport(dropout_off=dropped, weights=source, reference_chunk_rows=chunk)
    ref_opt = SplitAdamW(reference, lr=lr, weight_decay=weight_decay)
    if ref_opt_state is not None:  # the resumed moments and step counts, as the policy's
        ref_opt.load(ref_opt_state, lr)
        del ref_opt_state
    first: _FirstGradients | None = None
    for step, whole in enumerate(batches[: steps + 1]):
        whole = {name: value.to(device) for name, value in whole.items()}
        if step == steps:  # the loss after the last step, without another
            ref_loss = chunked_loss(reference, whole, chunk)
            report.step_loss_abs.append(abs(_global_loss(policy, whole) - ref_loss))
            break
        # the reference first: its (clipped) gradients are there when the policy's are gathered
        ref_loss = chunked_backward(reference, whole, chunk)
        norm = clip_exactly(reference, max_grad_norm)
        if step == 0:
            _compare_logits(policy, reference, whole, mine, local_index, chunk, report)
            first = _FirstGradients(policy, reference, report)
        batch = {name: value[mine] for name, value in whole.items()}
        # as plancc apply trains: the NLL's per-token terms through the 3-matmul lm_head
        row = policy.train(
            batch, token_loss=token_nll, micro_batch_size=micro_batch_size, max_tokens=max_tokens, pack=pack
        )
        if step == 0:
            report.loss_abs = abs(row["loss"] - ref_loss)
            report.first_loss = ref_loss
            assert first is not None and first.beyond is not None, "Policy.train stepped its optimizer"
            if first.beyond or report.logits_max_rel > TOLERANCES["logits_rel"]:
                # fp32 missed its fixed bar: how far fp32 itself is from exact, on these weights
                _measure_floor(reference, whole, first.beyond, clip_scale(norm, max_grad_norm), chunk, report)
            first = None
        else:
            report.step_loss_abs.append(abs(row["loss"] - ref_loss))
        ref_opt.step()
    report.replicas_identical = _replicas_identical(policy.model, mesh)
    if policy.weight_aliases:
        report.tied_identical = policy.tied_copies_identical()
    if policy.layout.pp > 1:  # each rank compared its own stages' gradients
        _over_stages(report, policy)
    return report


def _compare_logits(
    policy: Policy,
    reference: torch.nn.Module,
    whole: Batch,
    mine: slice,
    local_index: torch.Tensor | None,
    chunk: int,
    report: VerifyReport,
) -> None:
    """Compare this rank's logits with the reference's (its rows; under cp its positions; a
    pipeline's last stage every attended position), ``chunk`` rows at a time: the largest
    difference and the largest reference logit, whose ratio is the relative difference."""
    ids, mask = whole["input_ids"][mine], whole["attention_mask"][mine]
    staged = policy.layout.pp > 1
    if staged:  # the schedule takes the rank's rows whole
        pieces = [slice(0, ids.shape[0])]
    else:
        pieces = [slice(a, min(ids.shape[0], a + chunk)) for a in range(0, ids.shape[0], chunk)]
    diff = scale = 0.0
    for rows in pieces:
        part = {"input_ids": ids[rows], "attention_mask": mask[rows]}
        ref_logits = chunked_logits(reference, part, chunk)
        logits = policy.logits(part)  # the logits the loss never builds, for comparison
        if staged:  # every position, on every rank of the pipeline
            attended = part["attention_mask"].bool()
            logits, ref_logits = logits[attended], ref_logits[attended]
        elif local_index is not None:  # a cp rank's positions
            ref_logits = ref_logits.index_select(1, local_index)
        diff = max(diff, (logits - ref_logits).abs().max().item())
        scale = max(scale, ref_logits.abs().max().item())
    report.logits_max_abs = diff
    report.logits_max_rel = diff / (scale if scale > 0 else 1.0)


def _measure_floor(
    reference: torch.nn.Module,
    whole: Batch,
    beyond: dict[str, torch.Tensor],
    scale: float,
    chunk: int,
    report: VerifyReport,
) -> None:
    """The fp64 look, taken only when fp32 missed its fixed bar: the reference turned fp64 in
    place (at its weights before the first step, which it has not taken yet) on the first
    batch, its gradients for the parameters that missed only."""
    exact = fp64_floor(reference, whole, wanted=set(beyond), clip_scale=scale)
    report.floor_measured = exact is not None
    if exact is None:
        return
    logits64, grads64 = exact
    rows = logits64.shape[0]  # the batch's first rows: the floor is the model's, not a rank's
    first = {"input_ids": whole["input_ids"][:rows], "attention_mask": whole["attention_mask"][:rows]}
    report.logits_floor = _rel(chunked_logits(reference, first, chunk).double(), logits64)
    _compare_gradients(beyond, reference, grads64, report)


def load_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)``, strict but for the other names of tied weights: a
    pipeline's weights out name a tied weight once, as a Hugging Face folder does."""
    groups = tied_parameter_groups(model)
    aliases = {f"{module}.{param}" if module else param for group in groups for module, param in group}
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [name for name in missing if name not in aliases]
    if left or unexpected:
        raise RuntimeError(f"state dict keys missing: {left}; unexpected: {list(unexpected)}")


def _whole_state(policy: Policy) -> dict[str, Any]:
    """The policy's weights, whole, on every rank (a pipeline's from every stage)."""
    if policy.layout.pp > 1:
        return {name: tensor.clone() for name, tensor in policy.weights()}
    with quiet_logger("torch.distributed.tensor"):
        return get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True))


def _whole_optimizer_state(policy: Policy) -> dict[str, Any]:
    """The policy's optimizer state, whole (a copy: a full state dict may hold the optimizer's own
    tensors -- AdamW's step counts always, a shard that is the whole tensor too -- which both
    optimizers would then advance); a pipeline's merged from every stage's rank."""
    state = copy.deepcopy(
        get_optimizer_state_dict(policy.model, policy.optimizer, options=StateDictOptions(full_state_dict=True))
    )
    if policy.layout.pp == 1:
        return state
    every: list[Any] = [None] * policy.layout.pp
    dist.all_gather_object(every, state, group=policy.mesh["pp"].get_group())
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in every:
        merged["state"].update(part["state"])
        for i, group in enumerate(part["param_groups"]):
            if i == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            merged["param_groups"][i]["params"] += list(group["params"])
    return merged


def _over_stages(report: VerifyReport, policy: Policy) -> None:
    """A pipeline's report over every stage: each rank compared its own stages' gradients (the
    worst over every rank; the parameters counted once a stage, over the pipeline's ranks)."""
    mine = (report.grad_max_rel, report.worst_grad, report.grad_floor, report.grad_exact_rel)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    report.grad_max_rel, report.worst_grad = max(((e[0], e[1]) for e in every), key=lambda e: e[0])
    report.grad_floor = max(e[2] for e in every)
    report.grad_exact_rel = max(e[3] for e in every)
    counts: list[Any] = [None] * policy.layout.pp
    dist.all_gather_object(counts, report.params_compared, group=policy.mesh["pp"].get_group())
    report.params_compared = sum(counts)
