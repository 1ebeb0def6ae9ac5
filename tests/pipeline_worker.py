"""Rank-side code of the pipeline tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .conftest import PLANS
from .distributed import init_gloo, sized


def _model_pair(preset, layers):
    """A tiny model of ``layers`` full-attention layers (the same on every rank) and its copy,
    the unsharded reference."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from plancc.models import load_config

    config = load_config(preset)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return model, copy.deepcopy(model)


def _against_reference(runner, names, reference, ids, step, pp_group):
    """One pipeline step (``step()``: this pipeline's share of the loss summed over dp) against
    the reference on all of ``ids``: the loss, every gradient of this rank's stages, the grad norm
    over all stages, and the loss after an AdamW step on both."""
    import torch
    from torch.distributed.tensor import DTensor

    from plancc.runtime.pipeline import next_token_targets, pipeline_grad_norm

    def reference_loss():
        logits = reference(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten())

    params = runner.parameters()
    loss = step()
    ref = reference_loss()
    ref.backward()
    ref_params = dict(reference.named_parameters())
    worst, sharded = 0.0, 0
    for p in params:
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        sharded += isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
        want = ref_params[names[id(p)]].grad
        worst = max(worst, (got - want).abs().max().item() / (want.abs().max().item() or 1.0))
    norm = pipeline_grad_norm(params, pp_group)
    ref_norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt()
    torch.optim.AdamW(params, lr=1e-3).step()
    torch.optim.AdamW(list(reference.parameters()), lr=1e-3).step()
    for p in params:
        p.grad = None
    reference.zero_grad(set_to_none=True)
    after = step()
    ref_after = reference_loss()
    return {"loss": abs(loss.item() - ref.item()), "grad_rel": worst, "compared": len(params), "sharded": sharded,
            "norm": abs(norm.item() - ref_norm.item()) / ref_norm.item(), "after": abs(after.item() - ref_after.item())}


def _rows(config_vocab, rows):
    import torch

    return torch.randint(0, config_vocab, (rows, 16), generator=torch.Generator().manual_seed(1))


def compare_pipeline(preset, layers, schedule, microbatches, rows, virtual=1):
    """One step of a pipeline of ``world`` stages against the unsharded model on the whole batch."""
    import torch.distributed as dist

    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages

    rank, world = init_gloo()
    try:
        model, reference = _model_pair(preset, layers)
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, rank, world, schedule=schedule, virtual=virtual)
        runner = PipelineRunner(stages, world, microbatches=microbatches, schedule=schedule)
        ids = _rows(model.config.vocab_size, rows)
        result = _against_reference(runner, names, reference, ids, lambda: runner.step(ids), None)
        held = [None] * world
        dist.all_gather_object(held, [i for i, _ in stages])
        return {**result, "stage_params": held}
    finally:
        dist.destroy_process_group()


def compare_pipeline_fsdp(preset, layers, schedule, microbatches, rows, pp, virtual=1):
    """pp x dp: each stage FSDP2-sharded over the dp ranks, each dp rank a share of the rows;
    against the unsharded model on all of them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages, next_token_targets, shard_stages

    rank, world = init_gloo()
    try:
        dp = world // pp
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        model, reference = _model_pair(preset, layers)
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, mesh["pp"].get_local_rank(), pp, schedule=schedule, virtual=virtual)
        # FSDP replaces the parameters: name them by their place in the stages first
        origin = {(i, n): names[id(p)] for i, m in stages for n, p in m.named_parameters()}
        shard_stages(stages, mesh["dp"])
        names = {id(p): origin[(i, n)] for i, m in stages for n, p in m.named_parameters()}
        runner = PipelineRunner(stages, pp, microbatches=microbatches, schedule=schedule, group=mesh["pp"].get_group())
        ids = _rows(model.config.vocab_size, rows)
        mine = ids.chunk(dp)[mesh["dp"].get_local_rank()]
        total = int((next_token_targets(ids) != -100).sum())

        def step():
            share = runner.step(mine, total_tokens=total, data_parallel=dp)
            dist.all_reduce(share, group=mesh["dp"].get_group())
            return share

        return _against_reference(runner, names, reference, ids, step, mesh["pp"].get_group())
    finally:
        dist.destroy_process_group()


def compare_pipeline_tp(plan_path, preset, layers, schedule, microbatches, rows, pp, virtual=1):
    """pp x tp: the plan's TP styles applied to the model (plancc's own), then the stages cut
    from it; against the unsharded model on the whole batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import plancc
    from plancc.compiler.resolve import resolve_plan
    from plancc.runtime.parallelize import apply_tensor_parallel
    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages

    rank, world = init_gloo()
    try:
        mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "tp"))
        model, reference = _model_pair(preset, layers)
        apply_tensor_parallel(model, resolve_plan(plancc.load_plan(plan_path), model), mesh["tp"])
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, mesh["pp"].get_local_rank(), pp, schedule=schedule, virtual=virtual)
        runner = PipelineRunner(stages, pp, microbatches=microbatches, schedule=schedule, group=mesh["pp"].get_group())
        ids = _rows(model.config.vocab_size, rows)
        return _against_reference(runner, names, reference, ids, lambda: runner.step(ids), mesh["pp"].get_group())
    finally:
        dist.destroy_process_group()


def compare_pipeline_rows(preset, layers, schedule, lengths, virtual=1):
    """RL's uneven rows through ``step_rows`` (no padding) against the unsharded model on each
    row alone, summed over all rows' tokens."""
    import torch
    import torch.distributed as dist

    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages, next_token_targets

    rank, world = init_gloo()
    try:
        model, reference = _model_pair(preset, layers)
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, rank, world, schedule=schedule, virtual=virtual)
        runner = PipelineRunner(stages, world, microbatches=world, schedule=schedule)
        gen = torch.Generator().manual_seed(2)
        rows = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
        total = sum(n - 1 for n in lengths)
        loss = runner.step_rows(rows)

        ref = sum(
            torch.nn.functional.cross_entropy(
                reference(input_ids=r[None], use_cache=False).logits[0], next_token_targets(r[None])[0], reduction="sum"
            )
            for r in rows
        ) / total
        ref.backward()
        ref_params = dict(reference.named_parameters())
        worst = max(
            (p.grad - ref_params[names[id(p)]].grad).abs().max().item()
            / (ref_params[names[id(p)]].grad.abs().max().item() or 1.0)
            for p in runner.parameters()
        )
        dist.barrier()
        return {"loss": abs(loss.item() - ref.item()), "grad_rel": worst}
    finally:
        dist.destroy_process_group()


def checkpoint_across_pp(folder):
    """A pp=2 step saved by stages loads into the whole model (pp=1) and equals the unsharded
    model after the same step; a whole model's checkpoint loads into pp=2 stages."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages, load_stages, next_token_targets, save_stages

    rank, world = init_gloo()
    try:
        model, reference = _model_pair("tiny-qwen3", 4)
        stages = build_rank_stages(model, rank, world)
        runner = PipelineRunner(stages, world, microbatches=2)
        ids = _rows(model.config.vocab_size, 4)
        runner.step(ids)
        torch.optim.SGD(runner.parameters(), lr=0.5).step()
        logits = reference(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten()).backward()
        torch.optim.SGD(reference.parameters(), lr=0.5).step()
        save_stages(f"{folder}/pp2", stages)
        # pp=1: every rank loads the whole model from the stages' checkpoint
        whole, _ = _model_pair("tiny-qwen3", 4)
        with torch.no_grad():
            for p in whole.parameters():
                p.zero_()
        state = dict(whole.named_parameters())
        dcp.load(state, checkpoint_id=f"{folder}/pp2")
        ref = dict(reference.named_parameters())
        to_whole = max((state[n] - ref[n]).abs().max().item() for n in ref)
        # and back: the reference's whole state into fresh pp=2 stages
        dcp.save(dict(reference.named_parameters()), checkpoint_id=f"{folder}/whole")
        fresh, _ = _model_pair("tiny-qwen3", 4)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh_stages = build_rank_stages(fresh, rank, world)
        load_stages(f"{folder}/whole", fresh_stages)
        to_stages = max((p - ref[module.model_names[n]]).abs().max().item()
                        for _, module in fresh_stages for n, p in module.named_parameters())
        dist.barrier()
        return {"to_whole": to_whole, "to_stages": to_stages, "params": len(ref)}
    finally:
        dist.destroy_process_group()


def resume_across_steps(folder):
    """Two AdamW steps in a row against one step, a save (parameters and AdamW's state), fresh
    stages and a fresh optimizer loaded from it, and the second step: the same parameters."""
    import torch
    import torch.distributed as dist

    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages, load_stages, save_stages

    rank, world = init_gloo()
    try:
        model, _ = _model_pair("tiny-qwen3", 4)
        ids = _rows(model.config.vocab_size, 4)

        def trained(stages, optimizer):
            runner = PipelineRunner(stages, world, microbatches=2)
            runner.step(ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        straight = build_rank_stages(model, rank, world)
        params = [p for _, m in straight for p in m.parameters()]
        adamw = torch.optim.AdamW(params, lr=1e-2)
        trained(straight, adamw)
        save_stages(f"{folder}/step1", straight, adamw)
        trained(straight, adamw)
        fresh_model, _ = _model_pair("tiny-qwen3", 4)
        with torch.no_grad():
            for p in fresh_model.parameters():
                p.add_(1.0)  # not the saved weights
        resumed = build_rank_stages(fresh_model, rank, world)
        fresh_adamw = torch.optim.AdamW([p for _, m in resumed for p in m.parameters()], lr=1e-2)
        load_stages(f"{folder}/step1", resumed, fresh_adamw)
        trained(resumed, fresh_adamw)
        diff = max((a - b).abs().max().item() for a, b in zip(params, [p for _, m in resumed for p in m.parameters()]))
        dist.barrier()
        return {"diff": diff, "state": len(fresh_adamw.state)}
    finally:
        dist.destroy_process_group()


def policy_calls(folder):
    """``Policy`` with pipeline stages beyond ``train``: log-probs against the unsharded model,
    the reference's after a step (the initial weights'), weights out, and a save loaded at pp=2
    and at pp=1."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.build import seeded_model
    from plancc.engine.losses import token_nll
    from plancc.models import load_config
    from plancc.runtime.logprobs import token_logprobs

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


def policy_schedule(folder, schedule, cp=1):
    """``Policy(pp=2)`` (``x cp``) under a two-stages-a-rank ``schedule`` with the plan's activation
    checkpointing (``model.layers.*.mlp``), one NLL step on rows of every length against the
    unsharded model: the loss, the gradient norm and every gradient of this rank's stages; and
    the log-probs (forward only) of the same rows."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.build import seeded_model
    from plancc.models import load_config

    from .policy_worker import watch_sequence_shards, global_batch, nll

    init_gloo()
    try:
        text = (PLANS / "qwen3.yaml").read_text().replace(
            "schedule: 1f1b\n", f"schedule: {schedule}\n  virtual_stages_per_rank: 2\n  microbatches: 4\n")
        assert "activation_checkpointing: [model.layers.*.mlp]" in text
        path = f"{folder}/plan-{dist.get_rank()}.yaml"
        with open(path, "w") as f:
            f.write(text)
        config = load_config("tiny-qwen3")
        config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
        grads = {}

        def keep(optimizer, *_):
            grads.update({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for n, p in policy.model.named_parameters()})

        policy = plancc.Policy(path, config, max_grad_norm=None, layout=sized(pp=2, cp=cp),
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
                "compared": len(grads), "sequence_shards": sorted(shards), "logprobs": logprobs}
    finally:
        dist.destroy_process_group()


def policy_with_plan_stages(folder):
    """``Policy(pp=2)`` with the plan's stage globs cutting 4 layers 1 + 3: the ranks hold what
    the globs say, and a step equals the unsharded model's."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.build import seeded_model
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
