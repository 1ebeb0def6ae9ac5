"""The torch side of plancc's style vocabulary: plancc's own ``ParallelStyle`` classes, the
builder from the compiler's torch-free declarations, and lowering a resolved plan.

The compiler ends at declarations (``compiler.declarations``, ``compiler.styles``); these
modules run collectives and register hooks, so they live in the runtime (as torchtitan keeps
its styles in ``distributed/``).
"""

from .lower import compile_plan, lower
from .to_torch import torch_style

__all__ = ["compile_plan", "lower", "torch_style"]
