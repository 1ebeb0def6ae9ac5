"""Rank-side code of the runner tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo


def logits_from_hf_folder(plan_path, folder, dp, tp, input_ids, export_to=None):
    """Parallelize a meta model, load `folder` through plancc's rank-0 scatter, return full logits
    (and, given ``export_to``, export the loaded model there with plancc's export)."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.models import build_model, load_config
    from plancc.job.verify import full
    from plancc.weights import export_hf, load_hf_weights

    init_gloo()
    try:
        mesh = plancc.build_mesh(dp=dp, tp=tp, device_type="cpu")
        model = build_model(load_config(folder), device="meta")
        plancc.parallelize(model, plancc.load_plan(plan_path), mesh)
        plancc.materialize(model, "cpu")
        load_hf_weights(model, folder)
        if export_to is not None:
            export_hf(model, load_config(folder), export_to, source=folder)
        with torch.no_grad():
            return full(model(input_ids=input_ids).logits).clone()
    finally:
        dist.destroy_process_group()
