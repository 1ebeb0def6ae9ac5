"""plancc's own small torch styles: leave whole, rotary under sequence parallelism."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor
from torch.distributed.tensor.parallel import ParallelStyle


class LeaveWhole(ParallelStyle):
    """Explicitly keeps a module's parameters whole on every TP rank (no communication).

    Naming a module ``replicate`` documents a decision (e.g. Gemma3's tied embedding) and
    still lets the glob check catch typos, which silently omitting it would not.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class RotaryUnderSequenceParallel(ParallelStyle):
    """Rotary embeddings under sequence parallelism (their inputs are a tuple).

    transformers calls ``rotary_emb(hidden_states, position_ids[, layer_type])``; the hidden
    states only supply dtype/device, the position ids decide the result. Under SP the hidden
    states are a local sequence shard, and when ``position_ids`` is not passed HF derives it
    from that shard's length: every rank would rotate as if its shard started at position 0.
    This style hands the module plain tensors and refuses shard-length position ids loudly
    instead of computing wrong cos/sin. ``plancc.parallelize`` passes global position ids.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()

        def to_local(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
            kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
            hidden = args[0] if args else kwargs.get("x")
            positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
            if (
                tp > 1
                and isinstance(hidden, torch.Tensor)
                and isinstance(positions, torch.Tensor)
                and hidden.dim() >= 2
                and positions.shape[-1] == hidden.shape[1]
            ):
                raise RuntimeError(
                    "rotary_sp: position_ids have the length of the local sequence shard "
                    f"({positions.shape[-1]}), so transformers derived them from the shard; pass "
                    "global position_ids to the model (plancc.parallelize does this for you)"
                )
            return args, kwargs

        def local_outputs(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if isinstance(output, tuple):
                return type(output)(o.to_local() if isinstance(o, DTensor) else o for o in output)
            return output.to_local() if isinstance(output, DTensor) else output

        module.register_forward_pre_hook(lambda mod, a, kw: to_local(a, kw), with_kwargs=True)
        module.register_forward_hook(local_outputs, with_kwargs=True)
        return module
