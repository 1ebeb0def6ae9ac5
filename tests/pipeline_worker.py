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
