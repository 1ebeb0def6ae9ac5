"""What every check sees: the plan, the meta model and its config, the mesh sizes, and the
plan resolved to concrete module names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..compiler.plan import Plan, Rule
from ..compiler.resolve import ResolvedPlan
from ..compiler.styles import Layouts, ModuleKind, module_kind, style_layouts
from ..dataflow import Flow, TraceError, recorded_flow, remember, trace
from ..errors import Diagnostic, Severity, SourceLoc
from ..layout import Layout
from ..models import build_meta_model, field_values

if TYPE_CHECKING:  # transformers' modeling stack is not imported to check a plan
    from transformers import PretrainedConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """What a check finds; the engine stamps the rule id (the check module's ``ID``) and
    turns it into a ``Diagnostic``. A module that owns several rule ids names one in ``rule``."""

    message: str
    loc: SourceLoc
    fix: str | None = None
    severity: Severity = Severity.ERROR
    rule: str | None = None
    suggestion: Mapping[str, Any] | None = None  # the fix as rules to write: {glob: style}


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckContext:
    plan: Plan
    model: nn.Module
    config: PretrainedConfig
    layout: Layout
    resolved: ResolvedPlan | None
    seq_len: int | None = None
    # why the requested sizes do not fit (the mesh-sizes rule reports them); ``layout``
    # then keeps the sizes that were given, so the other rules still run
    layout_problems: tuple[Diagnostic, ...] = ()
    # the model's modules by name, walked once per context (every rule asks for them)
    modules: Mapping[str, nn.Module] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.modules:
            object.__setattr__(self, "modules", dict(self.model.named_modules()))

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    def assigned(self) -> Iterator[tuple[str, nn.Module, Rule, Layouts]]:
        """(module name, module, deciding rule, layouts of its style) for every styled module."""
        if self.resolved is None:
            return
        for name, rule in self.resolved.assignments.items():
            yield name, self.modules[name], rule, style_layouts(rule.style)

    def rule_for(self, name: str) -> Rule | None:
        return self.resolved.assignments.get(name) if self.resolved else None

    def first_rule_loc(self, *suffixes: str) -> SourceLoc:
        """Where to point config-level problems: the first rule naming one of ``suffixes``."""
        for rule in self.plan.tensor_parallel:
            if rule.pattern.endswith(suffixes):
                return rule.loc
        return self.plan.loc


def head_counts(config: PretrainedConfig) -> set[int]:
    """The config's numbers of attention heads and of key/value heads (what "one per head" can mean)."""
    text = text_config(config)
    return {int(n) for field in ("num_attention_heads", "num_key_value_heads") for n in field_values(text, field)}


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder config of multimodal wrappers, or the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def kind_of(module: nn.Module) -> ModuleKind:
    return module_kind(module)


def flow_of(ctx: CheckContext) -> Flow | str:
    """The model's recorded wiring, or why it could not be recorded."""
    flow = recorded_flow(ctx.model)
    if flow is not None:
        return flow
    on_meta = all(p.is_meta for p in ctx.model.parameters())
    try:
        flow = trace(ctx.model if on_meta else build_meta_model(ctx.config))
    except TraceError as exc:
        return str(exc)
    remember(ctx.model, flow)
    return flow
