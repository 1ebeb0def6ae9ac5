"""Rank-side code of the numerics tests (spawned by tests/distributed.py)."""

from __future__ import annotations

import traceback

from .distributed import init_gloo


def verify_cases(cases):
    """cases: [(plan_path, preset, dp, tp, sequence_parallel)] or
    [(plan_path, preset, dp, cp, tp, sequence_parallel)] -> {case index: report dict}."""
    import torch.distributed as dist

    import plancc
    from plancc.mesh import build_mesh
    from plancc.verify import verify_against_unsharded

    init_gloo()
    out = {}
    try:
        for i, case in enumerate(cases):
            plan_path, preset, dp, *sizes, sp = case
            cp, tp = sizes if len(sizes) == 2 else (1, sizes[0])
            try:
                mesh = build_mesh(dp=dp, cp=cp, tp=tp, device_type="cpu")
                report = verify_against_unsharded(plancc.load_plan(plan_path), preset, mesh, sequence_parallel=sp)
                out[i] = report.as_dict()
            except Exception as exc:  # report per case; other cases still run
                out[i] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
                dist.barrier()
    finally:
        dist.destroy_process_group()
    return out
