"""Nothing a user feeds plancc crashes it, a failing rank hangs nothing, bad data is named by
file and line before any step, an interrupted save loses nothing, and runs are repeatable.

The fuzz budget is small in CI; the nightly-size run is
``PLANCC_FUZZ_EXAMPLES=10000 python -m pytest tests/test_reliability.py -k fuzz`` (docs/reliability.md).
"""

import functools
import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plancc
from plancc import PlanError
from plancc.job.data import DataError, read_jsonl
from plancc.job.launch import RankFailure, root_cause
from plancc.compiler.styles import STYLE_NAMES

from .conftest import PLANS, forked_cli

FUZZ = int(os.environ.get("PLANCC_FUZZ_EXAMPLES", "200"))
fuzz_settings = settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))

KEYS = ["plancc", "name", "description", "architectures", "tensor_parallel", "sequence_parallel", "fsdp",
        "activation_checkpointing", "units", "style", "optional", "input_layouts", "use_local_output"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
                    st.sampled_from(STYLE_NAMES + ("colwsie", "shard(1)", "shard(x)", "model..x", "*", "**", "")),
                    st.text(max_size=12))
documents = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8), st.integers()),
                                               children, max_size=5)),
    max_leaves=25,
)


def only_diagnostics(path):
    """load_plan either returns a Plan or raises PlanError with diagnostics; nothing else."""
    try:
        plan = plancc.load_plan(path)
    except PlanError as exc:
        assert exc.diagnostics and all(d.rule and d.message for d in exc.diagnostics)
        return None
    return plan


@fuzz_settings
@given(documents)
def test_fuzz_structured_documents_give_only_diagnostics(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("fuzz") / "plan.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    only_diagnostics(path)


@fuzz_settings
@given(st.binary(max_size=400))
def test_fuzz_raw_bytes_give_only_diagnostics(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fuzz") / "plan.yaml"
    path.write_bytes(raw)
    only_diagnostics(path)


@fuzz_settings
@given(st.data())
def test_fuzz_mutated_real_plans_give_only_diagnostics(tmp_path_factory, data):
    text = (PLANS / data.draw(st.sampled_from(["qwen3.yaml", "llama.yaml", "gemma3.yaml"]))).read_text()
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 6))
        insert = data.draw(st.sampled_from(["", ":", " ", "\n", "-", "{", "[", "'", "*", "\t", "x", "\x00", "é"]))
        text = text[:at] + insert + text[at + cut:]
    path = tmp_path_factory.mktemp("fuzz") / "plan.yaml"
    path.write_text(text)
    only_diagnostics(path)


globs = st.sampled_from(["model.layers.*", "model.layers.*.mlp", "model.layers.1.self_attn", "model.norm",
                         "lm_head", "model..x", "**", "nothing.here", ""])
checkpoint_items = st.one_of(
    globs,
    st.fixed_dictionaries({"module": st.one_of(globs, scalars)},
                          optional={"save": st.one_of(st.lists(st.sampled_from(
                              ["matmul", "attention", "collectives", "matmull", ""]), max_size=4), scalars),
                              "modul": scalars}),
    documents,
)


@fuzz_settings
@given(st.lists(checkpoint_items, max_size=4), st.one_of(st.lists(globs, max_size=3), documents),
       st.one_of(st.booleans(), scalars))
def test_fuzz_checkpointing_and_fsdp_sections_give_only_diagnostics(tmp_path_factory, ac, units, reshard):
    """Deep in the plan (list items that are globs or mappings, nested units): loading and
    resolving against a model give a Plan or diagnostics, never an exception."""
    from plancc.compiler.resolve import resolve_plan

    doc = {"plancc": 1, "name": "t", "architectures": ["Qwen3ForCausalLM"], "tensor_parallel": {},
           "fsdp": {"units": units, "reshard_after_forward": reshard}, "activation_checkpointing": ac}
    path = tmp_path_factory.mktemp("fuzz") / "plan.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    plan = only_diagnostics(path)
    if plan is not None:
        try:
            resolve_plan(plan, _tiny_model())
        except PlanError as exc:
            assert exc.diagnostics and all(d.rule and d.message and d.line >= 1 for d in exc.diagnostics)


@functools.cache
def _tiny_model():
    from plancc.models import build_meta_model

    return build_meta_model("tiny-qwen3")


@settings(max_examples=max(20, FUZZ // 5), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_validate_cli_exits_1_or_2_never_a_traceback(tmp_path_factory, cli, data):
    text = (PLANS / "qwen3.yaml").read_text()
    at = data.draw(st.integers(0, len(text)))
    text = text[:at] + data.draw(st.sampled_from(["", "x", ":", "  ", "\n-"])) + text[at + data.draw(st.integers(0, 8)):]
    path = tmp_path_factory.mktemp("fuzz") / "plan.yaml"
    path.write_text(text)
    code, out, err = cli("validate", path, "--model", "tiny-qwen3", "--tp", "2")
    assert code in (0, 1, 2)
    assert "Traceback" not in out + err


# --------------------------------------------------------------------------- bad data
@pytest.mark.parametrize("lines,rule,line", [
    (['{"input_ids": [1, 2]}', '{"input_ids": [1, 2'], "data-json", 2),
    (['{"input_ids": [1]}', '{"tokens": [1, 2]}'], "data-input-ids", 2),
    (['{"input_ids": [1, 2, "x"]}'], "data-input-ids", 1),
    (['{"input_ids": [1, 2]}', '', '{"input_ids": [5, 999]}'], "data-token-range", 3),
    ([], "data-empty", 0),
])
def test_bad_data_is_reported_by_file_and_line(tmp_path, lines, rule, line):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(DataError) as info:
        read_jsonl(path, vocab_size=256)
    (diag,) = info.value.diagnostics
    assert (diag.rule, diag.line) == (rule, line)
    assert diag.fix


def test_apply_reports_bad_data_before_starting_any_process(tmp_path, cli):
    path = tmp_path / "data.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 300]}\n')
    code, out, err = cli("apply", PLANS / "qwen3.yaml", "--data", path)
    assert code == 1
    assert f"{path}:2:1: error: token id 300 is outside the vocabulary [0, 256) [data-token-range]" in err
    assert "plancc apply:" not in out


# --------------------------------------------------------------------------- failing ranks
def plancc_cli(*args, env=None, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "plancc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def leftover_workers(tag: str = "") -> list[str]:
    """Workers still alive; with ``tag`` (the TMPDIR a launch got, on its workers' command
    line) only that launch's, so other jobs on the machine do not count."""
    ps = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "plancc.job.runner" in line and tag in line and "ps -eo" not in line]


GLOO_PEER_GONE = ("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6037: Connection reset "
                  "by peer. This is typically caused by a remote worker hanging or bugs")


@pytest.mark.parametrize("victim_first", [True, False])
def test_the_rank_that_died_is_named_not_the_peer_that_lost_it(victim_first):
    # torch records failure times in whole seconds, and the survivor's error file can carry an
    # earlier second than the killed rank's record: time alone names the wrong rank.
    t = 1_795_353_239
    killed = RankFailure(1, "Signal 9 (SIGKILL) received by PID 12423", -9, t + (1 if victim_first else 0))
    victim = RankFailure(0, GLOO_PEER_GONE, -15, t)
    assert root_cause([victim, killed]) == 1


GLOO_TIMEOUT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                "15000ms for recv operation to complete")


def test_a_stopped_rank_is_named_not_the_peers_that_timed_out_waiting_for_it():
    # SIGSTOP on rank 2: ranks 0 and 1 raise a timeout after --timeout seconds; the agent's
    # SIGTERM cannot stop a stopped process, so rank 2 is SIGKILLed 30 s later, last of all.
    waiting = [RankFailure(r, GLOO_TIMEOUT, 1, 100 + r) for r in (0, 1)]
    stopped = RankFailure(2, "Signal 9 (SIGKILL) received by PID 99", -9, 131)
    assert root_cause([*waiting, stopped]) == 2
    bystander = RankFailure(3, "Signal 15 (SIGTERM) received by PID 98", -15, 101)
    assert root_cause([*waiting, bystander, stopped]) == 2
    # a rank that raised on its own still wins over everything else
    assert root_cause([*waiting, stopped, RankFailure(3, "ValueError: bad batch", 1, 99)]) == 3


def test_a_raising_rank_beats_ranks_the_agent_stopped_and_the_earliest_of_equals_wins():
    stopped = RankFailure(0, "Signal 15 (SIGTERM) received by PID 7", -15, 100)
    raised = RankFailure(3, "ValueError: injected failure", 1, 101)
    assert root_cause([stopped, raised]) == 3
    assert root_cause([RankFailure(2, "ValueError: a", 1, 101), RankFailure(3, "ValueError: b", 1, 100)]) == 3
    assert root_cause([]) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("action", ["raise", pytest.param("kill", marks=pytest.mark.extended)])
def test_a_failing_rank_stops_every_worker_quickly_and_is_named(action, tmp_path):
    t0 = time.perf_counter()
    as_json = action == "raise"  # --format json: the failure is the one JSON document on stdout
    code, out, err = plancc_cli("apply", PLANS / "qwen3.yaml", "--steps", 4, "--timeout", 30,
                                *(["--format", "json"] if as_json else []),
                                env={"PLANCC_FAULT": f"train:{action}@1#2", "TMPDIR": str(tmp_path)})
    if as_json:
        (problem,) = json.loads(out)["diagnostics"]
        assert problem["rule"] == "rank-failed"
        err, out = f"error: {problem['message']}\n" + err, err  # the log is on stderr
    elapsed = time.perf_counter() - t0
    assert code == 1
    assert elapsed < 180, elapsed  # a hang check: ~10 s on a quiet machine, minutes only if stuck
    expected = "injected failure" if action == "raise" else "SIGKILL"
    assert "error: rank 1 failed:" in err and expected in err.split("error: rank 1 failed:")[1].splitlines()[0]
    assert "step    1/4" in out and "step    2/4" not in out
    time.sleep(1)
    assert leftover_workers(str(tmp_path)) == []


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended  # the default run crashes a save at publishing (tests/test_nothing_lost.py)
def test_a_kill_during_save_leaves_the_previous_checkpoint_resumable(tmp_path, tiny_checkpoint):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    code, _, err = plancc_cli("apply", PLANS / "qwen3.yaml", "--steps", 3, "--resume", ck, "--save", ck,
                              env={"PLANCC_FAULT": "save:kill@0"})
    assert code == 1 and "SIGKILL" in err
    assert (ck / "latest").read_text().strip() == "step-000002"
    assert not (ck / "step-000003").exists()
    code, out, err = plancc_cli("apply", PLANS / "qwen3.yaml", "--steps", 3, "--resume", ck)
    assert code == 0, err
    assert "resumed from step 2" in out


# --------------------------------------------------------------------------- determinism
@pytest.mark.slow
@pytest.mark.extended  # every bitwise resume test runs the same seed and layout twice
@pytest.mark.timeout(300)
def test_same_seed_and_layout_give_bitwise_equal_losses(tmp_path, fp32_run):
    """Bitwise-equal losses also while the second run writes metrics, TensorBoard events and a
    checkpoint every step (keeping the newest two): none of that perturbs training."""
    metrics, board, ck = tmp_path / "metrics.jsonl", tmp_path / "tb", tmp_path / "ck"
    runs = [fp32_run, forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 3, "--tp", 2, "--format", "json",
                                 "--metrics", metrics, "--tensorboard", board,
                                 "--save", ck, "--save-every", 1, "--keep", 2)]
    assert all(code == 0 for code, _, _ in runs), runs[0][2]
    histories = [json.loads(out)["history"] for _, out, _ in runs]  # stdout is one JSON document
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # --metrics: a line per step
    assert [{k: r[k] for k in histories[1][0]} for r in rows] == histories[1]
    assert all(r["peak_memory_bytes"] > 0 and r["elapsed_s"] > 0 for r in rows)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-000002", "step-000003"]
    assert (ck / "latest").read_text().strip() == "step-000003"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board)).Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [r["step"] for r in rows]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in rows])  # stored as fp32
    assert all("plancc apply:" in err for _, _, err in runs)  # the log went to stderr
    assert [h["loss"] for h in histories[0]] == [h["loss"] for h in histories[1]]  # exact, not approx
    assert [h["grad_norm"] for h in histories[0]] == [h["grad_norm"] for h in histories[1]]


# --------------------------------------------------------------------------- ecosystem
def test_pre_commit_hook_runs_plancc_validate_on_plan_files():
    hooks = yaml.safe_load((PLANS.parent / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "plancc-validate"]
    assert hook["entry"].startswith("plancc validate") and hook["language"] == "python"
    import re

    files = re.compile(hook["files"])
    for name in ["plans/qwen3.yaml", "configs/plans/x.yml", "train/qwen.plan.yaml"]:
        assert files.search(name), name
    for name in ["plans/sub/readme.md", "config.yaml", ".github/workflows/ci.yaml"]:
        assert not files.search(name), name


def test_the_hook_entry_validates_every_plan_pre_commit_passes_in_one_call(tmp_path):
    """pre-commit runs `entry` with all matching files as arguments (several per call)."""
    import shlex

    hooks = yaml.safe_load((PLANS.parent / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "plancc-validate"]
    plans = [str(PLANS / name) for name in ("qwen3.yaml", "llama.yaml", "gemma3.yaml")]
    argv = [sys.executable, "-m", "plancc.cli", *shlex.split(hook["entry"])[1:]]
    proc = subprocess.run([*argv, *plans], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert all(f"({p})" in proc.stdout for p in plans)
    broken = tmp_path / "broken.plan.yaml"
    broken.write_text((PLANS / "qwen3.yaml").read_text().replace("colwise_logits", "colwsie_logits"))
    proc = subprocess.run([*argv, plans[0], str(broken)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and f"{broken}:" in proc.stderr and "[unknown-style]" in proc.stderr
    assert f"({plans[0]})" in proc.stdout  # the good plan is still reported
