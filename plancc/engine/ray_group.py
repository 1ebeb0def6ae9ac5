"""``plancc.ray.PolicyGroup``: a ``Policy`` as a group of Ray actors, one per rank, the shape RL
drivers (NeMo-RL, verl, OpenRLHF) already place their policy workers in.

The actors set up the default process group among themselves (rank 0's actor picks the address
and port on its own node, the others join it) and each builds the same ``Policy``. Each call
fans out: the driver passes the *global* batch, every actor trains or evaluates its own dp
slice (``Policy.slice_of``), and the results are gathered -- metrics from rank 0 (reduced over
ranks already), log-probs assembled from the dp slices in order. Nothing of Ray is
reimplemented: actors, ``ray.get``, resources as Ray counts them. Needs ``pip install
'plancc[ray]'``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .batches import Batch
from .channel import weight_channel
from .policy import Policy


class PolicyWorker:
    """One rank of a ``PolicyGroup`` (a Ray actor class: ``ray.remote(PolicyWorker)``)."""

    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.channel: Any = None

    def address(self) -> tuple[str, int]:
        """This actor's host and a free port on it: where rank 0 opens the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return socket.gethostbyname(socket.gethostname()), port

    def setup(self, rank: int, world: int, host: str, port: int, plan: Any, model: Any, kwargs: dict) -> int:
        os.environ.update(
            {
                "MASTER_ADDR": host,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
            }
        )
        self.policy = Policy(plan, model, **kwargs)
        return self.policy.dp_rank

    def _mine(self, batch: Batch) -> tuple[slice, dict[str, torch.Tensor]]:
        assert self.policy is not None, "setup() first"
        rows = self.policy.slice_of(batch["input_ids"].shape[0])
        return rows, {k: v[rows] for k, v in batch.items()}

    def train(self, batch: Batch, loss_fn: Callable, kwargs: dict) -> dict[str, float]:
        assert self.policy is not None, "setup() first"
        return self.policy.train(self._mine(batch)[1], loss_fn, **kwargs)

    def logprobs(self, batch: Batch, kwargs: dict, reference: bool) -> tuple[int, Any]:
        assert self.policy is not None, "setup() first"
        rows, mine = self._mine(batch)
        run = self.policy.reference_logprobs if reference else self.policy.logprobs
        return rows.start, run(mine, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Any other ``Policy`` method, as it is (offload, onload, save, load, export_hf, ...)."""
        return getattr(self.policy, method)(*args, **kwargs)

    def open_channel(self, host: str, port: int, world_size: int, backend: str | None, timeout: float) -> None:
        assert self.policy is not None, "setup() first"
        if self.policy.mesh.get_rank() == 0:
            self.channel = weight_channel(host, port, rank=0, world_size=world_size, backend=backend, timeout=timeout)

    def send_weights(self, kwargs: dict) -> int:
        assert self.policy is not None, "setup() first"
        return self.policy.send_weights(self.channel, **kwargs)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class PolicyGroup:
    """``num_workers`` Ray actors that together are one ``plancc.Policy(plan, model,
    **policy_kwargs)``; ``num_cpus`` / ``num_gpus`` are each actor's Ray resources."""

    def __init__(
        self,
        num_workers: int,
        plan: Any,
        model: Any,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        **policy_kwargs: Any,
    ) -> None:
        import ray

        actor: Any = ray.remote(PolicyWorker).options(num_cpus=num_cpus, num_gpus=num_gpus)
        self.workers: list[Any] = [actor.remote() for _ in range(num_workers)]
        host, port = ray.get(self.workers[0].address.remote())
        ray.get(
            [w.setup.remote(r, num_workers, host, port, plan, model, policy_kwargs) for r, w in enumerate(self.workers)]
        )

    def _all(self, calls: list[Any]) -> list[Any]:
        import ray

        return list(ray.get(calls))

    def train(self, batch: Batch, loss_fn: Callable, **kwargs: Any) -> dict[str, float]:
        """``Policy.train`` on the global ``batch``: each rank trains its dp slice; rank 0's
        metrics (already reduced over the ranks)."""
        return self._all([w.train.remote(batch, loss_fn, kwargs) for w in self.workers])[0]

    def logprobs(self, batch: Batch, **kwargs: Any) -> Any:
        """``Policy.logprobs`` of the global ``batch``, assembled from the dp slices in order."""
        return self._gather(batch, kwargs, reference=False)

    def reference_logprobs(self, batch: Batch, **kwargs: Any) -> Any:
        return self._gather(batch, kwargs, reference=True)

    def _gather(self, batch: Batch, kwargs: Mapping[str, Any], reference: bool) -> Any:
        parts = dict(self._all([w.logprobs.remote(batch, dict(kwargs), reference) for w in self.workers]))
        ordered = [parts[start] for start in sorted(parts)]  # tp / cp ranks of one slice: the same
        if isinstance(ordered[0], tuple):
            return tuple(torch.cat(column) for column in zip(*ordered, strict=True))
        return torch.cat(ordered)

    def offload(self) -> None:
        self._all([w.call.remote("offload") for w in self.workers])

    def onload(self) -> None:
        self._all([w.call.remote("onload") for w in self.workers])

    def save(self, folder: str) -> str:
        return str(self._all([w.call.remote("save", folder) for w in self.workers])[0])

    def load(self, folder: str) -> None:
        self._all([w.call.remote("load", folder) for w in self.workers])

    def export_hf(self, folder: str) -> None:
        self._all([w.call.remote("export_hf", folder) for w in self.workers])

    def weights_manifest(self, **kwargs: Any) -> dict[str, Any]:
        return self._all([w.call.remote("weights_manifest", **kwargs) for w in self.workers])[0]

    def open_channel(
        self, host: str, port: int, *, world_size: int, backend: str | None = None, timeout: float = 60.0
    ) -> None:
        """Rank 0's actor joins (opens) the weight channel at ``host:port`` as its rank 0."""
        self._all([w.open_channel.remote(host, port, world_size, backend, timeout) for w in self.workers])

    def send_weights(self, **kwargs: Any) -> int:
        """``Policy.send_weights`` over the channel ``open_channel`` opened; bytes sent."""
        return int(self._all([w.send_weights.remote(kwargs) for w in self.workers])[0])

    def close_channel(self) -> None:
        self._all([w.close_channel.remote() for w in self.workers])

    def shutdown(self) -> None:
        """End the actors (and with them the process group)."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
