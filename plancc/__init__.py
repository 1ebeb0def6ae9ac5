"""plancc: declarative parallelization plans for Hugging Face models on DTensor/FSDP2."""

from . import cp, logprobs  # plancc.cp.*, plancc.logprobs.* are public API
from .checks import check_plan
from .errors import Diagnostic, PlanError, Severity, SourceLoc
from .mesh import MeshError, MeshSpec, build_mesh
from .parallelize import materialize, parallelize
from .lower import compile_plan
from .plan import Plan, Rule, StyleRef, load_plan, parse_plan
from .resolve import ResolvedPlan, resolve_plan

__all__ = [
    "Diagnostic",
    "MeshError",
    "MeshSpec",
    "Plan",
    "PlanError",
    "ResolvedPlan",
    "Rule",
    "Severity",
    "SourceLoc",
    "StyleRef",
    "build_mesh",
    "check_plan",
    "compile_plan",
    "cp",
    "load_plan",
    "logprobs",
    "materialize",
    "parallelize",
    "parse_plan",
    "resolve_plan",
]
__version__ = "0.1.0"
