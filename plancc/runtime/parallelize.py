"""Apply a plan to a model on a (dp, cp, tp) mesh: TP/SP (and EP), then activation
checkpointing, then FSDP2 per unit and the root (torchtitan's order: sharding decisions first,
memory policies last, so FSDP sees the TP DTensors and builds 2-D shards).

With ``ep > 1`` the plan's ``moe_experts`` modules are spread over the (ep, tp) axes of an
expert mesh instead of tp alone, and get an FSDP unit of their own over its ``edp`` axis,
whose gradient reduction divides by all of dp: each expert's gradient already sums the tokens
of its ep ranks (the all-to-all's backward brought them), so dividing by the ``dp / ep``
ranks FSDP reduces over would count them ep times.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils._pytree import tree_map

from ..compiler.plan import Plan
from ..compiler.resolve import ResolvedPlan, resolve_plan, tied_parameter_groups, units_without_outside_users
from ..errors import Diagnostic, PlanError
from . import failures
from .activation_checkpointing import apply_activation_checkpointing
from .compile import compile_blocks
from .cp_context import enable_context_parallel
from .cp_key_selection import select_keys_over_the_sequence
from .cp_mixers import enable_mixer_context_parallel
from .expert_dispatch import ExpertParallel
from .gradient_scale import fsdp_divisor
from .hooks import GlobalSequenceInputs
from .lora import LoraSpec, add_adapters
from .mesh import ParallelMesh, require_parallel_mesh
from .styles.experts import ExpertsOverTensorParallel
from .styles.lower import lower


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """``parallelize_module`` replaces each module's parameters independently, which unties
    shared weights; point every user back at one (identically placed) parameter."""
    modules = dict(model.named_modules())
    for group in groups:
        (first_mod, first_name), *rest = group
        keep = getattr(modules[first_mod], first_name)
        for mod_name, p_name in rest:
            other = getattr(modules[mod_name], p_name)
            same_layout = isinstance(keep, DTensor) == isinstance(other, DTensor) and (
                not isinstance(keep, DTensor) or keep.placements == other.placements
            )
            if not same_layout:
                raise PlanError(
                    [
                        Diagnostic(
                            rule="tied-embeddings",
                            message=f"{first_mod}.{first_name} and {mod_name}.{p_name} are one tied weight "
                            "but the plan shards them differently",
                            fix="run `plancc validate` with --tp for the fix",
                        )
                    ]
                )
            setattr(modules[mod_name], p_name, keep)


def apply_tensor_parallel(
    model: nn.Module, resolved: ResolvedPlan, tp_mesh: DeviceMesh, *, expert_mesh: DeviceMesh | None = None
) -> list[str]:
    """The plan's styles on the tp mesh, its experts on ``expert_mesh`` (ep, tp) when given;
    the names of the experts modules spread over ep."""
    styles = lower(resolved)
    # with --ep the experts styles run on the (ep, tp) mesh, the rest on tp (torchtitan applies
    # its ExpertParallel the same way: one parallelize_module call per mesh)
    over_ep: dict[str, ParallelStyle] = {}
    if expert_mesh is not None:
        over_ep = {
            name: ExpertParallel(src_data_rank=style.src_data_rank)
            for name, style in styles.items()
            if isinstance(style, ExpertsOverTensorParallel)
        }
        parallelize_module(model, expert_mesh["ep", "tp"], over_ep)
        styles = {name: style for name, style in styles.items() if name not in over_ep}
    spread = list(over_ep)
    if tp_mesh.size() == 1:
        return spread
    groups = tied_parameter_groups(model)
    parallelize_module(model, tp_mesh, styles)
    _retie(model, groups)
    decoder = getattr(model, "model", model)
    if resolved.sequence_parallel and GlobalSequenceInputs.applies_to(decoder):
        decoder.register_forward_pre_hook(GlobalSequenceInputs(decoder), with_kwargs=True)
    return spread


def _outputs_in_own_storage(_module: nn.Module, _args: Any, output: Any) -> Any:
    """A unit's output tensors that are views, copied into their own storage.

    FSDP2 hooks a unit's outputs to gather its parameters again for backward; an in-place op
    on a view of an output (``x += y``) drops that hook, and the unit's backward then runs on
    sharded parameters. An embedding unit's output under TP is a view (``DTensor.to_local``),
    and FSDP2 warns on every step. One copy of a ``[batch, seq, hidden]`` activation, only
    where grad is enabled, removes both the risk and the warning."""
    if not torch.is_grad_enabled():
        return output
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t, output)


def apply_fsdp(
    model: nn.Module,
    units: Iterable[str],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    reshard_after_forward: bool = True,
    experts: Iterable[str] = (),
    expert_mesh: DeviceMesh | None = None,
    gradient_divide_factor: float | None = None,
    shard_dims: Mapping[str, int] | None = None,
) -> nn.Module:
    modules = dict(model.named_modules())
    # FSDP2's shard_placement_fn: the parameters the plan shards on another dim than 0, by
    # identity (FSDP calls it with each parameter object it is about to shard)
    dims = shard_dims or {}
    placements = {id(p): Shard(dims[n]) for n, p in model.named_parameters() if n in dims}

    def placement(param: nn.Parameter) -> Shard | None:
        return placements.get(id(param))

    chosen = placement if placements else None
    for name in experts:  # innermost first: their enclosing units then leave their weights alone
        assert expert_mesh is not None, "experts spread over ep come with their mesh"
        unit = fully_shard(
            modules[name],
            mesh=expert_mesh["edp"],
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )
        if gradient_divide_factor is not None:
            unit.set_gradient_divide_factor(gradient_divide_factor)
            # sum, then divide: gloo has no PREMUL_SUM (and NCCL copies less with plain sums).
            # Not on one rank: torch 2.13's single-rank path then divides twice.
            if expert_mesh["edp"].size() > 1:
                unit.set_force_sum_reduction_for_comms(True)
    unit_list = units_without_outside_users(model, units)
    for i, name in enumerate(unit_list):
        modules[name].register_forward_hook(_outputs_in_own_storage)  # before fully_shard's: runs first
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        fully_shard(
            modules[name],
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward and i < len(unit_list) - 1,
            shard_placement_fn=chosen,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy, shard_placement_fn=chosen)
    return model


# models whose FSDP shards (parameters, gradients, optimizer state) live in host memory
_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def offloaded(model: nn.Module) -> None:
    """Note that ``model``'s FSDP shards live in host memory (``materialize`` allocates them there)."""
    _OFFLOADED.add(model)


def params_on_host(model: nn.Module) -> bool:
    """Whether ``parallelize(cpu_offload=True)`` put the model's sharded parameters, their
    gradients and so the optimizer's state in host memory (FSDP2's ``CPUOffloadPolicy``: each
    unit's shards copied to the device for its all-gather, gradients copied back after the
    reduce-scatter, the optimizer stepping on the host)."""
    return model in _OFFLOADED


def parallelize(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    activation_checkpointing: bool | None = None,
    lora: LoraSpec | None = None,
) -> nn.Module:
    """TP/SP from the compiled plan, then activation checkpointing on the plan's targets,
    then FSDP2 ``fully_shard`` on the plan's units and the root. Works on a meta-device model
    (materialize it afterwards with ``plancc.materialize``).

    ``mesh``: the ``ParallelMesh`` of ``plancc.build_mesh``, which says the layout -- sequence
    parallelism and expert parallelism included.
    Expert parallelism borrows ranks from dp (``plancc.layout`` explains): the plan's
    ``moe_experts`` spread over ep*tp ranks with all-to-all token exchange.
    ``activation_checkpointing``: None follows the plan, False disables, True requires the
    plan to name targets. ``lora``: low-rank adapters on its targets, laid out with each base
    layer's style (``runtime.lora``); the base frozen.
    """
    pm = require_parallel_mesh(mesh, "plancc.parallelize")
    resolved = resolve_plan(plan, model, sequence_parallel=pm.sequence_parallel)
    failures.remember(model, resolved)
    expert_mesh = pm.expert_mesh
    experts = apply_tensor_parallel(model, resolved, pm["tp"], expert_mesh=expert_mesh)
    if expert_mesh is not None and not experts:
        raise PlanError(
            [
                Diagnostic(
                    rule="expert-parallel",
                    loc=plan.loc,
                    message=f"ep={pm.ep} but the plan spreads no experts (no 'moe_experts' rule matched this model)",
                    fix="drop --ep, or give the model's experts modules the 'moe_experts' style",
                )
            ]
        )
    if lora is not None:  # after the tp styles (they shard the base), before FSDP (it shards both)
        add_adapters(model, lora, resolved, pm["tp"])
    if pm["cp"].size() > 1:
        cp = enable_context_parallel(model, pm["cp"])
        enable_mixer_context_parallel(model, cp)
        select_keys_over_the_sequence(model, cp)
    if activation_checkpointing is not False:
        if activation_checkpointing and not resolved.activation_checkpointing:
            raise PlanError(
                [
                    Diagnostic(
                        rule="activation-checkpointing",
                        loc=plan.loc,
                        message="activation checkpointing was requested but the plan names no targets",
                        fix="add 'activation_checkpointing: [model.layers.*]' to the plan",
                    )
                ]
            )
        apply_activation_checkpointing(model, resolved.activation_checkpointing, resolved.checkpoint_saves)
    compile_blocks(model, plan.compile)  # after TP and checkpointing, before FSDP (torchtitan's order)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pinned host memory where there is a GPU to copy from (torchtitan pins too): its copies then
    # run without a staging buffer and overlap compute; a CPU-only host has nothing to pin for
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if cpu_offload:
        offloaded(model)
    return apply_fsdp(
        model,
        resolved.fsdp_units,
        pm.fsdp,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=plan.fsdp_reshard_after_forward,
        experts=experts,
        expert_mesh=expert_mesh,
        gradient_divide_factor=fsdp_divisor(pm.layout),
        shard_dims=resolved.fsdp_shard_dims,
    )
