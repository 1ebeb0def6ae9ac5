"""plancc: declarative parallelization plans for Hugging Face models on DTensor/FSDP2."""

from .errors import Diagnostic, PlanError, Severity, SourceLoc
from .lower import compile_plan
from .plan import Plan, Rule, StyleRef, load_plan, parse_plan
from .resolve import ResolvedPlan, resolve_plan

__all__ = [
    "Diagnostic",
    "Plan",
    "PlanError",
    "ResolvedPlan",
    "Rule",
    "Severity",
    "SourceLoc",
    "StyleRef",
    "compile_plan",
    "load_plan",
    "parse_plan",
    "resolve_plan",
]
__version__ = "0.1.0"
