"""The one place tests start processes: torch's elastic launcher (torchrun's machinery),
one process per rank, gloo on CPU, a free local port for the c10d rendezvous.

``launch(fn, nproc, *args)`` runs ``fn(*args)`` on every rank and returns {rank: result};
``fn`` must be a module-level function (processes are spawned).
"""

from __future__ import annotations

import os
import socket
import uuid

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, nproc: int, *args, timeout_s: int = 240):
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plancc-test-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": timeout_s},
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return elastic_launch(config, fn)(*args)


def init_gloo(timeout_s: int = 120):
    """In a worker: the default process group on gloo with a timeout on every collective."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
