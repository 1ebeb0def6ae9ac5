"""A parallelized model as a Hugging Face folder, written from the weights stream: ``export_hf``.

Rank 0 holds one shard at a time, never the model: each bucket of ``engine.streaming`` -- full
tensors gathered from the shards, in the checkpoint's names and layouts (tied weights once,
transformers' reverse conversions), cast to the dtype the config says (a bf16 folder in, a bf16
folder out; the fp32 masters are the run's, not the export's) -- becomes one safetensors shard,
written before the next is gathered. The peak host memory is a shard (and the one fp32 tensor
being cast) instead of a gathered full state dict plus a second full CPU model (~6 bytes per
parameter: ~420 GB for a 70B model). ``docs/export_memory.md`` has the figures.

The folder is written beside the target's files and moved into place file by file
(``runtime.hf_weights.publish_export``); failures of any rank are every rank's at once (the
gathers settle bucket by bucket, rank 0's file work ends in an agreement).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig

from ..errors import Diagnostic, PlanError, SourceLoc
from ..models import architecture_of
from ..runtime import faults
from ..runtime.hf_folder import check_export_target
from ..runtime.hf_weights import copy_companions, publish_export, refuse_non_finite_weights, write_adapter_config
from ..runtime.lora import adapters_of
from ..runtime.rank_agreement import group_device, on_rank0
from .refit_agreement import RefitAgreement
from .streaming import ValueOf, bucket_count, weight_buckets

# A shard of the export: what rank 0 holds at once (and safetensors' serialized copy of it).
# transformers' own default shard is far larger (it holds the whole model anyway).
SHARD_BYTES = 2 * 2**30


def export_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype the folder's weights are written in: the config's (fp32 when it says none)."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export_hf(
    model: nn.Module,
    config: PretrainedConfig,
    folder: str | Path,
    *,
    source: str | Path | None = None,
    adapters_only: bool = False,
    shard_bytes: int = SHARD_BYTES,
    values: ValueOf | None = None,
    held: nn.Module | None = None,
) -> None:
    """Collective: the model's full weights as a ``save_pretrained`` folder (rank 0 writes), with
    the tokenizer and generation files of ``source`` (the folder the model came from). A model
    with LoRA adapters is written merged; with ``adapters_only`` the folder is PEFT's
    (``adapter_model.safetensors`` and ``adapter_config.json``, what
    ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loader read).

    Nothing else in the target folder is touched: a user's notes, data or checkpoints there
    stay, and only a file an earlier export listed as its own, and this one does not write
    again, is removed. Refused when any weight is not finite. ``values`` and ``held``: a model
    that is structure only (a pipeline's whole model on meta), where each full tensor comes from
    (``streaming.weight_buckets``) and the module holding this rank's shards."""
    problems = check_export_target(folder, source)
    if problems:
        raise PlanError(problems)
    adapters = adapters_of(model)
    if adapters_only and adapters is None:
        raise ValueError("adapters_only=True, but this model has no LoRA adapters (construct it with lora=)")
    refuse_non_finite_weights(held or model, what=f"exporting to {folder}")
    target = Path(folder)
    dtype = None if adapters_only else export_dtype(config)
    count = bucket_count(model, bucket_bytes=shard_bytes, dtype=dtype, adapters_only=adapters_only)
    names = ["adapter_model.safetensors"] if adapters_only else shard_names(count)

    def failed(why: str) -> PlanError:
        return PlanError(
            [
                Diagnostic(
                    rule="export",
                    loc=SourceLoc(path=str(folder)),
                    message=f"exporting to {folder} failed: {why}; the folder's earlier files are as they were",
                    fix="free disk space or pass a writable --export-hf folder",
                )
            ]
        )

    partial = on_rank0(lambda: _partial_folder(target), fail=failed)
    try:
        written = _write_shards(model, partial, names, shard_bytes, dtype, adapters_only, failed, values)

        def finish() -> None:
            assert partial is not None, "rank 0 made the partial folder"
            if adapters_only:
                assert adapters is not None, "checked above"
                write_adapter_config(partial, adapters, config, source)
            else:
                _write_config(partial, config, dtype or torch.float32, written, names)
            copy_companions(source, partial)
            publish_export(partial, target)

        on_rank0(finish, fail=failed)
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)  # a folder of this export's own making


def shard_names(count: int) -> list[str]:
    """transformers' file names: one ``model.safetensors``, or ``model-0000i-of-0000n``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _partial_folder(target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for leftover in target.glob(".plancc-partial-*"):  # an export that died mid-way: its own folder
        shutil.rmtree(leftover, ignore_errors=True)
    faults.inject("export", rank=0)
    return Path(tempfile.mkdtemp(prefix=".plancc-partial-", dir=target))


def _write_shards(
    model: nn.Module,
    partial: Path | None,
    names: list[str],
    shard_bytes: int,
    dtype: torch.dtype | None,
    adapters_only: bool,
    failed: Any,
    values: ValueOf | None,
) -> dict[str, str]:
    """Collective: every rank gathers each bucket, rank 0 writes it as the next shard; a failure
    of rank 0's write or of any rank's gather is raised on every rank at the next settle.
    Returns ``{tensor name: shard file}`` (rank 0; empty elsewhere)."""
    from safetensors.torch import save_file

    agreement = RefitAgreement(group_device(), unit="shard")
    where: dict[str, str] = {}
    stream = weight_buckets(
        model, bucket_bytes=shard_bytes, dtype=dtype, agreement=agreement, adapters_only=adapters_only, values=values
    )
    collected: dict[str, torch.Tensor] = {}  # adapters_only: one small file of every adapter
    for index, bucket in enumerate(stream):
        if partial is None or agreement.problem:  # not rank 0, or its writing failed: gather on
            continue
        try:
            tensors = {name: value.contiguous() for name, value in bucket}
            del bucket
            if adapters_only:
                collected.update(tensors)
                continue
            save_file(tensors, str(partial / names[index]), metadata={"format": "pt"})
            where.update(dict.fromkeys(tensors, names[index]))
        except Exception as exc:  # noted; every rank raises it at the next settle
            agreement.note(exc)
    if partial is not None and adapters_only and not agreement.problem:
        try:
            save_file(collected, str(partial / names[0]), metadata={"format": "pt"})
        except Exception as exc:
            agreement.note(exc)
    try:
        agreement.settle()
    except Exception as exc:
        raise failed(str(exc)) from None
    return where


def _write_config(
    partial: Path, config: PretrainedConfig, dtype: torch.dtype, where: dict[str, str], names: list[str]
) -> None:
    """config.json (the config's dtype, the architecture), generation_config.json as
    ``save_pretrained`` derives it, and the shards' index when there are several."""
    saved = copy.deepcopy(config)
    saved.dtype = dtype
    saved.architectures = [architecture_of(config)]
    saved.save_pretrained(str(partial))
    generation = GenerationConfig.from_model_config(saved)
    generation.save_pretrained(str(partial))
    if len(names) > 1:
        total = sum((partial / name).stat().st_size for name in names)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


__all__ = ["SHARD_BYTES", "export_dtype", "export_hf", "shard_names"]
