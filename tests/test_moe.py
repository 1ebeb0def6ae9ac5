"""Mixtures of experts and multi-head latent attention before any process starts: transformers' MoE plans import as plancc's
``moe_experts``, the shipped MoE plans validate on the published configs, and the mistakes a
user makes with them (an expert count tp does not divide, an MoE plan on a dense model, the
experts style on a module that is not transformers' routed experts) are diagnostics at the
plan's line with a fix. The numerics (sharded == unsharded, router and experts gradients
included) are in test_numerics.py."""

import json

import pytest
from transformers import AutoConfig

import plancc
from plancc.checks import check_plan
from plancc.errors import PlanError
from plancc.tools.import_hf import import_hf

from .conftest import PLANS

# plan -> (published config, tp); Qwen3-30B-A3B has 4 KV heads
MOE_PLANS = {
    "qwen3_moe.yaml": ("qwen3-30b-a3b", 4),
    "mixtral.yaml": ("mixtral-8x7b", 8),
    "deepseek_v3.yaml": ("deepseek-v3", 8),
    "gpt_oss.yaml": ("gpt-oss-120b", 8),
}


def _errors(diags, rule=None):
    return [d for d in diags if d.is_error and (rule is None or d.rule == rule)]


def _tiny_folder(folder, model_type, **extra):
    config = AutoConfig.for_model(
        model_type, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, **extra,
    )
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("plan,preset_tp", MOE_PLANS.items())
def test_the_shipped_moe_plans_validate_on_the_published_configs(plan, preset_tp):
    preset, tp = preset_tp
    found = check_plan(plancc.load_plan(PLANS / plan), preset, tp=tp)
    assert not _errors(found), [d.message for d in found]
    assert not [d for d in found if d.rule == "sharded-region-params"]  # the wiring was traced


def test_import_hf_writes_one_experts_rule_for_hfs_packed_expert_weights(tmp_path):
    text = import_hf(_tiny_folder(tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32))
    assert "model.layers.*.mlp.experts: moe_experts" in text
    # HF's per-weight rules (packed_colwise gate_up_proj, rowwise down_proj) are the style's job
    assert "gate_up_proj" not in text and "experts.down_proj" not in text
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    assert not _errors(check_plan(plancc.load_plan(path), str(tmp_path), tp=2))


def test_import_hf_refuses_experts_that_take_pre_routed_tokens(tmp_path):
    folder = _tiny_folder(tmp_path, "llama4_text", num_local_experts=4, intermediate_size_mlp=128)
    with pytest.raises(PlanError) as err:
        import_hf(folder)
    (d,) = err.value.diagnostics
    assert d.rule == "unsupported-style" and "Llama4TextExperts" in d.message


def test_an_expert_count_tp_does_not_divide_is_an_error_at_the_experts_rule():
    plan = plancc.load_plan(PLANS / "qwen3_moe.yaml")
    found = _errors(check_plan(plan, "qwen3-30b-a3b", tp=3), "shape-divisible")
    (d,) = [d for d in found if "experts" in d.message]  # 128 of them
    assert "128 experts do not split over tp=3" in d.message
    assert d.loc.line == _line_of(PLANS / "qwen3_moe.yaml", "mlp.experts: moe_experts")
    assert "use tp in" in d.fix


def test_an_moe_plan_on_a_dense_model_names_the_experts_rule():
    found = _errors(check_plan(plancc.load_plan(PLANS / "qwen3_moe.yaml"), "qwen3-8b", tp=2), "glob-no-match")
    assert [d.loc.line for d in found] == [_line_of(PLANS / "qwen3_moe.yaml", "mlp.experts: moe_experts")]


def test_the_experts_style_on_a_dense_mlp_is_a_module_kind_error(write_plan):
    text = (PLANS / "qwen3.yaml").read_text().replace("model.layers.*.mlp.gate_proj: colwise",
                                                      "model.layers.*.mlp: moe_experts")
    text = text.replace("  model.layers.*.mlp.up_proj: colwise\n  model.layers.*.mlp.down_proj: rowwise\n", "")
    text = text.replace("  model.layers.*.mlp: shared_input\n", "")
    (d,) = _errors(check_plan(plancc.load_plan(write_plan(text)), "tiny-qwen3", tp=2), "style-module-kind")
    assert "'moe_experts' applies to experts modules" in d.message


def test_import_hf_gives_mla_kv_a_proj_the_configs_rotary_width(tmp_path):
    folder = _tiny_folder(tmp_path, "minicpm3", qk_rope_head_dim=8, qk_nope_head_dim=8, q_lora_rank=32,
                          kv_lora_rank=16, v_head_dim=16)
    plan = plancc.load_plan(_written(tmp_path, import_hf(folder)))
    (rule,) = [r for r in plan.tensor_parallel if r.style.name == "mla_kv_a_proj"]
    assert dict(rule.style.overrides) == {"rope_dim": 8}
    assert not _errors(check_plan(plan, folder, tp=2))


def test_a_rotary_width_other_than_the_configs_is_an_error_with_the_right_one():
    plan = plancc.load_plan(PLANS / "deepseek_v3.yaml")  # rope_dim: 64, DeepSeek-V3's
    assert not _errors(check_plan(plan, "deepseek-v3", tp=8), "mla-rope-dim")
    (d,) = _errors(check_plan(plan, _config_with(qk_rope_head_dim=32), tp=8), "mla-rope-dim")
    assert "rope_dim 64, but the config's qk_rope_head_dim is 32" in d.message
    assert d.fix == "write '{style: mla_kv_a_proj, rope_dim: 32}'"
    assert d.loc.line == _line_of(PLANS / "deepseek_v3.yaml", "kv_a_proj_with_mqa: {style")


def _config_with(**fields):
    from plancc.models import load_config

    config = load_config("deepseek-v3")
    for key, value in fields.items():
        setattr(config, key, value)
    return config


def _written(folder, text):
    path = folder / "imported.yaml"
    path.write_text(text)
    return path


def _line_of(path, needle):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


# --- expert parallelism (--ep): ranks borrowed from dp, experts over ep x tp ---------------

def test_qwen3_30b_a3b_spreads_its_128_experts_over_ep_8_by_tp_4():
    found = check_plan(plancc.load_plan(PLANS / "qwen3_moe.yaml"), "qwen3-30b-a3b", tp=4, ep=8)
    assert not _errors(found), [d.message for d in found]


def test_an_ep_that_does_not_divide_the_expert_count_is_an_error_at_the_experts_rule():
    plan = plancc.load_plan(PLANS / "qwen3_moe.yaml")
    (d,) = _errors(check_plan(plan, "qwen3-30b-a3b", tp=4, ep=3), "expert-parallel")
    assert "128 experts do not split over ep=3 x tp=4" in d.message
    assert d.loc.line == _line_of(PLANS / "qwen3_moe.yaml", "mlp.experts: moe_experts")
    assert "--ep in {1, 2, 4, 8, 16, 32}" in d.fix


def test_an_ep_that_does_not_divide_dp_is_a_mesh_size_error_naming_the_eps_that_fit():
    plan = plancc.load_plan(PLANS / "qwen3_moe.yaml")
    (d,) = _errors(check_plan(plan, "qwen3-30b-a3b", tp=4, ep=8, world_size=16), "mesh-sizes")
    assert "ep=8 does not divide dp=4" in d.message and "[1, 2, 4]" in d.fix


def test_ep_with_context_parallelism_is_refused_by_name():
    (d,) = _errors(check_plan(plancc.load_plan(PLANS / "qwen3_moe.yaml"), "qwen3-30b-a3b", tp=4, cp=2, ep=2,
                              world_size=16), "mesh-sizes")
    assert "expert parallelism with context parallelism is not supported" in d.message


def test_ep_on_a_dense_model_is_an_error_not_a_silent_no_op():
    (d,) = _errors(check_plan(plancc.load_plan(PLANS / "qwen3.yaml"), "qwen3-8b", ep=2), "expert-parallel")
    assert "no module has the 'moe_experts' style" in d.message and "drop --ep" in d.fix


def test_validate_dry_run_at_tp_4_ep_8_prints_per_rank_bytes_and_explain_shows_the_expert_placement(cli, tmp_path):
    """Qwen3-30B-A3B's published sizes (128 experts over ep*tp = 32, 32 heads, 4 KV heads over
    tp = 4) with 4 of its 48 layers: the same layers and shards, a twelfth of the dry run."""
    from plancc.models import build_model, load_config, presets

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**presets()["qwen3-30b-a3b"].config, "num_hidden_layers": 4}))
    code, out, err = cli("validate", str(PLANS / "qwen3_moe.yaml"), "--model", config, "--tp", "4",
                         "--ep", "8", "--dry-run", "--format", "json")
    assert code == 0, err
    dry = json.loads(out)["summary"]["dry_run"]
    assert dry["world_size"] == 32
    # fp32 parameters over 32 ranks: experts over ep*tp = 32, the rest over dp*tp = 32 (a few
    # small ones, the norms, in shards that round up)
    whole = 4 * sum(p.numel() for p in build_model(load_config(config)).parameters())
    assert whole / 32 <= dry["per_rank_bytes"]["parameters"] < 1.01 * whole / 32
    code, out, err = cli("explain", str(PLANS / "qwen3_moe.yaml"), "--model", "tiny-qwen3-moe", "--tp", "2",
                         "--ep", "2", "--dp", "4")
    assert code == 0, err
    experts = [line for line in out.splitlines() if line.startswith("model.layers.*.mlp.experts")]
    assert experts and all("4x64x64" in row or "4x64x32" in row for row in experts)
    assert all("shard(0) over ep*tp" in row and "shard(0) over 2" in row for row in experts)


# --- attention with learned sinks: per-head parameters sharded with the heads --------------

def test_gpt_oss_with_its_sinks_left_whole_fails_validate_with_the_per_head_fix(write_plan):
    text = (PLANS / "gpt_oss.yaml").read_text().replace(
        "  model.layers.*.self_attn: {style: per_head_params, input_layouts: replicate}\n", ""
    )
    (d,) = _errors(check_plan(plancc.load_plan(write_plan(text)), "tiny-gpt-oss", tp=2), "sharded-region-params")
    assert "self_attn (GptOssAttention) has parameters sinks" in d.message
    assert "'model.layers.*.self_attn: per_head_params'" in d.fix


def test_import_hf_maps_local_params_and_drops_hfs_rule_for_the_sinks_themselves(tmp_path):
    folder = _tiny_folder(tmp_path, "granite_swa")
    text = import_hf(folder)
    # the sinks split with the heads, and (shared-input) the block's input laid out once for q/k/v
    assert "model.layers.*.self_attn:\n    style: per_head_params\n    input_layouts: replicate" in text
    assert "sinks" not in text
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    assert not _errors(check_plan(plancc.load_plan(path), folder, tp=2))


def test_per_head_params_on_attention_without_parameters_of_its_own_is_a_warning(write_plan):
    """It does nothing there: the plan trains exactly as without the rule (the mutation bench's
    ground truth), so a warning, not a refusal."""
    text = (PLANS / "qwen3.yaml").read_text().replace(
        "  model.layers.*.self_attn: shared_input\n", "  model.layers.*.self_attn: per_head_params\n", 1)
    found = check_plan(plancc.load_plan(write_plan(text)), "tiny-qwen3", tp=2)
    assert not [d for d in found if d.is_error]
    (d,) = [d for d in found if d.rule == "style-module-kind"]
    assert "has no parameters of its own" in d.message and "does nothing" in d.message and "drop the rule" in d.fix
