"""Tied input and output embeddings under pipeline stages (Qwen3-0.6B, Llama 3.2 1B, Gemma): the
last stage holds a copy of the embedding as its lm_head, the two gradients are summed between the
stages before clipping, the norm counts the weight once, weight decay spares both, and what goes
out (checkpoints read at any pp, exports) names the weight once, as a Hugging Face folder does.

Exactness is ``--verify``'s: logits, loss and every gradient (the copy's against the tied weight's,
the sum of both uses) against the unsharded tied model, the loss after each step, and the two
copies equal after the steps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from plancc.models import build_meta_model, build_model, load_config
from plancc.engine.pipeline.pipeline_ties import untie_across_stages

from .conftest import PLANS, forked_cli
from .test_training_run import losses

QWEN3 = PLANS / "qwen3.yaml"


def tied_folder(folder, layers=4):
    """tiny-qwen3 with its embeddings tied and ``layers`` layers, saved with weights (the folder
    holds the embedding only, as transformers writes a tied model)."""
    config = load_config("tiny-qwen3")
    config.tie_word_embeddings, config.num_hidden_layers = True, layers
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(3)
    build_model(config, device="cpu").save_pretrained(folder)
    return folder


def test_the_stages_are_cut_from_a_copy_whose_lm_head_is_its_own():
    config = load_config("tiny-qwen3")
    config.tie_word_embeddings = True
    model = build_meta_model(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert untie_across_stages(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape and not model.config.tie_word_embeddings


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tied_model_trains_as_the_unsharded_model_at_pp2_x_tp2(tmp_path):
    """From a folder that holds the embedding alone (the lm_head's copy read from it), under
    sequence parallelism, with weight decay strong enough that a decayed copy would leave the
    tie (the copies' equality is part of the verdict). The rows are of odd lengths (31, 8, 22,
    37): each stage pads them on the right to a multiple of tp for SP, after their last token."""
    import json

    folder = tied_folder(tmp_path / "tied")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(7 * n + i) % 200 + 1 for i in range(n)]}) + "\n"
                            for n in (31, 8, 22, 37)))
    code, out, err = forked_cli(
        "apply", QWEN3, "--model", folder, "--nproc-per-node", 4, "--pp", 2, "--tp", 2, "--sp", "--verify",
        "--steps", 2, "--weight-decay", 0.1, "--lr", 0.01, "--data", data, "--batch-size", 4,
    )
    assert code == 0, err + out
    assert "verify: OK" in out and "over 47 parameters" in out  # 45 + the embedding and its copy
    assert "tied weights identical on the first and the last pipeline stage: True" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_without_stages_resumes_under_them_and_the_export_names_the_weight_once(tmp_path):
    """Saved at dp2 (the tie one tensor with one optimizer state), resumed at pp2: the copy's
    state is read from the weight's and the run continues as the uninterrupted one; the export
    holds the embedding and no lm_head, as the folder it started from."""
    folder = tied_folder(tmp_path / "tied")
    flags = ("--model", folder, "--steps", 3, "--weight-decay", 0.1)
    code, straight, err = forked_cli("apply", QWEN3, *flags, "--save", tmp_path / "ck", "--save-every", 1)
    assert code == 0, err
    code, resumed, err = forked_cli(
        "apply", QWEN3, *flags, "--pp", 2, "--resume", tmp_path / "ck" / "step-000001", "--export-hf", tmp_path / "out"
    )
    assert code == 0, err
    assert losses(resumed) == pytest.approx(losses(straight)[1:], rel=1e-5)
    names = set(safe_open(str(tmp_path / "out" / "model.safetensors"), "pt").keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_qwen3_06b_cut_to_four_layers_is_exact_at_pp2(tmp_path):
    """The real config (151,936-token vocabulary, hidden 1024, tied), bf16 as it ships, cut to 4
    layers: --verify at pp2 from its seeded init. ~70 s here, hence the extended tier."""
    config = json.loads((PLANS.parent / "plancc" / "presets" / "qwen3-0.6b.json").read_text())
    config.update(num_hidden_layers=4, max_window_layers=4)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:4]
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    code, out, err = forked_cli(
        "apply", QWEN3, "--model", tmp_path / "q", "--pp", 2, "--verify", "--steps", 2, "--seq-len", 16,
        "--batch-size", 2,
    )
    assert code == 0, err + out
    assert "verify: OK" in out and "tied weights identical on the first and the last pipeline stage: True" in out


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_a_v_schedule_holds_both_copies_on_one_rank_and_sums_them_there(tmp_path):
    """zbv: pipeline rank 0 holds the first and the last stage; the sum is local."""
    plan = tmp_path / "zbv.yaml"
    plan.write_text(QWEN3.read_text().replace("  schedule: 1f1b", "  schedule: zbv\n  virtual_stages_per_rank: 2"))
    folder = tied_folder(tmp_path / "tied")
    code, out, err = forked_cli(
        "apply", plan, "--model", folder, "--pp", 2, "--verify", "--steps", 3, "--weight-decay", 0.1, "--lr", 0.01
    )
    assert code == 0, err + out
    assert "verify: OK" in out and "tied weights identical on the first and the last pipeline stage: True" in out


def test_explain_counts_the_copy_on_the_last_stage(cli):
    """Qwen3-0.6B at pp2: each end stage holds one vocabulary-sized matrix (the embedding, its
    copy as the lm_head), so the stages add up to the whole model plus the copy."""
    code, out, err = cli("explain", QWEN3, "--model", "qwen3-0.6b", "--pp", 2, "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    config = load_config("qwen3-0.6b")
    copy = config.vocab_size * config.hidden_size
    whole = sum(p.numel() for p in build_meta_model("qwen3-0.6b").parameters())
    assert sum(s["parameters"] for s in found["stages"]) == whole + copy
