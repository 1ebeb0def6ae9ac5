"""``plancc suggest`` (issue 42): the layouts a plan allows for a model on N GPUs, costed and
ranked before any GPU is touched. Pinned here: only layouts the plan's checks pass are
costed; the fitting ones come first, fastest first; the per-rank parameter, gradient and
AdamW bytes are what the dry run's parallelized model holds; each kind of bad input is one
diagnostic with exit 1 (2 for flags); the checks reused across layouts say what a fresh check
says; the predicted peak is set beside one measured in the dry run's fake world (--verify-top).
The cost model, and its figures against measured peaks and published runs: docs/suggest.md."""

import json
import subprocess
import sys

import pytest

import plancc
from plancc.errors import PlanError


@pytest.fixture(scope="module")
def qwen3_8b_on_16():
    return plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=16, seq_len=8192, allow=("sp", "cp"))


def test_only_layouts_the_plans_checks_pass_are_costed(qwen3_8b_on_16):
    result = qwen3_8b_on_16
    layouts = {c.layout for c in result.candidates}
    assert all(c.layout.world_size == 16 for c in result.candidates)
    # Qwen3-8B has 8 KV heads: tp 16 would split one; the nodes have 8 GPUs: tp stays within one
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    assert all(not (lay.sequence_parallel and lay.tp == 1) for lay in layouts)


def test_the_fastest_fitting_layout_comes_first(qwen3_8b_on_16):
    result = qwen3_8b_on_16
    fitting = [c for c in result.candidates if c.fits]
    assert fitting and result.best is fitting[0]
    assert [c.time.total for c in fitting] == sorted(c.time.total for c in fitting)
    assert all(not c.fits for c in result.candidates[len(fitting) :])
    assert all(c.memory.total <= result.gpu_memory for c in fitting)


def test_memory_grows_as_the_gpus_shrink():
    big = plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=16, seq_len=4096, allow=())
    small = plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=16, seq_len=4096, allow=(), gpu_memory=24 * 2**30)
    assert big.best is not None and small.best is not None
    assert small.best.memory.total <= 24 * 2**30 < big.best.memory.total or small.best == big.best


@pytest.mark.parametrize("layout", [{"tp": 2, "dp": 2}, {"tp": 2, "dp": 1, "cp": 2}], ids=["dp2xtp2", "cp2xtp2"])
def test_parameter_gradient_and_adamw_bytes_are_the_dry_runs(layout):
    """At every moment of the step a rank holds its parameter shards and AdamW's state, the dry
    run's bytes; the gradients exist from backward on (all of them at its end), none in forward."""
    from plancc.compiler.resolve import resolve_sections
    from plancc.layout import Layout
    from plancc.models import build_meta_model, load_config
    from plancc.tools.dryrun import dry_run
    from plancc.tools.suggest_costs import _shape, step_ends

    chosen = Layout(**layout)
    result = plancc.suggest("plans/qwen3.yaml", "tiny-qwen3", gpus=chosen.world_size, seq_len=64, allow=("cp",))
    (candidate,) = [c for c in result.candidates
                    if c.layout == chosen and c.checkpointing == "none" and c.reshard_after_forward]
    measured = dry_run(plancc.load_plan("plans/qwen3.yaml"), load_config("tiny-qwen3"), chosen, seq_len=64)
    assert measured.ok
    model = build_meta_model("tiny-qwen3")
    (resolved, *_), _ = resolve_sections(plancc.load_plan("plans/qwen3.yaml"), model)
    ends = {m.at: m for m in step_ends(model, resolved, chosen, _shape(model, resolved, ()), 64, "none")}
    assert set(ends) == {"forward", "backward start", "backward end", "optimizer step"}
    assert {(m.parameters, m.optimizer) for at, m in ends.items() if at != "optimizer step"} == {
        (measured.param_bytes, measured.optimizer_bytes)
    }
    assert ends["forward"].gradients == ends["backward start"].gradients == 0
    assert ends["backward end"].gradients == ends["optimizer step"].gradients == measured.grad_bytes
    # AdamW's foreach update (CUDA) makes one temporary as large as the gradients
    assert ends["optimizer step"].optimizer == measured.optimizer_bytes + measured.grad_bytes
    assert candidate.memory.parameters == measured.param_bytes and candidate.memory.at in ends


def test_the_cli_prints_the_table_and_the_command_of_the_best(cli):
    code, out, err = cli("suggest", "plans/qwen3.yaml", "--model", "qwen3-8b", "--gpus", "16", "--seq-len", "8192")
    assert code == 0, err
    assert "best: " in out and "plancc apply plans/qwen3.yaml --model qwen3-8b --tp " in out
    code, out, err = cli("suggest", "plans/qwen3.yaml", "--model", "qwen3-8b", "--gpus", "8", "--format", "json")
    found = json.loads(out)
    assert code == 0 and found["best"]["fits"] and found["command"].startswith("plancc apply")
    assert isinstance(found["plan_edits"], list) and "#" not in found["command"]
    assert found["candidates"][0] == found["best"]


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--gpus", "12", "--gpus-per-node", "8"], 1, ["whole nodes"]),
        (["--gpus", "8", "--hardware", "tpu9"], 1, ["unknown hardware 'tpu9'", "h100"]),
        (["--gpus", "8", "--gpu-memory", "4GiB"], 1, ["no layout of 8 GPUs fits 4 GiB", "needs"]),
        (["--gpus", "8", "--gpu-memory", "lots"], 2, ["not a size"]),
        (["--gpus", "8", "--allow", "zz"], 2, ["unknown axis 'zz'", "sp,cp,ep,pp"]),
        (["--gpus", "8", "--model", "llama-3.1-8b"], 1, ["no layout of 8 GPUs passes the plan's checks"]),
    ],
    ids=["not-whole-nodes", "unknown-hardware", "too-little-memory", "bad-memory", "unknown-axis", "other-model"],
)
def test_bad_input_is_one_diagnostic(cli, args, code, words):
    if "--model" not in args:
        args = [*args, "--model", "qwen3-8b"]
    got, out, err = cli("suggest", "plans/qwen3.yaml", *args)
    assert got == code, out + err
    for word in words:
        assert word in out + err, out + err


def test_no_fit_names_the_smallest_layout_and_what_dominates_it():
    from plancc.tools.suggest_report import no_fit_problem

    plan = plancc.load_plan("plans/qwen3.yaml")
    result = plancc.suggest(plan, "qwen3-8b", gpus=8, seq_len=8192, gpu_memory=8 * 2**30)
    problem = no_fit_problem(result, plan)
    assert result.best is None and problem is not None
    assert "smallest" in problem.message and "most of it" in problem.message
    with pytest.raises(PlanError, match="unknown hardware"):
        plancc.suggest(plan, "qwen3-8b", gpus=8, hardware="tpu9")


@pytest.mark.parametrize(("plan", "model", "gpus"), [
    ("qwen3.yaml", "tiny-qwen3", 16),  # 4 heads, 2 KV heads: tp 4 and 8 fail, at different rules
    ("qwen3_moe.yaml", "tiny-qwen3-moe", 16),  # ep, and experts tp must divide
    ("deepseek_v3.yaml", "tiny-deepseek-v3", 8),  # MLA, dense layers before MoE ones
])
def test_the_checks_suggest_reuses_across_layouts_say_what_a_fresh_check_says(plan, model, gpus):
    """suggest keeps each rule's answer with the layout values the rule read, and reuses it at
    a layout of the same values: at every layout the diagnostics are a fresh check's, exactly."""
    from plancc.checks.rule_runner import check_at
    from plancc.checks.layout_memo import LayoutMemo
    from plancc.compiler.resolve import resolve_sections
    from plancc.models import build_meta_model
    from plancc.tools.suggest import layouts_for

    loaded = plancc.load_plan(f"plans/{plan}")
    meta = build_meta_model(model)
    resolved, _ = resolve_sections(loaded, meta)
    memo = LayoutMemo()
    layouts = layouts_for(gpus, allow=("sp", "cp", "ep"), max_tp=8)
    said = set()
    for layout in layouts:
        fresh = check_at(loaded, meta, layout, resolved=resolved, seq_len=4096)
        reused = check_at(loaded, meta, layout, resolved=resolved, seq_len=4096, memo=memo)
        assert [d.to_json() for d in reused] == [d.to_json() for d in fresh], layout
        said.update(d.rule for d in fresh if d.is_error)
    assert memo.reused > len(layouts)  # most rules read few sizes: their answers were reused
    assert said  # some layouts were refused: the answers differ by layout, not only reused
    # the context-parallel rule walks every decoder layer: once per cp size (and section), not per layout
    from plancc.checks import context_parallel
    assert len(memo.seen[context_parallel.__name__]) <= len({(x.cp, x.sequence_parallel) for x in layouts})


@pytest.fixture(scope="module")
def short_qwen3_0_6b(tmp_path_factory):
    """Qwen3-0.6B's real widths and vocabulary with 4 of its 28 layers: a measurement in seconds."""
    from plancc.models import presets

    path = tmp_path_factory.mktemp("configs") / "qwen3-0.6b-4-layers.json"
    path.write_text(json.dumps({**presets()["qwen3-0.6b"].config, "num_hidden_layers": 4}))
    return str(path)


@pytest.fixture(scope="module")
def qwen3_0_6b_small_vocab(tmp_path_factory):
    """Qwen3-0.6B's layers, 8 of them, under a vocabulary of 8192: the decoder layers' weights,
    not the embeddings, are most of the memory (what keeping them gathered changes)."""
    from plancc.models import presets

    path = tmp_path_factory.mktemp("configs") / "qwen3-0.6b-8-layers-8k-vocab.json"
    path.write_text(json.dumps({**presets()["qwen3-0.6b"].config, "num_hidden_layers": 8, "vocab_size": 8192}))
    return str(path)


@pytest.mark.parametrize(("sizes", "checkpointing", "reshard", "model"), [
    # the peak: the lm_head's gradient, the gathered embeddings, the layers' inputs
    ({"dp": 2}, "full", True, "short_qwen3_0_6b"),
    ({"dp": 2}, "none", True, "short_qwen3_0_6b"),  # every layer's activations
    ({"cp": 2}, "none", True, "short_qwen3_0_6b"),  # the keys and values gathered over the sequence (no mask)
    # every layer's unit kept gathered from its forward to its backward: 15% more here
    ({"dp": 2}, "full", False, "qwen3_0_6b_small_vocab"),
], ids=["dp2-full", "dp2-none", "cp2-none", "dp2-full-kept-gathered"])
def test_the_predicted_peak_is_within_10_percent_of_a_measured_step_and_the_shards_are_exact(
    request, sizes, checkpointing, reshard, model
):
    """One training step in the dry run's fake world (bf16 over fp32 masters, the fused lm_head loss,
    AdamW): the fp32 shards and AdamW state it holds are suggest's figures exactly, and the predicted
    total is within 10% of the measured peak."""
    from plancc.compiler.resolve import resolve_sections
    from plancc.layout import Layout
    from plancc.models import build_meta_model, load_config
    from plancc.tools.measured_memory import measure_step_memory
    from plancc.tools.suggest_costs import _shape, peak, step_ends

    config_path = request.getfixturevalue(model)
    plan = plancc.load_plan("plans/qwen3.yaml")
    layout = Layout(**sizes)
    config = load_config(config_path)
    measured = measure_step_memory(
        plan, config, layout, seq_len=2048, checkpointing=checkpointing, reshard_after_forward=reshard
    )
    model = build_meta_model(config_path)
    (resolved, *_), _ = resolve_sections(plan, model)
    shape = _shape(model, resolved, resolved.activation_checkpointing)
    want = peak(step_ends(
        model, resolved, layout, shape, 2048, checkpointing, None, 1, device="cpu", reshard_after_forward=reshard
    ))
    assert measured.parameters == want.parameters
    steps = 4 * len(list(model.parameters()))  # AdamW's step counter: one fp32 scalar a parameter
    if want.at != "optimizer step":  # whose temporaries the tracker files under the optimizer too
        assert measured.optimizer == want.optimizer + steps
    assert 0.9 <= want.total / measured.total <= 1.1, (want, measured)


def test_verify_top_prints_each_prediction_beside_its_measured_peak(cli, short_qwen3_0_6b):
    code, out, err = cli("suggest", "plans/qwen3.yaml", "--model", short_qwen3_0_6b, "--gpus", 2, "--seq-len", 1024,
                         "--allow", "sp", "--verify-top", 1)
    assert code == 0, err
    line = next(x for x in out.splitlines() if "measured" in x and "predicted" in x and "GiB" in x)
    assert line.split()[0].startswith("dp=") and "x;" in line, out


def test_keeping_units_gathered_is_searched_where_fsdp_shards_and_costs_memory_not_time():
    """reshard_after_forward=False: one all-gather per unit a step instead of two, every layer's
    bf16 weights held at the start of backward. A layout without FSDP ranks has nothing to keep.
    (In one pass each: with gradient accumulation the memory it costs is paid in passes.)"""
    one_pass = plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=16, seq_len=8192, allow=("sp", "cp"), accumulate=False)
    assert all(c.microbatches == 1 for c in one_pass.candidates)
    by_key = {}
    for c in one_pass.candidates:
        by_key.setdefault((c.layout, c.checkpointing), {})[c.reshard_after_forward] = c
    sharded = [pair for (layout, _), pair in by_key.items() if layout.fsdp_size > 1]
    assert sharded and all(set(pair) == {True, False} for pair in sharded)
    from plancc.tools.suggest_report import plan_edits

    for pair in sharded:
        kept, resharded = pair[False], pair[True]
        assert "fsdp: {reshard_after_forward: false}" in plan_edits(kept)
        assert not any("reshard" in edit for edit in plan_edits(resharded))
        assert kept.memory.total >= resharded.memory.total
        assert kept.time.total <= resharded.time.total and kept.time.fsdp <= resharded.time.fsdp
    # every layer's bf16 weights (2 bytes a parameter) held where, at the other end of backward,
    # the fp32 gradient shards are 4 / fsdp bytes: more memory from 4 FSDP ranks on (a tie at 2)
    wide = [pair for (layout, _), pair in by_key.items() if layout.fsdp_size >= 4]
    assert wide and all(pair[False].memory.total > pair[True].memory.total for pair in wide)
    two = plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=2, seq_len=4096, allow=())
    unsharded = [c for c in two.candidates if c.layout.tp == 2]  # dp=1: no FSDP ranks
    assert unsharded and all(c.reshard_after_forward for c in unsharded)
    assert len(unsharded) == len({c.checkpointing for c in unsharded})


def test_the_unit_fsdp_gathers_is_the_largest_layer_and_its_traffic_every_layer(tmp_path):
    """DeepSeek-V3's first three decoder layers are dense: FSDP's unit at a time is one of its MoE
    layers (most of its experts a rank's own under ep), a step's gathers are every layer's sum."""
    from plancc.compiler.resolve import resolve_sections
    from plancc.layout import Layout
    from plancc.models import build_meta_model, presets
    from plancc.tools.suggest_costs import _all_units_params, _shape, _unit_params

    path = tmp_path / "deepseek-v3-5-layers.json"
    path.write_text(json.dumps({**presets()["deepseek-v3"].config, "num_hidden_layers": 5}))
    model = build_meta_model(str(path))
    (resolved, *_), _ = resolve_sections(plancc.load_plan("plans/deepseek_v3.yaml"), model)
    shape = _shape(model, resolved, ())
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert sizes[0] < sizes[3] == max(sizes)  # dense first, MoE after
    assert (shape.layer_params, shape.layers_params) == (sizes[3], sum(sizes))
    assert 0 < shape.layer_expert_params < shape.layer_params
    layout = Layout(dp=2, ep=2)
    assert _unit_params(shape, layout) < sizes[3]  # half of the experts are the other rank's
    assert _all_units_params(shape, layout) < 5 * _unit_params(shape, layout)  # three layers are smaller


@pytest.mark.parametrize("plan,preset,gpus,allow", [
    ("llama.yaml", "llama-3.1-8b", 32, ("sp", "cp")),
    ("qwen3_moe.yaml", "qwen3-30b-a3b", 16, ("sp", "cp", "ep")),  # its config names experts by an alias
])
def test_a_preset_is_searched_on_its_skeleton_with_the_real_models_answers(plan, preset, gpus, allow):
    """suggest reads a built-in preset's shipped skeleton rather than building and tracing the
    model: every candidate's memory and time, and every refusal, are the real model's."""
    from plancc.models import build_meta_model

    on_skeleton = plancc.suggest(f"plans/{plan}", preset, gpus=gpus, seq_len=4096, allow=allow)
    on_model = plancc.suggest(f"plans/{plan}", build_meta_model(preset), gpus=gpus, seq_len=4096, allow=allow)
    assert on_skeleton.candidates == on_model.candidates and on_skeleton.rejected == on_model.rejected


def test_a_search_of_a_70b_preset_on_512_gpus_imports_no_transformers():
    """Llama 3.1 70B on 512 GPUs: the search runs on the preset's skeleton (docs/suggest.md: seconds)."""
    code = ("import sys, plancc; r = plancc.suggest('plans/llama.yaml', 'llama-3.1-70b', gpus=512, seq_len=8192); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers'))); print(r.best.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "[]" and lines[1].startswith("dp=")


def test_a_step_no_layout_holds_in_one_pass_is_costed_with_gradient_accumulation():
    """DeepSeek-V3 on 512 x 80 GiB at 16M tokens a step: no layout holds a rank's sequences of
    the step at once (the answer before: "no layout of 512 GPUs fits"); in fewer sequences a pass
    one does. From the second pass on every gradient is held beside the activations, and every
    pass gathers FSDP's weights again: more exposed traffic than the same layout in one pass."""
    from plancc.tools.suggest_model import GiB
    from plancc.tools.suggest_report import command_line

    kwargs = dict(gpus=512, gpu_memory=80 * GiB, seq_len=4096, tokens_per_step=16_777_216)
    one_pass = plancc.suggest("plans/deepseek_v3.yaml", "deepseek-v3", accumulate=False, **kwargs)
    assert one_pass.best is None
    result = plancc.suggest("plans/deepseek_v3.yaml", "deepseek-v3", **kwargs)
    best = result.best
    assert best is not None and best.memory.total <= 80 * GiB
    assert best.microbatches > 1 and (best.microbatches - 1) * best.micro_batch_size < best.sequences
    assert best.sequences * best.layout.dp * 4096 >= 16_777_216
    if best.memory.at in ("forward", "backward start"):
        assert best.memory.gradients > 0
    line = command_line("plans/deepseek_v3.yaml", "deepseek-v3", result, best)
    assert f"--batch-size {best.sequences * best.layout.dp} --micro-batch-size {best.micro_batch_size}" in line
    (same,) = [c for c in one_pass.candidates if (c.layout, c.checkpointing, c.reshard_after_forward)
               == (best.layout, best.checkpointing, best.reshard_after_forward)]
    assert same.microbatches == 1 and not same.fits and same.memory.total > best.memory.total
    assert best.time.fsdp > same.time.fsdp and best.time.compute == pytest.approx(same.time.compute)


def test_pipeline_layouts_are_costed_with_their_schedules_bubble_against_torchtitans_405b(cli):
    """torchtitan's Llama 3.1 405B on 512 H100s as FSDP 8 x TP 8 x PP 8 (published: 1F1B 100 and
    Interleaved 1F1B 128 tokens/s/GPU): with pp allowed, that layout fits under both schedules, is
    estimated no faster than suggest's first choice, and the interleaved schedule (its bubble
    (pp-1)/(v*m) of the compute, 1F1B's (pp-1)/m) faster than 1F1B."""
    from plancc.layout import Layout
    from plancc.tools.suggest_report import command_line, plan_edits

    result = plancc.suggest("plans/llama.yaml", "llama-3.1-405b", gpus=512, seq_len=8192,
                            tokens_per_step=1_048_576, allow=("pp",))
    published = Layout(dp=8, tp=8, pp=8)
    by = {c.schedule: c for c in result.candidates
          if c.layout == published and c.checkpointing == "full" and c.reshard_after_forward}
    assert set(by) == {"1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"}
    assert all(c.fits for c in by.values())
    one, two = by["1f1b"], by["interleaved_1f1b"]
    assert one.microbatches == two.microbatches == 16  # a dp rank's 16 sequences, one a microbatch
    assert one.time.pipeline > 7 / 16 * one.time.compute > two.time.pipeline > 7 / 32 * two.time.compute
    assert two.tokens_per_s > one.tokens_per_s and result.best.tokens_per_s >= two.tokens_per_s
    # zero bubble: W fills two thirds of the interleaved bubble, (pp-1)/(3*v*m); the V schedules
    # are costed at half of single-stage ZB-H1's, (pp-1)/(6*m): the same at v = 2
    zero, zbv, dual = by["zero_bubble"], by["zbv"], by["dualpipev"]
    assert two.time.pipeline > zero.time.pipeline > 7 / 96 * zero.time.compute
    assert zero.tokens_per_s > two.tokens_per_s
    assert zbv.time.pipeline == pytest.approx(zero.time.pipeline) == dual.time.pipeline
    assert dual.memory.activations > zbv.memory.activations  # DualPipeV keeps pp + 1 microbatches
    assert "--pp 8" in command_line("plans/llama.yaml", "llama-3.1-405b", result, one)
    assert any("pipeline: {schedule: 1f1b, microbatches: 16" in edit for edit in plan_edits(one))
    # pipeline parallelism is searched only when asked for
    assert all(c.layout.pp == 1 for c in plancc.suggest("plans/llama.yaml", "llama-3.1-405b", gpus=512,
                                                           seq_len=8192).candidates)
    code, out, err = cli("suggest", "plans/llama.yaml", "--model", "llama-3.1-405b", "--gpus", 512, "--seq-len", 8192,
                         "--tokens-per-step", 1_048_576, "--allow", "pp", "--top", 40)
    assert code == 0 and "pp=8 dp=8 cp=1 tp=8 zero_bubble" in out, err


# --- the command is the run it costed (issue 76, point 8) ---------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_run_suggest_writes_is_the_run_it_costed(cli, tmp_path):
    """suggest --write for a tiny preset, then that run launched as written: its layout, sequence
    length, compute dtype, batch, workers and -- from the written plan -- activation
    checkpointing and FSDP's resharding are the best candidate's (the run's own log and the
    settings it saved with its checkpoint say so)."""
    import yaml

    from plancc.layout import Layout

    from .conftest import forked_cli

    folder = tmp_path / "costed"
    code, out, err = cli("suggest", "plans/qwen3.yaml", "--model", "tiny-qwen3", "--gpus", 2, "--gpus-per-node", 2,
                         "--seq-len", 64, "--gpu-memory", "1GiB", "--write", folder, "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    best, layout = found["best"], Layout(**found["best"]["layout"])
    assert found["written"] == {"plan": str(folder / "plan.yaml"), "run": str(folder / "run.yaml")}
    code, out, err = forked_cli("apply", "--config", folder / "run.yaml", "--steps", 1, "--save", tmp_path / "ckpt")
    assert code == 0, err
    assert f"world {layout.world_size} {layout.describe()} |" in out
    saved = yaml.safe_load((tmp_path / "ckpt" / "step-000001" / "run.yaml").read_text())
    assert (saved["seq_len"], saved["param_dtype"]) == (64, "bf16") and "compute in bfloat16" in out
    assert saved["batch_size"] == best["micro_batch_size"] * best["microbatches"] * layout.dp
    assert saved.get("micro_batch_size") == (best["micro_batch_size"] if best["microbatches"] > 1 else None)
    layers = plancc.models.load_config("tiny-qwen3").num_hidden_layers
    checkpointed = {"none": 0, "full": layers, "plan": layers}[best["activation_checkpointing"]]  # the plan: each mlp
    assert f"activation checkpointing on {checkpointed} module" in out
    assert f"resharding after forward {'on' if best['reshard_after_forward'] else 'off'}" in out


def test_the_printed_command_carries_the_sequence_dtype_batch_and_the_nodes():
    """Two nodes of 8 for Qwen3-32B at 8k: every flag the cost assumed is on the line, and the
    per-node ones a user fills in; no plan edit is left as a comment on it."""
    from plancc.tools.suggest_report import command_line

    result = plancc.suggest("plans/qwen3.yaml", "qwen3-32b", gpus=16, seq_len=8192)
    line = command_line("plans/qwen3.yaml", "qwen3-32b", result, result.best)
    for flag in ("--seq-len 8192", "--param-dtype bf16", f"--batch-size {result.best.sequences * result.best.layout.dp}",
                 "--nnodes 2 --nproc-per-node 8", "--node-rank $NODE_RANK", "--rdzv-endpoint $HEAD_NODE:29500"):
        assert flag in line, (flag, line)
    assert "#" not in line


def test_a_layout_within_the_headroom_of_the_whole_memory_does_not_fit():
    """5% of each GPU is kept free by default (the cost model counts no allocator fragmentation,
    NCCL buffers or CUDA context): a layout at 98% of the memory is "fits: no" unless
    --headroom says otherwise."""
    from plancc.tools.suggest import DEFAULT_HEADROOM

    first = plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=8, seq_len=4096, headroom=0.0)
    memory = int(first.best.memory.total / 0.98)  # the best at 98% of it
    same = (first.best.layout, first.best.checkpointing, first.best.reshard_after_forward, first.best.microbatches)

    def candidate(headroom: float):
        found = plancc.suggest("plans/qwen3.yaml", "qwen3-8b", gpus=8, seq_len=4096, gpu_memory=memory,
                               headroom=headroom)
        return found, next(c for c in found.candidates
                           if (c.layout, c.checkpointing, c.reshard_after_forward, c.microbatches) == same)

    assert DEFAULT_HEADROOM == 0.05
    kept, at_98 = candidate(DEFAULT_HEADROOM)
    assert not at_98.fits and kept.usable_memory == memory * 95 // 100
    assert candidate(0.0)[1].fits


def test_a_written_pipeline_run_is_a_plan_and_run_file_validate_passes(cli, tmp_path):
    """Llama 3.1 405B on 512 GPUs with pp allowed: --write's plan carries the candidate's
    checkpointing and pipeline schedule, its run file the layout, sequence, dtype, batch and the
    64 nodes, and `plancc validate` passes the two at that layout."""
    import yaml

    code, out, err = cli("suggest", "plans/llama.yaml", "--model", "llama-3.1-405b", "--gpus", 512, "--seq-len", 8192,
                         "--tokens-per-step", 1_048_576, "--allow", "pp", "--write", tmp_path, "--format", "json")
    assert code == 0, err
    best = json.loads(out)["best"]
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    run = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert run["pp"] == best["layout"]["pp"] > 1 and run["nnodes"] == 64 and run["nproc_per_node"] == 8
    assert run["seq_len"] == 8192 and run["param_dtype"] == "bf16"
    assert plan["pipeline"]["schedule"] == best["schedule"]
    assert plan["pipeline"]["microbatches"] == best["microbatches"]
    if best["activation_checkpointing"] == "full":
        assert plan["activation_checkpointing"] == ["model.layers.*"]
    code, out, err = cli("validate", tmp_path / "run.yaml")
    assert code == 0 and "ok: 0 error(s)" in out, out + err


def test_write_into_a_file_or_a_headroom_out_of_bounds_is_a_usage_error(cli, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder")
    args = ("suggest", "plans/qwen3.yaml", "--model", "tiny-qwen3", "--gpus", 2, "--seq-len", 64)
    code, _, err = cli(*args, "--write", taken)
    assert code == 2 and f"--write {taken}" in err and "Traceback" not in err
    code, _, err = cli(*args, "--headroom", 0.9)
    assert code == 2 and "--headroom" in err
