"""The receiver's entry point of a refit: ``plancc.receive_weights``, whole tensors bucket by
bucket (``channel.receive_buckets``) or, given the receiver's own plan and tensor-parallel size,
only this rank's shard of each weight (``reshard.receive_shards``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from ..compiler.plan import Plan, load_plan
from ..models import build_model
from ..runtime.mesh import build_mesh
from ..runtime.parallelize import parallelize
from .channel import (
    WeightChannel,
    WeightChannelError,
    check_manifest,
    digest,
    handshake,
    manifest_dtype,
    receive_buckets,
)
from .reshard import receive_shards


def receive_weights(
    channel: WeightChannel,
    manifest: Mapping[str, Any],
    *,
    plan: str | Path | Plan | None = None,
    tp: int = 1,
    stats: dict[str, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side of ``policy.send_weights``: ``(name, tensor)`` of every weight.

    Without ``plan``: Hugging Face names and whole tensors, one bucket in flight (views into one
    reused buffer, valid until the next bucket). With ``plan`` and ``tp``: the receivers are a
    job of their own (their default process group: ``tp`` ranks per model replica) holding the
    model at that layout; each rank gets the model's parameter names and only its local shard
    of each, sent straight from the policy ranks that hold those elements
    (``policy.send_weights(channel, reshard=True)``: every policy rank joins the channel, as
    ranks 0..P-1, the receivers after them). ``stats["bytes"]`` counts what arrived."""
    if plan is None:
        yield from receive_buckets(channel, manifest)
        return
    check_manifest(manifest)
    config = dict(manifest.get("config") or {})
    if "model_type" not in config:
        raise WeightChannelError("the manifest carries no model config: send it from a plancc Policy")
    # the receiver's layout, built once per (manifest, plan, tp) on this channel: a later refit
    # of the same weights reads its shards' boxes from the same meta model
    key = (digest(manifest), str(plan) if not isinstance(plan, Plan) else plan.text or plan.name, tp)
    model = channel.receiver_layouts.get(key)
    if model is None:
        model = build_model(AutoConfig.for_model(config.pop("model_type"), **config), device="meta")
        parallelize(model, plan if isinstance(plan, Plan) else load_plan(str(plan)), build_mesh(tp=tp))
        channel.receiver_layouts = {key: model}  # one layout kept: the channel's current one
    handshake(channel, manifest)
    receivers = torch.distributed.get_world_size()
    policy_world, dtype = channel.world_size - receivers, manifest_dtype(manifest)
    for name, shard, got in receive_shards(channel, model, policy_world=policy_world, dtype=dtype):
        if stats is not None:
            stats["bytes"] = stats.get("bytes", 0) + got
        yield name, shard
