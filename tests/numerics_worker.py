"""Rank-side code of the numerics tests (spawned by tests/distributed.py)."""

from __future__ import annotations

import traceback

from .distributed import init_gloo


def verify_cases(cases):
    """cases: [(plan_path, preset, dp, tp, sequence_parallel)] or
    [(plan_path, preset, dp, cp, tp, sequence_parallel)] -> {case index: report dict}."""

    def layout(case):
        plan_path, preset, dp, *sizes, sp = case
        cp, tp = sizes if len(sizes) == 2 else (1, sizes[0])
        return plan_path, preset, dict(dp=dp, cp=cp, tp=tp, sequence_parallel=sp)

    return _verify_each(cases, layout)


def _verify_each(cases, layout):
    """Each case against the unsharded model on this gloo group; ``layout(case)`` ->
    (plan path, model, build_mesh's layout keywords). A failing case is reported and the others
    still run."""
    import torch.distributed as dist

    import plancc
    from plancc.job.verify import verify_against_unsharded
    from plancc.runtime.mesh import build_mesh

    init_gloo()
    out = {}
    try:
        for i, case in enumerate(cases):
            plan_path, preset, sizes = layout(case)
            try:
                mesh = build_mesh(**sizes, device_type="cpu")
                out[i] = verify_against_unsharded(plancc.load_plan(plan_path), preset, mesh).as_dict()
            except Exception as exc:  # report per case; other cases still run
                out[i] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
                dist.barrier()
    finally:
        dist.destroy_process_group()
    return out

def cpu_offload_matches(plan_path, preset):
    """parallelize(..., cpu_offload=True): logits and gradients still match the unsharded model."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.models import build_model, load_config
    from plancc.job.verify import full

    init_gloo()
    try:
        mesh = plancc.build_mesh(tp=2, device_type="cpu")
        torch.manual_seed(0)
        reference = build_model(load_config(preset), device="cpu")
        model = build_model(load_config(preset), device="meta")
        plancc.parallelize(model, plancc.load_plan(plan_path), mesh, cpu_offload=True)
        plancc.materialize(model, "cpu", full_state_dict=reference.state_dict())
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = full(model(input_ids=ids).logits)
        want = reference(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        want.float().pow(2).mean().backward()
        ref_grads = dict(reference.named_parameters())
        grad_err = max((full(p.grad) - ref_grads[n].grad).abs().max().item() / ref_grads[n].grad.abs().max().item()
                       for n, p in model.named_parameters())
        return {"logits": (logits - want).abs().max().item(), "grad_rel": grad_err}
    finally:
        dist.destroy_process_group()


def reshard_after_forward_cases(plan_paths, preset):
    """For each plan, at dp=2: how many rows of each FSDP unit's q_proj weight and of the
    input embedding a rank holds between forward and backward (all of them = kept gathered),
    and the numerics report."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.models import build_model, load_config
    from plancc.job.verify import verify_against_unsharded

    init_gloo()
    out = {}
    try:
        for path in plan_paths:
            plan = plancc.load_plan(path)
            mesh = plancc.build_mesh(dp=2, device_type="cpu")
            model = build_model(load_config(preset), device="meta")
            plancc.parallelize(model, plan, mesh)
            plancc.materialize(model, "cpu")
            model(input_ids=torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)))
            # sharded: a DTensor's local rows; gathered: FSDP2 swaps in the plain full parameter
            weights = [layer.self_attn.q_proj.weight for layer in model.model.layers]
            rows = [(w.to_local() if hasattr(w, "to_local") else w).shape[0] for w in weights]
            emb = model.model.embed_tokens.weight
            report = verify_against_unsharded(plan, preset, mesh)
            out[path] = {
                "rows_held_after_forward": rows,
                "embedding_rows_held_after_forward": (emb.to_local() if hasattr(emb, "to_local") else emb).shape[0],
                "report": report.as_dict(),
            }
    finally:
        dist.destroy_process_group()
    return out


def meta_built_models_match(cases, folder):
    """cases: [(plan_path, preset)]. The user's path: ``with torch.device("meta")`` (buffers
    on meta too), parallelize at tp=2, then weights either from a full state dict or from a
    ``save_pretrained`` folder (``load_hf_weights``) -> max |logits diff| against the
    unsharded model, per case and way."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import plancc
    from plancc.models import load_config
    from plancc.job.verify import full
    from plancc.weights import load_hf_weights

    init_gloo()
    out = {}
    try:
        mesh = plancc.build_mesh(tp=2, device_type="cpu")
        for plan_path, preset in cases:
            config = load_config(preset)
            torch.manual_seed(0)
            reference = AutoModelForCausalLM.from_config(config)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            meta_buffers = sorted(n for n, b in model.named_buffers() if b.is_meta)
            plancc.parallelize(model, plancc.load_plan(plan_path), mesh)
            plancc.materialize(model, "cpu", full_state_dict=reference.state_dict())
            ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                want = reference(input_ids=ids).logits
                diff = (full(model(input_ids=ids).logits) - want).abs().max().item()
            # the same, with weights read from an HF folder on rank 0
            saved = f"{folder}/{preset}"
            if dist.get_rank() == 0:
                reference.save_pretrained(saved)
            dist.barrier()
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            plancc.parallelize(model, plancc.load_plan(plan_path), mesh)
            plancc.materialize(model, "cpu")
            load_hf_weights(model, saved)
            with torch.no_grad():
                diff_hf = (full(model(input_ids=ids).logits) - want).abs().max().item()
            out[preset] = {"logits_abs": diff, "logits_abs_hf_folder": diff_hf, "meta_buffers": meta_buffers}
    finally:
        dist.destroy_process_group()
    return out


def parallelize_with_foreign_meshes(plan_path):
    """parallelize() given meshes not built by plancc.build_mesh -> the error text of each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import plancc
    from plancc.models import build_model, load_config

    init_gloo()
    try:
        errors = []
        for shape, names in [((1,), None), ((1,), ("tp",)), ((1, 1), ("dp_shard", "tp"))]:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            try:
                plancc.parallelize(build_model(load_config("tiny-qwen3"), device="meta"),
                                   plancc.load_plan(plan_path), mesh)
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        return errors
    finally:
        dist.destroy_process_group()


def decoder_called_directly(cases, cp=1):
    """cases: [(plan_path, preset, direct)]. Under tp=2 + SP (or cp=2), read the decoder's
    hidden states as a value or reward head does -- ``model.model(...)`` directly, or (a tied
    model, whose embedding weight the root holds) the whole model's last hidden states: its
    sequence shards, gathered, vs the unsharded decoder, per preset."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.job.verify import build_pair

    init_gloo()
    out = {}
    try:
        mesh = plancc.build_mesh(cp=cp, tp=2 // cp, sequence_parallel=cp == 1, device_type="cpu")
        for plan_path, preset, direct in cases:
            model, reference, config = build_pair(plancc.load_plan(plan_path), preset, mesh)
            ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                if direct:  # this rank's sequence shard
                    shard = model.model(input_ids=ids).last_hidden_state
                else:
                    shard = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
                if cp > 1:  # load-balanced layout
                    gathered = plancc.cp.all_gather(shard.contiguous(), mesh["cp"].get_group(), dim=1)
                else:  # SP: contiguous chunks over tp
                    parts = [torch.empty_like(shard) for _ in range(2)]
                    dist.all_gather(parts, shard.contiguous(), group=mesh["tp"].get_group())
                    gathered = torch.cat(parts, 1)
                want = reference.model(input_ids=ids).last_hidden_state
            out[preset] = {"shard_len": shard.shape[1], "max_abs": (gathered - want).abs().max().item(),
                           "scale": want.abs().max().item(),
                           # one parameter for both users of a tied weight, after FSDP
                           "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    finally:
        dist.destroy_process_group()
    return out


def verify_ep_cases(cases):
    """cases: [(plan_path, preset, dp, tp, ep)] -> {case index: report dict}: expert parallelism
    (experts over ep x tp, tokens by all-to-all) against the unsharded model."""
    return _verify_each(cases, lambda c: (c[0], c[1], dict(dp=c[2], tp=c[3], ep=c[4])))


def packed_projections_match(blocks_cases):
    """A fused projection split by its consumer (``packed_colwise``) and read whole by another
    (``packed_rowwise``), over every rank as one tp group, against the same module unsharded
    (fp64): {blocks: (output max |diff|, worst gradient max |diff|)}."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from plancc.compiler.styles import STYLES
    from plancc.runtime.styles import torch_style
    from plancc.runtime.styles.packed import PackedColwise, PackedRowwise

    _, world = init_gloo()
    mesh = init_device_mesh("cpu", (world,))

    class Fused(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = blocks
            self.up = nn.Linear(6, blocks * 2 * world, dtype=torch.float64)
            self.down = nn.Linear(2 * world, 6, dtype=torch.float64)
            self.back = nn.Linear(blocks * 2 * world, 6, dtype=torch.float64)

        def forward(self, x):
            h = self.up(x)
            first, second, *rest = h.chunk(self.blocks, dim=-1)
            act = first * torch.nn.functional.silu(second) + sum(rest, torch.zeros_like(first))
            return self.down(act) + self.back(h)

    out = {}
    for blocks in blocks_cases:
        torch.manual_seed(blocks)
        whole = Fused(blocks)
        sharded = copy.deepcopy(whole)
        parallelize_module(
            sharded,
            mesh,
            {"up": PackedColwise(blocks=blocks), "down": torch_style(STYLES["rowwise"].declare()), "back": PackedRowwise(blocks=blocks)},
        )
        x = torch.randn(3, 5, 6, dtype=torch.float64)
        want, got = whole(x), sharded(x)
        want.square().sum().backward()
        got.square().sum().backward()
        worst = 0.0
        for (name, p), q in zip(whole.named_parameters(), sharded.parameters(), strict=True):
            g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            worst = max(worst, (g - p.grad).abs().max().item())
        out[blocks] = ((got - want).abs().max().item(), worst)
    return out
