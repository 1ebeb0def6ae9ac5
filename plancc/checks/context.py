"""What every check sees: the plan, the meta model and its config, the mesh sizes, and the
plan resolved to concrete module names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from torch import nn

from ..errors import SourceLoc
from ..plan import Plan, Rule
from ..resolve import ResolvedPlan
from ..styles import Layouts, ModuleKind, canonical_style, layouts_of, module_kind


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSizes:
    tp: int
    cp: int
    dp: int | None  # None when it cannot be inferred (reported by mesh-sizes)
    world_size: int | None
    dp_given: bool = False

    @classmethod
    def infer(cls, *, tp: int, cp: int = 1, dp: int | None = None, world_size: int | None = None) -> "MeshSizes":
        given = dp is not None
        if dp is None:
            dp = world_size // (tp * cp) if world_size and world_size % (tp * cp) == 0 else (None if world_size else 1)
        if world_size is None and dp is not None:
            world_size = dp * cp * tp
        return cls(tp=tp, cp=cp, dp=dp, world_size=world_size, dp_given=given)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckContext:
    plan: Plan
    model: nn.Module
    config: object
    mesh: MeshSizes
    sequence_parallel: bool
    resolved: ResolvedPlan | None
    seq_len: int | None = None

    @property
    def tp(self) -> int:
        return self.mesh.tp

    def assigned(self) -> Iterator[tuple[str, nn.Module, Rule, Layouts]]:
        """(module name, module, deciding rule, layouts of its style) for every styled module."""
        if self.resolved is None:
            return
        modules = dict(self.model.named_modules())
        for name, rule in self.resolved.assignments.items():
            yield name, modules[name], rule, layouts_of(canonical_style(rule.style.name).build(rule.style.overrides))

    def rule_for(self, name: str) -> Rule | None:
        return self.resolved.assignments.get(name) if self.resolved else None

    def first_rule_loc(self, *suffixes: str) -> SourceLoc:
        """Where to point config-level problems: the first rule naming one of ``suffixes``."""
        for rule in self.plan.tensor_parallel:
            if rule.pattern.endswith(suffixes):
                return rule.loc
        return self.plan.loc


def text_config(config):
    """The decoder config of multimodal wrappers, or the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def kind_of(module: nn.Module) -> ModuleKind:
    return module_kind(module)
