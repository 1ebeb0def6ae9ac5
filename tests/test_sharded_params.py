"""sharded-region-params: a module with parameters that reads a tp-sharded activation and is
left whole trains wrong without an error; validate must refuse it, and accept it once its
gradients are summed over tp (replicated_with_grad_allreduce) -- which then trains exactly."""

import pytest
import yaml
from transformers import AutoConfig

import plancc
from plancc import dataflow
from plancc.checks import check_plan
from plancc.tools.import_hf import import_hf

from .conftest import PLANS, assert_verified, forked_cli

QWEN3 = PLANS / "qwen3.yaml"
ACT_FN_FIX = "  model.layers.*.mlp.act_fn: replicated_with_grad_allreduce\n"


def _errors(diags, rule="sharded-region-params"):
    return [d for d in diags if d.rule == rule and d.is_error]


@pytest.fixture(scope="module")
def apertus(tmp_path_factory):
    """A tiny Apertus (xIELU activation with learnable alpha_p / alpha_n) and the plan
    ``plancc import-hf`` writes for it. With attention dropout, which --verify turns off."""
    folder = _tiny_config(tmp_path_factory.mktemp("apertus"), "apertus", attention_dropout=0.1)
    return folder, import_hf(folder)


def test_per_head_norms_left_whole_are_refused(write_plan):
    text = "".join(line for line in QWEN3.read_text().splitlines(keepends=True) if "_norm: {style: qk_norm" not in line)
    found = _errors(check_plan(plancc.load_plan(write_plan(text)), "tiny-qwen3", tp=2))
    assert sorted(d.message.split(" ")[0] for d in found) == [
        "model.layers.*.self_attn.k_norm", "model.layers.*.self_attn.q_norm",
    ]
    q = next(d for d in found if "q_norm" in d.message.split(" ")[0])
    assert "weight" in q.message and "model.layers.*.self_attn.q_proj" in q.message
    assert q.line == text.splitlines().index("  model.layers.*.self_attn.q_proj: colwise") + 1
    assert "model.layers.*.self_attn.q_norm: replicated_with_grad_allreduce" in q.fix


def test_the_shipped_plan_passes_and_tp1_has_nothing_to_sum():
    plan = plancc.load_plan(QWEN3)
    assert _errors(check_plan(plan, "tiny-qwen3", tp=2)) == []
    assert _errors(check_plan(plan, "tiny-qwen3", tp=1)) == []


def _tiny_config(folder, model_type, **extra):
    sizes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256)
    config = AutoConfig.for_model(model_type, **{**sizes, **extra})
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(folder)
    return str(folder)


def test_import_hf_adds_the_grad_allreduce_rule_hf_lacks(apertus):
    _, imported = apertus
    assert ACT_FN_FIX in imported


def test_import_hf_leaves_out_rules_that_match_nothing_in_the_config(tmp_path, write_plan):
    """Doge's class plan has MoE rules (router_gate, up_embed, down_embed); a dense config has none
    of those modules, and a plan with them would fail glob-no-match."""
    folder = _tiny_config(tmp_path / "doge", "doge")
    text = import_hf(folder)
    assert "router_gate" not in text and "mlp.up_proj: colwise" in text
    assert [d for d in check_plan(plancc.load_plan(write_plan(text)), folder, tp=2) if d.is_error] == []


def test_import_hf_refuses_styles_it_cannot_map_as_unsupported_style(tmp_path):
    folder = _tiny_config(tmp_path / "inkling_text", "inkling_text")  # shared experts: all_reduce
    with pytest.raises(plancc.PlanError) as refused:
        import_hf(folder)
    (diag,) = refused.value.diagnostics
    assert diag.rule == "unsupported-style" and "all_reduce (a bare all-reduce" in diag.message


def test_an_activation_with_parameters_fails_then_passes_when_fixed(apertus, write_plan):
    folder, imported = apertus
    imported = imported.replace(ACT_FN_FIX, "")  # what transformers' own TP plan says
    (found,) = _errors(check_plan(plancc.load_plan(write_plan(imported)), str(folder), tp=2))
    assert found.message.startswith("model.layers.*.mlp.act_fn (XIELUActivation) has parameters alpha_p, alpha_n")
    assert "model.layers.*.mlp.up_proj" in found.message
    down = "  model.layers.*.mlp.down_proj: rowwise\n"
    fixed = imported.replace(down, ACT_FN_FIX + down)
    assert [d for d in check_plan(plancc.load_plan(write_plan(fixed)), str(folder), tp=2) if d.is_error] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fixed_plan_trains_exactly_at_tp2(apertus, tmp_path):
    """The grad-allreduce style on a non-norm module: logits, gradients (alpha_p, alpha_n
    included) and two optimizer steps equal the unsharded model's. The config's dropout is
    off in both models for the comparison (with it on, each draws its own masks)."""
    folder, imported = apertus
    plan = tmp_path / "apertus.yaml"
    plan.write_text(imported)  # with the act_fn rule import-hf adds
    code, out, err = forked_cli("apply", plan, "--model", folder, "--tp", "2", "--steps", "2", "--verify")
    assert code == 0, err + out
    assert "verify: OK" in out and "dropout off in both models for the comparison (attention_dropout=0.1)" in out


def test_a_forward_that_cannot_run_on_meta_is_a_warning_not_a_pass(monkeypatch, write_plan):
    def refuse(model):
        raise dataflow.TraceError("RuntimeError: data-dependent op on meta")

    monkeypatch.setattr("plancc.checks.context.trace", refuse)
    config = plancc.models.load_config("tiny-qwen3")  # a config, so no skeleton carries a flow
    diags = [d for d in check_plan(plancc.load_plan(QWEN3), config, tp=2) if d.rule == "sharded-region-params"]
    assert len(diags) == 1 and not diags[0].is_error and "could not be traced" in diags[0].message


def test_a_per_head_output_all_reduced_fails_validate_and_import_hf_writes_both_fixes(tmp_path):
    """Doge: transformers' plan all-reduces dt_proj (one dynamic-mask entry per KV head) inside
    head-split attention -- a shape error at run time after a clean validate, before this rule."""
    folder = _tiny_config(tmp_path / "doge", "doge", head_dim=16, is_moe=False)
    text = import_hf(folder)
    plan = yaml.safe_load(text)["tensor_parallel"]
    assert plan["model.layers.*.self_attn.dt_proj"] == {"style": "rowwise", "output_layouts": "shard(-1)"}
    # its A, one per KV head, follows the heads; the block's input goes to q/k/v once (shared-input)
    assert plan["model.layers.*.self_attn"] == {"style": "per_head_params", "input_layouts": "replicate"}
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    assert [d for d in check_plan(plancc.load_plan(path), folder, tp=2) if d.is_error] == []
    path.write_text(text.replace("style: rowwise\n    output_layouts: shard(-1)", "style: rowwise"))
    (found,) = [d for d in check_plan(plancc.load_plan(path), folder, tp=2) if d.is_error]
    assert found.rule == "per-head-output" and "dt_proj" in found.message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_fused_projections_and_a_per_head_output_train_exactly_at_tp2(tmp_path):
    """The CI's representatives of two families of the sweep (bench/hf_sweep.py): Phi-3's fused
    qkv_proj / gate_up_proj (transformers plans them gather-output colwise) and Doge with the
    two fixes import-hf writes -- each imported plan equal to the unsharded model at tp=2."""
    from .distributed import launch
    from .numerics_worker import verify_cases

    cases = []
    for model_type, extra in (("phi3", {"pad_token_id": 0, "num_hidden_layers": 3}), ("doge", {"head_dim": 16, "is_moe": False})):
        folder = _tiny_config(tmp_path / model_type, model_type, **extra)
        plan = tmp_path / f"{model_type}.yaml"
        plan.write_text(import_hf(folder))
        cases.append((str(plan), folder, 1, 2, False))
    # --verify's own bars (Doge's dynamic mask, exp of a softplus, is 3e-5 off in fp32 alone)
    assert_verified(launch(verify_cases, 2, cases), cases)


def test_a_norm_whose_width_equals_a_head_count_is_no_per_head_parameter(tmp_path):
    """Doge with 8 heads on a hidden of 64: its q/k norms are 8 wide (head_dim = 64 / 8), the
    number of heads. import-hf once wrote them ``per_head_params`` -- a style for an attention
    block's own parameters, which validate then refused on a norm: the import's plan must pass."""
    folder = _tiny_config(tmp_path / "doge", "doge", num_attention_heads=8, num_key_value_heads=2, is_moe=False)
    text = import_hf(folder)
    plan = yaml.safe_load(text)["tensor_parallel"]
    assert plan["model.layers.*.self_attn.q_norm"] in ("qk_norm", "replicated_with_grad_allreduce"), plan
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    assert [d for d in check_plan(plancc.load_plan(path), folder, tp=2) if d.is_error] == []
