"""Rank-side code of tests/test_policy.py (spawned by tests/distributed.py): plancc.Policy
against the unsharded model trained on the whole global batch in one pass."""

from __future__ import annotations

import copy

from .distributed import init_gloo, sized

ROWS_PER_RANK = 4
GRAD_NORM = "(gradient norm before clipping)"  # beside the gradients: clipping hides a scaled gradient
SEQ = 16
LR = 0.5


# ----------------------------------------------------------------------------- losses
def _token_mask(mb):
    from plancc.engine.batches import default_token_mask

    return default_token_mask(mb["attention_mask"]).float()


def nll(lp, mb, norm):
    """SFT: the token mean over the global batch."""
    mask = _token_mask(mb)
    loss = -(lp * mask).sum() / norm.tokens
    return loss, {"nll_sum": float(-(lp.detach() * mask).sum())}


def grpo(lp, mb, norm, eps=0.2, beta=0.05):
    """A clipped GRPO objective with a k3 KL penalty to the reference log-probs."""
    import torch

    mask = _token_mask(mb)
    ratio = torch.exp(lp - mb["old_logprobs"])
    adv = mb["advantages"].unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    delta = mb["ref_logprobs"] - lp
    kl = torch.exp(delta) - delta - 1
    loss = ((-surrogate + beta * kl) * mask).sum() / norm.tokens
    return loss, {"kl_sum": float((kl.detach() * mask).sum())}


def seq_mean_token_mean(lp, mb, norm):
    """Each row normalized by its own tokens, then the rows by the global sequence count."""
    mask = _token_mask(mb)
    per_row = (lp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return -per_row.sum() / norm.sequences, {}


def nll_per_rank(lp, mb, norm):
    """The bug the engine exists to prevent: the mean over what this microbatch holds."""
    mask = _token_mask(mb)
    return -(lp * mask).sum() / mask.sum(), {}


LOSSES = {"nll": nll, "grpo": grpo, "seq_mean_token_mean": seq_mean_token_mean, "nll_per_rank": nll_per_rank}


def nll_tokens(lp, tok, norm):
    """``nll`` as a sum of per-token terms (``Policy.train(token_loss=)``): a token without a
    log-prob has log-prob 0 and every field 0, its attention_mask included."""
    mask = tok["attention_mask"].float()
    return -(lp * mask).sum() / norm.tokens, {"nll_sum": -(lp.detach() * mask).sum()}


def grpo_tokens(lp, tok, norm, eps=0.2, beta=0.05):
    """``grpo`` per token: ``advantages`` (a per-row field) comes at each token's row."""
    import torch

    mask = tok["attention_mask"].float()
    ratio = torch.exp(lp - tok["old_logprobs"])
    adv = tok["advantages"]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    delta = tok["ref_logprobs"] - lp
    kl = torch.exp(delta) - delta - 1
    return ((-surrogate + beta * kl) * mask).sum() / norm.tokens, {"kl_sum": (kl.detach() * mask).sum()}


# a ``token_loss`` case is named after the loss_fn it must equal
TOKEN_LOSSES = {"nll_tokens": nll_tokens, "grpo_tokens": grpo_tokens}


# ----------------------------------------------------------------------------- data
def global_batch(rows, vocab, seed=1):
    """Rows of different lengths (right padding), with the fields a GRPO loss reads."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 3, SEQ + 1, (rows,), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "advantages": torch.randn(rows, generator=gen),
        "old_logprobs": -torch.rand(rows, SEQ, generator=gen) * 6,
        "ref_logprobs": -torch.rand(rows, SEQ, generator=gen) * 6,
    }


def _full_state(model):
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _reference_step(config, seed, batch, loss_fn, max_grad_norm, dtype, groups=None):
    """The unsharded model in ``dtype``, the whole global batch, the log-probs of a plain
    log_softmax: (loss, updated state). In one pass, or with the gradients accumulated over
    ``groups`` of rows (to measure what fp32 itself loses to accumulation)."""
    import torch

    from plancc.engine.batches import default_token_mask
    from plancc.engine.policy import BatchTotals
    from plancc.models import build_model
    from plancc.runtime.vocab_parallel_logprobs import per_position

    torch.manual_seed(seed)
    model = build_model(copy.deepcopy(config), device="cpu").to(dtype)
    norm = BatchTotals(
        tokens=float(default_token_mask(batch["attention_mask"]).sum()), sequences=float(batch["input_ids"].shape[0])
    )
    total = 0.0
    for rows in groups or [list(range(batch["input_ids"].shape[0]))]:
        ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
        lp = per_position(picked, mask, None).to(dtype)
        fields = {k: (v[rows].to(dtype) if v.is_floating_point() else v[rows]) for k, v in batch.items()}
        loss, _ = loss_fn(lp, fields, norm)
        loss.backward()
        total += float(loss.detach())
    norm_before_clipping = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    grads[GRAD_NORM] = norm_before_clipping
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return total, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def _update_error(before, after, want):
    """(worst difference of the sharded and the exact update of one parameter relative to the
    norm of the whole exact update, that parameter, and the same relative to its own update)."""
    deltas = {
        name: (after[name] - before[name], w - before[name])
        for name, w in want.items()
        if name in after and name in before
    }
    whole = max(sum(float(ref.norm()) ** 2 for _, ref in deltas.values()) ** 0.5, 1e-12)
    worst, where, own = 0.0, "", 0.0
    for name, (got, ref) in deltas.items():
        error = float((got - ref).norm())
        if error / whole > worst:
            worst, where, own = error / whole, name, error / max(float(ref.norm()), 1e-12)
    return worst, where, own


def _own_errors(before, after, want):
    """Each parameter's update difference relative to its own update."""
    return {
        name: float(((after[name] - before[name]) - (w - before[name])).norm())
        / max(float((w - before[name]).norm()), 1e-12)
        for name, w in want.items()
        if name in after and name in before
    }


def _recording_sgd(params):
    """SGD that keeps the full (clipped) gradient of every parameter it steps, by name."""
    import torch
    from torch.distributed.tensor import DTensor

    class RecordingSGD(torch.optim.SGD):
        names: list = []
        gradients: dict = {}

        def step(self, closure=None):
            params = [p for group in self.param_groups for p in group["params"]]
            self.gradients = {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for name, p in zip(self.names, params, strict=True)
                if p.grad is not None
            }
            return super().step(closure)

    return RecordingSGD(params, lr=LR)


def _gradient_verdict(got, exact, fp32, owned=None):
    """Every parameter's gradient against the exact one, relative to its own size: within 1e-5,
    or where the unsharded fp32 model on the same microbatches misses that itself, within 4x its
    distance. Returns (worst error / its bar, that parameter, its error, its bar, parameters).
    ``owned``: the parameters this rank holds (a pipeline rank: its stages'), default all."""
    worst = (0.0, "", 0.0, 0.0)
    for name, want in exact.items():
        if owned is not None and name not in owned:  # a parameter of another pipeline rank's stages
            continue
        want = want.double()
        scale = max(float(want.norm()), 1e-30)
        error = float((got[name].double() - want).norm()) / scale
        bar = max(1e-5, 4 * float((fp32[name].double() - want).norm()) / scale)
        if error / bar > worst[0]:
            worst = (error / bar, name, error, bar)
    return (*worst, len(got))


def _groups(batch, policy, cutting):
    """The rows (of the global batch) of every microbatch of every dp rank, as the engine cuts them."""
    from plancc.engine.batches import plan_microbatches

    per = batch["input_ids"].shape[0] // policy.dp_size
    groups = []
    for r in range(policy.dp_size):
        lengths = batch["attention_mask"][r * per : (r + 1) * per].sum(1).tolist()
        plan = plan_microbatches(
            lengths, micro_batch_size=cutting.get("micro_batch_size"), max_tokens=cutting.get("max_tokens")
        )
        groups += [[r * per + i for i in rows] for rows in plan]
    return groups


def _with_checkpointing(plan, path):
    """``PLAN#checkpoint=GLOB``: the plan with its activation checkpointing on ``GLOB`` instead
    (written to ``path``), as a user who checkpoints whole layers writes it; else ``plan``."""
    import re

    if "#checkpoint=" not in plan:
        return plan
    source, glob = plan.split("#checkpoint=")
    text = re.sub(r"(?m)^activation_checkpointing: .*$", f"activation_checkpointing: [{glob}]", open(source).read())
    with open(path, "w") as f:
        f.write(text)
    return path


def train_cases(plan, model_name, layout_kwargs, cases, folder=None):
    """For each (loss, cutting) case: one Policy.train call from the same initial weights against
    the unsharded reference; returns per case the loss difference and the worst relative update
    difference. With a ``folder``, then the policy's other bars at the same layout
    (``_refit_and_resume_bars``): the weights out bitwise, and a save loaded into a fresh policy
    training on identically."""
    import torch

    import plancc
    from plancc.models import load_config

    rank, _ = init_gloo()
    plan = _with_checkpointing(plan, f"{folder}-plan-{rank}.yaml")  # (a folder given with such a plan)
    policy = plancc.Policy(plan, model_name, optimizer=_recording_sgd, max_grad_norm=1.0, layout=sized(**layout_kwargs))
    policy.optimizer.names = [name for name, _ in policy.model.named_parameters()]
    config = load_config(model_name)
    initial = [t.clone() for t in policy._shards()]
    before = _full_state(policy.model)
    batch = global_batch(ROWS_PER_RANK * policy.dp_size, config.vocab_size)
    mine = policy.slice_of(batch["input_ids"].shape[0])
    shards = watch_sequence_shards(policy.model)
    out = []
    for loss_name, cutting in cases:
        with torch.no_grad():
            for param, value in zip(policy._shards(), initial, strict=True):
                param.copy_(value)
        mine_batch = {k: v[mine] for k, v in batch.items()}
        if loss_name in TOKEN_LOSSES:
            metrics = policy.train(mine_batch, token_loss=TOKEN_LOSSES[loss_name], **cutting)
        else:
            metrics = policy.train(mine_batch, LOSSES[loss_name], **cutting)
        after = _full_state(policy.model)
        reference_loss = LOSSES[loss_name.replace("_per_rank", "").replace("_tokens", "")]
        try:
            want_loss, exact, exact_grads = _reference_step(config, 0, batch, reference_loss, 1.0, torch.float64)
        except RuntimeError:  # transformers' grouped MoE matmul has no fp64: the fp32 model is the bar
            want_loss, exact, exact_grads = _reference_step(config, 0, batch, reference_loss, 1.0, torch.float32)
        groups = _groups(batch, policy, cutting)
        _, fp32, fp32_grads = _reference_step(config, 0, batch, reference_loss, 1.0, torch.float32, groups)
        exact = {k: v.float() for k, v in exact.items()}
        want_norm = exact_grads.pop(GRAD_NORM)
        fp32_grads.pop(GRAD_NORM)
        error, where, own = _update_error(before, after, exact)
        out.append(
            {
                "loss": loss_name,
                "cutting": cutting,
                "loss_diff": abs(metrics["loss"] - want_loss) / max(1.0, abs(want_loss)),
                "grad_norm_diff": abs(metrics["grad_norm"] - want_norm) / want_norm,
                "gradient": _gradient_verdict(
                    policy.optimizer.gradients, exact_grads, fp32_grads, set(policy.optimizer.names)
                ),
                "update_diff": error,
                "worst_parameter": where,
                "worst_parameter_own": own,
                # how far the unsharded fp32 model itself is from exact (the bar beyond 1e-5)
                "fp32_update_diff": _update_error(before, fp32, exact)[0],
                "fp32_update_diff_own": _update_error(before, fp32, exact)[2],
                "own": _own_errors(before, after, exact),
                "fp32_own": _own_errors(before, fp32, exact),
                "microbatches": metrics["microbatches"],
                "tokens": metrics["tokens"],
                # the step's throughput counts every attended token of the global batch
                "input_tokens": (metrics["input_tokens"], float(batch["attention_mask"].sum())),
                "sequence_shards": sorted(shards),
            }
        )
    bars = _refit_and_resume_bars(policy, plan, model_name, layout_kwargs, mine_batch, folder) if folder else {}
    torch.distributed.destroy_process_group()
    return {"cases": out, **bars}


def _refit_and_resume_bars(policy, plan, model_name, layout_kwargs, batch, folder):
    """The refit bar: what ``weights()`` streams, loaded by transformers itself into a receiver
    (its conversions undone: fused experts, tied weights), is bitwise every tensor of the model
    this rank holds (under pp, its stages'). The resume bar: the policy saved and loaded by a fresh
    one (other initial weights) trains the next step to the same loss and gradient norm, bitwise,
    and the two then give the same log-probs, bitwise."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import plancc
    from plancc.models import load_config

    own = _full_state(policy.model)
    streamed = {name: t.contiguous() for name, t in policy.weights()}
    with tempfile.TemporaryDirectory() as receiver_folder:
        load_config(model_name).save_pretrained(receiver_folder)
        save_file(streamed, f"{receiver_folder}/model.safetensors", metadata={"format": "pt"})
        receiver, loading = AutoModelForCausalLM.from_pretrained(
            receiver_folder, dtype=torch.float32, output_loading_info=True
        )
    received = receiver.state_dict()
    shared = sorted(set(own) & set(received))
    bitwise = bool(shared) and all(torch.equal(received[n], own[n]) for n in shared)
    # what the receiver had to initialize itself: a weight the stream left out
    missing = sorted(loading["missing_keys"]) + sorted(set(own) - set(received))
    policy.save(folder)
    twin = plancc.Policy(
        plan, model_name, seed=7, optimizer=_recording_sgd, max_grad_norm=1.0, layout=sized(**layout_kwargs)
    )
    twin.optimizer.names = list(policy.optimizer.names)
    twin.load(folder)
    went_on = policy.train(batch, LOSSES["grpo"])
    resumed = twin.train(batch, LOSSES["grpo"])
    same_step = (resumed["loss"], resumed["grad_norm"]) == (went_on["loss"], went_on["grad_norm"])
    same_logprobs = torch.equal(policy.logprobs(batch), twin.logprobs(batch))
    return {
        "refit_bitwise": bitwise,
        "refit_compared": len(shared),
        "refit_missing": missing,
        "resumed": (twin.step == policy.step, same_step, same_logprobs),
    }


def watch_sequence_shards(model):
    """What the attention layers under context parallelism see: the rows' whole length over the
    queries a rank holds (cp where the sequence is sharded), one entry per distinct ratio."""
    from plancc.runtime.cp_context import context_of
    from plancc.sequence_mixing import is_cp_attention

    seen = set()

    def record(module, args, kwargs):
        ctx = context_of(module)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if ctx is not None and ctx.batch is not None and hidden is not None:
            seen.add(ctx.batch.key_positions.shape[1] // hidden.shape[1])

    for module in model.modules():
        if is_cp_attention(module):
            module.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def logprobs_reference_weights(plan, model_name, layout_kwargs, export_dir):
    """Policy.logprobs / reference_logprobs against the unsharded model before and after a step;
    that both leave the weights and optimizer state bitwise; weights() against export_hf; a bad
    batch refused on every rank with nothing changed."""
    import torch
    from safetensors.torch import load_file

    import plancc
    from plancc.engine.batches import BatchError
    from plancc.engine.policy import NonFiniteError
    from plancc.models import build_model, load_config
    from plancc.runtime.vocab_parallel_logprobs import token_logprobs

    init_gloo()
    policy = plancc.Policy(plan, model_name, reference=True, layout=sized(**layout_kwargs))
    config = load_config(model_name)
    batch = global_batch(ROWS_PER_RANK * policy.dp_size, config.vocab_size, seed=3)
    mine = policy.slice_of(batch["input_ids"].shape[0])
    local = {k: v[mine] for k, v in batch.items()}
    torch.manual_seed(0)
    unsharded = build_model(copy.deepcopy(config), device="cpu").eval()
    want, want_ent = token_logprobs(
        unsharded, local["input_ids"], attention_mask=local["attention_mask"], entropy=True, temperature=0.7
    )
    got, got_ent = policy.logprobs(local, entropy=True, temperature=0.7, micro_batch_size=3)
    result = {"logprobs": float((got - want).abs().max()), "entropy": float((got_ent - want_ent).abs().max())}
    policy.train(local, nll)  # AdamW: the policy moves, the reference stays
    after_step = _full_state(policy.model)
    optim_before = {k: {n: v.clone() for n, v in s.items()} for k, s in policy.optimizer.state_dict()["state"].items()}
    ref_lp = policy.reference_logprobs(local, max_tokens=2 * SEQ)
    result["reference"] = float(
        (ref_lp - token_logprobs(unsharded, local["input_ids"], attention_mask=local["attention_mask"])).abs().max()
    )
    moved = policy.logprobs(local)
    result["policy_moved"] = float((moved - ref_lp).abs().max())
    after_calls = _full_state(policy.model)
    optim_after = policy.optimizer.state_dict()["state"]
    result["weights_bitwise"] = all(torch.equal(after_step[k], after_calls[k]) for k in after_step)
    result["optimizer_bitwise"] = all(
        torch.equal(_plain(optim_before[k][n]), _plain(optim_after[k][n]))
        for k in optim_before
        for n in optim_before[k]
    )
    # weights out, bucket by bucket, against what export_hf writes
    streamed = {}
    for name, tensor in policy.weights(bucket_bytes=64 * 1024):
        streamed[name] = tensor.clone()
    policy.export_hf(export_dir)
    exported = load_file(f"{export_dir}/model.safetensors")
    result["weights_names_equal"] = sorted(streamed) == sorted(exported)
    result["weights_bitwise"] = all(torch.equal(streamed[k], exported[k]) for k in exported if k in streamed)
    # a bad batch: refused on every rank, nothing changed
    bad = dict(local)
    if policy.dp_rank == 0:
        bad["advantages"] = bad["advantages"][:-1]
    before_bad = _full_state(policy.model)
    try:
        policy.train(bad, grpo)
        result["bad_rows"] = "accepted"
    except BatchError as exc:
        result["bad_rows"] = str(exc)
    missing = {k: v for k, v in local.items() if k != "ref_logprobs"}
    try:
        policy.train(missing, grpo)
        result["missing_field"] = "accepted"
    except BatchError as exc:
        result["missing_field"] = str(exc)
    try:
        policy.train(local, lambda lp, mb, norm: (lp.sum() * float("nan"), {}))
        result["non_finite"] = "accepted"
    except NonFiniteError as exc:  # divergence is not bad input: its own error
        result["non_finite"] = str(exc)
    try:
        policy.train(local, nll, max_tokens=3)
        result["budget"] = "accepted"
    except BatchError as exc:
        result["budget"] = str(exc)
    after_bad = _full_state(policy.model)
    result["unchanged_after_bad"] = all(torch.equal(before_bad[k], after_bad[k]) for k in before_bad)
    torch.distributed.destroy_process_group()
    return result


def _plain(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def save_then_load_elsewhere(plan, model_name, folder, save_layout, load_layout):
    """Train one step at ``save_layout`` and save; a fresh Policy at ``load_layout`` loads it:
    its log-probs and its next step equal the saving policy's (the optimizer state came along)."""
    import torch

    import plancc
    from plancc.models import load_config

    init_gloo()
    config = load_config(model_name)
    batch = global_batch(ROWS_PER_RANK * 2, config.vocab_size, seed=5)
    out = {}
    first = plancc.Policy(plan, model_name, layout=sized(**save_layout))
    mine = first.slice_of(batch["input_ids"].shape[0])
    first.train({k: v[mine] for k, v in batch.items()}, nll)
    first.save(folder)
    want = first.logprobs({k: v[mine] for k, v in batch.items()})
    second = plancc.Policy(plan, model_name, seed=7, layout=sized(**load_layout))  # other initial weights
    second.load(folder)
    other = second.slice_of(batch["input_ids"].shape[0])
    got = second.logprobs({k: v[other] for k, v in batch.items()})
    # compare the rows both ranks hold: gather every rank's rows into the global batch
    full_want = [None] * torch.distributed.get_world_size()
    full_got = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(full_want, (mine.start, want))
    torch.distributed.all_gather_object(full_got, (other.start, got))
    rows = {}
    for start, lp in full_want:
        for i in range(lp.shape[0]):
            rows[start + i] = lp[i]
    out["logprobs"] = max(
        float((lp[i] - rows[start + i]).abs().max()) for start, lp in full_got for i in range(lp.shape[0])
    )
    out["step"] = second.step
    torch.distributed.destroy_process_group()
    return out


def slices_that_do_not_fit(plan, model_name):
    """At dp2 x tp2: dp ranks with different row counts, and tp ranks with different rows, are
    refused on every rank (naming what is wrong) and change nothing."""
    import torch

    import plancc
    from plancc.engine.batches import BatchError
    from plancc.models import load_config

    init_gloo()
    policy = plancc.Policy(plan, model_name, layout=sized(dp=2, tp=2))
    config = load_config(model_name)
    batch = global_batch(ROWS_PER_RANK * 2, config.vocab_size, seed=9)
    local = {k: v[policy.slice_of(batch["input_ids"].shape[0])] for k, v in batch.items()}
    before = _full_state(policy.model)
    out = {}
    short = {k: (v[:-1] if policy.dp_rank == 1 else v) for k, v in local.items()}
    other = dict(local)
    if torch.distributed.get_rank() == 3:  # dp rank 1, tp rank 1
        other["input_ids"] = (other["input_ids"] + 1) % config.vocab_size
    for name, bad in {"uneven": short, "tp_differs": other}.items():
        try:
            policy.train(bad, nll)
            out[name] = "accepted"
        except BatchError as exc:
            out[name] = str(exc)
    after = _full_state(policy.model)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    torch.distributed.destroy_process_group()
    return out


def offload_round_trip_and_weights(plan, model_name, layout_kwargs, export_dir):
    """Training continued after offload/onload is bitwise the training without it; an offloaded
    policy refuses to train and to give the reference's log-probs (before it swaps weights),
    one with its optimizer's state alone offloaded gives log-probs and refuses to train;
    weights() equals export_hf (names and values) and gathers no more
    than a bucket (or one larger tensor) at a time."""
    import torch

    import plancc
    from plancc.models import load_config
    from safetensors.torch import load_file

    init_gloo()
    config = load_config(model_name)
    a = plancc.Policy(plan, model_name, reference=True, layout=sized(**layout_kwargs))
    b = plancc.Policy(plan, model_name, layout=sized(**layout_kwargs))
    batch = global_batch(ROWS_PER_RANK * a.dp_size, config.vocab_size, seed=11)
    local = {k: v[a.slice_of(batch["input_ids"].shape[0])] for k, v in batch.items()}
    out = {}
    a.train(local, nll)
    b.train(local, nll)
    a.offload()
    for name, call in {"train": lambda: a.train(local, nll), "reference": lambda: a.reference_logprobs(local)}.items():
        try:
            call()
            out[f"offloaded_{name}"] = "accepted"
        except RuntimeError as exc:
            out[f"offloaded_{name}"] = str(exc)
    a.onload()
    on_device = a.logprobs(local)
    a.offload(params=False)  # the optimizer's state alone (a colocated engine short of memory)
    # log-probs read the parameters alone: they run, the same bits; a step needs the state
    out["optimizer_offloaded_logprobs"] = torch.equal(a.logprobs(local), on_device)
    try:
        a.train(local, nll)
        out["optimizer_offloaded"] = "accepted"
    except RuntimeError as exc:
        out["optimizer_offloaded"] = str(exc)
    a.offload(optimizer=False)  # then the parameters too
    a.onload()
    a.train(local, nll)
    b.train(local, nll)
    sa, sb = _full_state(a.model), _full_state(b.model)
    out["bitwise"] = all(torch.equal(sa[k], sb[k]) for k in sa)
    # weights out: a small bucket, so that many buckets pass
    bucket = 16 * 1024
    held, peak, largest, streamed = 0, 0, 0, {}
    for name, tensor in a.weights(bucket_bytes=bucket):
        streamed[name] = tensor.clone()
        largest = max(largest, tensor.numel() * tensor.element_size())
    out["buckets_bounded"] = _buckets_bounded(a, bucket)
    a.export_hf(export_dir)
    exported = {}
    import glob

    for path in glob.glob(f"{export_dir}/*.safetensors"):
        exported.update(load_file(path))
    out["names_equal"] = sorted(streamed) == sorted(exported)
    out["missing"] = sorted(set(exported) - set(streamed))[:3]
    out["bitwise_export"] = all(torch.equal(streamed[k], exported[k]) for k in exported if k in streamed)
    torch.distributed.destroy_process_group()
    return out


def _buckets_bounded(policy, bucket):
    """Every bucket the stream gathers holds at most ``bucket`` bytes, or one larger tensor."""
    from plancc.engine.streaming import buckets, exported_names

    state = policy.model.state_dict()
    sizes = [(n, state[n].numel() * state[n].element_size()) for n in exported_names(policy.model)]
    groups = buckets(sizes, bucket)
    by_name = dict(sizes)
    return len(groups) > 1 and all(sum(by_name[n] for n in g) <= bucket or len(g) == 1 for g in groups)


def torchrun_reference_for_ray(plan, model_name, layout_kwargs):
    """What tests/test_ray_group.py's actors compute, on ranks started by the elastic launcher:
    log-probs of the global batch (this rank's slice), one SGD step, its metrics."""
    import torch

    import plancc
    from plancc.models import load_config

    init_gloo()
    policy = plancc.Policy(
        plan, model_name, optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": LR}}, layout=sized(**layout_kwargs)
    )
    batch = global_batch(ROWS_PER_RANK * policy.dp_size, load_config(model_name).vocab_size, seed=13)
    mine = policy.slice_of(batch["input_ids"].shape[0])
    local = {k: v[mine] for k, v in batch.items()}
    out = {"start": mine.start, "logprobs": policy.logprobs(local)}
    metrics = policy.train(local, grpo, micro_batch_size=3)
    out["metrics"] = {k: v for k, v in metrics.items() if k != "seconds"}
    out["after"] = policy.logprobs(local)
    torch.distributed.destroy_process_group()
    return out


def weights_peak_memory(plan, config_path, layout_kwargs, bucket):
    """This rank's peak bytes of the tensors made while it streams weights() (each one dropped
    once seen) and while it takes the seed's full state dict (tests/live_bytes.py)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    import plancc

    from .live_bytes import LiveBytes

    init_gloo()
    policy = plancc.Policy(plan, config_path, layout=sized(**layout_kwargs))
    held = [
        t._local_tensor if isinstance(t, DTensor) else t for t in [*policy.model.parameters(), *policy.model.buffers()]
    ]
    largest = [0]

    def stream():
        for _, tensor in policy.weights(bucket_bytes=bucket):
            largest[0] = max(largest[0], tensor.numel() * tensor.element_size())

    def seed_way():
        return len(get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True)))

    out = {}
    for name, run in {"stream": stream, "seed": seed_way}.items():
        with LiveBytes(held) as counter:
            run()
        out[name] = counter.peak
    out["largest"] = largest[0]
    out["total"] = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    torch.distributed.destroy_process_group()
    return out


def ratio_at_temperatures(plan, model_name, layout_kwargs, temperatures):
    """max |exp(train's log-probs - logprobs(T)) - 1| over the real tokens, per temperature, with
    the weights identical (SGD at lr 0): the PPO ratio at step 0."""
    import torch

    import plancc

    init_gloo()
    policy = plancc.Policy(
        plan, model_name, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), layout=sized(**layout_kwargs)
    )
    batch = global_batch(ROWS_PER_RANK * policy.dp_size, 256, seed=5)
    local = {k: v[policy.slice_of(batch["input_ids"].shape[0])] for k, v in batch.items()}
    out = {}
    for temperature in temperatures:
        old = policy.logprobs(local, temperature=temperature)
        seen = []

        def loss(lp, mb, norm):
            seen.append(lp.detach())
            return nll(lp, mb, norm)

        policy.train(local, loss, temperature=temperature)
        mask = _token_mask(local).bool()
        ratio = torch.exp(seen[0] - old)[mask]
        untempered = torch.exp(seen[0] - policy.logprobs(local))[mask]
        out[temperature] = {"ratio_off": float((ratio - 1).abs().max()), "t1_off": float((untempered - 1).abs().max())}
    try:
        policy.logprobs(local, temperature=float("inf"))
        out["inf"] = "accepted"
    except ValueError as exc:
        out["inf"] = str(exc)
    return out


def dies_on_rank_1(lp, mb, norm):
    """A loss whose rank 1 process dies mid-train (an actor lost to a node failure, an OOM kill)."""
    import os

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(17)
    return nll(lp, mb, norm)


def reference_places(plan, model_name, layout_kwargs):
    """The reference kept on the device in bf16 (the compute dtype) and in host memory in fp32:
    bf16 compute gives the same log-probs from both, bitwise, and the initial weights' own; the
    policy's weights come back bitwise after each call."""
    import torch

    import plancc
    from plancc.models import load_config

    init_gloo()
    config = load_config(model_name)
    batch = global_batch(ROWS_PER_RANK * 2, config.vocab_size, seed=5)
    found = {}
    for place in ("device", "host"):
        policy = plancc.Policy(plan, model_name, reference=place, param_dtype="bfloat16", layout=sized(**layout_kwargs))
        local = {k: v[policy.slice_of(batch["input_ids"].shape[0])] for k, v in batch.items()}
        before = policy.logprobs(local)
        policy.train(local, nll)
        kept = [t.clone() for t in policy._shards()]
        storage = [t.untyped_storage().data_ptr() for t in policy._shards()]
        found[place] = {
            "kept": policy._reference.weights[0].dtype,
            "reference": policy.reference_logprobs(local),
            "before": before,
            "bitwise_after": all(torch.equal(a, b) for a, b in zip(kept, policy._shards(), strict=True)),
            # on the device the flat shards FSDP gathers from trade places: no buffer for the
            # policy's weights, and its parameters keep their own storage
            "by_reference": policy._reference.held is not None and not policy._reference.kept,
            "same_storage": storage == [t.untyped_storage().data_ptr() for t in policy._shards()],
            # an offload moves the device reference with the parameters (a no-op on the CPU: the
            # storages it would move are named here)
            "offloaded_with_params": _storages(policy._reference.weights)
            <= _storages(policy._memory.tensors("params")),
        }
    torch.distributed.destroy_process_group()
    device, host = found["device"], found["host"]
    return {
        "dtypes": (str(device["kept"]), str(host["kept"])),
        "same": torch.equal(device["reference"], host["reference"]),
        "initial": torch.equal(device["reference"], device["before"]),
        "bitwise_after": device["bitwise_after"] and host["bitwise_after"],
        "swapped_by_reference": (device["by_reference"], host["by_reference"]),
        "same_storage": device["same_storage"] and host["same_storage"],
        "offloaded_with_params": (device["offloaded_with_params"], host["offloaded_with_params"]),
    }


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def dropped_policies_freed(plan, model_name):
    """Whether a Policy (with a device reference, trained a step) and its optimizer (the state:
    twice the parameters' bytes) are freed as the last reference goes, with the garbage
    collector off: a reference cycle through the policy would keep them until a collection.
    (The model is not: FSDP2's hooks tie each module to its state, so torch's own cycles free it
    at the next collection.)"""
    import gc
    import weakref

    import plancc
    from plancc.models import load_config

    init_gloo()
    batch = global_batch(ROWS_PER_RANK, load_config(model_name).vocab_size, seed=3)
    freed = {}
    gc.disable()
    try:
        for reference in (True, "host", False):
            policy = plancc.Policy(plan, model_name, reference=reference)
            policy.train(batch, nll)
            alive = [weakref.ref(policy), weakref.ref(policy.optimizer)]
            del policy
            freed[str(reference)] = [ref() is None for ref in alive]
    finally:
        gc.enable()
    import torch

    torch.distributed.destroy_process_group()
    return freed


def calls_out_of_step(plan, model_name, layout_kwargs):
    """offload() on rank 0 alone, then train and logprobs on both ranks; then rank 0 logprobs while
    rank 1 trains: each outcome (and how long it took) on this rank, and whether the policy trains
    once both are in step again."""
    import time

    import torch.distributed as dist

    import plancc

    init_gloo()
    try:
        policy = plancc.Policy(plan, model_name, device="cpu", layout=sized(**layout_kwargs))
        batch = global_batch(4, policy.config.vocab_size)
        rows = policy.slice_of(batch["input_ids"].shape[0])
        mine = {k: v[rows] for k, v in batch.items()}
        policy.train(mine, nll)
        out = {}

        def outcome(name, call):
            start = time.perf_counter()
            try:
                call()
                out[name] = "ran"
            except RuntimeError as exc:
                out[name] = f"RuntimeError: {exc}"
            out[f"{name} seconds"] = time.perf_counter() - start

        if dist.get_rank() == 0:
            policy.offload()
        outcome("train", lambda: policy.train(mine, nll))
        outcome("logprobs", lambda: policy.logprobs(mine))
        if dist.get_rank() == 0:
            policy.onload()
        outcome("in step", lambda: policy.train(mine, nll))
        outcome(
            "different calls",
            (lambda: policy.logprobs(mine)) if dist.get_rank() == 0 else (lambda: policy.train(mine, nll)),
        )
        outcome("after", lambda: policy.train(mine, nll))
        return out
    finally:
        dist.destroy_process_group()
