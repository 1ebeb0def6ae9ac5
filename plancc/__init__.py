"""plancc: declarative parallelization plans for Hugging Face models on DTensor/FSDP2.

The package is layered (each layer imports only the ones below it; ``.importlinter``
enforces it): ``compiler`` reads and compiles plans, ``checks`` checks them against a model
config, ``runtime`` applies them inside a job, ``engine`` is the RL policy engine
(``Policy``), ``job`` runs training and evaluation, ``tools``
explain and dry-run plans, ``cli`` is the command line. ``layout``, ``models`` and
``errors`` are shared by all.

This module is the public API. Its names are imported on first use (PEP 562), so that
``import plancc.cli`` or validating a plan does not load the runtime: ``plancc --help``
stays fast, and the front end provably runs without torch.distributed's process groups.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from . import cp, logprobs, weights
    from .checks import check_plan
    from .compiler.plan import Plan, Rule, StyleRef, load_plan, parse_plan
    from .compiler.resolve import ResolvedPlan, resolve_plan
    from .engine.batches import BatchError, Microbatching
    from .engine.channel import WeightChannelError, weight_channel
    from .engine.colocated import receive_shared_weights
    from .engine.policy import BatchTotals, NonFiniteError, Policy
    from .engine.refit import receive_weights
    from .engine.streaming import WeightFormat
    from .errors import Diagnostic, PlanError, Severity, SourceLoc
    from .layout import Layout, LayoutError
    from .runtime.gradnorm import clip_grad_norm_
    from .runtime.loss import causal_lm_loss
    from .runtime.materialize import materialize
    from .runtime.mesh import ParallelMesh, build_mesh
    from .runtime.parallelize import parallelize
    from .runtime.styles.lower import compile_plan
    from .tools.suggest import suggest

_HOMES = {
    "check_plan": "plancc.checks",
    "compile_plan": "plancc.runtime.styles.lower",
    **dict.fromkeys(["Plan", "Rule", "StyleRef", "load_plan", "parse_plan"], "plancc.compiler.plan"),
    **dict.fromkeys(["ResolvedPlan", "resolve_plan"], "plancc.compiler.resolve"),
    **dict.fromkeys(["Diagnostic", "PlanError", "Severity", "SourceLoc"], "plancc.errors"),
    **dict.fromkeys(["Layout", "LayoutError"], "plancc.layout"),
    "materialize": "plancc.runtime.materialize",
    "causal_lm_loss": "plancc.runtime.loss",
    "clip_grad_norm_": "plancc.runtime.gradnorm",
    **dict.fromkeys(["ParallelMesh", "build_mesh"], "plancc.runtime.mesh"),
    "parallelize": "plancc.runtime.parallelize",
    **dict.fromkeys(["BatchTotals", "NonFiniteError", "Policy"], "plancc.engine.policy"),
    **dict.fromkeys(["BatchError", "Microbatching"], "plancc.engine.batches"),
    "WeightFormat": "plancc.engine.streaming",
    **dict.fromkeys(["WeightChannelError", "weight_channel"], "plancc.engine.channel"),
    "receive_weights": "plancc.engine.refit",
    "receive_shared_weights": "plancc.engine.colocated",
    "suggest": "plancc.tools.suggest",
}
_SUBMODULES = ("cp", "logprobs", "weights")  # plancc.cp.*, plancc.logprobs.*, plancc.weights.*

__all__ = [
    "BatchError",
    "BatchTotals",
    "Diagnostic",
    "Layout",
    "LayoutError",
    "Microbatching",
    "NonFiniteError",
    "ParallelMesh",
    "Plan",
    "PlanError",
    "Policy",
    "ResolvedPlan",
    "Rule",
    "Severity",
    "SourceLoc",
    "StyleRef",
    "WeightChannelError",
    "WeightFormat",
    "build_mesh",
    "causal_lm_loss",
    "check_plan",
    "clip_grad_norm_",
    "compile_plan",
    "cp",
    "load_plan",
    "logprobs",
    "materialize",
    "parallelize",
    "parse_plan",
    "receive_shared_weights",
    "receive_weights",
    "resolve_plan",
    "suggest",
    "weight_channel",
    "weights",
]
assert sorted(__all__) == sorted([*_HOMES, *_SUBMODULES])
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = import_module(f"plancc.{name}")
    elif name in _HOMES:
        value = getattr(import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'plancc' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
