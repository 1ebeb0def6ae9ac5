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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checks.lora_targets import IDS, lora_problems
from ..compiler.adapted_modules import adapted_modules
from ..compiler.adapter_layouts import ADAPTER_PLACEMENTS, adapter_layout
from ..compiler.lora_spec import LoraSpec
from ..compiler.resolve import ResolvedPlan
from ..errors import Diagnostic, PlanError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Adapters", "LoraSpec", "add_adapters", "adapters_disabled", "adapters_of", "initial_adapter_state"]

PEFT_PREFIX = "base_model.model."


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


def add_adapters(
    model: nn.Module, spec: LoraSpec, resolved: ResolvedPlan | None, tp_mesh: DeviceMesh | None
) -> Adapters:
    """Adapters on every target (after tensor parallelism, before FSDP); the base frozen."""
    # DTensor here, not at import: the launcher reads adapter names (``adapters_of``) from
    # this module before any worker starts
    from torch.distributed.tensor import distribute_tensor

    from .styles.dtensor_placements import to_torch  # lazy: the launcher's LoRA checks run without DTensor

    tp = tp_mesh.size() if tp_mesh is not None else 1
    problems = lora_problems(model, spec, resolved, tp)
    if problems:
        raise PlanError([Diagnostic(rule=p.rule or IDS[0], loc=p.loc, message=p.message, fix=p.fix) for p in problems])
    names = list(adapted_modules(model, spec)[0])
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        base = modules[name]
        assert isinstance(base, nn.Linear)
        # the base's device and dtype: an adapter computes with the layer's input and output
        device, dtype = base.weight.device, base.weight.dtype
        out_features, in_features = base.weight.shape
        a = nn.Linear(in_features, spec.r, bias=False, device=device, dtype=dtype)
        b = nn.Linear(spec.r, out_features, bias=False, device=device, dtype=dtype)
        layout = adapter_layout(name, resolved, tp)
        if layout in ("colwise", "rowwise") and tp_mesh is not None:  # a plain layer keeps plain adapters
            for layer, placement in zip((a, b), ADAPTER_PLACEMENTS[layout], strict=True):
                layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), tp_mesh, [to_torch(placement)]))
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
        # drawn on the host, as the seeded base is (engine.parallel_model): one seed, the same numbers anywhere
        a = torch.empty(adapters.spec.r, in_features, device="cpu")
        b = torch.empty(out_features, adapters.spec.r, device="cpu")
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
    return {n: tuple(modules[n].weight.shape) for n in adapters.modules}


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


def merge_into(state: dict[str, Any], adapters: Adapters) -> dict[str, Any]:
    """A full state dict with every adapted weight merged (``merge_and_unload``) and the
    adapters' own entries gone: the base model's names and shapes."""
    for base, (a, b) in adapters.by_base_weight().items():
        state[base] = merged(state[base], state.pop(a), state.pop(b), adapters.spec.scale)
    return state


def adapter_tensors(state: Mapping[str, torch.Tensor], adapters: Adapters) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict under PEFT's saved names (``adapter_model.safetensors``)."""
    return {peft_name(name): state[name].contiguous() for name in adapters.parameter_names()}
