"""LoRA under pipeline stages: the adapters laid out on the stages as at pp=1 (after the tp styles,
before FSDP), seeded alike, trained alone; the weights go out merged from the stages that hold
them, or as PEFT's adapters. At pp2 a run is the one-rank run step for step (loss and gradient
norm), and its merged export is the one-rank run's; on a model whose embeddings are tied too."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"
LORA = ("--lora-r", 4, "--lora-targets", "model.layers.*.self_attn.*_proj,model.layers.*.mlp.*_proj")


def steps(stdout: str) -> list[tuple[str, str]]:
    """Each step line's loss and gradient norm, as printed."""
    return [
        (line.split(" loss ")[1].split()[0], line.split(" grad_norm ")[1].split()[0])
        for line in stdout.splitlines()
        if line.startswith("step ")
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_at_pp2_is_the_one_rank_run_and_exports_its_merged_weights(tmp_path):
    flags = (*LORA, "--steps", 3, "--lr", 0.01)
    code, one, err = forked_cli("apply", QWEN3, *flags, "--nproc-per-node", 1, "--export-hf", tmp_path / "one")
    assert code == 0, err
    code, staged, err = forked_cli(
        "apply", QWEN3, *flags, "--pp", 2, "--export-hf", tmp_path / "pp2", "--save", tmp_path / "ck"
    )
    assert code == 0, err
    assert steps(staged) == steps(one) and len(steps(one)) == 3
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "pp2"))
    assert sorted(got) == sorted(want) and not any("lora" in k for k in got)
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) <= 1e-6
    # the adapters alone, from the checkpoint of adapters alone, as PEFT's folder
    code, out, err = forked_cli(
        "apply", QWEN3, *flags, "--pp", 2, "--resume", tmp_path / "ck", "--export-hf", tmp_path / "adapters",
        "--export-adapters",
    )
    assert code == 0, err
    adapters = load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    meta = json.loads(next((tmp_path / "ck").glob("step-*/plancc.json")).read_text())
    assert meta["adapters_only"], "a LoRA checkpoint holds the adapters and their state, not the base"


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_lora_on_a_tied_model_at_pp2_is_the_one_rank_run(tmp_path):
    """The embedding and its lm_head copy frozen with the rest of the base: nothing to sum
    between the stages, and the export merged from the stages as at pp=1 (the extended tier: the
    default run has LoRA under stages above and tied stages in test_pipeline_tied)."""
    from .test_pipeline_tied import tied_folder

    folder = tied_folder(tmp_path / "tied")
    flags = ("--model", folder, *LORA, "--steps", 3, "--lr", 0.01)
    code, one, err = forked_cli("apply", QWEN3, *flags, "--nproc-per-node", 1, "--export-hf", tmp_path / "one")
    assert code == 0, err
    code, staged, err = forked_cli("apply", QWEN3, *flags, "--pp", 2, "--export-hf", tmp_path / "pp2")
    assert code == 0, err
    assert [float(x) for s in steps(staged) for x in s] == pytest.approx(
        [float(x) for s in steps(one) for x in s], rel=1e-6
    )
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "pp2"))
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) <= 1e-6
