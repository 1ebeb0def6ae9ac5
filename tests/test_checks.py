"""Model-aware checks find, on the meta device, the failures users otherwise meet on GPUs."""

import pytest

import plancc
from plancc.checks import check_plan

from .conftest import PLANS

QWEN3 = PLANS / "qwen3.yaml"
LLAMA = PLANS / "llama.yaml"
GEMMA3 = PLANS / "gemma3.yaml"


def rules(diags, errors_only=True):
    return sorted({d.rule for d in diags if d.is_error or not errors_only})


def test_kv_heads_not_divisible_names_valid_tp(cli):
    code, out, err = cli("validate", QWEN3, "--model", "qwen3-8b", "--tp", "16")
    assert code == 1
    assert "[kv-heads-divisible]" in err and "fix: use tp in {1, 2, 4, 8}" in err
    assert cli("validate", QWEN3, "--model", "qwen3-8b", "--tp", "8")[0] == 0


def test_attention_heads_not_divisible():
    diags = check_plan(plancc.load_plan(QWEN3), "qwen2.5-7b", tp=8)  # 28 heads, 4 kv heads
    assert {"attention-heads-divisible", "kv-heads-divisible"} <= set(rules(diags))


@pytest.mark.parametrize("plan,preset", [(QWEN3, "qwen3-0.6b"), (LLAMA, "llama-3.2-1b"), (GEMMA3, "gemma-3-1b")])
def test_shipped_plans_on_shipped_tied_models_have_no_tied_error(plan, preset):
    tp = 1 if preset == "gemma-3-1b" else 2  # gemma-3-1b has one KV head: tp must be 1
    for sp in (False, True):
        diags = check_plan(plancc.load_plan(plan), preset, tp=tp, sequence_parallel=sp)
        assert rules(diags) == [], [d.format() for d in diags]


def test_inconsistent_tied_layout_is_an_error(write_plan):
    text = (PLANS / "llama.yaml").read_text().replace("  model.embed_tokens: embedding_rowwise\n", "")
    text = text.replace("  lm_head: colwise_logits\n", "  lm_head: colwise\n")
    plan = plancc.load_plan(write_plan(text))
    diags = check_plan(plan, "llama-3.2-1b", tp=2)
    (tied,) = [d for d in diags if d.rule == "tied-embeddings"]
    assert tied.line == text.splitlines().index("  lm_head: colwise") + 1
    assert "embedding_rowwise" in tied.fix
    # the same plan on an untied model is fine
    assert "tied-embeddings" not in rules(check_plan(plan, "llama-3.1-8b", tp=2))


def test_missing_o_proj_is_a_pairing_error(write_plan):
    text = QWEN3.read_text().replace("  model.layers.*.self_attn.o_proj: rowwise\n", "")
    plan = plancc.load_plan(write_plan(text))
    diags = [d for d in check_plan(plan, "tiny-qwen3", tp=2) if d.rule == "layout-pairing"]
    assert len(diags) == 1
    assert "q_proj" in diags[0].message and "o_proj (left whole)" in diags[0].message
    assert "'model.layers.*.self_attn.o_proj: rowwise'" in diags[0].fix


def test_lm_head_with_plain_sharded_logits_is_a_pairing_error(write_plan):
    text = QWEN3.read_text().replace("  lm_head: colwise_logits\n", "  lm_head: colwise\n")
    diags = [d for d in check_plan(plancc.load_plan(write_plan(text)), "tiny-qwen3", tp=2)
             if d.rule == "layout-pairing"]
    assert len(diags) == 1 and diags[0].line == text.splitlines().index("  lm_head: colwise") + 1
    assert "one rank's slice of the vocabulary" in diags[0].message and "colwise_logits" in diags[0].fix


def test_sp_overlay_without_gathering_attention_is_a_pairing_error(write_plan):
    """Like the reference SP plan: q/k/v read the sequence shard as if it were whole."""
    text = QWEN3.read_text().replace("  model.layers.*.self_attn: gather_seq_input\n", "")
    plan = plancc.load_plan(write_plan(text))
    diags = [d for d in check_plan(plan, "tiny-qwen3", tp=2, sequence_parallel=True) if d.is_error]
    assert {d.rule for d in diags} == {"layout-pairing"}
    assert "'model.layers.*.self_attn: gather_seq_input'" in diags[0].fix
    assert "self_attn (shared_input)" in diags[0].message and "sequence" in diags[0].message


def test_style_on_wrong_module_kind(write_plan):
    plan = plancc.load_plan(write_plan("plancc: 1\nname: t\narchitectures: [Qwen3ForCausalLM]\n"
                                       "tensor_parallel:\n  model.layers.*.mlp: colwise\n  model.norm: rotary_sp\n"))
    diags = [d for d in check_plan(plan, "tiny-qwen3", tp=2) if d.rule == "style-module-kind"]
    assert [d.line for d in diags] == [5, 6]


def test_architecture_not_served():
    diags = check_plan(plancc.load_plan(QWEN3), "tiny-llama", tp=1)
    assert rules(diags) == ["architecture-mismatch"]
    assert "Qwen3ForCausalLM, Qwen2ForCausalLM" in diags[0].message


@pytest.mark.parametrize("kwargs,ok", [
    (dict(tp=2, world_size=8), True),
    (dict(tp=2, dp=4, world_size=8), True),
    (dict(tp=4, world_size=6), False),
    (dict(tp=2, dp=2, world_size=8), False),
    (dict(tp=2, cp=2, world_size=8), True),
])
def test_mesh_sizes_must_multiply_to_world_size(kwargs, ok):
    diags = check_plan(plancc.load_plan(QWEN3), "tiny-qwen3", **kwargs)
    assert ("mesh-sizes" not in rules(diags)) is ok


def test_sp_with_tp1_is_a_warning_only():
    diags = check_plan(plancc.load_plan(QWEN3), "tiny-qwen3", tp=1, sequence_parallel=True)
    assert rules(diags) == [] and rules(diags, errors_only=False) == ["sequence-parallel"]


def test_uneven_ffn_is_an_error_and_uneven_vocab_a_warning():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3", vocab_size=250, hidden_size=64, intermediate_size=102,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    cfg.architectures = ["Qwen3ForCausalLM"]
    diags = check_plan(plancc.load_plan(QWEN3), cfg, tp=4)
    shape = [d for d in diags if d.rule == "shape-divisible"]
    assert sorted((d.severity.value, d.message.split(":")[0]) for d in shape) == [
        ("error", "model.layers.0.mlp.down_proj"), ("error", "model.layers.0.mlp.gate_proj"),
        ("error", "model.layers.0.mlp.up_proj"), ("warning", "lm_head"), ("warning", "model.embed_tokens")]


def test_shipped_plans_validate_on_their_default_models(cli):
    for plan in (QWEN3, LLAMA, GEMMA3):
        code, out, err = cli("validate", plan)
        assert code == 0, err
        assert "modules" in out


@pytest.mark.parametrize("kwargs,pad", [
    (dict(tp=1, cp=2, seq_len=30), 2),
    (dict(tp=2, cp=2, seq_len=36, sequence_parallel=True), 4),  # multiple of 2*cp*tp = 8
    (dict(tp=2, seq_len=33, sequence_parallel=True), 1),
])
def test_sequence_length_off_the_multiple_reports_the_pad(kwargs, pad):
    diags = [d for d in check_plan(plancc.load_plan(QWEN3), "tiny-qwen3", **kwargs) if d.rule == "sequence-length"]
    assert len(diags) == 1 and f"padded by {pad}" in diags[0].message
    assert diags[0].loc.line == 0  # a command-line value, not a line of the plan
    assert check_plan(plancc.load_plan(QWEN3), "tiny-qwen3", **{**kwargs, "seq_len": kwargs["seq_len"] + pad}) == []


def test_cp_with_attention_softcapping_is_accepted():
    """The block attention soft-caps in its tiled kernel (tests/test_cp.py runs Gemma 2 exact)."""
    from plancc.models import load_config

    config = load_config("tiny-gemma3")
    config.attn_logit_softcapping = 50.0
    assert [d for d in check_plan(plancc.load_plan(GEMMA3), config, tp=1, cp=2) if d.rule == "context-parallel"] == []


def test_sp_overlay_without_rotary_sp_warns_about_position_ids(write_plan):
    text = QWEN3.read_text().replace("  model.rotary_emb: rotary_sp\n", "")
    diags = check_plan(plancc.load_plan(write_plan(text)), "tiny-qwen3", tp=2, sequence_parallel=True)
    assert rules(diags) == []
    (warning,) = [d for d in diags if d.rule == "sequence-parallel"]
    assert "model.rotary_emb" in warning.message and "position ids" in warning.message


def test_models_lists_published_and_tiny_presets(cli):
    code, out, _ = cli("models")
    assert code == 0
    for name in ["qwen3-0.6b", "qwen3-8b", "qwen3-32b", "qwen2.5-7b", "llama-3.1-8b", "llama-3.2-1b", "gemma-3-1b",
                 "tiny-qwen3", "tiny-llama", "tiny-gemma3"]:
        assert name in out


def test_model_from_a_config_json_path(cli, tmp_path):
    import json

    from plancc.models import presets

    path = tmp_path / "config.json"
    path.write_text(json.dumps(presets()["llama-3.2-1b"].config))
    code, out, err = cli("validate", LLAMA, "--model", path, "--tp", "8")
    assert code == 0, err


def test_the_summary_counts_the_units_fsdp_shards_and_names_the_tied_one_left_to_the_root():
    from plancc.checks.report import validate_plan

    tied = validate_plan(QWEN3, model="qwen3-0.6b", tp=2)  # 28 layers; its embedding is the lm_head's weight
    untied = validate_plan(QWEN3, model="qwen3-8b", tp=2)  # 36 layers and its own embedding
    assert (tied.summary()["fsdp_units"], tied.summary()["fsdp_units_left_to_root"]) == (28, 1)
    assert (untied.summary()["fsdp_units"], untied.summary()["fsdp_units_left_to_root"]) == (37, 0)
    assert "fsdp units: 28 (+1 left to the root: a tied weight)" in tied.render()
    assert not tied.has_errors and not [d for d in tied.diagnostics if d.rule == "fsdp-units"]


def test_a_config_checked_again_is_not_traced_again_but_a_model_handed_in_is(monkeypatch, write_plan):
    """The wiring of a model built from a config is traced once per equal config (a second
    plan, another layout); a model the caller hands in is traced from the model itself."""
    import plancc.checks.context as context
    from plancc.models import build_meta_model, load_config

    traced = []
    real = context.trace
    monkeypatch.setattr(context, "trace", lambda model: traced.append(model) or real(model))
    config = load_config("tiny-qwen3")
    config.intermediate_size *= 2  # a config no other test has traced in this process
    broken = write_plan((PLANS / "qwen3.yaml").read_text().replace("  model.layers.*.self_attn.o_proj: rowwise\n", ""))
    ok = check_plan(plancc.load_plan(PLANS / "qwen3.yaml"), config, tp=2)
    found = check_plan(plancc.load_plan(broken), config, tp=2)
    assert len(traced) == 1
    assert not [d for d in ok if d.is_error] and any(d.rule == "layout-pairing" for d in found)
    config.intermediate_size *= 2  # another config: traced for itself
    check_plan(plancc.load_plan(PLANS / "qwen3.yaml"), config, tp=2)
    assert len(traced) == 2
    check_plan(plancc.load_plan(PLANS / "qwen3.yaml"), build_meta_model(config), tp=2)
    assert len(traced) == 3


def test_an_lm_head_split_by_its_input_is_refused_only_where_log_probs_read_its_weight(write_plan):
    """plancc's fused log-probs read the lm_head's weight a vocabulary shard at a time, so a
    rowwise_rep lm_head fails their first step; a model that transforms its logits (Gemma 2's
    final soft-cap, Inkling2's) is read through its logits, which rowwise_rep gives whole: exact
    (bench/hf_sweep.py: inkling2_text verifies at tp=2), and validate says nothing."""
    from plancc.models import load_config

    text = QWEN3.read_text().split("sequence_parallel:")[0].replace("  lm_head: colwise_logits\n", "  lm_head: rowwise_rep\n")
    plan = plancc.load_plan(write_plan(text))
    split = [d for d in check_plan(plan, "tiny-qwen3", tp=2) if d.is_error]
    assert split and "splits the lm_head weight by its input features" in split[0].message, split
    capped = load_config("tiny-qwen3")
    capped.final_logit_softcapping = 30.0
    assert [d for d in check_plan(plan, capped, tp=2) if d.is_error] == []
