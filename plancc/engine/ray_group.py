"""``plancc.ray.PolicyGroup``: a ``Policy`` as a group of Ray actors, one per rank, the shape RL
drivers (NeMo-RL, verl, OpenRLHF) already place their policy workers in.

The actors are placed in one placement group, a bundle each (their CPUs / GPUs reserved
together, packed on few nodes or spread, as the caller chooses), set up the default process
group among themselves (rank 0's actor picks the address and port on its own node, the others
join it) and each builds the same ``Policy``. Each call fans out: the driver puts the *global*
batch in the object store once, every actor trains or evaluates its own dp slice
(``Policy.slice_of``), and only what the driver needs comes back -- metrics from rank 0 (reduced
over ranks already), log-probs from one rank of each dp slice (its tp / cp peers hold the same),
assembled in order. An actor that dies fails the call at once with one ``PolicyGroupError``
naming its rank, and the group's other actors are ended (they would wait in a collective for
it until the process group's timeout). Nothing of Ray is reimplemented: actors, placement
groups, the object store, ``ray.wait``. Needs ``pip install 'plancc[ray]'``.
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

# How long the driver waits, after an actor raised, for a peer's death to surface: the death is
# the cause, the raise (a collective that lost its peer) its effect
DEATH_GRACE_S = 10.0


class PolicyGroupError(RuntimeError):
    """A call of the group failed on an actor (it raised, or its process died); the group is ended."""


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

    def train(self, batch: Batch, loss_fn: Callable | None, kwargs: dict) -> dict[str, float]:
        assert self.policy is not None, "setup() first"
        return self.policy.train(self._mine(batch)[1], loss_fn, **kwargs)

    def logprobs(self, batch: Batch, kwargs: dict, reference: bool) -> tuple[int, Any]:
        """(the first row of this rank's slice, its log-probs) -- the log-probs from one rank of
        each dp slice only (its tp / cp peers computed the same rows): None from the others."""
        assert self.policy is not None, "setup() first"
        rows, mine = self._mine(batch)
        run = self.policy.reference_logprobs if reference else self.policy.logprobs
        result = run(mine, **kwargs)
        mesh = self.policy.mesh
        first_of_slice = mesh["tp"].get_local_rank() == 0 and mesh["cp"].get_local_rank() == 0
        return rows.start, result if first_of_slice else None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Any other ``Policy`` method, as it is (offload, onload, save, load, export_hf, ...)."""
        return getattr(self.policy, method)(*args, **kwargs)

    def open_channel(
        self, host: str, port: int, world_size: int, backend: str | None, timeout: float, every_rank: bool
    ) -> None:
        """Rank 0 joins (opens) the channel as its rank 0; with ``every_rank`` (a resharded refit)
        every rank joins, as its own global rank."""
        assert self.policy is not None, "setup() first"
        rank = self.policy.mesh.device_mesh.get_rank()
        if every_rank or rank == 0:
            self.channel = weight_channel(
                host, port, rank=rank, world_size=world_size, backend=backend, timeout=timeout
            )

    def send_weights(self, kwargs: dict) -> int:
        assert self.policy is not None, "setup() first"
        return self.policy.send_weights(self.channel, **kwargs)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class PolicyGroup:
    """``num_workers`` Ray actors that together are one ``plancc.Policy(plan, model,
    **policy_kwargs)``; ``num_cpus`` / ``num_gpus`` are each actor's Ray resources, reserved as
    one placement group (``strategy``: ``PACK``, ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``,
    Ray's own), ready within ``timeout_s`` or refused."""

    def __init__(
        self,
        num_workers: int,
        plan: Any,
        model: Any,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        strategy: str = "PACK",
        timeout_s: float = 300.0,
        **policy_kwargs: Any,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self.placement = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
        ready, _ = ray.wait([self.placement.ready()], timeout=timeout_s)
        if not ready:
            self._remove_placement()
            raise PolicyGroupError(
                f"Ray could not reserve {num_workers} bundles of {bundle} ({strategy}) within {timeout_s:g}s: "
                "the cluster has too few free resources"
            )
        actor: Any = ray.remote(PolicyWorker)
        self.workers: list[Any] = [
            actor.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(num_workers)
        ]
        host, port = self._all([self.workers[0].address.remote()])[0]
        self._all(
            [w.setup.remote(r, num_workers, host, port, plan, model, policy_kwargs) for r, w in enumerate(self.workers)]
        )

    def _all(self, calls: list[Any]) -> list[Any]:
        """Every call's result, in order; the first that fails (an actor raised, or died) ends the
        group at once and is raised as one ``PolicyGroupError`` naming the rank."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(calls)}
        results: dict[int, Any] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:
                    if not isinstance(exc, ray.exceptions.RayActorError):
                        # an actor that raised may only have lost a peer in a collective: a peer
                        # whose process died is the cause, as the launcher's root_cause says
                        rank, exc = self._dead_peer(pending) or (rank, exc)
                    self.shutdown()
                    died = isinstance(exc, ray.exceptions.RayActorError)
                    what = "died" if died else f"raised {type(exc).__name__}"
                    cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                    raise PolicyGroupError(
                        f"rank {rank}'s actor {what}"
                        + (f" ({cause})" if cause else "")
                        + "; the group's other actors were ended"
                    ) from None
        return [results[rank] for rank in range(len(calls))]

    @staticmethod
    def _dead_peer(pending: dict[Any, int]) -> tuple[int, Exception] | None:
        """A still-pending call whose actor died, seen within ``DEATH_GRACE_S``: the rank that
        failed first when another rank's collective then failed under it."""
        import ray

        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return pending[ref], exc
            except Exception:  # noqa: BLE001, S112 - another victim: keep looking for the death
                continue
        return None

    def train(self, batch: Batch, loss_fn: Callable | None = None, **kwargs: Any) -> dict[str, float]:
        """``Policy.train`` on the global ``batch``: each rank trains its dp slice; rank 0's
        metrics (already reduced over the ranks). ``token_loss=`` instead of ``loss_fn`` as there."""
        import ray

        shared = ray.put(batch)  # once, not once per actor
        return self._all([w.train.remote(shared, loss_fn, kwargs) for w in self.workers])[0]

    def logprobs(self, batch: Batch, **kwargs: Any) -> Any:
        """``Policy.logprobs`` of the global ``batch``, assembled from the dp slices in order."""
        return self._gather(batch, kwargs, reference=False)

    def reference_logprobs(self, batch: Batch, **kwargs: Any) -> Any:
        return self._gather(batch, kwargs, reference=True)

    def _gather(self, batch: Batch, kwargs: Mapping[str, Any], reference: bool) -> Any:
        import ray

        shared = ray.put(batch)
        answers = self._all([w.logprobs.remote(shared, dict(kwargs), reference) for w in self.workers])
        parts = {start: result for start, result in answers if result is not None}
        ordered = [parts[start] for start in sorted(parts)]
        if isinstance(ordered[0], tuple):
            return tuple(torch.cat(column) for column in zip(*ordered, strict=True))
        return torch.cat(ordered)

    def open_channel(
        self,
        host: str,
        port: int,
        *,
        world_size: int,
        backend: str | None = None,
        timeout: float = 60.0,
        reshard: bool = False,
    ) -> None:
        """Rank 0's actor joins (opens) the weight channel at ``host:port`` as its rank 0; with
        ``reshard=True`` every actor joins, as its global rank (the receivers after them), for
        ``send_weights(reshard=True)``."""
        self._all([w.open_channel.remote(host, port, world_size, backend, timeout, reshard) for w in self.workers])

    def send_weights(self, **kwargs: Any) -> int:
        """``Policy.send_weights`` over the channel ``open_channel`` opened; bytes sent (all ranks')."""
        return sum(int(sent) for sent in self._all([w.send_weights.remote(kwargs) for w in self.workers]))

    def close_channel(self) -> None:
        self._all([w.close_channel.remote() for w in self.workers])

    def shutdown(self) -> None:
        """End the actors (and with them the process group) and free their reservation."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self._remove_placement()

    def _remove_placement(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if getattr(self, "placement", None) is not None:
            remove_placement_group(self.placement)
            self.placement = None


# Policy's public methods that the group runs in its own way (a global batch cut into the dp
# slices, the channel its actors hold), that answer for one rank (which rows it holds: the group
# cuts the global batch itself; ``logits`` of a rank's rows, for --verify), or that cannot be
# carried between processes: ``weights`` yields
# gathered tensors one bucket at a time on each actor (consume it in an actor: ``call``), and
# ``share_weights`` takes a connection to a process on the actor's own device.
NOT_FORWARDED = frozenset(
    {
        "train",
        "logprobs",
        "logits",
        "reference_logprobs",
        "send_weights",
        "slice_of",
        "balanced_slices",
        "weights",
        "share_weights",
    }
)


def _forwarded(name: str) -> Callable[..., Any]:
    def method(self: PolicyGroup, *args: Any, **kwargs: Any) -> Any:
        return self._all([w.call.remote(name, *args, **kwargs) for w in self.workers])[0]

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``Policy.{name}`` on every actor (it is collective); rank 0's result."
    return method


def forward_policy_methods(group: type) -> None:
    """Every public method of ``Policy`` the group does not define or refuse, as every actor's
    call: a method added to ``Policy`` is the group's too, with no list to keep."""
    for name, member in vars(Policy).items():
        if name.startswith("_") or not callable(member) or name in NOT_FORWARDED or name in vars(group):
            continue
        setattr(group, name, _forwarded(name))


forward_policy_methods(PolicyGroup)
