"""Apply a plan to a model on a (dp, cp, tp) mesh: TP/SP, then activation checkpointing,
then FSDP2 per unit and the root (torchtitan's order: sharding decisions first, memory
policies last, so FSDP sees the TP DTensors and builds 2-D shards).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Iterable

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from .checkpointing import apply_activation_checkpointing
from .errors import Diagnostic, PlanError
from .lower import lower
from .plan import Plan
from .resolve import ResolvedPlan, resolve_plan


def tied_parameter_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that share one Parameter object."""
    owners: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            owners[id(param)].append((mod_name, p_name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """``parallelize_module`` replaces each module's parameters independently, which unties
    shared weights; point every user back at one (identically placed) parameter."""
    modules = dict(model.named_modules())
    for group in groups:
        (first_mod, first_name), *rest = group
        keep = getattr(modules[first_mod], first_name)
        for mod_name, p_name in rest:
            other = getattr(modules[mod_name], p_name)
            same_layout = (
                isinstance(keep, DTensor) == isinstance(other, DTensor)
                and (not isinstance(keep, DTensor) or keep.placements == other.placements)
            )
            if not same_layout:
                raise PlanError([Diagnostic(
                    rule="tied-embeddings",
                    message=f"{first_mod}.{first_name} and {mod_name}.{p_name} are one tied weight but the plan "
                    "shards them differently",
                    fix="run `plancc validate` with --tp for the fix",
                )])
            setattr(modules[mod_name], p_name, keep)


def call_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A forward call's arguments by name (``**kwargs`` flattened in), so a pre-hook can
    rewrite them and hand them back as keywords."""
    values = dict(signature.bind_partial(*args, **kwargs).arguments)
    values.update(values.pop("kwargs", {}) or {})
    return values


class GlobalSequenceInputs:
    """Forward pre-hook for sequence parallelism on a Hugging Face decoder (``model.model``).

    Under SP the embedding hands the decoder a sequence shard, and transformers derives
    position ids and the causal mask from ``inputs_embeds.shape[1]``, i.e. from the shard.
    This hook computes both from the full ``input_ids`` before the decoder runs: global
    ``position_ids`` (unless given) and the prepared masks, which transformers uses as-is.
    It sits on the decoder, not the causal LM, so that calling the decoder directly (a value
    head on hidden states, a reward model) gets global positions too.
    """

    def __init__(self, base: nn.Module):
        self.signature = inspect.signature(base.forward)
        self.base = base
        config = base.config
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.sliding = "sliding_attention" in (getattr(self.config, "layer_types", None) or ())

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        values = call_arguments(self.signature, args, kwargs)
        input_ids = values.get("input_ids")
        if input_ids is None or isinstance(values.get("attention_mask"), dict):
            return None
        batch, seq = input_ids.shape[:2]
        if values.get("position_ids") is None:
            values["position_ids"] = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, -1)
        values["attention_mask"] = self._masks(input_ids, values.get("attention_mask"), values["position_ids"])
        return (), values

    def _masks(self, input_ids, attention_mask, position_ids):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        dtype = next(self.base.parameters()).dtype
        stand_in = torch.empty((*input_ids.shape[:2], 0), dtype=dtype, device=input_ids.device)
        kwargs = dict(config=self.config, inputs_embeds=stand_in, attention_mask=attention_mask,
                      past_key_values=None, position_ids=position_ids)
        full = create_causal_mask(**kwargs)
        if not self.sliding:
            return full
        return {"full_attention": full, "sliding_attention": create_sliding_window_causal_mask(**kwargs)}


def apply_tensor_parallel(model: nn.Module, resolved: ResolvedPlan, tp_mesh: DeviceMesh) -> nn.Module:
    if tp_mesh.size() == 1:
        return model
    groups = tied_parameter_groups(model)
    parallelize_module(model, tp_mesh, lower(resolved))
    _retie(model, groups)
    if resolved.sequence_parallel:
        decoder = getattr(model, "model", model)
        decoder.register_forward_pre_hook(GlobalSequenceInputs(decoder), with_kwargs=True)
    return model


def apply_fsdp(
    model: nn.Module,
    units: Iterable[str],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    modules = dict(model.named_modules())
    unit_list = list(units)
    for i, name in enumerate(unit_list):
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        fully_shard(modules[name], mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                    reshard_after_forward=reshard_after_forward and i < len(unit_list) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    return model


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP shards over data- and context-parallel ranks together (they hold the same weights)."""
    from .mesh import dp_cp_mesh

    return dp_cp_mesh(mesh)


def parallelize(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    activation_checkpointing: bool | None = None,
) -> nn.Module:
    """TP/SP from the compiled plan, then activation checkpointing on the plan's targets,
    then FSDP2 ``fully_shard`` on the plan's units and the root. Works on a meta-device model
    (materialize it afterwards with ``plancc.materialize``).

    ``activation_checkpointing``: None follows the plan, False disables, True requires the
    plan to name targets.
    """
    _require_plancc_axes(mesh)
    resolved = resolve_plan(plan, model, sequence_parallel=sequence_parallel)
    apply_tensor_parallel(model, resolved, mesh["tp"])
    if mesh["cp"].size() > 1:
        from .cp import enable_context_parallel

        enable_context_parallel(model, mesh["cp"])
    if activation_checkpointing is not False:
        if activation_checkpointing and not resolved.activation_checkpointing:
            raise PlanError([Diagnostic(
                rule="activation-checkpointing", loc=plan.loc,
                message="activation checkpointing was requested but the plan names no targets",
                fix="add 'activation_checkpointing: [model.layers.*]' to the plan",
            )])
        apply_activation_checkpointing(model, resolved.activation_checkpointing, resolved.checkpoint_saves)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
    return apply_fsdp(model, resolved.fsdp_units, fsdp_mesh(mesh), mp_policy=mp, offload_policy=offload,
                      reshard_after_forward=plan.fsdp_reshard_after_forward)


MESH_AXES = ("dp", "cp", "tp")


def _require_plancc_axes(mesh: DeviceMesh) -> None:
    """A mesh from elsewhere (torchtitan's dp_shard/tp, a 1-D mesh) fails deep inside torch
    with a slicing error; say what is needed instead."""
    names = tuple(mesh.mesh_dim_names or ())
    if set(MESH_AXES) <= set(names):
        return
    got = f"axes {names} of sizes {tuple(mesh.shape)}" if names else f"an unnamed mesh of shape {tuple(mesh.shape)}"
    raise ValueError(
        f"plancc.parallelize needs a device mesh with axes named {MESH_AXES} (size 1 where unused); got {got}. "
        "Build it with plancc.build_mesh(dp=..., cp=..., tp=...)")


def materialize(model: nn.Module, device: torch.device | str, *, full_state_dict: dict | None = None) -> nn.Module:
    """Allocate a (parallelized) meta model on ``device`` and fill it.

    With ``full_state_dict`` every rank passes the unsharded tensors and keeps its shards.
    Non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) are in no state
    dict: those built for real (``plancc.models.build_model``) are carried over, and those
    built on meta (``with torch.device("meta"): AutoModelForCausalLM.from_config(...)``)
    are recomputed by the model's own transformers initializer.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}
    lost = [name for name, buf in model.named_buffers() if buf.is_meta and _is_non_persistent(model, name)]
    model.to_empty(device=device)
    modules = dict(model.named_modules())
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        modules[owner]._buffers[attr] = value.to(device)
    if lost:
        _recompute_buffers(model, lost)
    if full_state_dict is not None:
        set_model_state_dict(model, full_state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
    return model


def _is_non_persistent(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr in model.get_submodule(owner)._non_persistent_buffers_set


def _recompute_buffers(model: nn.Module, names: list[str]) -> None:
    """Recompute non-persistent buffers that were created on the meta device.

    Without this, ``to_empty`` leaves rotary frequencies as uninitialized memory and the
    model runs with silently wrong logits. transformers (5.x) builds its own models on meta
    and recomputes these buffers in ``_init_weights``; plancc calls it on the owning modules
    only, with the parameters swapped for meta stand-ins so that no weight is touched. A
    NaN sentinel shows any buffer the initializer does not know.
    """
    init = getattr(model, "_init_weights", None)

    def sentinel(buf: torch.Tensor):
        return float("nan") if buf.is_floating_point() else torch.iinfo(buf.dtype).min

    def untouched(buf: torch.Tensor) -> bool:
        return bool((buf.isnan() if buf.is_floating_point() else buf == sentinel(buf)).all())

    for name in names:
        buf = model.get_buffer(name)
        buf.fill_(sentinel(buf))
    for owner in dict.fromkeys(name.rpartition(".")[0] for name in names):
        module = model.get_submodule(owner)
        params = dict(module._parameters)
        module._parameters = {k: None if p is None else nn.Parameter(torch.empty(p.shape, device="meta"))
                              for k, p in params.items()}
        try:
            if init is not None:
                init(module)
        finally:
            module._parameters = params
    unfilled = [name for name in names if untouched(model.get_buffer(name))]
    if unfilled:
        raise ValueError(
            f"buffers {', '.join(unfilled)} were created on the meta device, are in no state dict, and "
            f"{type(model).__name__} has no initializer that recomputes them; build the model with "
            "plancc.models.build_model(config, device='meta'), which keeps buffers real")
