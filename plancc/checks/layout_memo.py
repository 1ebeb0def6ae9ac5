"""Rule results reused across the layouts of one plan and model (``plancc suggest`` checks
every layout of N GPUs: dozens of them, each with every rule).

A rule's problems depend on the plan, the model and the layout values the rule reads. While a
rule runs it sees the context through ``_Reads``, which notes each layout value it reads (``tp``,
``cp``, ``ep``, ... -- whatever it touches, through ``ctx.layout`` or the context's shortcuts);
at another layout whose values agree with every noted one, the same problems are the answer.
Nothing is declared by the rules, so a rule that starts reading another size is keyed on it
by construction. A rule that calls one of the layout's methods, or reads the mesh problems, is
keyed on the whole layout. The resolved plan depends on sequence parallelism, which is
therefore always part of the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

from ..layout import Layout
from .context import CheckContext, Problem

_WHOLE = "layout"  # the key for "every value of the layout"

Noted = dict[str, Any]


class _LayoutReads:
    """A layout that notes the values read from it."""

    __slots__ = ("_layout", "_noted")

    def __init__(self, layout: Layout, noted: Noted) -> None:
        self._layout, self._noted = layout, noted

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._layout, name)
        if callable(value):  # a method may read anything: key on the whole layout
            self._noted[_WHOLE] = self._layout
        else:
            self._noted[name] = value
        return value


class _Reads:
    """A check context that notes the layout values a rule reads through it."""

    __slots__ = ("_ctx", "_noted")

    def __init__(self, ctx: CheckContext, noted: Noted) -> None:
        self._ctx, self._noted = ctx, noted

    def __getattr__(self, name: str) -> Any:
        ctx = self._ctx
        if name == "layout":
            return _LayoutReads(ctx.layout, self._noted)
        if name in ("tp", "sequence_parallel"):  # the context's shortcuts into the layout
            self._noted[name] = getattr(ctx.layout, name)
        elif name == "layout_problems":  # why requested sizes did not fit: not a layout value
            self._noted[_WHOLE] = ctx.layout
            self._noted["layout_problems"] = tuple(d.message for d in ctx.layout_problems)
        return getattr(ctx, name)


def _value(ctx: CheckContext, name: str) -> Any:
    if name == _WHOLE:
        return ctx.layout
    if name == "layout_problems":
        return tuple(d.message for d in ctx.layout_problems)
    return getattr(ctx.layout, name)


@dataclass(slots=True)
class LayoutMemo:
    """Each rule's problems with the layout values they were found at, for one plan and model
    (and one ``seq_len``): pass the same memo only to checks of that plan and model."""

    seen: dict[str, list[tuple[Noted, list[Problem]]]] = field(default_factory=dict)
    reused: int = 0  # how many rule runs the memo answered (for the benchmark's figures)

    def problems(self, rule: ModuleType, ctx: CheckContext) -> list[Problem]:
        found = self.seen.setdefault(rule.__name__, [])
        for earlier, problems in found:
            if all(_value(ctx, name) == value for name, value in earlier.items()):
                self.reused += 1
                return problems
        noted: Noted = {"sequence_parallel": ctx.layout.sequence_parallel}  # the resolved plan follows it
        problems = list(rule.check(cast(CheckContext, _Reads(ctx, noted))))
        found.append((noted, problems))
        return problems
