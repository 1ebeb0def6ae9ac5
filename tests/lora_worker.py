"""Rank-side code of tests/test_lora.py (spawned by tests/distributed.py): a ``Policy`` with
LoRA adapters against the unsharded PEFT model (``peft.get_peft_model`` on the same base and
the same adapter weights) trained on the whole global batch in one pass."""

from __future__ import annotations

import copy

from .distributed import init_gloo, sized
from .policy_worker import (
    GRAD_NORM,
    LOSSES,
    LR,
    ROWS_PER_RANK,
    TOKEN_LOSSES,
    _full_state,
    _gradient_verdict,
    _groups,
    _recording_sgd,
    global_batch,
)

SPEC = {"r": 4, "alpha": 8, "init_lora_weights": False}  # B drawn at random: both A and B get gradients
ATTENTION = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj"]
MLP = ["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.down_proj"]


def peft_model(config, spec, adapters, dtype):
    """The unsharded base (seed 0, as the Policy's) wrapped by PEFT, with ``adapters`` (plancc's
    names, full tensors) as its LoRA weights."""
    import torch
    from peft import LoraConfig, get_peft_model

    from plancc.models import build_model

    torch.manual_seed(0)
    base = build_model(copy.deepcopy(config), device="cpu").to(dtype)
    modules = sorted({name.rsplit(".lora_", 1)[0] for name in adapters})
    lora = LoraConfig(
        r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=modules, init_lora_weights=False
    )
    model = get_peft_model(base, lora)
    state = {
        "base_model.model." + name.replace(".weight", ".default.weight"): value.to(dtype)
        for name, value in adapters.items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "lora_" in m], (missing, unexpected)
    return model


def _peft_step(config, spec, adapters, batch, loss_fn, dtype, groups=None):
    """(loss, gradients by plancc's names, the merged weights after the step) of the PEFT
    model on the whole batch (or accumulated over ``groups`` of rows)."""
    import torch

    from plancc.engine.batches import default_token_mask
    from plancc.engine.policy import BatchTotals
    from plancc.runtime.vocab_parallel_logprobs import per_position

    model = peft_model(config, spec, adapters, dtype)
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
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    norm_before = float(torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0))
    ours = {n.removeprefix("base_model.model.").replace(".default.weight", ".weight"): p for n, p in trained}
    grads = {name: p.grad.detach().clone() for name, p in ours.items()}
    grads[GRAD_NORM] = norm_before
    with torch.no_grad():
        for p in ours.values():
            p -= LR * p.grad
    merged = model.merge_and_unload()
    return total, grads, {k: v.detach().clone() for k, v in merged.state_dict().items()}


def lora_train_cases(plan, model_name, layout_kwargs, targets, cases):
    """Per (loss, cutting) case from the same initial weights: the loss, gradient norm and the
    adapters' gradients against the PEFT model's (fp64 exact; fp32 on the same microbatches as
    the floor), whether every base parameter is bitwise unchanged, and the merged weights of
    ``weights()`` against PEFT's ``merge_and_unload`` after the reference's step."""
    import torch

    import plancc
    from plancc.models import load_config
    from plancc.runtime.lora import adapters_of

    init_gloo()
    spec = {**SPEC, "targets": targets}
    policy = plancc.Policy(plan, model_name, optimizer=_recording_sgd, max_grad_norm=1.0, lora=spec, layout=sized(**layout_kwargs))
    policy.optimizer.names = [name for name, p in policy.model.named_parameters() if p.requires_grad]
    config = load_config(model_name)
    adapter_names = set(adapters_of(policy.model).parameter_names())
    initial = [t.clone() for t in policy._shards()]
    before = _full_state(policy.model)
    adapters = {k: v for k, v in before.items() if k in adapter_names}
    batch = global_batch(ROWS_PER_RANK * policy.dp_size, config.vocab_size)
    mine = policy.slice_of(batch["input_ids"].shape[0])
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
        merged = dict(policy.weights())
        reference_loss = LOSSES[loss_name.replace("_tokens", "")]
        try:
            want_loss, exact, want_merged = _peft_step(config, spec, adapters, batch, reference_loss, torch.float64)
        except RuntimeError:  # transformers' grouped MoE matmul has no fp64: the fp32 model is the bar
            want_loss, exact, want_merged = _peft_step(config, spec, adapters, batch, reference_loss, torch.float32)
        groups = _groups(batch, policy, cutting)
        _, fp32, _ = _peft_step(config, spec, adapters, batch, reference_loss, torch.float32, groups)
        want_norm = exact.pop(GRAD_NORM)
        fp32.pop(GRAD_NORM)
        base_changed = [k for k in before if k not in adapter_names and not torch.equal(before[k], after[k])]
        merged_error = max(
            float((merged[k].double() - want_merged[k].double()).abs().max()) for k in want_merged if k in merged
        )
        out.append(
            {
                "loss": loss_name,
                "cutting": cutting,
                "loss_diff": abs(metrics["loss"] - want_loss) / max(1.0, abs(want_loss)),
                "grad_norm_diff": abs(metrics["grad_norm"] - want_norm) / want_norm,
                "gradient": _gradient_verdict(policy.optimizer.gradients, exact, fp32),
                "trained": sorted(policy.optimizer.gradients) == sorted(adapter_names),
                "base_changed": base_changed,
                "merged_error": merged_error,
                # every adapted weight streamed under its base name (MoE experts stream in the
                # checkpoint's per-expert layout, so only the shared names compare)
                "merged_names": all(f"{m}.weight" in merged for m in adapters_of(policy.model).modules),
            }
        )
    torch.distributed.destroy_process_group()
    return out


def _base_logprobs(config, batch):
    """log p of every token under the unsharded base model (seed 0), 0 at position 0 and padding."""
    import torch

    from plancc.models import build_model

    torch.manual_seed(0)
    model = build_model(copy.deepcopy(config), device="cpu")
    return _logprobs_of(model, batch)


def _logprobs_of(model, batch):
    import torch

    from plancc.runtime.vocab_parallel_logprobs import per_position

    with torch.no_grad():
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
        return per_position(picked, mask, None)


def reference_export_and_resume(plan, model_name, layout_kwargs, targets, folder):
    """With LoRA: ``reference=True`` keeps no copy and ``reference_logprobs`` (after a step) is
    the base model's; ``export_hf`` writes the merged weights (``weights()``'s), and with
    ``adapters_only`` a folder ``peft.PeftModel.from_pretrained`` loads into the policy's
    log-probs; ``save`` / ``load`` keep the adapters and their AdamW state (the next step
    equal); a LoRA checkpoint into a policy without LoRA, and the reverse, are refused."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.checkpoint import CheckpointError
    from plancc.models import load_config

    init_gloo()
    spec = {**SPEC, "targets": targets}
    adamw = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}
    config = load_config(model_name)
    policy = plancc.Policy(plan, model_name, lora=spec, reference=True, optimizer=adamw, layout=sized(**layout_kwargs))
    out: dict = {"reference_copy": policy._reference is not None}
    batch = global_batch(ROWS_PER_RANK * policy.dp_size, config.vocab_size)
    mine = {k: v[policy.slice_of(batch["input_ids"].shape[0])] for k, v in batch.items()}
    loss = LOSSES["nll"]
    policy.train(mine, loss)
    reference = policy.reference_logprobs(mine)
    base = _base_logprobs(config, mine)
    out["reference_vs_base"] = float((reference - base).abs().max())
    trained = policy.logprobs(mine)
    out["trained_vs_base"] = float((trained - base).abs().max())
    root = Path(folder)
    policy.export_hf(root / "merged")
    policy.export_hf(root / "adapters", adapters_only=True)
    streamed = dict(policy.weights())
    adapters_streamed = dict(policy.weights(adapters_only=True))
    manifest = policy.weights_manifest(adapters_only=True)
    out["adapter_manifest"] = [
        sorted(t["name"] for b in manifest["buckets"] for t in b["tensors"]) == sorted(adapters_streamed),
        manifest["adapter_config"]["r"],
    ]
    if dist.get_rank() == 0:
        from peft import PeftModel
        from safetensors.torch import load_file

        written = load_file(str(root / "merged" / "model.safetensors"))
        out["merged_export_vs_stream"] = max(float((written[k] - streamed[k]).abs().max()) for k in written)
        out["merged_export_names"] = sorted(written) == sorted(streamed)
        out["adapter_files"] = sorted(p.name for p in (root / "adapters").iterdir() if not p.name.startswith("."))
        on_disk = load_file(str(root / "adapters" / "adapter_model.safetensors"))
        out["adapter_stream_equal"] = sorted(on_disk) == sorted(adapters_streamed) and all(
            torch.equal(on_disk[k], adapters_streamed[k]) for k in on_disk
        )
        from plancc.models import build_model

        torch.manual_seed(0)
        loaded = PeftModel.from_pretrained(build_model(copy.deepcopy(config), device="cpu"), str(root / "adapters"))
        out["peft_loaded_vs_policy"] = float((_logprobs_of(loaded, mine) - trained).abs().max())
    saved = policy.save(root / "ck")
    from torch.distributed.checkpoint import FileSystemReader

    held = [k for k in FileSystemReader(str(saved)).read_metadata().state_dict_metadata if k.startswith("model.")]
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    out["checkpoint_holds_adapters_only"] = bool(held) and {k.removeprefix("model.") for k in held} == trainable
    # the checkpoint holds the adapters alone: a policy on another base (seed 7's) is refused
    other = plancc.Policy(plan, model_name, lora=spec, optimizer=adamw, seed=7, layout=sized(**layout_kwargs))
    try:
        other.load(root / "ck")
        out["other_base"] = None
    except CheckpointError as exc:
        out["other_base"] = str(exc)
    del other
    resumed = plancc.Policy(plan, model_name, lora=spec, optimizer=adamw, layout=sized(**layout_kwargs))
    resumed.load(root / "ck")
    a, b = _full_state(policy.model), _full_state(resumed.model)
    out["resumed_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    first, second = policy.train(mine, loss), resumed.train(mine, loss)
    a, b = _full_state(policy.model), _full_state(resumed.model)
    out["next_step_equal"] = first["loss"] == second["loss"] and all(torch.equal(a[k], b[k]) for k in a)
    full = plancc.Policy(plan, model_name, optimizer=adamw, layout=sized(**layout_kwargs))
    full.save(root / "full")
    refusals = []
    for into, source in ((full, root / "ck"), (resumed, root / "full")):  # LoRA into full, full into LoRA
        kept = _full_state(into.model)
        try:
            into.load(source)
            refusals.append(None)
        except CheckpointError as exc:
            changed = any(not torch.equal(v, _full_state(into.model)[k]) for k, v in kept.items())
            refusals.append(None if changed else str(exc))
    out["refusals"] = refusals
    out["saved"] = saved.name
    torch.distributed.destroy_process_group()
    return out
