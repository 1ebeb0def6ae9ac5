"""The trainer's side of the vLLM rollout that runs without vLLM: which slice each vLLM worker
is sent, the model check before a refit, a missing environment. (vLLM itself: the rollout tier,
tests/test_rollout_vllm.py.)"""

from __future__ import annotations

import pytest

from plancc.engine.vllm_rollout import RolloutError, VLLMRollout, VLLMSpec, same_model, vllm_config, vllm_slice
from plancc.models import load_config


def _config(heads=8, kv=2):
    config = load_config("tiny-qwen3")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv, 64
    return config


def test_each_vllm_rank_is_sent_the_rows_columns_and_vocabulary_range_its_loader_takes():
    config = _config()
    # column-parallel: rows split evenly (q, gate, up); row-parallel: columns (o, down)
    assert vllm_slice("model.layers.0.self_attn.q_proj.weight", (512, 128), 1, 2, config) == [0, 256, 256]
    assert vllm_slice("model.layers.0.mlp.up_proj.weight", (384, 128), 1, 4, config) == [0, 96, 96]
    assert vllm_slice("model.layers.0.mlp.down_proj.weight", (128, 384), 2, 4, config) == [1, 192, 96]
    assert vllm_slice("model.layers.0.self_attn.o_proj.weight", (128, 512), 0, 2, config) == [1, 0, 256]
    # 2 key/value heads at tp=2: one each; at tp=4 each head is replicated on 2 ranks, as vLLM does
    assert vllm_slice("model.layers.0.self_attn.k_proj.weight", (128, 128), 1, 2, config) == [0, 64, 64]
    assert [vllm_slice("model.layers.0.self_attn.v_proj.weight", (128, 128), r, 4, config) for r in range(4)] == [
        [0, 0, 64],
        [0, 0, 64],
        [0, 64, 64],
        [0, 64, 64],
    ]
    # the vocabulary padded to 64 before the split: 250 -> 256, 128 a rank, the last range short
    assert vllm_slice("model.embed_tokens.weight", (250, 128), 1, 2, config) == [0, 128, 122]
    assert vllm_slice("lm_head.weight", (250, 128), 0, 2, config) == [0, 0, 128]
    # norms whole, and nothing is cut at tp=1
    assert vllm_slice("model.layers.0.self_attn.q_norm.weight", (64,), 1, 2, config) is None
    assert vllm_slice("model.layers.0.self_attn.q_proj.weight", (512, 128), 0, 1, config) is None


def test_experts_and_mla_projections_are_cut_as_vllms_moe_and_mla_loaders_take_them():
    config = _config()
    # each expert's (and a shared expert's) gate/up by rows and down by columns, as vLLM's fused
    # MoE shards every expert's intermediate size at tensor parallel 2
    assert vllm_slice("model.layers.1.mlp.experts.3.gate_proj.weight", (32, 128), 1, 2, config) == [0, 16, 16]
    assert vllm_slice("model.layers.1.mlp.experts.3.down_proj.weight", (128, 32), 1, 2, config) == [1, 16, 16]
    assert vllm_slice("model.layers.1.mlp.shared_experts.up_proj.weight", (32, 64), 0, 2, config) == [0, 0, 16]
    # Mixtral's names: w1 gate, w3 up, w2 down (a w1 outside the experts is not theirs)
    assert vllm_slice("model.layers.1.block_sparse_moe.experts.0.w3.weight", (128, 64), 1, 2, config) == [0, 64, 64]
    assert vllm_slice("model.layers.1.block_sparse_moe.experts.0.w2.weight", (64, 128), 1, 2, config) == [1, 64, 64]
    assert vllm_slice("model.layers.1.mlp.w1.weight", (128, 64), 1, 2, config) is None
    # MLA: the up-projections split by heads, the down-projections and the router whole
    assert vllm_slice("model.layers.0.self_attn.kv_b_proj.weight", (96, 512), 1, 2, config) == [0, 48, 48]
    assert vllm_slice("model.layers.0.self_attn.q_b_proj.weight", (288, 32), 0, 2, config) == [0, 0, 144]
    assert vllm_slice("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 64), 1, 2, config) is None
    assert vllm_slice("model.layers.1.mlp.gate.weight", (4, 64), 1, 2, config) is None


def test_vllm_is_told_deepseek_v3s_router_correction_that_the_pinned_transformers_no_longer_writes():
    config = load_config("tiny-deepseek-v3")
    assert "topk_method" not in config.to_dict()  # transformers' model always adds the correction
    written = vllm_config(config)
    assert written["topk_method"] == "noaux_tc" and "transformers_version" not in written
    assert "topk_method" not in vllm_config(_config())


def test_a_served_model_of_another_shape_is_named_by_its_first_difference():
    mine = _config()
    assert same_model(mine, mine.to_dict()) is None
    served = {**mine.to_dict(), "num_hidden_layers": mine.num_hidden_layers + 1}
    assert same_model(mine, served) == (
        f"num_hidden_layers: the policy has {mine.num_hidden_layers}, vLLM serves {mine.num_hidden_layers + 1}"
    )


def test_a_missing_vllm_environment_is_one_error_naming_the_setup_command(one_rank, tmp_path):
    with pytest.raises(RolloutError, match="no vLLM environment at .*scripts/vllm_env.sh"):
        VLLMRollout(VLLMSpec(python=str(tmp_path / "bin" / "python")), _config())
