"""Packed (fused) projections: a module that computes several projections at once and whose
consumer splits its output (Phi-3's and GLM-4's ``gate_up_proj``). ``packed_colwise`` gives
each rank its 1/tp of every block, ``packed_rowwise`` takes such an output back unsplit; plain
colwise on a packed module (wrong numbers, no error) and a packed style on a module nobody
splits are diagnostics at the plan's line with a fix."""

import pytest
from transformers import AutoConfig

import plancc
from plancc.checks import check_plan

from .conftest import PLANS, assert_verified


def _packed_errors(plan_path, model, tp=2, **sizes):
    found = check_plan(plancc.load_plan(plan_path), model, tp=tp, **sizes)
    return [d for d in found if d.is_error and d.rule == "packed-projection"], found


def _edited(write_plan, **rules):
    text = (PLANS / "phi3.yaml").read_text()
    for glob, style in rules.items():
        old = next(line for line in text.splitlines() if line.startswith(f"  {glob}:"))
        text = text.replace(old, f"  {glob}: {style}", 1)
    return write_plan(text, "phi3.yaml")


def test_the_shipped_phi3_plan_validates_with_and_without_sp():
    for sp in (False, True):
        packed, found = _packed_errors(PLANS / "phi3.yaml", "tiny-phi3", sequence_parallel=sp)
        assert not [d for d in found if d.is_error], [d.message for d in found]


def test_colwise_on_a_packed_projection_is_an_error_whose_fix_is_packed_colwise(write_plan):
    plan = _edited(write_plan, **{"model.layers.*.mlp.gate_up_proj": "colwise"})
    packed, _ = _packed_errors(plan, "tiny-phi3")
    assert len(packed) == 1 and packed[0].loc.line == 15
    assert "{style: packed_colwise, blocks: 2}" in packed[0].fix


def test_a_consumer_slicing_with_the_models_own_sizes_needs_the_output_gathered(write_plan):
    """Phi-3 slices qkv as qkv[..., :heads * head_dim] with the config's global sizes."""
    plan = _edited(write_plan, **{"model.layers.*.self_attn.qkv_proj": "colwise",
                                  "model.layers.*.self_attn.o_proj": "rowwise"})
    packed, _ = _packed_errors(plan, "tiny-phi3")
    assert len(packed) == 1 and "[64, 32, 32]" in packed[0].message
    assert "colwise_rep" in packed[0].fix


@pytest.mark.parametrize("rule,fix", [
    ("{style: packed_colwise, blocks: 3}", "blocks: 2"),  # gate_up is split in two
])
def test_a_blocks_count_other_than_the_split_is_an_error(write_plan, rule, fix):
    plan = _edited(write_plan, **{"model.layers.*.mlp.gate_up_proj": rule})
    packed, _ = _packed_errors(plan, "tiny-phi3")
    assert len(packed) == 1 and fix in packed[0].fix


def test_packed_styles_on_modules_that_are_not_packed_are_errors(write_plan):
    # qwen3's q_proj output is reshaped into heads, never split; down_proj reads gate*up, not a packed output
    qwen = (PLANS / "qwen3.yaml").read_text().replace(
        "model.layers.*.self_attn.q_proj: colwise", "model.layers.*.self_attn.q_proj: packed_colwise")
    packed, _ = _packed_errors(write_plan(qwen, "qwen3.yaml"), "tiny-qwen3")
    assert len(packed) == 1 and packed[0].fix == "'model.layers.*.self_attn.q_proj: colwise'"
    plan = _edited(write_plan, **{"model.layers.*.mlp.down_proj": "packed_rowwise"})
    packed, _ = _packed_errors(plan, "tiny-phi3")
    assert len(packed) == 1 and packed[0].fix == "'model.layers.*.mlp.down_proj: rowwise'"


def test_packed_styles_tell_the_size_that_does_not_split(write_plan, tmp_path):
    """An intermediate size of 6: gate_up_proj's two blocks of 6 features do not split over tp=4."""
    config = AutoConfig.for_model("phi3", num_hidden_layers=2, hidden_size=64, intermediate_size=6,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256, pad_token_id=0)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)
    packed, _ = _packed_errors(PLANS / "phi3.yaml", str(tmp_path), tp=4)
    assert len(packed) == 1 and "do not split over tp=4" in packed[0].message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packed_styles_equal_the_unsharded_module_over_four_ranks():
    """2 and 3 blocks over tp=4: an uneven route (each rank sends its units to 2 or 3 ranks)."""
    from .distributed import launch
    from .numerics_worker import packed_projections_match

    results = launch(packed_projections_match, 4, (2, 3))
    for rank, by_blocks in results.items():
        for blocks, (output, grad) in by_blocks.items():
            assert output <= 1e-12 and grad <= 1e-12, (rank, blocks, output, grad)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_phi3_plan_trains_exactly_at_dp2_tp2_sp_and_tp4(tmp_path):
    from .distributed import launch
    from .numerics_worker import verify_cases

    folder = tmp_path / "phi3-4kv"
    config = AutoConfig.for_model("phi3", num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256, pad_token_id=0)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(folder)
    plan = str(PLANS / "phi3.yaml")
    cases = [(plan, "tiny-phi3", 2, 2, True), (plan, str(folder), 1, 4, False)]
    assert_verified(launch(verify_cases, 4, cases), cases)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_packed_model_loads_from_and_exports_to_an_hf_folder_unchanged(tmp_path):
    """gate_up_proj's weight stays in the Hugging Face layout (only its output is regrouped):
    a save_pretrained folder loads at tp=2 to transformers' own logits, and the export is the
    folder's tensors, bit for bit."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from plancc.models import build_model, load_config

    from .distributed import launch
    from .runner_worker import logits_from_hf_folder

    torch.manual_seed(5)
    build_model(load_config("tiny-phi3"), device="cpu").save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(input_ids=ids).logits
    results = launch(logits_from_hf_folder, 2, str(PLANS / "phi3.yaml"), str(tmp_path / "hf"), 1, 2, ids,
                     str(tmp_path / "out"))
    for rank, got in results.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
    source, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)
