"""Model-aware checks: one module per rule, each ``check(ctx) -> Iterator[Problem]``.

A rule's module docstring is its user documentation, with passing and failing examples
(``plancc rules`` prints them; ``tests/test_rule_examples.py`` runs them). Checks yield every
problem they see and the engine stamps the rule id; nothing here raises for a user mistake
and nothing touches a process group.
"""

from __future__ import annotations

from .context import CheckContext, Problem
from .rule_runner import RULES, check_plan, rule_ids, run_rules

__all__ = ["RULES", "CheckContext", "Problem", "check_plan", "rule_ids", "run_rules"]
