"""The worker side of ``plancc_gloo``: weights over gloo, each worker receiving its own slices.

The trainer (rank 0 of a gloo group whose ranks ``1..N`` are vLLM's workers, every data-parallel
replica's tensor-parallel ranks in vLLM's worker order) sends each worker, weight by weight, the
slice of the checkpoint tensor that the worker's rank of vLLM's tensor parallelism loads: a row
range of a column-parallel weight (the query, key and value projections that vLLM fuses into
``qkv_proj``, the gate and up projections of ``gate_up_proj``), a column range of a row-parallel
one, the vocabulary range of the embedding and the head, the whole of a replicated norm. The
per-worker update info (vLLM hands each worker its own entry of a list) names every weight with
its checkpoint shape, its dtype and the slice ``[dim, start, length]`` (or none: the whole).

The slice is placed into a zero tensor of the checkpoint's shape and handed to the model's own
``load_weights``, which cuts the same range out of it (and fuses it): the wire carries the slice
only, vLLM's loaders stay the authority on layouts. ``start_weight_update`` and
``finish_weight_update`` run vLLM's layerwise reload (the CPU backend repacks weights after
loading; a plain ``load_weights`` after start-up fails there).

What a refit did is written to ``stats_dir/worker<rank>.json`` at its finish: the version, the
tensors and bytes received, the worker's shard in vLLM's layout, and the error that stopped it
(the server reads it to know whether the refit completed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

# Tag of the weight messages: one stream, in the update info's order.
TAG = 7


@dataclass
class ShardInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int  # the trainer + every vLLM worker
    timeout_s: float = 120.0
    stats_dir: str | None = None


@dataclass
class ShardUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]  # the checkpoint's (whole) shapes
    slices: list[list[int] | None] = field(default_factory=list)  # [dim, start, length] or None
    version: str | None = None

    def __post_init__(self) -> None:
        if not self.slices:
            self.slices = [None] * len(self.names)
        counts = {len(self.names), len(self.dtype_names), len(self.shapes), len(self.slices)}
        if len(counts) != 1:
            raise ValueError(f"names, dtype_names, shapes and slices differ in length: {sorted(counts)}")


def worker_rank(parallel_config: Any) -> int:
    """This worker's rank in the transfer group (rank 0 is the trainer)."""
    return 1 + parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def forget_cpu_moe_kernels(model: torch.nn.Module) -> int:
    """Make every CPU MoE layer process its reloaded experts as at start-up; returns how many.

    vLLM 0.32's unquantized MoE treats a layer whose kernel exists as a weight update and skips
    the experts' own ``process_weights_after_loading`` then. On the CPU that step pads the
    intermediate size and prepacks the experts into the grouped-gemm layout, so a reload without
    it serves raw weights to a kernel expecting packed ones: log-probs off by 2e-2 on a tiny
    Qwen3-MoE (and a shape error at tensor parallel 2, where padding applies). Without the kernel
    the layer's reload runs the first-load path, and the layerwise reload copies its packed
    result into the tensors the model already holds. The GPU kernels need no such step."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            method.moe_kernel = None
            count += 1
    return count


def tied_modules(model: torch.nn.Module) -> list[str]:
    """Modules whose weight is another module's (the head tied to the embedding): every owner of
    a shared parameter but its first, by name. Read while the model is as vLLM built it."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    return [module for names in owners.values() for module in names[1:]]


def reprocess(model: torch.nn.Module, modules: list[str]) -> None:
    """Run each module's own after-loading step again on the weights it shares.

    The reload loads a shared weight through its first owner only (vLLM's loader skips the tied
    head), so the other owners are not processed: on the CPU the head keeps the packed GEMM
    built from its previous weights (tied-embedding models sampled from the dummy weights)."""
    found = dict(model.named_modules())
    for name in modules:
        module = found.get(name)
        method = getattr(module, "quant_method", None)
        if module is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


class ShardEngine(WeightTransferEngine[ShardInitInfo, ShardUpdateInfo]):
    init_info_cls = ShardInitInfo
    update_info_cls = ShardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.rank = worker_rank(self.parallel_config)
        self.stats_dir: str | None = None
        self.received: dict[str, Any] = {"version": None, "tensors": 0, "bytes": 0, "error": None}
        self.shard_bytes = 0
        self.tied = tied_modules(model)

    def init_transfer_engine(self, init_info: ShardInitInfo) -> None:
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.host, init_info.port, init_info.world_size, False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("plancc_gloo", store), self.rank, init_info.world_size, timeout)
        self.stats_dir = init_info.stats_dir

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received = {"version": None, "tensors": 0, "bytes": 0, "error": None}
        initialize_layerwise_reload(self.model)
        forget_cpu_moe_kernels(self.model)
        # the worker's shard as vLLM lays it out to load (fused, its vocabulary range padded):
        # what it needs, counted by vLLM's own parameters rather than by the trainer's slices (a
        # tied weight once: the reload gives each owner a copy until it finishes)
        self.shard_bytes = sum(
            p.numel() * p.element_size()
            for name, p in self.model.named_parameters(remove_duplicate=False)
            if name.rpartition(".")[0] not in self.tied
        )

    def receive_weights(self, update_info: ShardUpdateInfo) -> None:
        """Every slice of the update, in order. A weight vLLM's loader refuses is kept as the
        refit's error and the rest are still received (and dropped): a worker that stopped
        reading would leave the trainer blocked in its send until the transfer's timeout."""
        if self.group is None:
            raise RuntimeError("plancc_gloo: init_weight_transfer_engine was not called")
        for name, dtype_name, shape, cut in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, update_info.slices, strict=True
        ):
            dtype = getattr(torch, dtype_name)
            size = list(shape) if cut is None else [cut[2] if d == cut[0] else n for d, n in enumerate(shape)]
            buffer = torch.empty(size, dtype=dtype)
            self.group.recv([buffer], 0, TAG).wait()
            self.received["tensors"] += 1
            self.received["bytes"] += buffer.numel() * buffer.element_size()
            if self.received["error"] is not None:
                continue
            try:
                if cut is None:
                    whole = buffer
                else:  # the slice in place in a checkpoint-shaped tensor: vLLM's loader cuts it out again
                    whole = torch.zeros(shape, dtype=dtype)
                    whole.narrow(cut[0], cut[1], cut[2]).copy_(buffer)
                self.model.load_weights([(name, whole.to(self.device))])
            except Exception as error:
                self.received["error"] = f"{name}: {type(error).__name__}: {error}"
        self.received["version"] = update_info.version

    # A worker never raises out of the update's phases: vLLM's multiprocess executor reads the
    # workers' replies in order and stops at the first failure, so a second failing worker's reply
    # would answer the next call (seen: a refit's error returned to the next init). A failure is
    # kept, written to the worker's stats, and the server reports the refit as failed part-way.
    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as error:  # the transfer itself (the trainer's group closed, a timeout)
            self.received["error"] = self.received["error"] or f"{type(error).__name__}: {error}"

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
            reprocess(self.model, self.tied)
        except Exception as error:
            self.received.setdefault("error", f"{type(error).__name__}: {error}")
        if self.stats_dir:
            path = os.path.join(self.stats_dir, f"worker{self.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({**self.received, "rank": self.rank, "shard_bytes": self.shard_bytes}, f)
            os.replace(path + ".tmp", path)

    def shutdown(self) -> None:
        self.group = None
