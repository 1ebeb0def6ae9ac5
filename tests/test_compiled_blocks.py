"""The plan's ``compile:`` section: each decoder block ``torch.compile``d (torchtitan's per-block
compile), after the TP styles and activation checkpointing and before FSDP2, exact against the
unsharded eager model; the layouts it does not run at refused before launch. The suite traces
with the ``aot_eager`` backend (forward and backward graphs, run eagerly: what dynamo and AOT
autograd make of the blocks, in seconds); ``inductor``'s generated kernels are exercised by
``bench/compiled_blocks.sh`` (a minute of C++ compilation a process on this CPU; docs/performance.md has its results)."""

import pytest

from .conftest import PLANS


def _plan(tmp_path, section="compile: {backend: aot_eager}\n"):
    path = tmp_path / "plan.yaml"
    path.write_text((PLANS / "qwen3.yaml").read_text() + section)
    return path


def test_the_compile_section_is_read_and_its_layouts_checked(tmp_path):
    import plancc
    from plancc.runtime.compile import decoder_blocks

    plan = plancc.load_plan(_plan(tmp_path, "compile: true\n"))
    assert plan.compile is not None and plan.compile.backend == "inductor" and not plan.compile.fullgraph
    assert plancc.load_plan(_plan(tmp_path, "compile: false\n")).compile is None

    def problems(**layout):
        return [d for d in plancc.check_plan(plan, "qwen3-8b", **layout) if d.rule == "compile"]

    assert problems(world_size=8) == [] and problems(tp=2, cp=2, world_size=8) == []
    path = _plan(tmp_path, "compile: true\n")
    path.write_text(path.read_text().replace("schedule: 1f1b\n", "schedule: dualpipev\n  virtual_stages_per_rank: 2\n"))
    staged = plancc.load_plan(path)
    refused = [d for d in plancc.check_plan(staged, "qwen3-8b", pp=2, world_size=8) if d.rule == "compile"]
    assert refused and "dualpipev schedule" in refused[0].message and refused[0].line > 0
    with pytest.raises(plancc.PlanError, match="compile"):
        plancc.load_plan(_plan(tmp_path, "compile: {backend: tvm}\n"))
    from plancc.models import build_model, load_config

    model = build_model(load_config("tiny-qwen3"), device="meta")
    assert decoder_blocks(model) == list(model.model.layers)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout",
    [
        # the default run: the TP styles' DTensors inside the graphs, FSDP around them (over one
        # rank); the extended tier: SP's shards, FSDP over two, cp's gathers, pipeline stages
        pytest.param(["--dp", "2"], marks=pytest.mark.extended),
        ["--tp", "2"],  # where rows of a new length overflowed the recompiled backward's stack
        pytest.param(["--tp", "2", "--sp"], marks=pytest.mark.extended),
        pytest.param(["--cp", "2"], marks=pytest.mark.extended),
        pytest.param(["--pp", "2"], marks=pytest.mark.extended),
    ],
    ids=["dp2", "tp2", "tp2-sp", "cp2", "pp2"],
)
def test_compiled_blocks_verify_against_the_unsharded_eager_model(tmp_path, layout):
    """FSDP2 around compiled blocks (each block's graph holds its checkpointed MLP's
    recomputation), the TP styles' DTensors and SP's sequence shards traced into the graphs, the
    cp attention's gathers, and compiled blocks inside pipeline stages: logits, loss, gradients
    and the loss after a step equal the unsharded eager model's -- on rows whose length changes
    between the steps."""
    import json

    from .conftest import forked_cli

    # rows whose length changes from step to step (each block recompiles for the new shape: the
    # recompiled backward overflowed the stack at tp=2 with dynamic shapes)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(1, n + 1))}) + "\n" for n in (12, 12, 21, 21)))
    code, out, err = forked_cli("apply", _plan(tmp_path), "--nproc-per-node", 2, *layout, "--verify", "--steps", 2,
                                "--data", data, "--batch-size", 2)
    assert code == 0, err + out
    assert "verify: OK" in out


def test_compile_with_lora_is_one_answer_from_every_entry_point(tmp_path, cli, one_rank):
    """The plan's lora: section was refused beside compile:, the --lora flags accepted: the same
    refusal now from the plan, the flags and Policy(lora=...), at the compile: line."""
    import plancc

    path = _plan(tmp_path)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), start=1) if text.startswith("compile:"))
    code, _, err = cli("apply", path, "--lora-r", 4, "--lora-targets", "model.layers.*.self_attn.q_proj")
    assert code == 1 and f"{path}:{line}:" in err and "[compile]" in err and "--lora-r/--lora-targets" in err
    with_section = tmp_path / "lora.yaml"
    with_section.write_text(path.read_text() + "lora: {r: 4, targets: [model.layers.*.self_attn.q_proj]}\n")
    (found,) = [d for d in plancc.check_plan(plancc.load_plan(with_section), "tiny-qwen3") if d.rule == "compile"]
    assert found.line == line and "LoRA adapters (the plan's lora: section)" in found.message
    with pytest.raises(plancc.PlanError, match=r"LoRA adapters \(lora=\)"):
        plancc.Policy(path, "tiny-qwen3", device="cpu", lora={"r": 4, "targets": ["model.layers.*.self_attn.q_proj"]})
