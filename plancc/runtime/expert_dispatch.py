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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from .local_tensors import local_tensor
from .styles.experts import (
    ExpertArguments,
    local_parameters_during_forward,
    shard_experts,
    sum_gradients_over,
    sum_over,
)


class ExpertParallel(ParallelStyle):
    """``moe_experts`` over a 2-D (ep, tp) mesh: the plan's experts style when ``--ep`` spreads
    them over ep as well as tp. torchtitan's ``ExpertParallel`` shape: a pre-forward hook
    dispatches the tokens (all-to-all), the experts run on what arrived, a forward hook combines
    the rows at home. What the combine needs from the dispatch (the routing order, the split
    sizes) is kept per call on a stack, as activation checkpointing re-enters the forward."""

    def __init__(self, *, src_data_rank: int | None = 0):
        self.src_data_rank = src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ep_mesh, tp_mesh = device_mesh["ep"], device_mesh["tp"]
        local, first = shard_experts(module, device_mesh, src_data_rank=self.src_data_rank)
        route = _Routing(ExpertArguments.of(module), ep_mesh, tp_mesh, local, first)
        module.register_forward_pre_hook(route.dispatch, with_kwargs=True)
        local_parameters_during_forward(module)
        module.register_forward_hook(route.combine, always_call=True)
        return module


@dataclass(frozen=True)
class _Dispatched:
    """One call's routing, from the dispatch to the combine."""

    shape: torch.Size  # the hidden states as given
    hidden: torch.Tensor  # one row per token
    token: torch.Tensor  # the token of each sent (token, choice) pair, in send order
    weights: torch.Tensor  # the routing weight of each sent pair, applied at home
    send: list[int]
    receive: list[int]


class _Routing:
    def __init__(
        self, arguments: ExpertArguments, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh, local: int, first: int
    ) -> None:
        self.arguments = arguments
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.tp_mesh = tp_mesh
        self.local = local  # experts on this rank
        self.first = first  # global id of the first
        self.per_ep_rank = local * tp_mesh.size()
        self.calls: list[_Dispatched] = []

    def dispatch(self, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Send each (token, choice) pair to the ep rank holding its expert."""
        bound = self.arguments.bind(args, kwargs)
        hidden, ids, weights = (local_tensor(x) for x in self.arguments.read(bound))
        shape = hidden.shape
        hidden = hidden.reshape(-1, shape[-1])  # one row per token
        choices = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        destination = torch.div(flat_ids, self.per_ep_rank, rounding_mode="floor")
        order = torch.argsort(destination, stable=True)  # (token, choice) pairs by ep rank
        send, receive = _exchange_counts(destination, self.ep, self.group)
        token = torch.div(order, choices, rounding_mode="floor")
        arrived = _all_to_all(hidden[token], receive, send, self.group)
        arrived_ids = _all_to_all(flat_ids[order], receive, send, self.group) - self.first
        self.calls.append(_Dispatched(shape, hidden, token, weights.reshape(-1)[order], send, receive))
        # one expert per arrived row, weight 1 (applied at home); the other tp ranks' experts:
        # transformers' sentinel, skipped
        elsewhere = (arrived_ids < 0) | (arrived_ids >= self.local)
        ids_in = arrived_ids.masked_fill(elsewhere, self.local).unsqueeze(1)
        weights_in = (~elsewhere).to(arrived.dtype).unsqueeze(1)
        hidden_in = sum_gradients_over(arrived, self.tp_mesh) if self.tp_mesh.size() > 1 else arrived
        return self.arguments.write(bound, hidden_in, ids_in, weights_in)

    def combine(self, _module: nn.Module, _args: Any, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Bring the expert outputs home, weight them and sum each token's choices."""
        if not self.calls:  # the dispatch itself failed
            return rows
        call = self.calls.pop()
        if rows is None:  # the experts' forward raised; the exception goes on
            return rows
        rows = sum_over(rows, self.tp_mesh) if self.tp_mesh.size() > 1 else rows
        returned = _all_to_all(rows, call.send, call.receive, self.group)
        weighted = returned * call.weights.unsqueeze(1)
        out = torch.zeros_like(call.hidden).index_add(0, call.token, weighted.to(call.hidden.dtype))
        return out if out.shape == call.shape else out.reshape(call.shape)  # a view only when it must be


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
