"""A parallelized model from a plan, a model name and a mesh: built on meta, parallelized,
then filled -- from a Hugging Face folder's safetensors, or with the seeded initial weights an
unsharded model built with the same seed has (every rank builds that full model on the CPU and
keeps its shards: right for presets and tests; real models come from a folder)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import PretrainedConfig

from ..checks.compiled_blocks import with_lora
from ..compiler.plan import Plan
from ..errors import Diagnostic, PlanError, Severity, SourceLoc
from ..models import MASTER_DTYPE, build_model
from ..runtime.document_attention import enable_document_attention
from ..runtime.hf_weights import has_safetensors, load_hf_weights
from ..runtime.lora import LoraSpec, adapters_of, base_shapes, initial_adapter_state
from ..runtime.materialize import materialize
from ..runtime.mesh import ParallelMesh
from ..runtime.non_finite import first_non_finite
from ..runtime.parallelize import parallelize


def from_folder(model: str | None) -> bool:
    return bool(model) and Path(str(model)).is_dir() and has_safetensors(str(model))


def seeded_model(config: PretrainedConfig, seed: int) -> nn.Module:
    """The full model with ``seed``'s initial weights, built on the CPU so that a seed means the
    same weights on every device: what a ``Policy`` without a model folder starts from, and the
    unsharded reference it is verified against."""
    torch.manual_seed(seed)
    # fp32 whatever the config's dtype (a seed means the same masters as a Policy's); a copy,
    # since transformers writes the dtype it built with into the config
    return build_model(copy.deepcopy(config), device="cpu", dtype=MASTER_DTYPE)


def load_weights(model: nn.Module, source: str | None, config: PretrainedConfig, device: str, seed: int) -> str:
    """Fill a parallelized meta model; returns where its weights came from. LoRA adapters
    start from their seeded initialization either way (``runtime.lora.initial_adapter_state``)."""
    adapters = adapters_of(model)
    initial = {} if adapters is None else initial_adapter_state(adapters, base_shapes(model, adapters), seed)
    if source is not None and from_folder(source):
        materialize(model, device)
        load_hf_weights(model, str(source))
        if initial:
            set_model_state_dict(
                model,
                {k: v.to(device) for k, v in initial.items()},
                options=StateDictOptions(full_state_dict=True, strict=False),
            )
        return f"safetensors from {source}"
    full = seeded_model(config, seed)
    state = {k: v.to(device) for k, v in full.state_dict().items()}
    state.update({k: v.to(device) for k, v in initial.items()})
    del full
    materialize(model, device, full_state_dict=state)
    return f"random init (seed {seed})"


def non_finite_weight_warning(model: nn.Module, source: str | None, device: str) -> Diagnostic | None:
    """Collective: a warning naming the first tensor a model folder filled with NaN or inf
    (training or evaluating it gives NaN with exit 0 otherwise); None for seeded weights."""
    if source is None or not from_folder(source):
        return None
    bad = first_non_finite(model.state_dict().items(), device)
    if bad is None:
        return None
    return Diagnostic(
        rule="non-finite-weights",
        loc=SourceLoc(path=str(source)),
        severity=Severity.WARNING,
        message=f"tensor {bad!r} of the model folder holds NaN or inf: log-probs and losses will be NaN",
        fix="check the folder (a failed conversion or a diverged run saved it); export from a good checkpoint",
    )


def build_parallel_model(
    plan: Plan,
    source: str | None,
    config: PretrainedConfig,
    mesh: ParallelMesh,
    *,
    device: str,
    seed: int,
    param_dtype: torch.dtype | None = None,
    lora: LoraSpec | None = None,
    cpu_offload: bool = False,
) -> tuple[nn.Module, str]:
    """The model built on meta, parallelized with the plan and filled; (model, weight source)."""
    # its own config (cp changes it; so does building at another dtype); fp32 masters whatever
    # the config's dtype, the compute dtype is ``param_dtype`` (FSDP2's mixed precision)
    if lora is not None and plan.compile is not None:  # Policy(lora=...) gets the CLI's answer
        problem = with_lora(plan.compile.loc, "lora=")
        raise PlanError([Diagnostic(rule="compile", loc=problem.loc, message=problem.message, fix=problem.fix)])
    model = build_model(copy.deepcopy(config), device="meta", dtype=MASTER_DTYPE)
    parallelize(model, plan, mesh, param_dtype=param_dtype, lora=lora, cpu_offload=cpu_offload)
    # packed documents attend one at a time, no [T, T] mask (cp's attention does the same itself)
    enable_document_attention(model)
    return model, load_weights(model, source, config, device, seed)
