"""A rule's passing and failing examples, as data: ``plancc rules`` prints them and
``tests/test_rule_examples.py`` runs each one, so the documentation cannot drift from what
the rule does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Verdict = Literal["PASS", "FAIL", "WARN"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    verdict: Verdict
    text: str  # the line `plancc rules` prints after the verdict
    plan: str = "qwen3.yaml"  # a shipped plan, under plans/
    model: str = "qwen3-8b"  # a preset
    config: Mapping[str, Any] = field(default_factory=dict)  # overrides of the preset's config
    # changes to the plan: (section, key, value); value None removes the key, a key None
    # removes the section whole (value None) or sets it whole (a list: checkpointing targets)
    edits: tuple[tuple[str, str | None, Any], ...] = ()
    # the layout and sequence length, as `plancc validate` flags: tp, cp, dp, world_size,
    # sequence_parallel, seq_len
    args: Mapping[str, Any] = field(default_factory=dict)

    def render(self) -> str:
        return f"{self.verdict:<5} {self.text}"


def render_rule(doc: str, examples: tuple[Example, ...]) -> str:
    """A rule's documentation as ``plancc rules`` prints it: its docstring, then its examples."""
    return "\n".join([doc.strip(), "", *(e.render() for e in examples)])
