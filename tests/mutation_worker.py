"""Rank side of bench/plan_mutations.py's ground truth: mutated plans, unchecked, against the
unsharded model."""

from __future__ import annotations

import datetime
import time
import traceback
from typing import Any


def verify_unchecked(cases: list[tuple[str, str, bool]]) -> dict[int, dict[str, Any]]:
    """On each rank of a 2-rank gloo group: every (plan, model, sp) case, one step against the
    unsharded model at tp=2 (``plancc.job.verify``, what ``apply --verify`` runs), with no check
    before it. A case that raises is that case's verdict; the others still run."""
    import torch.distributed as dist

    import plancc
    from plancc.job.verify import verify_against_unsharded, within_tolerance
    from plancc.runtime.mesh import build_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out: dict[int, dict[str, Any]] = {}
    try:
        for i, (plan_path, model, sp) in enumerate(cases):
            start = time.perf_counter()
            try:
                mesh = build_mesh(dp=1, cp=1, tp=2, sequence_parallel=sp, device_type="cpu")
                plan = plancc.load_plan(plan_path)
                report = verify_against_unsharded(plan, model, mesh, steps=1)
                out[i] = {"exact": within_tolerance(report), "rc": 0, "detail": ""}
            except Exception as exc:  # noqa: BLE001 - a crash is the verdict
                out[i] = {"exact": False, "rc": 1, "detail": f"{type(exc).__name__}: {exc}"[:300]}
                traceback.clear_frames(exc.__traceback__)
                dist.barrier()
            out[i]["seconds"] = round(time.perf_counter() - start, 1)
    finally:
        dist.destroy_process_group()
    return out
