"""Context parallelism for linear-attention and state-space layers: heads over the cp ranks.

A gated delta net (Qwen3-Next, Qwen3.5, OLMo hybrid), Kimi's delta attention, a Mamba2 mixer
(Nemotron-H, Granite hybrid, Bamba, Falcon-H1, Zamba2) or a Mamba mixer (Jamba, Falcon-Mamba)
mixes positions only inside two kinds of kernel: a depthwise causal convolution over the
sequence and a recurrent scan, both independent per channel / head. Everything around them
works token by token. So under cp the layer keeps its projections on the rank's sequence shard
and, around each kernel call, trades the shard of every head for the whole sequence of a
block of heads (Megatron's ``mamba_context_parallel``: one all-to-all in, one out, the
head-tail load balancing undone before the kernel and re-applied after). Each rank runs the
kernel on ``heads / cp`` heads over the whole sequence: exact, no work repeated, and the
kernels (torch's here, a fused one where transformers loads it) are the model's own.

transformers 5.23 calls these kernels by name from each model's module (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``,
``mamba_selective_scan``). ``enable_mixer_context_parallel`` wraps those names in the modules
of the model's mixers; a wrapper reshards only while a cp mixer is running (a forward hook
sets it), so an unsharded model of the same family in the same process runs untouched.
``mamba2_split_conv1d_scan_combined`` (the fused whole-layer kernel) is refused under cp: the
layer falls back to the two kernels above. MiniMax's lightning attention keeps its recurrence
in its own code: under cp its instances run the same code on a block of heads
(``_lightning_forward``). The plan's checks make sure the heads divide
(``checks.context_parallel``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..sequence_mixing import CP_KERNELS, cp_kernels, is_lightning_attention
from .cp_context import (
    CPContext,
    all_gather,
    shard,
    shard_packed,
    unshard,
    unshard_packed,
)
from .hooks import call_arguments
from .local_tensors import local_tensor

_ACTIVE: ContextVar[CPContext | None] = ContextVar("plancc_cp_mixer", default=None)


# --------------------------------------------------------------------------- the all-to-alls
def _documents(ctx: CPContext) -> list[int] | None:
    return ctx.batch.bounds if ctx.batch is not None else None


def _to_heads(x: torch.Tensor, ctx: CPContext, seq_dim: int, head_dim: int) -> torch.Tensor:
    """[.. S/cp (seq_dim) .. H (head_dim) ..] -> [.. S .. H/cp ..], the sequence in its order."""
    world, bounds = ctx.size, _documents(ctx)
    moved = x.movedim((seq_dim, head_dim), (0, 1))  # [s, H, rest]
    s, heads, rest = moved.shape[0], moved.shape[1], moved.shape[2:]
    send = moved.reshape(s, world, heads // world, *rest).transpose(0, 1).contiguous()
    received = torch.empty_like(send)  # received[i]: rank i's shard of the sequence, my heads
    dist.all_to_all_single(received, send, group=ctx.group)
    parts = list(received.unbind(0))
    full = unshard(parts, dim=0) if bounds is None else unshard_packed(parts, bounds, dim=0)
    return full.movedim((0, 1), (seq_dim, head_dim)).contiguous()  # the kernels view their inputs


def _to_sequence(x: torch.Tensor, ctx: CPContext, seq_dim: int, head_dim: int) -> torch.Tensor:
    """The inverse of ``_to_heads``: [.. S .. H/cp ..] -> [.. S/cp .. H ..]."""
    world, bounds = ctx.size, _documents(ctx)
    moved = x.movedim((seq_dim, head_dim), (0, 1))  # [S, H/cp, rest]
    pieces = [
        shard(moved, world, r, dim=0) if bounds is None else shard_packed(moved, bounds, world, r, dim=0)
        for r in range(world)
    ]
    send = torch.stack(pieces).contiguous()  # send[i]: rank i's shard of the sequence, my heads
    received = torch.empty_like(send)  # received[i]: my shard of the sequence, rank i's heads
    dist.all_to_all_single(received, send, group=ctx.group)
    s, rest = received.shape[1], received.shape[3:]
    local = received.transpose(0, 1).reshape(s, world * received.shape[2], *rest)
    return local.movedim((0, 1), (seq_dim, head_dim)).contiguous()  # the layer views the result


class _SequenceToHeads(torch.autograd.Function):
    """Autograd-aware: the two all-to-alls are each other's adjoint (both are permutations)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPContext, seq_dim: int, head_dim: int, inverse: bool) -> torch.Tensor:
        ctx.cp, ctx.dims, ctx.inverse = cp, (seq_dim, head_dim), inverse
        return (_to_sequence if inverse else _to_heads)(x, cp, seq_dim, head_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _to_heads if ctx.inverse else _to_sequence
        return back(grad.contiguous(), ctx.cp, *ctx.dims), None, None, None, None


def to_heads(x: torch.Tensor, ctx: CPContext, seq_dim: int, head_dim: int) -> torch.Tensor:
    result: torch.Tensor = _SequenceToHeads.apply(x, ctx, seq_dim, head_dim, False)
    return result


def to_sequence(x: torch.Tensor, ctx: CPContext, seq_dim: int, head_dim: int) -> torch.Tensor:
    result: torch.Tensor = _SequenceToHeads.apply(x, ctx, seq_dim, head_dim, True)
    return result


def _my_block(x: torch.Tensor | None, ctx: CPContext, dim: int = 0) -> torch.Tensor | None:
    """This rank's block of a per-head (per-channel) parameter."""
    if x is None:
        return None
    x = local_tensor(x)
    n = x.shape[dim] // ctx.size
    return x.narrow(dim, ctx.rank * n, n)


def _per_head(x: torch.Tensor, heads: int) -> tuple[torch.Tensor, bool]:
    """[B, S, H, ...] as it is, or [B, S, H * d] viewed as [B, S, H, d] (flattened heads)."""
    if x.dim() >= 4 or (x.dim() == 3 and x.shape[2] == heads):
        return x, False
    return x.unflatten(2, (heads, x.shape[2] // heads)), True


def _heads_in(x: torch.Tensor, ctx: CPContext, heads: int) -> torch.Tensor:
    viewed, flat = _per_head(x, heads)
    out = to_heads(viewed, ctx, 1, 2)
    return out.flatten(2) if flat else out


def _groups_in(x: torch.Tensor, ctx: CPContext, heads: int) -> torch.Tensor:
    """[B, S/cp, G, N] of G head groups -> the whole sequence of the groups this rank's heads read:
    a block of G/cp by all-to-all where cp divides G, else (cp a multiple of G) the one group, by
    an all-gather of the (small) group tensor."""
    groups = x.shape[2]
    if groups % ctx.size == 0:
        return to_heads(x, ctx, 1, 2)
    full = all_gather(x, ctx.group, dim=1, cu_seqlens=_documents(ctx))
    group = (ctx.rank * (heads // ctx.size)) // (heads // groups)
    return full.narrow(2, group, 1)


# --------------------------------------------------------------------------- the kernels under cp
def _conv(
    original: Callable[..., Any],
    ctx: CPContext,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> Any:
    """Depthwise causal conv over [B, C, S/cp]: a block of channels over the whole sequence."""
    x = to_heads(hidden_states, ctx, 2, 1)
    out = original(x, _my_block(weight, ctx), _my_block(bias, ctx), activation, **kwargs)
    return to_sequence(out, ctx, 2, 1)


def _delta_rule(
    original: Callable[..., Any],
    ctx: CPContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Gated delta rule (and Kimi's): q, k [B, S, Hk, d], v [B, S, Hv, d], g, beta per v head."""
    if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
        raise ValueError("a recurrent cache is not supported under context parallelism (training runs without one)")
    hv = value.shape[2]
    q, k = (to_heads(t, ctx, 1, 2) for t in (query, key))
    v = to_heads(value, ctx, 1, 2)
    out, state = original(q, k, v, _heads_in(g, ctx, hv), _heads_in(beta, ctx, hv), *args, **kwargs)
    return to_sequence(out, ctx, 1, 2), state


def _mamba2_scan(
    original: Callable[..., Any],
    ctx: CPContext,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Any:
    """Mamba2's chunked scan: x [B, S, H, P], dt [B, S, H], A/D/dt_bias [H], B/C [B, S, G, N]."""
    if initial_states is not None or return_final_states:
        raise ValueError("a recurrent cache is not supported under context parallelism (training runs without one)")
    heads = hidden_states.shape[2]
    out = original(
        to_heads(hidden_states, ctx, 1, 2),
        to_heads(dt, ctx, 1, 2),
        _my_block(A, ctx),
        _groups_in(B, ctx, heads),
        _groups_in(C, ctx, heads),
        chunk_size,
        D=_my_block(D, ctx),
        dt_bias=_my_block(dt_bias, ctx),
        initial_states=None,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        return_final_states=False,
        **kwargs,
    )
    return to_sequence(out, ctx, 1, 2)


def _mamba_scan(
    original: Callable[..., Any],
    ctx: CPContext,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> Any:
    """Mamba's selective scan: x, dt, z [B, D, S] per channel, A [D, N], B/C [B, N, S] shared."""
    if return_last_state:
        raise ValueError("a recurrent cache is not supported under context parallelism (training runs without one)")
    documents = _documents(ctx)
    out = original(
        to_heads(hidden_states, ctx, 2, 1),
        to_heads(dt, ctx, 2, 1),
        _my_block(A, ctx),
        all_gather(B, ctx.group, dim=2, cu_seqlens=documents),
        all_gather(C, ctx.group, dim=2, cu_seqlens=documents),
        D=_my_block(D, ctx),
        z=None if z is None else to_heads(z, ctx, 2, 1),
        delta_bias=_my_block(delta_bias, ctx),
        delta_softplus=delta_softplus,
        return_last_state=False,
        **kwargs,
    )
    return to_sequence(out, ctx, 2, 1)


def _fused_layer(original: Callable[..., Any], ctx: CPContext, *args: Any, **kwargs: Any) -> None:
    return None  # the whole-layer kernel would scan the shard alone: take the layer's two-kernel path


_UNDER_CP: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _delta_rule,
    "chunk_kimi_delta_attention": _delta_rule,
    "mamba2_chunk_scan": _mamba2_scan,
    "mamba_selective_scan": _mamba_scan,
    "mamba2_split_conv1d_scan_combined": _fused_layer,
}
assert set(_UNDER_CP) == set(CP_KERNELS), "every kernel the checks accept has its cp form"


def _wrap(original: Callable[..., Any], under_cp: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        ctx = _ACTIVE.get()
        if ctx is None:
            return original(*args, **kwargs)
        return under_cp(original, ctx, *args, **kwargs)

    kernel.__dict__["_plancc_cp_original"] = original
    return kernel


def _install(module_name: str, names: tuple[str, ...]) -> None:
    namespace = sys.modules[module_name].__dict__
    for name in names:
        current = namespace.get(name)
        if current is not None and "_plancc_cp_original" not in getattr(current, "__dict__", {}):
            namespace[name] = _wrap(current, _UNDER_CP[name])


# --------------------------------------------------------------------------- lightning attention
def _lightning_forward(
    module: Any,
    ctx: CPContext,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """MiniMax's lightning attention (transformers 5.23's training path, no cache) on this rank's
    block of heads over the whole sequence: the same blocks of ``block_size`` positions, the same
    per-head decays (sliced to the block), the projections and the norm on the local tokens."""
    if past_key_values is not None:
        raise ValueError("a recurrent cache is not supported under context parallelism (training runs without one)")
    batch, local, _ = hidden_states.shape
    heads, dim, world = module.num_attention_heads, module.head_dim, ctx.size
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    if attention_mask is not None and attention_mask.dim() == 2 and batch > 1:  # padding, as the layer zeroes it
        qkv = qkv * attention_mask[:, :, None].to(qkv.dtype)
    qkv = to_heads(qkv.reshape(batch, local, heads, 3 * dim), ctx, 1, 2)  # [B, S, H/cp, 3d]
    query, key, value = (t.transpose(1, 2) for t in torch.split(qkv, dim, dim=3))
    mine = slice(ctx.rank * heads // world, (ctx.rank + 1) * heads // world)
    slope, query_decay, key_decay = module.slope_rate[mine], module.query_decay[mine], module.key_decay[mine]
    diagonal_decay = module.diagonal_decay[:, mine]
    seq, size = query.shape[2], module.block_size
    state = query.new_zeros((batch, query.shape[1], dim, dim))
    parts = []
    for start in range(0, seq, size):
        end = min(start + size, seq)
        n = end - start
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal_decay[:, :, :n, :n], v)
        inter = torch.matmul(q * query_decay[:, :n], state)
        parts.append(inter + intra)
        state = state * torch.exp(-slope * n) + torch.matmul((k * key_decay[:, -n:]).transpose(-1, -2), v)
    out = to_sequence(torch.cat(parts, dim=-2).transpose(1, 2), ctx, 1, 2)  # [B, S/cp, H, d]
    out = module.norm(out.reshape(batch, local, heads * dim))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None


# --------------------------------------------------------------------------- the mixer's hooks
class _Running:
    """Pre- and post-hook of a cp mixer: the kernels reshard while it runs. The pre-hook also
    hands the layer its rows' padding for its local tokens (the cp input hook dropped the mask):
    the mixers zero padded positions before they enter the recurrence."""

    def __init__(self, module: nn.Module, ctx: CPContext) -> None:
        self.ctx = ctx
        self.signature = inspect.signature(module.forward)
        self.tokens: list[Any] = []

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.tokens.append(_ACTIVE.set(self.ctx))
        if self.ctx.batch is None or "attention_mask" not in self.signature.parameters:
            return None
        padding = self.ctx.local_padding()
        if padding is None:
            return None
        values = call_arguments(self.signature, args, kwargs)
        values["attention_mask"] = padding
        return (), values

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        _ACTIVE.reset(self.tokens.pop())


def enable_mixer_context_parallel(model: nn.Module, ctx: CPContext) -> int:
    """Make the model's linear-attention / state-space mixers context-parallel; returns how many."""
    count = 0
    for module in model.modules():
        names = cp_kernels(module)
        lightning = is_lightning_attention(module)
        if not names and not lightning:
            continue
        _install(type(module).__module__, names)
        running = _Running(module, ctx)
        module.register_forward_pre_hook(running.before, with_kwargs=True)
        module.register_forward_hook(running.after, with_kwargs=True, always_call=True)
        if lightning:  # its recurrence is its own code: the instance runs the head-block version
            module.forward = functools.partial(_lightning_forward, module, ctx)
        count += 1
    return count
