"""Expert parallelism: one layer's experts spread over an (ep, tp) mesh, tokens moved by all-to-all.

The ep ranks are data-parallel ranks (``plancc.layout`` says how ep borrows from dp): they
hold different tokens, so tokens move. Each (token, choice) pair goes by all-to-all to the ep
rank that holds its expert; there the tp ranks split that rank's experts the way the tp-only
``moe_experts`` style does (same tokens on every tp rank, partial outputs all-reduced); the
result rows come back by the reverse all-to-all. The routing weights are applied at home after
the return trip, so their gradient never travels, and both all-to-alls are differentiable
(the backward of one is the other), so each expert's gradient sums the tokens of all its ep
ranks -- which is why the experts' FSDP unit divides by all of dp (``runtime.parallelize``).

The counts are exchanged first (one small all-to-all per layer); a dry run, whose fake tensors
have no routing to count, assumes a balanced load.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh

from .styles.experts import (
    ExpertsOverTensorParallel,
    local_parameters,
    plain,
    shard_experts,
    sum_gradients_over,
    sum_over,
)


def spread_experts(module: nn.Module, style: ExpertsOverTensorParallel, ep_tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``module``'s experts over the 2-D (ep, tp) mesh and route its tokens to them."""
    ep_mesh, tp_mesh = ep_tp_mesh["ep"], ep_tp_mesh["tp"]
    ep, tp = ep_mesh.size(), tp_mesh.size()
    local, first = shard_experts(module, ep_tp_mesh, src_data_rank=style.src_data_rank)
    per_ep_rank = local * tp
    original = module.forward
    signature = inspect.signature(original)
    hidden_arg, index_arg, weight_arg = list(signature.parameters)[:3]
    group = ep_mesh.get_group()

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        hidden, ids, weights = (plain(given[a]) for a in (hidden_arg, index_arg, weight_arg))
        shape = hidden.shape
        hidden = hidden.reshape(-1, shape[-1])  # one row per token
        choices = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        destination = torch.div(flat_ids, per_ep_rank, rounding_mode="floor")
        order = torch.argsort(destination, stable=True)  # (token, choice) pairs by ep rank
        send, receive = _exchange_counts(destination, ep, group)
        token = torch.div(order, choices, rounding_mode="floor")
        arrived = _all_to_all(hidden[token], receive, send, group)
        arrived_ids = _all_to_all(flat_ids[order], receive, send, group) - first
        # one expert per arrived row, weight 1 (applied at home); the other tp ranks' experts:
        # transformers' sentinel, skipped
        elsewhere = (arrived_ids < 0) | (arrived_ids >= local)
        given[index_arg] = arrived_ids.masked_fill(elsewhere, local).unsqueeze(1)
        given[weight_arg] = (~elsewhere).to(arrived.dtype).unsqueeze(1)
        given[hidden_arg] = sum_gradients_over(arrived, tp_mesh) if tp > 1 else arrived
        with local_parameters(module):
            rows = original(*bound.args, **bound.kwargs)
        rows = sum_over(rows, tp_mesh) if tp > 1 else rows
        returned = _all_to_all(rows, send, receive, group)
        weighted = returned * weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))
        return out if out.shape == shape else out.reshape(shape)  # a view only when it must be

    module.forward = forward
    return module


def _exchange_counts(destination: torch.Tensor, ep: int, group: dist.ProcessGroup) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each ep rank, rows it receives from each)."""
    pairs = destination.numel()
    if isinstance(destination, FakeTensor):  # a dry run: balanced routing
        even = [pairs // ep + (1 if r < pairs % ep else 0) for r in range(ep)]
        return even, even
    send = torch.bincount(destination, minlength=ep)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    return send.tolist(), receive.tolist()


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Rows of ``x`` exchanged over ``group`` (``input_splits[r]`` rows to rank r); differentiable."""
    exchange = funcol.all_to_all_single_autograd if x.requires_grad else funcol.all_to_all_single
    return funcol.wait_tensor(exchange(x.contiguous(), output_splits, input_splits, group))
