"""A failure inside a parallelized model's forward, told as one diagnostic at the plan's rule.

The static checks catch the layout mistakes they can reason about; whatever still fails when
the model runs (a dry run, a job's steps) fails deep inside torch with a message about
tensors, and a traceback that names transformers' code, not the plan. ``diagnosed`` turns an
exception raised inside the forward of a module that ``parallelize`` styled into a
``PlanError``: the module (read off the exception's traceback), the last module that finished
inside it (a module hook, only while active), the plan rule that styles them -- the last
one's own, else the failing module's, else the nearest styled module inside or around it --
and torch's first line, which carries the shapes. A failure outside every parallelized
model's modules (a data problem, a fault) is not the plan's and propagates unchanged.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from ..compiler.plan import Rule
from ..compiler.resolve import ResolvedPlan
from ..errors import Diagnostic, PlanError, SourceLoc

RULE = "run-time-layout"

# models plancc.parallelize styled, with their resolved plans: where a failing module's rule is
_STYLED: list[tuple[weakref.ref[nn.Module], ResolvedPlan]] = []


def remember(model: nn.Module, resolved: ResolvedPlan) -> None:
    """Called by ``parallelize``: a failure inside ``model`` can name its plan rule."""
    _STYLED[:] = [(ref, r) for ref, r in _STYLED if ref() is not None]
    _STYLED.append((weakref.ref(model), resolved))


def _owner(module: nn.Module) -> tuple[nn.Module, ResolvedPlan] | None:
    for ref, resolved in _STYLED:
        model = ref()
        if model is not None and any(candidate is module for candidate in model.modules()):
            return model, resolved
    return None


def rule_near(name: str, resolved: ResolvedPlan) -> tuple[str, Rule] | None:
    """The styled module that decides ``name``'s layout: itself, the first styled module
    inside it, or the nearest styled one around it."""
    assignments = resolved.assignments
    if name in assignments:
        return name, assignments[name]
    inside = next((n for n in assignments if n.startswith(name + ".")), None) if name else None
    if inside is not None:
        return inside, assignments[inside]
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        around = ".".join(parts[:cut])
        if around in assignments:
            return around, assignments[around]
    return None


def _failing_module(exc: BaseException) -> nn.Module | None:
    """The innermost module whose ``__call__`` the exception passed through: from its traceback,
    so nothing that ran before (a checkpoint's recompute that torch stops early by raising
    inside modules) can leave a stale answer."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is _CALL_IMPL and isinstance(frame.f_locals.get("self"), nn.Module):
            found = frame.f_locals["self"]
        tb = tb.tb_next
    return found


_CALL_IMPL = nn.Module._call_impl.__code__

# gloo raises a plain RuntimeError when a peer is gone ("[.../gloo/transport/tcp/pair.cc:553]
# Connection closed by peer"); NCCL's come as DistBackendError
_TRANSPORT = re.compile(r"gloo/transport|Connection closed by peer|NCCL error|ProcessGroupNCCL")


def _communication_failure(exc: BaseException) -> bool:
    """A collective that failed because a peer died or timed out: the launcher names the rank
    that failed first (``rank-failed``); blaming the plan's layout here would hide that."""
    return isinstance(exc, dist.DistError) or bool(_TRANSPORT.search(str(exc)))


class ModuleTracker:
    """While active, which module finished its forward last (a global module hook: it sees every
    module, whatever model it belongs to); with an exception's traceback, where it failed."""

    def __init__(self) -> None:
        self.last_done: nn.Module | None = None
        self.handle: Any = None

    def _leave(self, module: nn.Module, _args: Any, _output: Any) -> None:
        # inside a compiled block (the plan's compile:) the hook is traced, not run: its side
        # effect would break the block's graph, and under TP the gradients of the DTensors at the
        # break left the graph as plain tensors. The block as a whole is still tracked.
        if torch.compiler.is_compiling():
            return
        self.last_done = module

    def __enter__(self) -> ModuleTracker:
        self.handle = register_module_forward_hook(self._leave)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.handle.remove()

    def where(self, model: nn.Module, exc: BaseException) -> tuple[str, str | None] | None:
        """(the innermost module of ``model`` the exception came through, the last module that
        finished inside it), or None when it came through none of ``model``'s modules."""
        names = {id(m): n for n, m in model.named_modules()}
        failing = _failing_module(exc)
        inner = names.get(id(failing)) if failing is not None else None
        if inner is None:
            return None
        done = names.get(id(self.last_done)) if self.last_done is not None else None
        inside = done is not None and (inner == "" or done.startswith(inner + "."))
        return inner, done if inside else None


def failure_diagnostic(
    exc: BaseException,
    *,
    where: tuple[str, str | None] | None,
    resolved: ResolvedPlan | None,
    stage: str,
    fallback: SourceLoc,
    rule_id: str,
) -> Diagnostic:
    """One line: the module that failed (and the last one that finished inside it), the rule
    that styles it, and torch's first line (which carries the shapes)."""
    text = str(exc).strip()
    first = text.splitlines()[0][:400] if text else type(exc).__name__
    module, done = where or ("<model>", None)
    rule = None
    if resolved is not None and where is not None:
        rule = (
            (done, resolved.assignments[done]) if done and done in resolved.assignments else rule_near(module, resolved)
        )
    place = module + (f" after {done}" if done else "")
    if rule is None:
        styled, loc = "no plan rule styles it or the modules in it", fallback
    else:
        styled_name, styled_rule = rule
        loc = styled_rule.loc
        whose = "rule" if styled_name in (module, done) else f"the rule of {styled_name}"
        styled = f"{whose} '{styled_rule.pattern}: {styled_rule.style.describe()}'"
    return Diagnostic(
        rule=rule_id,
        loc=loc,
        message=f"{stage} failed in {place} ({styled}): {type(exc).__name__}: {first}",
        fix="check this rule and the rules of the modules feeding it (`plancc explain` shows every layout; "
        "`plancc validate --dry-run` runs the model at this layout without a GPU)",
    )


@contextmanager
def diagnosed(stage: str, *, fallback: SourceLoc) -> Iterator[None]:
    """Within this block, an exception raised inside the forward of a module of a model that
    ``parallelize`` styled becomes a ``PlanError`` (rule ``run-time-layout``)."""
    with ModuleTracker() as tracker:
        try:
            yield
        except PlanError:
            raise
        except Exception as exc:  # torch's error from inside the model: named after the plan's rule
            failing = None if _communication_failure(exc) else _failing_module(exc)
            owner = _owner(failing) if failing is not None else None
            if owner is None:
                raise
            model, resolved = owner
            where = tracker.where(model, exc)
            raise PlanError(
                [failure_diagnostic(exc, where=where, resolved=resolved, stage=stage, fallback=fallback, rule_id=RULE)]
            ) from exc
