"""Rank-side code of the pipeline tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .conftest import PLANS
from .distributed import init_gloo, sized


def policy_calls(folder):
    """``Policy`` with pipeline stages beyond ``train``: log-probs against the unsharded model,
    the reference's after a step (the initial weights'), weights out, and a save loaded at pp=2
    and at pp=1."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.parallel_model import seeded_model
    from plancc.engine.losses import token_nll
    from plancc.models import load_config
    from plancc.runtime.vocab_parallel_logprobs import token_logprobs

    from pathlib import Path

    from .policy_worker import global_batch, nll

    init_gloo()
    try:
        adamw = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}
        policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", reference=True, optimizer=adamw, layout=sized(pp=2))
        config = load_config("tiny-qwen3")
        batch = global_batch(4, config.vocab_size)
        mask = batch["attention_mask"].bool()
        whole = seeded_model(config, 0)
        with torch.no_grad():
            want = token_logprobs(whole, batch["input_ids"], attention_mask=batch["attention_mask"])
        before = policy.logprobs(batch)
        lp_diff = (before - want)[mask].abs().max().item()
        outside = before[~mask].abs().max().item()  # padding: 0
        policy.train(batch, nll)
        after = policy.logprobs(batch)
        policy.offload()  # while a rollout engine runs: refused until onload, then as it was
        refused = ""
        calls = {
            "logprobs": lambda: policy.logprobs(batch),
            "weights": lambda: next(policy.weights()),
            "save": lambda: policy.save(folder),
            "load": lambda: policy.load(folder),
        }
        for name, call in calls.items():  # each refused, naming itself, before it reads a weight
            try:
                call()
            except RuntimeError as exc:
                refused += f"{name}: {exc}\n" if f"Policy.{name}:" in str(exc) else ""
        policy.onload()
        back = (policy.logprobs(batch) - after).abs().max().item()
        reference = policy.reference_logprobs(batch)
        names = [name for name, _ in whole.named_parameters()]
        out = dict(policy.weights())
        mine = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in policy.model.named_parameters()}
        weights_diff = max((out[n] - t).abs().max().item() for n, t in mine.items())
        path = policy.save(folder)
        again = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", seed=1, optimizer=adamw, layout=sized(pp=2))
        again.load(folder)
        resumed = again.logprobs(batch)
        flat = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", seed=1, optimizer=adamw, layout=sized(dp=2))
        info = flat.load(folder)
        at_pp1 = flat.logprobs(batch)
        # the weights out are Policy's at every layout: the same stream, manifest and export
        # from the stages as from the same checkpoint loaded at pp=1
        out_format = {"bucket_bytes": 65536, "dtype": torch.bfloat16}
        staged, plain = list(again.weights(**out_format)), list(flat.weights(**out_format))
        same_stream = [n for n, _ in staged] == [n for n, _ in plain] and all(
            torch.equal(a, b) for (_, a), (_, b) in zip(staged, plain, strict=True)
        )
        same_manifest = again.weights_manifest(**out_format) == flat.weights_manifest(**out_format)
        again.export_hf(Path(folder) / "hf-pp2")
        flat.export_hf(Path(folder) / "hf-pp1")
        exported = None
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            a, b = (load_file(str(Path(folder) / f / "model.safetensors")) for f in ("hf-pp2", "hf-pp1"))
            exported = sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
        # and a second step on both: the same loss (the optimizer's state came along)
        second = again.train(batch, token_loss=token_nll)["loss"]
        second_flat = flat.train({k: v[flat.slice_of(4)] for k, v in batch.items()}, token_loss=token_nll)["loss"]
        dist.barrier()
        return {
            "lp_diff": lp_diff,
            "outside": outside,
            "moved": (after - before)[mask].abs().max().item(),
            "reference": (reference - before).abs().max().item(),
            "names": list(out) == names,
            "weights_diff": weights_diff,
            "saved": path.name,
            "resumed": (resumed - after).abs().max().item(),
            "at_pp1": (at_pp1 - after)[mask].abs().max().item(),
            "step": info.step,
            "second": abs(second - second_flat),
            "refused": refused,
            "back": back,
            "is_policy": isinstance(policy, plancc.Policy),
            "same_stream": same_stream,
            "same_manifest": same_manifest,
            "exported": exported,
        }
    finally:
        dist.destroy_process_group()


def legacy_checkpoint(folder):
    """A checkpoint whose optimizer groups are numbered (as plancc wrote them before keying the
    optimizer's state by parameter name, for pipeline ranks) still loads: weights and AdamW's
    moments as saved."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import plancc

    from pathlib import Path

    from .policy_worker import global_batch, nll

    init_gloo()
    try:
        adamw = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}
        policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", optimizer=adamw, layout=sized(dp=2))
        batch = global_batch(4, 256)
        policy.train({k: v[policy.slice_of(4)] for k, v in batch.items()}, nll)
        path = policy.save(folder)
        model_sd, optim_sd = get_state_dict(policy.model, policy.optimizer)  # the numbered form
        if dist.get_rank() == 0:  # one rank clears the step's shards (two would race on the same files)
            for stale in path.glob("*.distcp"):
                stale.unlink()
        dist.barrier()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        numbered = any(k.startswith("optim.param_groups.0.") for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        fresh = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", seed=3, optimizer=adamw, layout=sized(dp=2))
        fresh.load(folder)
        weights = max((a - b).abs().max().item() for a, b in zip(policy._shards(), fresh._shards(), strict=True))
        moments = max(
            (policy.optimizer.state[p]["exp_avg"] - fresh.optimizer.state[q]["exp_avg"]).abs().max().item()
            for p, q in zip(policy.model.parameters(), fresh.model.parameters(), strict=True)
        )
        lr = fresh.optimizer.param_groups[0]["betas"]
        dist.barrier()
        return {"numbered": numbered, "weights": weights, "moments": moments, "betas": list(lr)}
    finally:
        dist.destroy_process_group()


def policy_schedule(folder, schedule, cp=1, pp=2, virtual=2, microbatches=4, layers=4):
    """``Policy(pp=pp)`` (``x cp``) under ``schedule`` with ``virtual`` stages a rank and the plan's
    activation checkpointing (``model.layers.*.mlp``), one NLL step on rows of every length
    against the unsharded model: the loss, the gradient norm and every gradient of this rank's
    stages; the log-probs (forward only) of the same rows; the decoder layers this rank holds."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.parallel_model import seeded_model
    from plancc.models import load_config

    from .policy_worker import watch_sequence_shards, global_batch, nll

    init_gloo()
    try:
        virtual_line = f"  virtual_stages_per_rank: {virtual}\n" if virtual > 1 else ""
        text = (PLANS / "qwen3.yaml").read_text().replace(
            "schedule: 1f1b\n", f"schedule: {schedule}\n{virtual_line}  microbatches: {microbatches}\n")
        assert "activation_checkpointing: [model.layers.*.mlp]" in text
        path = f"{folder}/plan-{dist.get_rank()}.yaml"
        with open(path, "w") as f:
            f.write(text)
        config = load_config("tiny-qwen3")
        config.num_hidden_layers, config.layer_types = layers, ["full_attention"] * layers
        grads = {}

        def keep(optimizer, *_):
            grads.update({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for n, p in policy.model.named_parameters()})

        policy = plancc.Policy(path, config, max_grad_norm=None, layout=sized(pp=pp, cp=cp),
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        policy.optimizer.register_step_pre_hook(keep)
        shards = watch_sequence_shards(policy.model)
        batch = global_batch(8, config.vocab_size)
        got = policy.train(batch, nll)  # lr 0: the weights stay the initial ones
        lp = policy.logprobs(batch)  # forward only: torch's V schedules cannot, plancc's walk does
        reference = seeded_model(config, 0)
        with torch.no_grad():
            ids, mask = batch["input_ids"], batch["attention_mask"]
            logits = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
            want_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            counted = (mask[:, 1:] * mask[:, :-1]).bool()
            logprobs = (lp[:, 1:] - want_lp)[counted].abs().max().item()
        loss = _mean_nll(reference, batch)
        loss.backward()
        want = dict(reference.named_parameters())
        worst = max((g - want[n].grad).abs().max().item() / want[n].grad.abs().max().item() for n, g in grads.items())
        norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt().item()
        dist.barrier()
        return {"loss": abs(got["loss"] - loss.item()), "norm": abs(got["grad_norm"] - norm) / norm, "grad": worst,
                "compared": len(grads), "sequence_shards": sorted(shards), "logprobs": logprobs,
                "layers": sorted(int(i) for i in policy.model.model.layers)}
    finally:
        dist.destroy_process_group()


def policy_with_plan_stages(folder):
    """``Policy(pp=2)`` with the plan's stage globs cutting 4 layers 1 + 3: the ranks hold what
    the globs say, and a step equals the unsharded model's."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.parallel_model import seeded_model
    from plancc.models import load_config

    from .policy_worker import global_batch, nll

    init_gloo()
    try:
        text = (PLANS / "qwen3.yaml").read_text().replace(
            "schedule: 1f1b\n",
            'schedule: 1f1b\n  stages:\n    - [model.embed_tokens, "model.layers.[0-0]"]\n'
            '    - ["model.layers.[1-3]", model.norm, lm_head]\n')
        path = f"{folder}/plan-{dist.get_rank()}.yaml"
        with open(path, "w") as f:
            f.write(text)
        config = load_config("tiny-qwen3")
        config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
        policy = plancc.Policy(path, config, max_grad_norm=None, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), layout=sized(pp=2))
        layers = sorted({int(n.split(".")[2]) for n, _ in policy.model.named_parameters() if ".layers." in n})
        batch = global_batch(4, config.vocab_size)
        got = policy.train(batch, nll)
        want = float(_mean_nll(seeded_model(config, 0), batch))
        dist.barrier()
        return {"layers": layers, "loss": abs(got["loss"] - want)}
    finally:
        dist.destroy_process_group()


def _mean_nll(model, batch):
    """The unsharded model's mean next-token NLL over a batch's attended positions (the loss
    ``policy_worker.nll`` gives a ``Policy``)."""
    import torch

    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    counted = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp * counted).sum() / counted.sum()


def refusal_on_one_dp_rank():
    """``Policy(pp=2, dp=2)``: a loss that fails on dp rank 1 only is every rank's ``BatchError``
    with nothing changed; a metric only dp rank 0's loss gives is summed, 0 on the other."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.batches import BatchError

    from .policy_worker import global_batch, nll

    init_gloo()
    try:
        policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", layout=sized(pp=2, dp=2))
        batch = global_batch(8, 256)
        mine = {k: v[policy.slice_of(8)] for k, v in batch.items()}

        def picky(lp, mb, norm):
            if policy.dp_rank == 1:
                raise ValueError("dp rank 1 refuses")
            return nll(lp, mb, norm)

        def one_sided(lp, mb, norm):
            loss, _ = nll(lp, mb, norm)
            return loss, ({"only_dp0": torch.tensor(1.0)} if policy.dp_rank == 0 else {})

        before = [t.clone() for t in policy._shards()]
        try:
            policy.train(mine, picky)
            refused = "accepted"
        except BatchError as exc:
            refused = str(exc)
        same = all(torch.equal(a, b) for a, b in zip(before, policy._shards(), strict=True))
        row = policy.train(mine, one_sided)
        dist.barrier()
        return {"refused": refused, "unchanged": same, "only_dp0": row.get("only_dp0")}
    finally:
        dist.destroy_process_group()
