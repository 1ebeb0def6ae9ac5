"""The parallel layout of a job: how many ranks each mesh axis has, as one frozen value.

A ``Layout`` cannot exist with sizes that do not multiply to its world size: the sizes are
validated once, here, and the missing data-parallel size is inferred here and nowhere else.
The checks, the CLI, the runner, the dry run and ``explain`` all take a ``Layout`` rather
than loose ``dp``/``cp``/``tp``/``sp`` arguments; ``plancc.runtime.mesh`` turns one into a
device mesh. Pure Python: nothing here needs torch or a process group.

The axes, outermost first, are ``dp`` (data parallel: FSDP2 shards parameters over it), ``cp``
(context parallel: sequence shards; FSDP shards over ``dp*cp`` because cp ranks hold the same
parameters) and ``tp`` (tensor parallel, innermost so its collectives stay on one node).
Sequence parallelism is not an axis: it reuses the tp ranks, so it is a flag.

Pipeline parallelism (``pp``) is the outermost axis: each pipeline rank holds its stages of the
model and a whole (dp, cp, tp) layout of them. ``build_mesh`` gives it the outermost dim of the
mesh (``pp, dp, cp, tp``); ``Policy`` with pp > 1 holds its stages as its model parts
(``engine.pipeline.pipeline_steps``).

Expert parallelism (``ep``) is not an axis of its own either: like torchtitan and NeMo
Automodel, it borrows ranks from data parallelism. ``ep`` data-parallel ranks (which hold
different tokens) share one layer's experts and exchange tokens by all-to-all; the tp ranks
inside each of them (which hold the same tokens) split those experts further without moving a
token. So a layer's experts are spread over ``ep * tp`` ranks, and FSDP shards each expert's
weights over the ``dp / ep`` ranks left (``expert_fsdp_size``). ``ep`` must divide ``dp``;
with ``cp`` it is not supported yet (cp ranks would have to join the token exchange).

HSDP (torchtitan's ``dp_replicate`` x ``dp_shard``) splits data parallelism in two: ``dp`` stays
the number of ranks that take different rows, and ``dp_replicate`` of them hold whole replicas of
the sharded model, each replica's parameters sharded over the ``dp_shard = dp / dp_replicate``
ranks inside it (times cp). FSDP then reduce-scatters gradients within a replica and all-reduces
the shards between replicas: the slow inter-node link carries one shard's all-reduce instead of
every all-gather and reduce-scatter. ``dp_replicate`` is 1 (plain FSDP) unless asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from .errors import Diagnostic, PlanError, SourceLoc

AXES: Final = ("dp", "cp", "tp")
RULE: Final = "mesh-sizes"


class LayoutError(PlanError, ValueError):
    """Axis sizes that cannot describe this job (a usage error on the command line)."""

    @classmethod
    def from_message(cls, message: str, fix: str) -> LayoutError:
        return cls([Diagnostic(rule=RULE, loc=SourceLoc(path="<layout>"), message=message, fix=fix)])


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    dp_replicate: int = 1  # HSDP: replicas of the FSDP-sharded model among the dp ranks

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep", "pp", "dp_replicate"):
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LayoutError(
                    [
                        Diagnostic(
                            rule=RULE,
                            loc=SourceLoc(path="<layout>"),
                            message=f"{axis} must be a positive integer, got {size!r}",
                            fix=f"pass --{axis} 1 or more",
                        )
                    ]
                )
        problem = _expert_parallel_problem(self.dp, self.cp, self.ep, SourceLoc(path="<layout>"))
        problem = problem or _replicate_problem(self.dp, self.dp_replicate, self.ep, SourceLoc(path="<layout>"))
        if problem is not None:
            raise LayoutError([problem])

    def to_json(self) -> dict[str, int | bool]:
        """The serialised form: a ``Layout(**layout.to_json())`` on the other side is this one."""
        found: dict[str, int | bool] = {
            "dp": self.dp,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
            "sequence_parallel": self.sequence_parallel,
        }
        if self.pp > 1:  # written only where it says something: older readers take the rest
            found["pp"] = self.pp
        if self.dp_replicate > 1:
            found["dp_replicate"] = self.dp_replicate
        return found

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks one replica's parameters are sharded over (all of dp without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards parameters over: a replica's data- and context-parallel ranks
        together (every dp rank without HSDP)."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp_size(self) -> int:
        """Ranks FSDP shards each expert's weights over: the data-parallel ranks ep leaves."""
        return self.dp // self.ep

    @property
    def expert_ranks(self) -> int:
        """Ranks one layer's experts are spread over (moe_experts): ep times tp."""
        return self.ep * self.tp

    @property
    def sequence_multiple(self) -> int:
        """What every sequence length must be a multiple of to split evenly over the ranks that
        shard the sequence: tp under SP, times 2 * cp under CP (each cp rank takes a head and a
        tail chunk)."""
        return (self.tp if self.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        stages = f"pp={self.pp} " if self.pp > 1 else ""
        data = f"dp={self.dp}"
        if self.dp_replicate > 1:
            data = f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}"
        return f"{stages}{data} cp={self.cp} tp={self.tp}{experts}" + (" +sp" if self.sequence_parallel else "")

    @classmethod
    def infer(
        cls,
        *,
        world_size: int | None = None,
        dp: int | None = None,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        sequence_parallel: bool = False,
        loc: SourceLoc | None = None,
        pp: int = 1,
        dp_replicate: int = 1,
    ) -> Layout:
        """The layout of ``world_size`` ranks with ``dp`` inferred when omitted; raises
        ``LayoutError`` (rule ``mesh-sizes``) when the sizes cannot fit."""
        layout, problems = cls.diagnose(
            world_size=world_size,
            dp=dp,
            cp=cp,
            tp=tp,
            ep=ep,
            sequence_parallel=sequence_parallel,
            loc=loc,
            pp=pp,
            dp_replicate=dp_replicate,
        )
        if problems:
            raise LayoutError(problems)
        return layout

    @classmethod
    def diagnose(
        cls,
        *,
        world_size: int | None = None,
        dp: int | None = None,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        sequence_parallel: bool = False,
        loc: SourceLoc | None = None,
        pp: int = 1,
        dp_replicate: int = 1,
    ) -> tuple[Layout, list[Diagnostic]]:
        """(layout, problems): the best layout these sizes describe and why they do not fit.

        When they do not fit, the layout keeps cp, tp and sp as given (dp as given, or 1) so
        that checks which depend only on those can still run and report their own problems.
        """
        where = loc or SourceLoc(path="<layout>")
        bad = [
            (axis, size)
            for axis, size in (
                ("pp", pp),
                ("cp", cp),
                ("tp", tp),
                ("ep", ep),
                ("dp", dp),
                ("dp_replicate", dp_replicate),
                ("world size", world_size),
            )
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1)
        ]
        if bad:
            axis, size = bad[0]
            return cls(), [
                Diagnostic(
                    rule=RULE,
                    loc=where,
                    message=f"{axis} must be a positive integer, got {size!r}",
                    fix="every axis size is 1 or more",
                )
            ]
        if world_size is None:
            # no world size: dp as given, or the least that holds ep
            size = dp if dp is not None else math.lcm(ep, dp_replicate)
            return cls._with_experts(
                dp=size,
                cp=cp,
                tp=tp,
                ep=ep,
                sequence_parallel=sequence_parallel,
                loc=where,
                pp=pp,
                dp_replicate=dp_replicate,
            )
        inner = pp * cp * tp
        inferred = dp if dp is not None else (world_size // inner if world_size % inner == 0 else None)
        if inferred is not None and inferred * inner == world_size:
            return cls._with_experts(
                dp=inferred,
                cp=cp,
                tp=tp,
                ep=ep,
                sequence_parallel=sequence_parallel,
                loc=where,
                pp=pp,
                dp_replicate=dp_replicate,
            )
        divisors = divisors_of(world_size)
        shown = f"dp={dp} x " if dp is not None else ""
        axes, named = ("pp*cp*tp", f"pp={pp} x ") if pp > 1 else ("cp*tp", "")
        why = "" if dp is not None else f" ({world_size} is not a multiple of {axes}={inner})"
        problem = Diagnostic(
            rule=RULE,
            loc=where,
            message=f"{shown}{named}cp={cp} x tp={tp} does not fit world size {world_size}{why}",
            fix=f"choose {axes} among the divisors of {world_size}: {listed(divisors)}"
            + (", or drop --dp to infer it" if dp is not None else ""),
            # what a caller that knows where the world size came from can rephrase the fix with
            suggestion={"world_size": world_size, "divisors": divisors},
        )
        return cls(dp=dp or 1, cp=cp, tp=tp, sequence_parallel=sequence_parallel, pp=pp), [problem]

    @classmethod
    def _with_experts(
        cls,
        *,
        dp: int,
        cp: int,
        tp: int,
        ep: int,
        sequence_parallel: bool,
        loc: SourceLoc,
        pp: int = 1,
        dp_replicate: int = 1,
    ) -> tuple[Layout, list[Diagnostic]]:
        """The layout, or (without ep, or without HSDP) the layout and why ep or dp_replicate
        does not fit it."""
        problem = _expert_parallel_problem(dp, cp, ep, loc)
        if problem is not None:
            return cls(dp=dp, cp=cp, tp=tp, sequence_parallel=sequence_parallel, pp=pp), [problem]
        problem = _replicate_problem(dp, dp_replicate, ep, loc)
        if problem is not None:
            return cls(dp=dp, cp=cp, tp=tp, ep=ep, sequence_parallel=sequence_parallel, pp=pp), [problem]
        return cls(
            dp=dp, cp=cp, tp=tp, ep=ep, sequence_parallel=sequence_parallel, pp=pp, dp_replicate=dp_replicate
        ), []


def _expert_parallel_problem(dp: int, cp: int, ep: int, loc: SourceLoc) -> Diagnostic | None:
    """Why ``ep`` cannot borrow from these data-parallel ranks, or None."""
    if ep == 1:
        return None
    if cp > 1:
        return Diagnostic(
            rule=RULE,
            loc=loc,
            message=f"ep={ep} with cp={cp}: expert parallelism with context parallelism is not supported",
            fix="drop --cp, or drop --ep (moe_experts still spreads the experts over tp)",
        )
    if dp % ep:
        options = listed(divisors_of(dp))
        return Diagnostic(
            rule=RULE,
            loc=loc,
            message=f"ep={ep} does not divide dp={dp}: expert parallelism borrows its ranks from data parallelism",
            fix=f"choose --ep among the divisors of dp={dp}: {options}, or more ranks (dp a multiple of {ep})",
        )
    return None


def _replicate_problem(dp: int, dp_replicate: int, ep: int, loc: SourceLoc) -> Diagnostic | None:
    """Why ``dp`` cannot hold ``dp_replicate`` replicas of the sharded model, or None."""
    if dp_replicate == 1:
        return None
    if ep > 1:
        return Diagnostic(
            rule=RULE,
            loc=loc,
            message=f"dp_replicate={dp_replicate} with ep={ep}: HSDP with expert parallelism is not supported",
            fix="drop --dp-replicate (plain FSDP over dp), or drop --ep",
        )
    if dp % dp_replicate:
        return Diagnostic(
            rule=RULE,
            loc=loc,
            message=f"dp_replicate={dp_replicate} does not divide dp={dp}: "
            "each replica shards over dp / dp_replicate ranks",
            fix=f"choose --dp-replicate among the divisors of dp={dp}: {listed(divisors_of(dp))}",
        )
    return None


def divisors_of(n: int) -> list[int]:
    """The divisors of ``n`` >= 1 in order, in sqrt(n) steps (a world size of 10^12 answers in a
    fraction of a second; listing range(1, n + 1) never did)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def listed(values: list[int], most: int = 16) -> str:
    """``values`` for a message: all of them, or the first ``most`` and how many more."""
    if len(values) <= most:
        return str(values)
    return "[" + ", ".join(map(str, values[:most])) + f", ... ({len(values) - most} more, up to {values[-1]})]"
