"""fp32 master weights whatever the checkpoint's dtype: every real preset and Hugging Face folder
says ``dtype: bfloat16``, and transformers builds in it when not told otherwise. The model a
``Policy`` trains, its AdamW state and its checkpoints are fp32; compute in bf16 is FSDP2's mixed
precision (``param_dtype``); an export writes the config's dtype again (a bf16 folder in, a bf16
folder out)."""

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from plancc.models import load_config

from .conftest import PLANS


def bf16_qwen3():
    """qwen3-0.6b's published config (``dtype: bfloat16``), shrunk to a tiny size."""
    config = load_config("qwen3-0.6b")
    assert config.dtype == torch.bfloat16, "the published preset is bf16: the case this file pins"
    for field, value in {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "layer_types": ["full_attention"],
    }.items():
        setattr(config, field, value)
    return config


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _batch(vocab, rows=2, seq=12):
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _nll(lp, mb, norm):
    mask = mb["attention_mask"].clone()
    mask[:, 0] = 0
    return -(lp * mask).sum() / norm.tokens


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA where a GPU is (docs/gpu.md)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
def test_a_bf16_config_trains_fp32_masters_and_fp32_adamw_state(one_rank, tmp_path, param_dtype, device):
    from plancc import Policy

    config = bf16_qwen3()
    policy = Policy(
        PLANS / "qwen3.yaml",
        config,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}},
        param_dtype=param_dtype,
        device=device,
    )
    assert {_local(p).dtype for p in policy.model.parameters()} == {torch.float32}
    assert policy.config.dtype == torch.bfloat16, "the user's config keeps its dtype (the export writes it)"
    before = [_local(p).detach().clone() for p in policy.model.parameters()]

    policy.train(_batch(config.vocab_size), _nll)

    state = [t for s in policy.optimizer.state.values() for t in s.values() if t.is_floating_point() and t.dim()]
    assert state and {_local(t).dtype for t in state} == {torch.float32}
    after = [_local(p).detach() for p in policy.model.parameters()]
    changed = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
    total = sum(b.numel() for b in before)
    # AdamW's first step moves every weight with a gradient by ~lr: in bf16 (8 bits of mantissa)
    # a step of 1e-6 on weights of scale 0.02 rounds away for almost all of them
    assert changed / total > 0.9, (changed, total)

    policy.export_hf(tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118


@pytest.mark.timeout(240)
def test_an_export_is_written_shard_by_shard_and_loads_as_the_one_file_export(one_rank, tmp_path):
    """Rank 0 holds one shard at a time (engine.export): a small shard size gives transformers'
    sharded layout (model-0000i-of-0000n.safetensors and the index), which loads as the same
    model as the one-file export, in the config's dtype."""
    from transformers import AutoModelForCausalLM

    from plancc import Policy
    from plancc.weights import export_hf

    policy = Policy(PLANS / "qwen3.yaml", bf16_qwen3(), device="cpu")
    export_hf(policy.model, policy.config, tmp_path / "one")
    export_hf(policy.model, policy.config, tmp_path / "sharded", shard_bytes=16 * 1024)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    one = AutoModelForCausalLM.from_pretrained(tmp_path / "one").state_dict()
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").state_dict()
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)
    assert {v.dtype for v in one.values() if v.is_floating_point()} == {torch.bfloat16}
