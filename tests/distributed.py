"""The one place tests start processes: torch's elastic launcher (torchrun's machinery),
one process per rank, gloo on CPU, a free local port for the c10d rendezvous.

``launch(fn, nproc, *args)`` runs ``fn(*args)`` on every rank and returns {rank: result};
``fn`` must be a module-level function (its reference is pickled to the workers).

Workers are forked from a forkserver that imported torch, transformers and plancc once per
test session: a spawned worker spends ~5 s of CPU importing them, every launch, on a 2-core
machine. The server only imports (no tensor op ran in it, so no thread pool is forked); each
worker then gets the test's environment as it is at the launch (``_in_test_env``).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import uuid

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what workers import (the modeling files of the tiny presets' families included)
_PRELOAD = [
    "torch",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.phi3.modeling_phi3",
    "plancc",
    "plancc.job.verify",
    "plancc.runtime.logprobs",
]


def _in_test_env(fn, env: dict[str, str], *args):
    """Run ``fn`` with the launching test's environment (the forkserver holds the one of the
    first launch); the agent's per-rank variables are not in it and stay."""
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    tempfile.tempdir = None  # computed again from this TMPDIR
    return fn(*args)


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
        start_method="forkserver",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return elastic_launch(config, _in_test_env)(fn, dict(os.environ), *args)


def init_gloo(timeout_s: int = 120):
    """In a worker: the default process group on gloo with a timeout on every collective."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
