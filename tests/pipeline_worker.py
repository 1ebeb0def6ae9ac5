"""Rank-side code of the pipeline tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo


def compare_pipeline(preset, layers, schedule, microbatches, rows, virtual=1):
    """One step of a pipeline of ``world`` stages against the unsharded model on the whole batch:
    the loss, every gradient of this rank's stage, the grad norm and the loss after an AdamW step."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from plancc.models import load_config
    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages, next_token_targets, pipeline_grad_norm

    rank, world = init_gloo()
    try:
        config = load_config(preset)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"] * layers
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        reference = copy.deepcopy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, rank, world, schedule=schedule, virtual=virtual)
        runner = PipelineRunner(stages, world, microbatches=microbatches, schedule=schedule)
        params = runner.parameters()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (rows, 16), generator=gen)

        def reference_loss():
            logits = reference(input_ids=ids, use_cache=False).logits
            targets = next_token_targets(ids)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

        loss = runner.step(ids)
        ref = reference_loss()
        ref.backward()
        ref_params = dict(reference.named_parameters())
        worst, compared = 0.0, 0
        for p in params:
            want = ref_params[names[id(p)]].grad
            scale = want.abs().max().item() or 1.0
            worst = max(worst, (p.grad - want).abs().max().item() / scale)
            compared += 1
        norm = pipeline_grad_norm(params)
        ref_norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt()
        # one AdamW step on both, then the loss again
        for group in (params, list(reference.parameters())):
            torch.optim.AdamW(group, lr=1e-3).step()
        for p in params:
            p.grad = None
        reference.zero_grad(set_to_none=True)
        after = runner.step(ids)
        ref_after = reference_loss()
        stages_seen = [None] * world
        dist.all_gather_object(stages_seen, [i for i, _ in stages])
        return {"loss": abs(loss.item() - ref.item()), "grad_rel": worst, "compared": compared,
                "norm": abs(norm.item() - ref_norm.item()) / ref_norm.item(),
                "after": abs(after.item() - ref_after.item()), "stage_params": stages_seen}
    finally:
        dist.destroy_process_group()


def compare_pipeline_fsdp(preset, layers, schedule, microbatches, rows, pp, virtual=1):
    """pp x dp: each stage FSDP2-sharded over the dp ranks, each dp rank a share of the rows;
    against the unsharded model on all of them."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from plancc.models import load_config
    from plancc.runtime.pipeline import (
        PipelineRunner,
        build_rank_stages,
        next_token_targets,
        pipeline_grad_norm,
        shard_stages,
    )

    rank, world = init_gloo()
    try:
        dp = world // pp
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        config = load_config(preset)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"] * layers
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        reference = copy.deepcopy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, mesh["pp"].get_local_rank(), pp, schedule=schedule, virtual=virtual)
        # FSDP replaces the parameters: name them by their place in the stages first
        origin = {(i, n): names[id(p)] for i, m in stages for n, p in m.named_parameters()}
        shard_stages(stages, mesh["dp"])
        runner = PipelineRunner(stages, pp, microbatches=microbatches, schedule=schedule, group=mesh["pp"].get_group())
        params = runner.parameters()
        names = {id(p): origin[(i, n)] for i, m in stages for n, p in m.named_parameters()}
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (rows, 16), generator=gen)
        mine = ids.chunk(dp)[mesh["dp"].get_local_rank()]
        total = int((next_token_targets(ids) != -100).sum())

        def reference_loss():
            logits = reference(input_ids=ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten())

        def global_loss(share):
            dist.all_reduce(share, group=mesh["dp"].get_group())
            return share

        loss = global_loss(runner.step(mine, total_tokens=total, data_parallel=dp))
        ref = reference_loss()
        ref.backward()
        ref_params = dict(reference.named_parameters())
        worst = 0.0
        for p in params:
            got = p.grad.full_tensor()
            want = ref_params[names[id(p)]].grad
            worst = max(worst, (got - want).abs().max().item() / (want.abs().max().item() or 1.0))
        norm = pipeline_grad_norm(params, mesh["pp"].get_group())
        ref_norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt()
        torch.optim.AdamW(params, lr=1e-3).step()
        torch.optim.AdamW(list(reference.parameters()), lr=1e-3).step()
        for p in params:
            p.grad = None
        reference.zero_grad(set_to_none=True)
        after = global_loss(runner.step(mine, total_tokens=total, data_parallel=dp))
        ref_after = reference_loss()
        return {"loss": abs(loss.item() - ref.item()), "grad_rel": worst,
                "norm": abs(norm.item() - ref_norm.item()) / ref_norm.item(),
                "after": abs(after.item() - ref_after.item()), "compared": len(params)}
    finally:
        dist.destroy_process_group()


def compare_pipeline_tp(plan_path, preset, layers, schedule, microbatches, rows, pp, virtual=1):
    """pp x tp: the plan's TP styles applied to the model (plancc's own), then the stages cut
    from it; against the unsharded model on the whole batch."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import plancc
    from plancc.compiler.resolve import resolve_plan
    from plancc.models import load_config
    from plancc.runtime.parallelize import apply_tensor_parallel
    from plancc.runtime.pipeline import PipelineRunner, build_rank_stages, next_token_targets, pipeline_grad_norm

    rank, world = init_gloo()
    try:
        tp = world // pp
        mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        config = load_config(preset)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"] * layers
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        reference = copy.deepcopy(model)
        apply_tensor_parallel(model, resolve_plan(plancc.load_plan(plan_path), model), mesh["tp"])
        names = {id(p): n for n, p in model.named_parameters()}
        stages = build_rank_stages(model, mesh["pp"].get_local_rank(), pp, schedule=schedule, virtual=virtual)
        runner = PipelineRunner(stages, pp, microbatches=microbatches, schedule=schedule, group=mesh["pp"].get_group())
        params = runner.parameters()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (rows, 16), generator=gen)

        def reference_loss():
            logits = reference(input_ids=ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_token_targets(ids).flatten())

        loss = runner.step(ids)
        ref = reference_loss()
        ref.backward()
        ref_params = dict(reference.named_parameters())
        worst, sharded = 0.0, 0
        for p in params:
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            sharded += isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
            want = ref_params[names[id(p)]].grad
            worst = max(worst, (got - want).abs().max().item() / (want.abs().max().item() or 1.0))
        norm = pipeline_grad_norm(params, mesh["pp"].get_group())
        ref_norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt()
        torch.optim.AdamW(params, lr=1e-3).step()
        torch.optim.AdamW(list(reference.parameters()), lr=1e-3).step()
        for p in params:
            p.grad = None
        reference.zero_grad(set_to_none=True)
        after = runner.step(ids)
        ref_after = reference_loss()
        return {"loss": abs(loss.item() - ref.item()), "grad_rel": worst, "sharded": sharded,
                "norm": abs(norm.item() - ref_norm.item()) / ref_norm.item(),
                "after": abs(after.item() - ref_after.item())}
    finally:
        dist.destroy_process_group()
