"""Sharded == unsharded. For every shipped plan and layout, on real gloo process groups:
logits, loss and every parameter's gradient match the unsharded model, three AdamW steps
with global-norm clipping keep matching, and parameters replicated over tp stay bitwise
identical across tp ranks. A plan with the reference's q_norm/k_norm omission must fail.

Tolerances (fp32): logits 1e-5 relative to the largest logit, gradients 1e-5 relative to
the largest entry of each gradient, loss 1e-5 absolute. Losses after optimizer steps: 1e-4
relative, because Adam divides each update by sqrt(v): rounding-level differences in
near-zero gradient entries become differences of up to lr in those parameters.
"""

import pytest

from .conftest import PLANS
from .distributed import launch
from .numerics_worker import (
    cpu_offload_matches,
    decoder_called_directly,
    meta_built_models_match,
    reshard_after_forward_cases,
    verify_cases,
)

# the shipped plans' FSDP units, which some cases below edit
UNITS = "units: [model.embed_tokens, model.layers.*]"


def _edited(plan, old: str, new: str) -> str:
    text = plan.read_text()
    assert old in text, f"{plan.name} no longer contains {old!r}: the edited plan would test nothing new"
    return text.replace(old, new)


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LOGITS_REL = GRAD_REL = LOSS_ABS = 1e-5
STEP_LOSS_REL = 1e-4

FAMILIES = [
    ("qwen3.yaml", "tiny-qwen3"),
    ("qwen3.yaml", "tiny-qwen3-tied"),
    ("qwen3.yaml", "tiny-qwen2"),
    ("llama.yaml", "tiny-llama"),
    ("llama.yaml", "tiny-llama-tied"),
    ("gemma3.yaml", "tiny-gemma3"),
]
# mixtures of experts (whole experts over tp, router and expert gradients compared too); the
# MoE plans have no sequence_parallel section
MOE_FAMILIES = [
    ("qwen3_moe.yaml", "tiny-qwen3-moe"),
    ("mixtral.yaml", "tiny-mixtral"),
    ("deepseek_v3.yaml", "tiny-deepseek-v3"),
    ("gpt_oss.yaml", "tiny-gpt-oss"),
]
TWO_RANK_LAYOUTS = [(1, 2, False), (1, 2, True), (2, 1, False)]  # tp=2; tp=2+SP; dp=2 (FSDP only)
FOUR_RANK_LAYOUTS = [(2, 2, False), (2, 2, True)]  # dp=2 x tp=2, with and without SP


def run(nproc, cases):
    cases = [(str(PLANS / plan) if "/" not in plan else plan, preset, dp, tp, sp)
             for plan, preset, dp, tp, sp in cases]
    results = launch(verify_cases, nproc, cases)
    return {rank: results[rank] for rank in results}


def assert_matches(report, label):
    assert "error" not in report, f"{label}: {report.get('trace', report)}"
    assert report["logits_max_rel"] <= LOGITS_REL, label
    assert report["loss_abs"] <= LOSS_ABS, label
    assert report["grad_max_rel"] <= GRAD_REL, f"{label}: worst {report['worst_grad']}"
    loss_scale = 5.0  # ln(256) ~ 5.5 for a random tiny model
    assert max(report["step_loss_abs"]) <= STEP_LOSS_REL * loss_scale, label
    assert report["replicas_identical"], label
    assert report["params_compared"] >= 20, label


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    # The negative control: the reference's TP plan leaves Qwen3's q_norm/k_norm whole.
    broken = tmp_path_factory.mktemp("plans") / "qwen3-reference-qk.yaml"
    broken.write_text((PLANS / "qwen3.yaml").read_text().replace(
        "{style: qk_norm, optional: true}", "{style: replicate, optional: true}"))
    cases = [(p, m, dp, tp, sp) for p, m in FAMILIES for dp, tp, sp in TWO_RANK_LAYOUTS]
    cases += [(p, m, 1, 2, False) for p, m in MOE_FAMILIES]
    # an uneven vocab split (255 over tp=2: 128 + 127), which the shape check only warns about
    import json

    from plancc.models import presets

    uneven = tmp_path_factory.mktemp("configs") / "uneven-vocab.json"
    uneven.write_text(json.dumps({**presets()["tiny-qwen3"].config, "vocab_size": 255}))
    cases += [("qwen3.yaml", str(uneven), 1, 2, sp) for sp in (False, True)]
    # nested FSDP units (each mlp and attention block inside each layer): wrapped inner first
    nested = tmp_path_factory.mktemp("plans") / "qwen3-nested-units.yaml"
    nested.write_text(_edited(PLANS / "qwen3.yaml",
        UNITS, "units: [model.embed_tokens, model.layers.*, model.layers.*.mlp, model.layers.*.self_attn]"))
    cases.append((str(nested), "tiny-qwen3", 2, 1, False))
    # selective checkpointing that keeps TP collectives' and matmuls' outputs, under SP
    selective = tmp_path_factory.mktemp("plans") / "qwen3-selective-ac.yaml"
    selective.write_text((PLANS / "qwen3.yaml").read_text().replace(
        "activation_checkpointing: [model.layers.*.mlp]",
        "activation_checkpointing:\n  - model.layers.*.mlp\n"
        "  - {module: model.layers.*.self_attn, save: [matmul, attention, collectives]}"))
    cases += [(str(selective), "tiny-qwen3", 1, 2, sp) for sp in (False, True)]
    # the second negative control: MLA's shared rotary key without its gradient summed over tp
    mla_broken = tmp_path_factory.mktemp("plans") / "deepseek-v3-rotary-key-whole.yaml"
    mla_broken.write_text((PLANS / "deepseek_v3.yaml").read_text().replace(
        "{style: mla_kv_a_proj, rope_dim: 64}", "replicate"))
    cases.append((str(mla_broken), "tiny-deepseek-v3", 1, 2, False))
    cases.append((str(broken), "tiny-qwen3", 1, 2, False))
    return cases, run(2, cases)


def test_every_plan_and_two_rank_layout_matches_unsharded(two_rank_results):
    cases, results = two_rank_results
    for rank, reports in results.items():
        for i, case in enumerate(cases[:-2]):
            assert_matches(reports[i], f"rank {rank} {case}")


def test_mla_without_the_rotary_key_gradient_sum_trains_wrong(two_rank_results):
    """kv_a_proj_with_mqa left plain 'replicate': its rotary key meets each rank's heads only."""
    cases, results = two_rank_results
    report = results[0][len(cases) - 2]
    assert report["logits_max_rel"] <= LOGITS_REL  # the forward pass is still right...
    assert report["grad_max_rel"] > 1e-3  # ...the gradients upstream of the key are not

def test_leaving_qk_norm_whole_gives_wrong_gradients_like_the_reference(two_rank_results):
    """Under TP each rank normalizes only its heads: q_norm's weight gradient is partial."""
    cases, results = two_rank_results
    report = results[0][len(cases) - 1]
    assert report["logits_max_rel"] <= LOGITS_REL  # the forward pass is still right...
    assert report["grad_max_rel"] > 0.05  # ...but the norms' gradients are not
    assert "_norm" in report["worst_grad"]


# dp2 x tp2 composes the two layouts every family passes above. The README command runs the
# composition once per kind of weight it handles: untied with and without SP (Qwen3), a tied
# embedding with its plan's own units under SP (Gemma3), and experts, which FSDP shards again
# over dp (Qwen3-MoE); the extended tier runs every other family at dp2 x tp2 as well.
FOUR_RANK_CASES = [
    ("qwen3.yaml", "tiny-qwen3", 2, 2, False),
    ("qwen3.yaml", "tiny-qwen3", 2, 2, True),
    ("gemma3.yaml", "tiny-gemma3", 2, 2, True),
    ("qwen3_moe.yaml", "tiny-qwen3-moe", 2, 2, False),
]


def _four_rank_matches(cases):
    results = run(4, cases)
    for rank, reports in results.items():
        for i, case in enumerate(cases):
            assert_matches(reports[i], f"rank {rank} {case}")


def test_dp2_x_tp2_matches_unsharded():
    _four_rank_matches(FOUR_RANK_CASES)


@pytest.mark.extended  # the composition itself: test_dp2_x_tp2_matches_unsharded; each family: the two-rank layouts
def test_dp2_x_tp2_matches_unsharded_for_every_family():
    cases = [(p, m, dp, tp, sp) for p, m in FAMILIES for dp, tp, sp in FOUR_RANK_LAYOUTS]
    cases += [(p, m, 2, 2, False) for p, m in MOE_FAMILIES[::2]]  # experts: sharded again over dp
    _four_rank_matches([case for case in cases if case not in FOUR_RANK_CASES])


def test_cpu_offload_keeps_logits_and_gradients():
    results = launch(cpu_offload_matches, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3")
    for rank, r in results.items():
        assert r["logits"] <= 1e-5 and r["grad_rel"] <= GRAD_REL, (rank, r)


def test_fsdp_reshard_after_forward_false_keeps_units_gathered_and_numerics(tmp_path):
    kept = tmp_path / "qwen3-keep-gathered.yaml"
    kept.write_text(_edited(PLANS / "qwen3.yaml",
        UNITS, UNITS + "\n  reshard_after_forward: false"))
    default = str(PLANS / "qwen3.yaml")
    results = launch(reshard_after_forward_cases, 2, [default, str(kept)], "tiny-qwen3")
    for rank, by_plan in results.items():
        q_rows = 64  # tiny-qwen3: 4 heads x 16; a dp=2 shard holds 32 of them
        # default: every unit but the last is freed after forward (backward gathers it again)
        assert by_plan[default]["rows_held_after_forward"] == [q_rows // 2, q_rows], rank
        assert by_plan[str(kept)]["rows_held_after_forward"] == [q_rows, q_rows], rank
        # the input embedding is a unit of its own (tiny-qwen3 is untied): its 256 vocab rows
        # are freed during the decoder, not held to the end of forward as the root's are
        assert by_plan[default]["embedding_rows_held_after_forward"] == 256 // 2, rank
        assert by_plan[str(kept)]["embedding_rows_held_after_forward"] == 256, rank
        for plan, r in by_plan.items():
            assert_matches(r["report"], f"rank {rank} {plan}")


def test_models_built_wholly_on_meta_get_their_buffers_back(tmp_path):
    """``with torch.device("meta")`` puts rotary frequencies and Gemma's embedding scale on
    meta too; no state dict holds them. Left as ``to_empty`` garbage the logits were off by
    0.2-0.5 with no error."""
    cases = [(str(PLANS / p), m) for p, m in [("qwen3.yaml", "tiny-qwen3"), ("llama.yaml", "tiny-llama"),
                                              ("gemma3.yaml", "tiny-gemma3")]]
    results = launch(meta_built_models_match, 2, cases, str(tmp_path))
    for rank, by_preset in results.items():
        for preset, r in by_preset.items():
            assert any("inv_freq" in n for n in r["meta_buffers"]), (preset, r)  # the case is real
            assert r["logits_abs"] <= 1e-5 and r["logits_abs_hf_folder"] <= 1e-5, (rank, preset, r)


@pytest.mark.parametrize("cp", [1, 2], ids=["tp2-sp", "cp2"])
def test_decoder_called_directly_sees_global_positions(tmp_path, cp):
    """A value head reads ``model.model(...)``'s hidden states; under SP or CP they are
    sequence shards, and each shard must have been computed with its global positions and
    mask. (Untied Qwen3's decoder is an FSDP unit here: called directly, it gathers its own
    parameters. Gemma3 ties its embedding to the lm_head, so the root holds that weight and
    the hidden states come from the whole model's forward.)"""
    decoder_unit = tmp_path / "qwen3.yaml"
    decoder_unit.write_text(_edited(PLANS / "qwen3.yaml", UNITS, "units: [model.embed_tokens, model.layers.*, model]"))
    cases = [(str(decoder_unit), "tiny-qwen3", True), (str(PLANS / "gemma3.yaml"), "tiny-gemma3", False)]
    results = launch(decoder_called_directly, 2, cases, cp)
    for rank, by_preset in results.items():
        assert set(by_preset) == {"tiny-qwen3", "tiny-gemma3"}
        for preset, r in by_preset.items():
            assert r["shard_len"] == 8, r  # really sharded: 16 tokens over 2 ranks
            assert r["max_abs"] <= LOGITS_REL * r["scale"], (preset, rank, r)
        # Gemma3's plan names its (tied) embedding as a unit: left to the root, the lm_head
        # keeps the same parameter (as a unit, FSDP2 gave the lm_head a copy of its own)
        assert by_preset["tiny-gemma3"]["tied"] and not by_preset["tiny-qwen3"]["tied"], rank
