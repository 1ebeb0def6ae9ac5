"""Pipeline stages under torch's schedules, through ``Policy`` (the engine; no runner API of its
own since issue 75), equal the unsharded model trained on the whole batch: loss, every stage's
gradients, the norm over every stage, with every schedule and several microbatches a stage;
and ``plancc apply --pp``'s checks, runs and exports."""

from __future__ import annotations

import pytest

from plancc.engine.pipeline.pipeline_stages import stage_layers

from .conftest import PLANS as PLANS_DIR
from .distributed import launch


def test_stages_cover_every_layer_once_in_order_the_first_taking_the_remainder():
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert [i for r in stage_layers(36, 8) for i in r] == list(range(36))
    with pytest.raises(ValueError, match="at least one"):
        stage_layers(2, 4)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layers,schedule,microbatches,virtual,held", [
    pytest.param(2, 2, "1f1b", 2, 1, [[0], [1]], marks=pytest.mark.extended),  # 1F1B at 4mb below, and the policy bars
    (2, 3, "1f1b", 4, 1, [[0, 1], [2]]),
    (2, 2, "gpipe", 4, 1, [[0], [1]]),
    (4, 4, "1f1b", 4, 1, [[0], [1], [2], [3]]),
    (2, 4, "interleaved_1f1b", 4, 2, [[0, 2], [1, 3]]),
    (2, 4, "zbv", 4, 2, [[0, 3], [1, 2]]),
], ids=["pp2-1f1b-2mb", "pp2-1f1b-4mb-uneven-stages", "pp2-gpipe-4mb", "pp4-1f1b-4mb", "pp2-interleaved-1f1b",
        "pp2-zbv"])
def test_a_pipeline_step_equals_the_unsharded_model_on_the_whole_batch(
        tmp_path, world, layers, schedule, microbatches, virtual, held):
    """``Policy`` with stages, through the engine (no runner of its own): each schedule and cut
    of the layers, one step on rows of every length against the unsharded model on all of them
    (loss, norm, every gradient of the rank's stages), and forward-only log-probs. Zero bubble
    and DualPipeV: test_policy_runs_two_stage_schedules_with_activation_checkpointing; pp x dp,
    pp x tp and pp x cp: tests/test_policy.py's layouts."""
    from .pipeline_worker import policy_schedule

    results = launch(policy_schedule, world, str(tmp_path), schedule, 1, world, virtual, microbatches, layers)
    for rank, r in results.items():
        assert r["loss"] <= 1e-5 and r["norm"] <= 1e-5 and r["grad"] <= 1e-5 and r["compared"] > 0, (rank, r)
        assert r["logprobs"] <= 1e-5, (rank, r)
        assert r["layers"] == held[rank], (rank, r)


def test_fewer_microbatches_than_ranks_is_refused_before_the_schedule_hangs():
    import torch
    from torch import nn

    from plancc.engine.pipeline.pipeline_stages import PipelineRunner

    with pytest.raises(ValueError, match="at least one per rank"):
        PipelineRunner([(0, nn.Linear(2, 2))], 4, microbatches=2, device=torch.device("cpu"))  # type: ignore[list-item]


def test_each_schedule_places_its_stages_and_v_schedules_take_exactly_two():
    from plancc.engine.pipeline.pipeline_stages import rank_stages

    assert rank_stages(1, 4, "interleaved_1f1b", 3) == [1, 5, 9]
    assert rank_stages(0, 4, "zbv", 2) == [0, 7]
    with pytest.raises(ValueError, match="exactly two stages"):
        rank_stages(0, 4, "dualpipev", 1)
    with pytest.raises(ValueError, match="one stage a rank"):
        rank_stages(0, 4, "1f1b", 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        rank_stages(0, 4, "1f2b", 1)


PIPELINE_PLAN = """plancc: 1
name: qwen3-pp
architectures: [Qwen3ForCausalLM]
tensor_parallel:
  model.layers.*.mlp: shared_input
  model.layers.*.mlp.gate_proj: colwise
  model.layers.*.mlp.up_proj: colwise
  model.layers.*.mlp.down_proj: rowwise
pipeline:
  schedule: SCHEDULE
  microbatches: MICRO
  virtual_stages_per_rank: VIRTUAL
  stages:
    - [model.embed_tokens, "model.layers.[0-17]"]
    - ["model.layers.[18-35]", model.norm, lm_head]
"""


def _pipeline_problems(tmp_path, model="qwen3-8b", schedule="1f1b", micro=4, virtual=1, replace=(), **layout):
    import plancc

    text = PIPELINE_PLAN.replace("SCHEDULE", schedule).replace("MICRO", str(micro)).replace("VIRTUAL", str(virtual))
    for old, new in replace:
        text = text.replace(old, new)
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return [d for d in plancc.check_plan(plancc.load_plan(path), model, **layout) if d.rule == "pipeline"]


def test_a_pipeline_section_whose_stages_cover_every_layer_in_order_passes(tmp_path):
    assert _pipeline_problems(tmp_path, pp=2, tp=2, world_size=8) == []
    assert _pipeline_problems(tmp_path, pp=1, world_size=8) == []  # read only with --pp


@pytest.mark.parametrize("kwargs,found", [
    (dict(replace=[("[18-35]", "[18-34]")]), "1 decoder layers in no stage, the first model.layers.35"),
    (dict(replace=[("[18-35]", "[17-35]")]), "model.layers.17 is in stage 0 and stage 1"),
    (dict(replace=[('["model.layers.[18-35]", model.norm, lm_head]', '["model.layers.[18-35]", lm_head]'),
                   ('[model.embed_tokens, "model.layers.[0-17]"]', '["model.layers.[0-17]", model.norm]')]),
     "model.norm in stage 0"),
    (dict(replace=[("model.embed_tokens, ", ""), ("model.norm, lm_head", "model.norm, lm_head, model.embed_tokens")]),
     "model.embed_tokens in stage 1"),
    (dict(micro=2, pp=4, world_size=8), "2 microbatches for pp=4"),
    (dict(virtual=2), "1f1b runs one stage a rank, not 2"),
    (dict(schedule="zbv"), "zbv runs exactly two stages a rank (a V), not 1"),
    (dict(schedule="interleaved_1f1b", virtual=2), "2 stages listed for pp=2 x 2 a rank = 4"),
    (dict(replace=[("model.norm, lm_head", "model.nrom, lm_head")]), "stage 1's glob 'model.nrom' matches no module"),
    (dict(replace=[("model.norm, lm_head", "'model.[norm', lm_head")]), "has an unclosed '['"),
], ids=["layer-missing", "layer-twice", "norm-first", "embedding-last", "microbatches", "v-on-1f1b", "zbv-one",
        "stage-count", "typo", "malformed"])
def test_the_pipeline_check_names_what_cannot_run(tmp_path, kwargs, found):
    layout = {k: kwargs.pop(k) for k in ("pp", "cp", "ep", "tp", "world_size") if k in kwargs}
    layout.setdefault("pp", 2)
    layout.setdefault("world_size", 4)
    problems = _pipeline_problems(tmp_path, **kwargs, **layout)
    assert any(found in p.message for p in problems), [p.message for p in problems]
    assert all(p.is_error and p.line > 0 and p.fix for p in problems)


def test_too_few_layers_for_the_stages_is_refused_without_stage_globs(tmp_path):
    import plancc

    path = tmp_path / "plan.yaml"
    path.write_text((PLANS_DIR / "qwen3.yaml").read_text().replace("schedule: 1f1b\n", "schedule: 1f1b\n  microbatches: 4\n"))
    problems = [d for d in plancc.check_plan(plancc.load_plan(path), "tiny-qwen3", pp=4, world_size=4)
                if d.rule == "pipeline"]
    assert problems and "2 decoder layers for 4 stages" in problems[0].message


def test_the_layout_counts_pipeline_ranks_and_apply_checks_the_stages_before_launch(cli):
    from plancc.layout import Layout

    layout = Layout.infer(world_size=16, pp=2, tp=2)
    assert (layout.dp, layout.world_size, layout.to_json()["pp"]) == (4, 16, 2)
    assert layout.describe().startswith("pp=2 dp=4") and "pp" not in Layout(dp=2).to_json()
    code, out, err = cli("validate", "plans/qwen3.yaml", "--model", "tiny-qwen3", "--pp", 4, "--world-size", 4)
    assert code == 1 and "2 decoder layers for 4 stages" in out + err
    code, out, err = cli("apply", "plans/qwen3.yaml", "--pp", 4, "--nproc-per-node", 4)
    assert code == 1 and "2 decoder layers for 4 stages" in out + err  # no process started


def test_explain_gives_each_stage_its_layers_and_bytes_summing_to_the_whole(cli, tmp_path):
    """The plan's stage globs decide the layers; every parameter is in one stage, so the stages'
    per-rank bytes add up to the whole model's at the same tp and dp; without globs the layers
    split evenly, the first stages taking the remainder."""
    import json

    path = tmp_path / "plan.yaml"
    path.write_text(PIPELINE_PLAN.replace("SCHEDULE", "1f1b").replace("MICRO", "4").replace("VIRTUAL", "1"))
    code, out, err = cli("explain", str(path), "--model", "qwen3-8b", "--pp", 2, "--tp", 2, "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    stages = found["stages"]
    assert [s["layers"] for s in stages] == [list(range(18)), list(range(18, 36))]
    assert sum(s["parameter_bytes"] for s in stages) == found["per_rank_bytes"]["parameters"]
    code, out, err = cli("explain", "plans/qwen3.yaml", "--model", "qwen3-8b", "--pp", 8)
    assert code == 0 and "stage 7 (pp rank 7): layers 32-35" in out and "stage 0 (pp rank 0): layers 0-4" in out, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_policy_with_stages_gives_logprobs_reference_weights_and_checkpoints_of_the_whole_model(tmp_path):
    """``Policy(pp=2)``: log-probs equal the unsharded model's (0 at padding); offloaded, its
    log-probs, weights, save and load refused until onloaded, then the same bits; after a step
    the reference's are the initial weights' bit for bit; ``weights()`` yields every parameter of the whole model in its order; a save loads at
    pp=2 bit for bit and at pp=1 (dp=2) within fp32, and the next step's loss agrees (the
    optimizer's state came along). It is a ``plancc.Policy``: from the same checkpoint, its
    ``weights(bucket_bytes=, dtype=)``, manifest and ``export_hf`` folder equal pp=1's bit for bit."""
    from .distributed import launch
    from .pipeline_worker import policy_calls

    results = launch(policy_calls, 2, str(tmp_path / "ckpt"))
    for rank, r in results.items():
        assert r["lp_diff"] <= 1e-5 and r["outside"] == 0.0, (rank, r)
        assert r["moved"] > 1e-3 and r["reference"] == 0.0, (rank, r)
        assert r["names"] and r["weights_diff"] == 0.0, (rank, r)
        assert r["step"] == 1 and r["resumed"] == 0.0 and r["at_pp1"] <= 1e-5, (rank, r)
        assert r["second"] <= 1e-5, (rank, r)
        assert "offloaded; call onload() first" in r["refused"] and r["back"] == 0.0, (rank, r)
        refused = [line.split(":")[0] for line in r["refused"].splitlines()]
        assert refused == ["logprobs", "weights", "save", "load"], (rank, r)
        # one Policy: its weights out (any WeightFormat), manifest and export_hf are pp=1's
        assert r["is_policy"] and r["same_stream"] and r["same_manifest"], (rank, r)
    assert results[0]["exported"], results[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_with_numbered_optimizer_groups_still_loads(tmp_path):
    from .pipeline_worker import legacy_checkpoint

    for rank, r in launch(legacy_checkpoint, 2, str(tmp_path / "ckpt")).items():
        assert r["numbered"] and r["weights"] == 0.0 and r["moments"] == 0.0, (rank, r)
        assert r["betas"] == [0.9, 0.999], (rank, r)


# ----------------------------------------------------------------------------- `plancc apply --pp`
def _uneven_rows(path, rows=16, seed=0):
    import json

    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (rows,), generator=gen).tolist()
    path.write_text("".join(json.dumps({"input_ids": torch.randint(0, 256, (n,), generator=gen).tolist()}) + "\n"
                            for n in lengths))
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_pp2_dp2_verifies_on_rows_of_every_length(tmp_path):
    """`plancc apply --pp 2 --verify` on a data file of rows 5-39 tokens long: each dp rank's rows
    go through the stages unpadded, a schedule step a length; logits, loss, every stage's
    gradients and the losses after two steps equal the unsharded model's on the whole batch."""
    from .conftest import forked_cli

    data = _uneven_rows(tmp_path / "rows.jsonl")
    code, out, err = forked_cli("apply", PLANS_DIR / "qwen3.yaml", "--nproc-per-node", 4, "--pp", 2, "--verify",
                                "--steps", 2, "--batch-size", 8, "--micro-batch-size", 2, "--data", data)
    assert code == 0, err + out
    assert "pp=2 dp=2" in out and "verify: OK" in out and "over 25 parameters" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_pp2_cp2_verifies_on_rows_of_every_length(tmp_path):
    """Context parallelism inside each stage: the first stage keeps its cp rank's load-balanced
    shard of a row's tokens, every stage attends over the gathered keys, the last stage's
    log-probs are gathered whole; rows of every length padded on the right to a multiple of
    2 x cp. Logits, loss, gradients and the losses after two steps equal the unsharded model's."""
    from .conftest import forked_cli

    data = _uneven_rows(tmp_path / "rows.jsonl", rows=8, seed=3)  # the longest 37 tokens: no multiple of 4
    code, out, err = forked_cli("apply", PLANS_DIR / "qwen3.yaml", "--nproc-per-node", 4, "--pp", 2, "--cp", 2,
                                "--verify", "--steps", 2, "--batch-size", 8, "--data", data)
    assert code == 0, err + out
    assert "pp=2 dp=1 cp=2 tp=1" in out and "verify: OK" in out and "over 25 parameters" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pp2_run_resumes_without_stages_and_verifies_resumed_with_them(tmp_path):
    """Checkpoints keyed by the model's names: a pp=2 run's checkpoint resumes at dp=2 (its
    step, the schedule's position) and `--verify --resume` at pp=2 starts both models from it.
    The pp=2 run's `--export-hf` folder is the whole model, as transformers writes it."""
    from safetensors.torch import load_file

    from plancc.engine.parallel_model import seeded_model
    from plancc.models import load_config

    from .conftest import forked_cli

    ckpt = tmp_path / "ckpt"
    code, out, err = forked_cli("apply", PLANS_DIR / "qwen3.yaml", "--pp", 2, "--steps", 2, "--save", ckpt,
                                "--export-hf", tmp_path / "hf")
    assert code == 0 and "saved checkpoint" in out and "exported Hugging Face weights" in out, err + out
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    whole = seeded_model(load_config("tiny-qwen3"), 0).state_dict()
    assert {n: tuple(t.shape) for n, t in exported.items()} == {n: tuple(t.shape) for n, t in whole.items()}
    code, out, err = forked_cli("apply", PLANS_DIR / "qwen3.yaml", "--steps", 3, "--resume", ckpt)
    assert code == 0 and "resumed from step 2 (saved at pp=2 dp=1" in out and "step    3/3" in out, err + out
    code, out, err = forked_cli("apply", PLANS_DIR / "qwen3.yaml", "--pp", 2, "--steps", 1, "--resume", ckpt,
                                "--verify")
    assert code == 0 and "the checkpoint of step 2" in out and "verify: OK" in out, err + out


@pytest.mark.timeout(300)
def test_the_dry_run_lays_out_rank_zeros_stages_at_the_real_world_size():
    """`validate --dry-run --pp`: rank 0's stages (the embedding and the first layers) built,
    laid out and run forward and backward on fake ranks; a 405B-class layout included."""
    import plancc
    from plancc.layout import Layout
    from plancc.models import load_config
    from plancc.tools.dryrun import dry_run

    plan = plancc.load_plan(PLANS_DIR / "qwen3.yaml")
    config = load_config("tiny-qwen3")
    whole = dry_run(plan, config, Layout(dp=1), seq_len=16)
    staged = dry_run(plan, config, Layout(dp=1, pp=2), seq_len=16)
    assert whole.ok and staged.ok, staged.diagnostics
    assert 0 < staged.param_bytes < whole.param_bytes and staged.grad_bytes == staged.param_bytes
    big = dry_run(plancc.load_plan(PLANS_DIR / "llama.yaml"), load_config("llama-3.1-405b"),
                  Layout(pp=8, dp=8, tp=8), seq_len=16)
    assert big.ok, big.diagnostics
    # 16 of 126 layers and the embedding, fp32, over tp 8 x dp 8: about 3.1 GiB a rank
    assert 2.9 * 2**30 < big.param_bytes < 3.3 * 2**30, big.param_bytes


@pytest.mark.slow
@pytest.mark.extended  # the tied pp2 x tp2 + SP verify in test_pipeline_tied: a folder, rows of odd lengths
@pytest.mark.timeout(300)
def test_apply_pp2_tp2_with_sequence_parallelism_from_a_model_folder_verifies_on_rows_of_odd_lengths(tmp_path):
    """SP inside each stage: a stage sends its tp rank's shard of the sequence; rows of odd
    length are padded on the right to a multiple of tp (after their last token: no real position
    sees it) and their positions are the whole sequence's. The weights are a Hugging Face
    folder's, read into the stages under TP (rank 0 reads, every stage's ranks get their slices)
    and verified against the same folder unsharded. (One launch for both: it was two.)"""
    import torch

    from plancc.models import build_model, load_config

    from .conftest import forked_cli

    torch.manual_seed(5)
    build_model(load_config("tiny-qwen3"), device="cpu").save_pretrained(tmp_path / "model")
    data = _uneven_rows(tmp_path / "rows.jsonl", rows=4, seed=3)
    code, out, err = forked_cli("apply", PLANS_DIR / "qwen3.yaml", "--model", tmp_path / "model",
                                "--nproc-per-node", 4, "--pp", 2, "--tp", 2, "--sp", "--verify", "--steps", 2,
                                "--batch-size", 4, "--data", data)
    assert code == 0, err + out
    assert "pp=2 dp=1 cp=1 tp=2 +sp" in out and "verify: OK" in out
    assert f"safetensors from {tmp_path / 'model'}" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("schedule", "cp"),
    # ZBV at cp2 in the extended tier: DualPipeV covers the V schedules' forward-only walk,
    # Interleaved 1F1B at cp2 the recomputation after later microbatches' forwards
    [("zero_bubble", 1), ("dualpipev", 1), ("interleaved_1f1b", 2), pytest.param("zbv", 2, marks=pytest.mark.extended)],
)
def test_policy_runs_two_stage_schedules_with_activation_checkpointing(tmp_path, schedule, cp):
    """The plan's activation checkpointing inside stages that torch's zero-bubble schedules split
    into input- and weight-gradient passes, and under context parallelism inside schedules that
    run later microbatches' forwards before a checkpointed layer's recomputation: exact against
    the unsharded model; log-probs too (torch's V schedules cannot run forward only: the stages
    run in order instead)."""
    from .pipeline_worker import policy_schedule

    for rank, r in launch(policy_schedule, 2 * cp, str(tmp_path), schedule, cp).items():
        assert r["sequence_shards"] == ([cp] if cp > 1 else []), (rank, r)  # half of every row under cp
        assert r["logprobs"] <= 1e-5, (rank, r)  # forward only, V schedules included
        assert r["loss"] <= 1e-5 and r["norm"] <= 1e-5 and r["grad"] <= 1e-5 and r["compared"] > 0, (rank, r)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("plan", "packed", "cp"), [
    ("qwen3", False, 1), ("qwen3", True, 1),
    ("qwen3", True, 2),  # packed rows beside cp in the stages: the training side is test_policy's pp2xcp2 bars
    # Gemma 3: a rotary per layer type and sliding windows of 8 (rows of up to 39 tokens);
    # gpt-oss: an eager attention (for its sinks) that masks only by the mask it is given
    ("gemma3", False, 1), ("gpt_oss", False, 1), ("gpt_oss", True, 1),
], ids=["by-length", "packed", "packed-cp2", "gemma3", "gpt-oss", "gpt-oss-packed"])
def test_logprobs_with_stages_verify_against_the_unsharded_model(tmp_path, plan, packed, cp):
    """`plancc logprobs --pp 2`: rows of every length through the stages, the last stage's
    log-probs (and entropy) written by rank 0, equal to the unsharded model's. With --pack the
    rows go packed end to end (one schedule step), each attending to itself alone; with --cp 2
    as well, each document by the ids the cp attention reads from the packed positions. A stage
    gives each layer the rotary embedding and mask the model's own forward would."""
    import json

    from .conftest import forked_cli

    data = _uneven_rows(tmp_path / "rows.jsonl", rows=6, seed=1)
    out = tmp_path / "lp.jsonl"
    model = [] if plan == "qwen3" else ["--model", f"tiny-{plan.replace('_', '-')}"]
    code, stdout, err = forked_cli("logprobs", PLANS_DIR / f"{plan}.yaml", *model, "--data", data, "--pp", 2, "--entropy",
                                   "--verify", "--out", out, *(["--pack"] if packed else []),
                                   *(["--cp", cp, "--nproc-per-node", 2 * cp] if cp > 1 else []))
    assert code == 0 and "verify: max |logprob diff|" in stdout and "OK" in stdout, err + stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = [len(json.loads(line)["input_ids"]) for line in data.read_text().splitlines()]
    assert [len(r["logprobs"]) for r in rows] == lengths and all(len(r["entropy"]) == n for r, n in zip(rows, lengths))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_plans_stage_globs_decide_what_each_rank_holds(tmp_path):
    from .pipeline_worker import policy_with_plan_stages

    results = launch(policy_with_plan_stages, 2, str(tmp_path))
    assert results[0]["layers"] == [0] and results[1]["layers"] == [1, 2, 3], results
    assert all(r["loss"] <= 1e-5 for r in results.values()), results


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_dp_ranks_refused_loss_is_every_ranks_and_its_metrics_are_agreed():
    from .pipeline_worker import refusal_on_one_dp_rank

    results = launch(refusal_on_one_dp_rank, 4)
    for rank, r in results.items():
        assert "dp rank 1 refuses" in r["refused"] and r["unchanged"], (rank, r)
        assert r["only_dp0"] is not None and r["only_dp0"] > 0, (rank, r)


def test_the_first_and_last_stages_can_be_lighter_by_the_embedding_and_the_lm_head(tmp_path):
    """``first_stage_less_layers`` / ``last_stage_less_layers`` (torchtitan's): the embedding and
    the lm_head count as layers in the even split; the plan's check refuses a split that leaves a
    middle stage empty, and the runtime and ``explain --pp`` cut where the check says."""
    import plancc
    from plancc.compiler.plan import PipelineSpec
    from plancc.models import build_model, load_config
    from plancc.engine.pipeline.pipeline_stages import plan_stage_layers
    from plancc.tools.explain_stages import stages_of

    assert stage_layers(6, 4, 1, 1) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert [len(r) for r in stage_layers(126, 8, 1, 1)] == [15, 16, 16, 16, 16, 16, 16, 15]  # Llama 3.1 405B
    assert stage_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert stage_layers(3, 3, 2, 2) == [range(0, 1), range(1, 3), range(3, 3)]  # the lm_head's stage alone
    with pytest.raises(ValueError, match="a stage would hold -1"):
        stage_layers(3, 3, 3, 0)
    spec = PipelineSpec(schedule="interleaved_1f1b", virtual_stages_per_rank=2, first_stage_less_layers=1,
                        last_stage_less_layers=1, microbatches=4)
    config = load_config("tiny-qwen3")
    config.num_hidden_layers, config.layer_types = 6, ["full_attention"] * 6
    assert plan_stage_layers(build_model(config, device="meta"), spec, 2) == [[0], [1, 2], [3, 4], [5]]
    assert stages_of(spec, 6, 2, None) == {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3}
    path = tmp_path / "plan.yaml"
    path.write_text((PLANS_DIR / "qwen3.yaml").read_text().replace(
        "schedule: 1f1b\n", "schedule: 1f1b\n  first_stage_less_layers: 4\n"))
    problems = [d for d in plancc.check_plan(plancc.load_plan(path), "tiny-qwen3", pp=2, world_size=2)
                if d.rule == "pipeline"]
    assert problems and "a stage would hold" in problems[0].message, problems


def test_layers_per_stage_derives_the_stage_count_from_the_models_layers(tmp_path):
    """``layers_per_stage`` (torchtitan's): the layers plus the embedding's and the lm_head's
    weights cut that many a stage, over pp ranks -- Llama 3.1 405B's 126 layers at 16 a stage with
    both ends one lighter are 8 stages, one a rank at pp=8 and two at pp=4; a count that is not
    whole rounds of pp, or not what the schedule runs, is refused at the plan's line; so is a plan
    giving it beside ``virtual_stages_per_rank``."""
    import plancc
    from plancc.compiler.plan import PipelineSpec
    from plancc.errors import PlanError
    from plancc.models import build_model, load_config
    from plancc.engine.pipeline.pipeline_stages import plan_stage_layers

    lighter = {"first_stage_less_layers": 1, "last_stage_less_layers": 1}
    assert PipelineSpec(schedule="1f1b", layers_per_stage=16, **lighter).per_rank(126, 8) == 1
    assert PipelineSpec(schedule="interleaved_1f1b", layers_per_stage=16, **lighter).per_rank(126, 4) == 2
    with pytest.raises(ValueError, match="1f1b runs one stage a rank, not 2"):
        PipelineSpec(schedule="1f1b", layers_per_stage=16, **lighter).per_rank(126, 4)
    with pytest.raises(ValueError, match="make 8 stages, not a multiple of pp=3"):
        PipelineSpec(schedule="1f1b", layers_per_stage=16, **lighter).per_rank(126, 3)

    config = load_config("tiny-qwen3")
    config.num_hidden_layers, config.layer_types = 6, ["full_attention"] * 6
    spec = PipelineSpec(schedule="interleaved_1f1b", layers_per_stage=2, microbatches=4, **lighter)
    assert plan_stage_layers(build_model(config, device="meta"), spec, 2) == [[0], [1, 2], [3, 4], [5]]

    def problems(extra: str, model: str, pp: int) -> list:
        path = tmp_path / "plan.yaml"
        path.write_text((PLANS_DIR / "qwen3.yaml").read_text().replace("schedule: 1f1b\n", f"schedule: 1f1b\n{extra}"))
        found = plancc.check_plan(plancc.load_plan(path), model, pp=pp, world_size=pp)
        return [d for d in found if d.rule == "pipeline"]

    assert problems("  layers_per_stage: 9\n", "qwen3-8b", 4) == []  # 36 layers, 9 a stage: one a rank
    refused = problems("  layers_per_stage: 12\n", "qwen3-8b", 2)  # 3 stages for 2 ranks
    assert refused and "make 3 stages, not a multiple of pp=2" in refused[0].message and refused[0].line > 0
    with pytest.raises(PlanError, match="both layers_per_stage and virtual_stages_per_rank"):
        problems("  layers_per_stage: 9\n  virtual_stages_per_rank: 1\n", "qwen3-8b", 4)


def test_packed_rows_fill_rows_by_the_token_budget_rule_and_come_back_at_their_batch_positions():
    """--pack under pp: rows (right or left padded) packed end to end, each with its own positions
    from 0 and the padding a document of its own; what the caller's loss sees is the batch's rows
    again, 0 at each row's first position (nothing in the row predicts it)."""
    import torch

    from plancc.engine.pipeline.pipeline_rows import PipelineRows

    ids = torch.tensor([[11, 12, 13, 14, 15, 0], [0, 0, 0, 21, 22, 23], [31, 32, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    rows = PipelineRows.of({"input_ids": ids, "attention_mask": mask}, micro_batch_size=None, max_tokens=6,
                           microbatches=2, pack=True)
    (group,) = rows.groups()
    assert group.input_ids.tolist() == [[11, 12, 13, 14, 15, 0], [21, 22, 23, 31, 32, 0]]
    assert group.positions.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]]
    assert group.microbatches == 2 and rows.input_tokens == 10
    lp, fields = group.loss_view(group.input_ids[1:].float(), torch.tensor([1]), {})  # microbatch: bin 1
    assert fields["input_ids"].tolist() == [[0, 0, 0, 21, 22, 23], [31, 32, 0, 0, 0, 0]]  # bin 1's rows, as given
    assert lp.tolist() == [[0, 0, 0, 0, 22, 23], [0, 32, 0, 0, 0, 0]]
    out = torch.zeros(3, 6)
    group.place(out, group.input_ids.float(), torch.tensor([0, 1]), predicted=True)
    assert out.tolist() == [[0, 12, 13, 14, 15, 0], [0, 0, 0, 0, 22, 23], [0, 32, 0, 0, 0, 0]]
