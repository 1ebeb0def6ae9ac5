"""One failure rule for every weight transport: a problem on any rank is raised on every rank.

Handing weights out is collective: every policy rank gathers each bucket (FSDP and TP shards)
while one rank hands it to the engine. A rank that leaves on an exception of its own -- rank
0's socket broke, its consumer died, a bucket failed to pack, another rank's gather raised --
leaves its peers inside the next gather until the collective timeout, minutes later, with an
error that names nothing. So each rank notes its problem instead of leaving, and before every
bucket's gather (and once at the end) the ranks settle: one all-reduce of a flag, and when
any rank noted one, the earliest problem -- its rank, its bucket, its cause -- is raised on
every rank as the same ``WeightChannelError``. No rank is then inside a collective another
skipped.

A settle is a read of the device (the flag's value), so on a GPU it stops the host from queuing
the next bucket's gathers while the last bucket is still on the wire. A refit may therefore
settle every ``every`` buckets instead of before each one: a rank that noted a problem goes on
taking part in the gathers (it hands nothing more out) until the next settle, where every rank
raises it. The latency of a failure report is then at most ``every`` buckets' gathers.

A resharded refit settles the same way before each gather and at the end; a policy
rank whose point-to-point send failed stops sending, and the receiver waiting for it fails
within the channel's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..runtime.rank_agreement import first_problem, said
from .channel import WeightChannelError

__all__ = ["AgreedRefitError", "RefitAgreement", "first_problem"]


class AgreedRefitError(WeightChannelError):
    """The failure every rank of a refit raises together (``RefitAgreement.settle``)."""


@dataclass(slots=True)
class RefitAgreement:
    """The problems the ranks of one refit note, settled bucket by bucket (collective)."""

    device: str
    bucket: int = 0  # the bucket (or transfer) being gathered or handed out (1-based; 0 before the first)
    unit: str = "bucket"  # what ``bucket`` counts: a plain refit's buckets, a resharded one's transfers
    problem: str = ""
    at: int = 0  # the bucket the problem was noted at
    settled: bool = False  # a settle raised: every rank has left together, nothing more to agree
    every: int = 1  # buckets between settles (the first bucket and the end always settle)

    def note(self, exc: BaseException) -> None:
        """This rank's problem at the current bucket (the first one counts)."""
        if isinstance(exc, AgreedRefitError):
            raise exc  # already every rank's: nothing left to agree on
        if not self.problem:
            where = f"{self.unit} {self.bucket}" if self.bucket else f"before the first {self.unit}"
            self.problem = f"rank {dist.get_rank()}, {where}: {said(exc)}"
            self.at = self.bucket

    def due(self, index: int) -> bool:
        """Whether the ranks settle before the gather of bucket ``index`` (0-based)."""
        return index % self.every == 0

    def settle(self) -> None:
        """Collective: every rank raises the first rank's problem when any rank noted one."""
        # the earliest problem is the cause; later ones (a peer's broken connection) follow from it
        found = first_problem(self.problem, self.device, at=self.at)
        if found is not None:
            self.settled = True
            raise AgreedRefitError(f"refit failed on {found[1]}")
