"""A plan's ``lora:`` section (or ``Policy(lora={...})``): low-rank adapters on module globs.

PEFT's ``LoraConfig`` fields of the same meaning; the targets are plancc globs, each kept with
its place in the plan so that a problem with one is reported at its line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import Diagnostic, PlanError, SourceLoc

FIELDS = ("r", "alpha", "dropout", "targets", "init_lora_weights")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """What to adapt and how: PEFT's ``LoraConfig`` fields of the same meaning (``alpha`` is
    ``lora_alpha``, ``targets`` are plancc globs over module names, ``init_lora_weights``
    False draws ``B`` at random as PEFT does, for tests; True starts ``B`` at zero)."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    init_lora_weights: bool = True
    loc: SourceLoc = field(default_factory=lambda: SourceLoc(path="<lora>"), compare=False)
    target_locs: tuple[SourceLoc, ...] = field(default=(), compare=False)  # one per target, in a plan

    def target_loc(self, index: int) -> SourceLoc:
        return self.target_locs[index] if index < len(self.target_locs) else self.loc

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def of(
        cls,
        value: LoraSpec | Mapping[str, Any] | None,
        loc: SourceLoc | None = None,
        target_locs: tuple[SourceLoc, ...] = (),
    ) -> LoraSpec | None:
        """A spec from ``Policy(lora={...})`` or a plan's ``lora:`` section; a ``PlanError``
        with one diagnostic per problem."""
        if value is None or isinstance(value, LoraSpec):
            return value
        where = loc or SourceLoc(path="<lora>")
        if not isinstance(value, Mapping):
            raise PlanError([_bad(where, f"lora is a {type(value).__name__}", "a mapping of r, alpha, targets")])
        problems = [
            _bad(where, f"unknown lora field {key!r}", f"the fields {', '.join(FIELDS)}")
            for key in value
            if key not in FIELDS
        ]
        r = value.get("r")
        alpha = value.get("alpha", r if isinstance(r, int) and not isinstance(r, bool) and r > 0 else 1)
        targets = value.get("targets")
        dropout = value.get("dropout", 0.0)
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            problems.append(_bad(where, f"lora r is {r!r}", "a whole number above 0 (the adapters' rank)"))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            problems.append(_bad(where, f"lora alpha is {alpha!r}", "a number above 0 (the scale is alpha / r)"))
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            problems.append(_bad(where, f"lora dropout is {dropout!r}", "a number in [0, 1)"))
        if isinstance(targets, str):
            targets = [targets]
        if not targets or not all(isinstance(t, str) and t for t in targets):
            problems.append(_bad(where, f"lora targets are {targets!r}", "a list of module globs"))
        if problems:
            raise PlanError(problems)
        return cls(
            r=int(r),  # type: ignore[arg-type]
            alpha=float(alpha),
            targets=tuple(targets),  # type: ignore[arg-type]
            dropout=float(dropout),
            init_lora_weights=bool(value.get("init_lora_weights", True)),
            loc=where,
            target_locs=target_locs,
        )

    def peft_config(self, targets: Iterable[str]) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` for these adapters on the named modules."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": self.init_lora_weights,
            "inference_mode": True,
        }


def _bad(loc: SourceLoc, found: str, allowed: str, rule: str = "lora-config", fix: str | None = None) -> Diagnostic:
    return Diagnostic(rule=rule, loc=loc, message=f"{found}; allowed: {allowed}", fix=fix or f"give {allowed}")
