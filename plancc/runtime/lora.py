"""Low-rank adapters (LoRA) laid out with their base layer's tensor-parallel style.

An adapted ``nn.Linear`` keeps its name, its weight and its plan rule; it gains two children
under PEFT's names, ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``), and a forward hook
that adds ``scale * B(A(x))`` to its output (``scale = alpha / r``, PEFT's). The hook runs
*between* the layer's matmul and the tensor-parallel output hook (``prepend=True``), so it sees
the input and output as DTensors in the layout the base style gave them, and the adapter's
weights are placed so that the adapter path is exact by DTensor's own rules, with no
collective of its own:

- ``colwise`` base (weight ``Shard(0)``, input replicated, output ``Shard(-1)``): ``A`` whole,
  ``B`` sharded by output rows -- the adapter's output is sharded like the base's.
- ``rowwise`` base (weight ``Shard(1)``, input ``Shard(-1)``, output ``Partial`` before the
  output hook): ``A`` sharded by input columns, ``B`` whole -- the adapter's output is
  ``Partial`` too, and the base's one all-reduce (or, with sequence parallelism, its
  reduce-scatter) reduces both.
- no style (a plain layer, every layer at tp = 1): plain adapters.

Every other style (packed projections, experts, embeddings, attention-specific styles) is
refused at the rule's line, as are adapters on the output embedding (the fused lm_head reads
its weight, never its forward). The base is frozen; FSDP shards the adapters with their layer.

Weights go out merged (``W + scale * B @ A``, PEFT's ``merge_and_unload``) or as adapters only
under PEFT's names (``base_model.model.<module>.lora_A.weight``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from ..compiler import declarations as d
from ..compiler.globs import ModuleTree, glob_problem
from ..compiler.resolve import ResolvedPlan, no_match
from ..compiler.styles import declared
from ..errors import Diagnostic, PlanError, SourceLoc

PEFT_PREFIX = "base_model.model."
FIELDS = ("r", "alpha", "dropout", "targets", "init_lora_weights")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """What to adapt and how: PEFT's ``LoraConfig`` fields of the same meaning (``alpha`` is
    ``lora_alpha``, ``targets`` are plancc globs over module names, ``init_lora_weights``
    False draws ``B`` at random as PEFT does, for tests; True starts ``B`` at zero)."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    init_lora_weights: bool = True
    loc: SourceLoc = field(default_factory=lambda: SourceLoc(path="<lora>"), compare=False)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def of(cls, value: LoraSpec | Mapping[str, Any] | None, loc: SourceLoc | None = None) -> LoraSpec | None:
        """A spec from ``Policy(lora={...})`` or a plan's ``lora:`` section; a ``PlanError``
        with one diagnostic per problem."""
        if value is None or isinstance(value, LoraSpec):
            return value
        where = loc or SourceLoc(path="<lora>")
        if not isinstance(value, Mapping):
            raise PlanError([_bad(where, f"lora is a {type(value).__name__}", "a mapping of r, alpha, targets")])
        problems = [
            _bad(where, f"unknown lora field {key!r}", f"the fields {', '.join(FIELDS)}")
            for key in value
            if key not in FIELDS
        ]
        r, alpha = value.get("r"), value.get("alpha", value.get("r"))
        targets = value.get("targets")
        dropout = value.get("dropout", 0.0)
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            problems.append(_bad(where, f"lora r is {r!r}", "a whole number above 0 (the adapters' rank)"))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            problems.append(_bad(where, f"lora alpha is {alpha!r}", "a number above 0 (the scale is alpha / r)"))
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            problems.append(_bad(where, f"lora dropout is {dropout!r}", "a number in [0, 1)"))
        if isinstance(targets, str):
            targets = [targets]
        if not targets or not all(isinstance(t, str) and t for t in targets):
            problems.append(_bad(where, f"lora targets are {targets!r}", "a list of module globs"))
        if problems:
            raise PlanError(problems)
        return cls(
            r=int(r),  # type: ignore[arg-type]
            alpha=float(alpha),
            targets=tuple(targets),  # type: ignore[arg-type]
            dropout=float(dropout),
            init_lora_weights=bool(value.get("init_lora_weights", True)),
            loc=where,
        )

    def peft_config(self, targets: Iterable[str]) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` for these adapters on the named modules."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": self.init_lora_weights,
            "inference_mode": True,
        }


def _bad(loc: SourceLoc, found: str, allowed: str, rule: str = "lora-config", fix: str | None = None) -> Diagnostic:
    return Diagnostic(rule=rule, loc=loc, message=f"{found}; allowed: {allowed}", fix=fix or f"give {allowed}")


class _AdapterHook:
    """Adds ``scale * B(A(dropout(x)))`` to an adapted layer's output (see the module doc)."""

    def __init__(self, scale: float, dropout: float) -> None:
        self.scale, self.dropout, self.enabled = scale, dropout, True

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return output
        x = args[0]
        if self.dropout and module.training:
            x = F.dropout(x, self.dropout, training=True)
        a, b = module.get_submodule("lora_A"), module.get_submodule("lora_B")
        return output + b(a(x)) * self.scale


@dataclass(frozen=True, slots=True)
class Adapters:
    """The adapters of a model: each adapted module's name, and the spec."""

    spec: LoraSpec
    modules: tuple[str, ...]

    def parameter_names(self) -> list[str]:
        return [f"{m}.lora_{ab}.weight" for m in self.modules for ab in ("A", "B")]

    def by_base_weight(self) -> dict[str, tuple[str, str]]:
        """``{module.weight: (module.lora_A.weight, module.lora_B.weight)}``."""
        return {f"{m}.weight": (f"{m}.lora_A.weight", f"{m}.lora_B.weight") for m in self.modules}


def adapters_of(model: nn.Module) -> Adapters | None:
    found = model.__dict__.get("_plancc_adapters")
    return found if isinstance(found, Adapters) else None


def _placements(name: str, resolved: ResolvedPlan | None, tp: int) -> tuple[Placement, Placement] | str | None:
    """(A's, B's) tp placement for the base module's style; a reason when its style cannot
    carry adapters; None for a plain layer."""
    rule = resolved.assignments.get(name) if resolved is not None and tp > 1 else None
    if rule is None:
        return None
    decl = declared(rule.style)
    if type(decl) is d.Colwise:
        return Replicate(), Shard(0)
    if type(decl) is d.Rowwise:
        return Shard(1), Replicate()
    if isinstance(decl, d.LeaveWhole):
        return None
    return rule.style.name


def check_targets(model: nn.Module, spec: LoraSpec, resolved: ResolvedPlan | None, tp: int) -> list[str]:
    """The module names the spec adapts, in model order; a ``PlanError`` with every problem:
    a glob matching nothing, a module without a 2-D weight, the output embedding, a rank larger
    than a layer's dims, a style that cannot carry adapters, dropout under tp."""
    tree = ModuleTree.of(model)
    problems: list[Diagnostic] = []
    names: dict[str, None] = {}
    for pattern in spec.targets:
        if (why := glob_problem(pattern)) is not None:
            problems.append(_bad(spec.loc, f"lora target {pattern!r}: {why}", "a module glob", "lora-target"))
            continue
        found = tree.match(pattern)
        if not found:
            problems.append(no_match(pattern, spec.loc, tree, "lora target"))
        names.update(dict.fromkeys(found))
    modules = dict(model.named_modules())
    embeddings = getattr(model, "get_output_embeddings", None)
    head = embeddings() if callable(embeddings) else None
    for name in names:
        module = modules[name]
        if module is head:
            problems.append(
                _bad(
                    spec.loc,
                    f"lora target {name!r} is the output embedding "
                    "(the fused lm_head reads its weight, not its forward)",
                    "the decoder's linear layers",
                    "lora-target",
                    fix="drop it from the targets",
                )
            )
            continue
        if type(module) is not nn.Linear:
            problems.append(
                _bad(
                    spec.loc,
                    f"lora target {name!r} is a {type(module).__name__}, not an nn.Linear with a 2-D weight",
                    "nn.Linear modules (attention and MLP projections)",
                    "lora-target",
                    fix="narrow the glob to the projections, e.g. 'model.layers.*.self_attn.q_proj'",
                )
            )
            continue
        out_features, in_features = module.out_features, module.in_features
        if spec.r > min(in_features, out_features):
            problems.append(
                _bad(
                    spec.loc,
                    f"lora r={spec.r} exceeds {name!r}'s dims ({in_features} -> {out_features})",
                    f"r <= {min(in_features, out_features)}",
                    fix=f"lower r to at most {min(in_features, out_features)}",
                )
            )
        placed = _placements(name, resolved, tp)
        if isinstance(placed, str):
            rule = resolved.assignments[name] if resolved is not None else None
            problems.append(
                Diagnostic(
                    rule="lora-style",
                    loc=rule.loc if rule is not None else spec.loc,
                    message=f"lora target {name!r} has the style {placed!r}, which cannot carry adapters; "
                    "allowed: 'colwise' and 'rowwise' (and layers the plan leaves whole)",
                    fix="drop the module from the lora targets",
                )
            )
        elif placed is not None and spec.dropout:
            problems.append(
                _bad(
                    spec.loc,
                    f"lora dropout {spec.dropout} with tensor parallelism (tp={tp})",
                    "dropout 0 when tp > 1 (a replicated input would need one mask on every tp rank)",
                    fix="set dropout: 0",
                )
            )
    if problems:
        raise PlanError(problems)
    return list(names)


def add_adapters(
    model: nn.Module, spec: LoraSpec, resolved: ResolvedPlan | None, tp_mesh: DeviceMesh | None
) -> Adapters:
    """Adapters on every target (after tensor parallelism, before FSDP); the base frozen."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    names = check_targets(model, spec, resolved, tp)
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        base = modules[name]
        assert isinstance(base, nn.Linear)
        device = base.weight.device
        a = nn.Linear(base.in_features, spec.r, bias=False, device=device)
        b = nn.Linear(spec.r, base.out_features, bias=False, device=device)
        placed = _placements(name, resolved, tp)
        if isinstance(placed, tuple) and tp_mesh is not None:
            for layer, placement in zip((a, b), placed, strict=True):
                layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), tp_mesh, [placement]))
        base.lora_A, base.lora_B = a, b  # registered after the tp styles shard the base: left alone by them
        base.register_forward_hook(_AdapterHook(spec.scale, spec.dropout), prepend=True)
    adapters = Adapters(spec=spec, modules=tuple(names))
    model.__dict__["_plancc_adapters"] = adapters
    return adapters


def initial_adapter_state(adapters: Adapters, shapes: Mapping[str, tuple[int, int]], seed: int) -> dict[str, Any]:
    """The adapters' initial full tensors, the same on every rank and for an unsharded
    reference: ``A`` as PEFT draws it (nn.Linear's kaiming-uniform), ``B`` zero, or drawn the
    same way with ``init_lora_weights=False``. ``shapes``: module name -> (out, in)."""
    gen = torch.Generator().manual_seed(seed + 0x10AA)
    state: dict[str, Any] = {}
    for name in adapters.modules:
        out_features, in_features = shapes[name]
        a = torch.empty(adapters.spec.r, in_features)
        b = torch.empty(out_features, adapters.spec.r)
        _kaiming(a, gen)
        if adapters.spec.init_lora_weights:
            b.zero_()
        else:
            _kaiming(b, gen)
        state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"] = a, b
    return state


def _kaiming(t: torch.Tensor, gen: torch.Generator) -> None:
    """nn.Linear's default init (kaiming-uniform, a=sqrt(5)): bound 1/sqrt(fan_in)."""
    bound = 1 / math.sqrt(t.shape[1])
    t.uniform_(-bound, bound, generator=gen)


def base_shapes(model: nn.Module, adapters: Adapters) -> dict[str, tuple[int, int]]:
    modules = dict(model.named_modules())
    return {n: (modules[n].out_features, modules[n].in_features) for n in adapters.modules}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone (the reference policy) for the block."""
    hooks = [h for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, _AdapterHook)]
    for hook in hooks:
        hook.enabled = False
    try:
        yield
    finally:
        for hook in hooks:
            hook.enabled = True


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` of full tensors, in fp32, back in W's dtype (PEFT's merge)."""
    delta = (b.float() @ a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def peft_name(name: str) -> str:
    """A module's adapter parameter under PEFT's saved name."""
    return PEFT_PREFIX + name


def local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value.detach()


def merge_into(state: dict[str, Any], adapters: Adapters) -> dict[str, Any]:
    """A full state dict with every adapted weight merged (``merge_and_unload``) and the
    adapters' own entries gone: the base model's names and shapes."""
    for base, (a, b) in adapters.by_base_weight().items():
        state[base] = merged(state[base], state.pop(a), state.pop(b), adapters.spec.scale)
    return state


def adapter_tensors(state: Mapping[str, torch.Tensor], adapters: Adapters) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict under PEFT's saved names (``adapter_model.safetensors``)."""
    return {peft_name(name): state[name].contiguous() for name in adapters.parameter_names()}
