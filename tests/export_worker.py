"""Rank-side code of tests/test_trained_export.py (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo

STEPS = 2
LR = 0.5  # SGD: the update is linear in the gradient, so the sharded run matches to fp32 rounding


def trained_exports(cases, root):
    """cases: [(name, plan text, dp, tp)]. Each plan trains STEPS SGD steps on 2 ranks and
    is exported with plancc's export_hf; rank 0 returns, per case, how far the export is from
    (a) the unsharded model trained on the whole batch and (b) the initial weights."""
    import copy
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    import plancc
    from plancc.models import build_model, load_config
    from plancc.weights import export_hf

    init_gloo()
    config = load_config("tiny-qwen3")
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        for name, text, dp, tp in cases:
            plan_path = Path(root) / f"{name}.yaml"
            if dist.get_rank() == 0:
                plan_path.write_text(text)
            dist.barrier()
            mesh = plancc.build_mesh(dp=dp, tp=tp, device_type="cpu")
            torch.manual_seed(0)
            reference = build_model(copy.deepcopy(config), device="cpu")
            initial = {k: v.clone() for k, v in reference.state_dict().items()}
            model = build_model(copy.deepcopy(config), device="meta")
            plancc.parallelize(model, plancc.load_plan(plan_path), mesh)
            plancc.materialize(model, "cpu", full_state_dict=initial)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
            rows = ids.shape[0] // dp
            mine = ids[mesh["dp"].get_local_rank() * rows :][:rows]
            for _ in range(STEPS):
                plancc.causal_lm_loss(model, mine, mesh=mesh).backward()
                optimizer.step()
                optimizer.zero_grad()
                reference(input_ids=ids, labels=ids).loss.backward()  # the whole batch in one pass
                ref_optimizer.step()
                ref_optimizer.zero_grad()
            folder = Path(root) / f"export-{name}-dp{dp}-tp{tp}"
            export_hf(model, config, folder)
            if dist.get_rank() == 0:
                exported = load_file(str(folder / "model.safetensors"))
                trained = reference.state_dict()
                out[f"{name} dp{dp} tp{tp}"] = {
                    "from_trained": max(
                        ((exported[k] - trained[k]).abs().max() / trained[k].abs().max()).item() for k in exported
                    ),
                    "from_initial": max((exported[k] - initial[k]).abs().max().item() for k in exported),
                    "tensors": len(exported),
                }
    finally:
        dist.destroy_process_group()
    return out


def one_rank_weights_without_a_gather():
    """A one-rank policy's streamed weights with ``DTensor.full_tensor`` made to fail: what comes
    out must be its local tensors (a one-rank mesh's local tensor is the whole one), equal to a
    full state dict."""
    import torch
    from torch.distributed.tensor import DTensor

    import plancc

    init_gloo()
    policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3")
    want = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in policy.model.state_dict().items()}

    def no_gather(self):
        raise AssertionError("a one-rank mesh gathered")

    DTensor.full_tensor = no_gather
    got = dict(policy.weights(bucket_bytes=4096))
    torch.distributed.destroy_process_group()
    return {"names": sorted(got) == sorted(want), "equal": all(torch.equal(got[k], want[k]) for k in want)}
