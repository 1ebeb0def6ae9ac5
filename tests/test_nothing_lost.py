"""Nothing lost, nothing silently wrong: each case of the adversarial pass, reproduced as a
user hits it (real processes, real crashes at the exact point, real files), asserting that
the previous complete checkpoint still resumes with bitwise-equal losses, that no file
outside the named folders changes, that the run exits non-zero with one line naming the
cause, and that no process is left behind."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plancc.engine import checkpoint

from .conftest import PLANS, forked_cli
from .distributed import launch

QWEN3 = PLANS / "qwen3.yaml"


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path, monkeypatch):
    """Each test's launches get their own TMPDIR: the launcher's result folder is in it, and
    workers name it on their command line, so a test counts its own workers only (other
    jobs on the machine, concurrent test runs, do not count)."""
    tmp = tmp_path / "launcher-tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def run(*args, env=None, timeout=240, **popen):
    proc = subprocess.run([sys.executable, "-m", "plancc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, **popen)
    return proc.returncode, proc.stdout, proc.stderr


def losses(stdout: str) -> list[float]:
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*")) if not p.is_symlink()}


def leftover_workers() -> list[str]:
    """This test's workers still alive (matched by the TMPDIR its launches got)."""
    mine = os.environ["TMPDIR"]
    ps = subprocess.run(["ps", "-eww", "-o", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "plancc.job.runner" in line and mine in line and " Z" not in line]


def no_workers_within(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while leftover_workers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


@pytest.fixture
def good(tiny_checkpoint):
    return tiny_checkpoint


def copy_of(good, tmp_path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(good[0], ck)
    return ck


def resumes_exactly(ck: Path, good) -> None:
    code, out, err = forked_cli("apply", QWEN3, "--steps", 4, "--resume", ck)
    assert code == 0, err
    assert "resumed from step 2" in out
    assert losses(out) == good[1]  # bitwise: the same floats printed


# --------------------------------------------------------------------------- 1, 4: crashes mid-save
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,steps", [
    ("publish:kill@0", 0),  # re-saving step 2: old copy moved aside, new one not yet in place
    pytest.param("latest:kill@0", 1, marks=pytest.mark.extended),  # step 3 in place, 'latest' about to be replaced
    # (a kill after the shards, before publishing: tests/test_reliability.py, save:kill@0)
])
def test_a_crash_at_any_point_of_a_save_keeps_a_checkpoint_that_resumes_bitwise(good, tmp_path, fault, steps):
    ck = copy_of(good, tmp_path)
    code, _, err = run("apply", QWEN3, "--steps", 2 + steps, "--schedule-steps", 4, "--resume", ck, "--save", ck,
                       env={"PLANCC_FAULT": fault})
    assert code == 1 and "SIGKILL" in err
    assert no_workers_within(10)
    if checkpoint.read_info(checkpoint.find(ck)).step == 2:  # step-000002, or its copy moved aside
        resumes_exactly(ck, good)
    else:  # step 3 was complete before the crash: resuming it continues the same run
        assert fault == "latest:kill@0"
        code, out, err = run("apply", QWEN3, "--steps", 4, "--resume", ck)
        assert code == 0 and "resumed from step 3" in out, err
        assert losses(out) == good[1][1:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_planted_link_is_never_followed_and_an_old_export_is_replaced_whole(good, tmp_path):
    ck = copy_of(good, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (ck / ".latest.tmp").symlink_to(victim)
    (ck / "latest").unlink()
    (ck / "latest").symlink_to(victim)
    export = tmp_path / "export"
    _sharded_hf_folder(export)
    code, out, err = forked_cli("apply", QWEN3, "--steps", 3, "--resume", ck, "--save", ck, "--export-hf", export)
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    assert (ck / "latest").read_text().strip() == "step-000003" and not (ck / "latest").is_symlink()
    # the export is the new model alone: no shard or index of the old sharded one survives
    assert sorted(p.name for p in export.glob("model*")) == ["model.safetensors"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(export).config.vocab_size == 256


def _sharded_hf_folder(folder: Path, preset: str = "tiny-qwen3", **config) -> None:
    from plancc.models import build_model, load_config

    cfg = load_config(preset)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    build_model(cfg, device="cpu").save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()


# --------------------------------------------------------------------------- 2: two writers
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_run_saving_into_the_same_folder_is_refused_and_the_first_completes(tmp_path):
    """The first run's rank 0 (the folder's holder) freezes itself before its second step
    (``train:stop``): the second run tries while the first one certainly still holds the folder,
    however fast its steps would be, and the first completes once it is resumed."""
    ck = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "3",
                              "--save", str(ck)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PLANCC_FAULT": "train:stop@0#2"})
    holder = None
    try:
        deadline = time.monotonic() + 240
        while holder is None or not _stopped(holder):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            said = (ck / ".lock").read_text() if holder is None and _locked(ck) else ""
            if said.startswith("pid "):
                holder = int(said.split()[1])  # rank 0, its pid in the lock file
            time.sleep(0.2)
        assert _locked(ck)
        code, out, err = run("apply", QWEN3, "--steps", 1, "--save", ck)
        assert code == 1 and "plancc apply:" not in out  # refused before any process started
        assert f"{ck}: error: another run (pid {holder}) " in err and "[checkpoint]" in err
        os.kill(holder, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if holder is not None:
            subprocess.run(["kill", "-CONT", str(holder)], check=False)
        first.kill()
    assert first.returncode == 0, err
    assert checkpoint.find(ck).name == "step-000003"
    assert checkpoint.read_info(checkpoint.find(ck)).step == 3


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _locked(folder: Path) -> bool:
    try:
        fd = os.open(folder / ".lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# --------------------------------------------------------------------------- 3: export targets
def test_export_into_a_file_or_the_input_folder_is_refused_before_launch(cli, tmp_path):
    target = tmp_path / "exists.bin"
    target.write_bytes(b"keep me")
    code, out, err = cli("apply", QWEN3, "--export-hf", target)
    assert code == 1 and "--export-hf names an existing file [export-hf]" in err and "plancc apply:" not in out
    assert target.read_bytes() == b"keep me"
    folder = tmp_path / "hf"
    _sharded_hf_folder(folder)
    before = snapshot(folder)
    code, _, err = cli("apply", QWEN3, "--model", folder, "--export-hf", folder)
    assert code == 1 and "would write into the folder the model is read from" in err
    assert snapshot(folder) == before


# --------------------------------------------------------------------------- 5: HF folders
def _single_file_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from plancc.models import build_model, load_config

    torch.manual_seed(0)
    build_model(load_config("tiny-qwen3"), device="cpu").save_pretrained(folder)
    return load_file(folder / "model.safetensors")


def _rewrite(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")


@pytest.mark.parametrize("damage,expected", [
    ("drop", "tensor 'model.layers.1.mlp.down_proj.weight' of the model is in no weights file"),
    ("larger", "tensor 'model.norm.weight' has shape [65], the model needs [64]"),
    ("smaller", "tensor 'model.layers.0.self_attn.q_proj.weight' has shape [63, 64], the model needs [64, 64]"),
    ("index", "tensor 'model.embed_tokens.weight' of the model is in no weights file"),
    ("bin-only", "pytorch_model.bin is a weight format plancc does not load"),
])
def test_a_folder_that_would_load_garbage_is_refused_before_launch_naming_the_tensor(cli, tmp_path, damage,
                                                                                       expected):
    folder = tmp_path / "hf"
    tensors = _single_file_folder(folder)
    if damage == "drop":
        tensors.pop("model.layers.1.mlp.down_proj.weight")
        _rewrite(folder, tensors)
    elif damage == "larger":
        tensors["model.norm.weight"] = torch.ones(65)
        _rewrite(folder, tensors)
    elif damage == "smaller":
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:63]
        _rewrite(folder, tensors)
    elif damage == "index":
        shutil.rmtree(folder)
        _sharded_hf_folder(folder)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"].pop("model.embed_tokens.weight")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    code, out, err = cli("apply", QWEN3, "--model", folder, "--steps", 1)
    assert code == 1 and "plancc apply:" not in out
    assert expected in err and "[weights]" in err and "Traceback" not in err


def _load_into_model(folder: str):
    import plancc
    from plancc.models import build_model, load_config
    from plancc.weights import load_hf_weights

    from .distributed import init_gloo

    init_gloo()
    mesh = plancc.build_mesh(tp=2, device_type="cpu")
    model = build_model(load_config("tiny-qwen3"), device="meta")
    plancc.parallelize(model, plancc.load_plan(str(QWEN3)), mesh)
    plancc.materialize(model, "cpu")
    try:
        load_hf_weights(model, folder)
    except plancc.PlanError as exc:
        return [d.message for d in exc.diagnostics]
    finally:
        torch.distributed.destroy_process_group()
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_hf_weights_refuses_a_missing_tensor_on_every_rank_in_a_users_own_loop(tmp_path):
    folder = tmp_path / "hf"
    tensors = _single_file_folder(folder)
    tensors.pop("model.norm.weight")
    _rewrite(folder, tensors)
    results = launch(_load_into_model, 2, str(folder))
    assert results[0] == results[1] == ["tensor 'model.norm.weight' of the model is in no weights file"]


# --------------------------------------------------------------------------- 6: non-finite training
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_that_goes_non_finite_stops_at_that_step_and_keeps_the_last_checkpoint(good, tmp_path):
    ck = copy_of(good, tmp_path)
    before = snapshot(ck)
    code, out, err = run("apply", QWEN3, "--steps", 5, "--resume", ck, "--save", ck,
                         env={"PLANCC_FAULT": "loss:nan@0#4"})
    assert code == 1
    (line,) = [x for x in err.splitlines() if "[non-finite]" in x]
    assert "step 4: loss nan" in line and "first non-finite gradient: model.embed_tokens.weight" in line
    assert "step    3/5" in out and "step    4/5" not in out
    # byte for byte the checkpoint that resumes to the reference losses (the fixture's resume)
    assert {k: v for k, v in snapshot(ck).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}
    assert no_workers_within(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.extended  # the default run stops a run that goes non-finite at a later step (above)
def test_a_config_that_makes_nan_is_stopped_at_the_first_step(tmp_path):
    from plancc.models import load_config

    config = load_config("tiny-qwen3")
    config.rms_norm_eps = float("nan")
    config.save_pretrained(tmp_path / "nan")
    code, out, err = run("apply", QWEN3, "--model", tmp_path / "nan", "--steps", 3)
    assert code == 1 and "step 1: loss nan" in err and "[non-finite]" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- 7: data and plans
def test_input_that_trains_on_nothing_or_crashes_later_is_refused_up_front(cli, tmp_path, write_plan):
    data = tmp_path / "one.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n{"input_ids": [9]}\n')
    code, _, err = cli("apply", QWEN3, "--data", data)
    assert code == 1 and f"{data}:2:1: error: the line has 1 token; training needs at least 2" in err
    config = tmp_path / "config.json"
    from plancc.models import presets

    config.write_text(json.dumps({**presets()["tiny-qwen3"].config, "vocab_size": 0}))
    code, _, err = cli("validate", QWEN3, "--model", config)
    assert code == 1 and "vocab_size is 0" in err and "[model-config]" in err
    units = write_plan(QWEN3.read_text().replace("units: [model.embed_tokens, model.layers.*]", "units: ['**']"))
    code, _, err = cli("validate", units, "--model", "tiny-qwen3", "--tp", 2)
    assert code == 1 and "[fsdp-units]" in err and "ModuleList" in err


def test_a_merge_key_override_is_not_a_duplicate_and_a_line_separator_in_a_string_is_data(write_plan, tmp_path):
    import plancc
    from plancc.job.data import read_jsonl

    text = QWEN3.read_text().replace("tensor_parallel:\n", "tensor_parallel:\n  <<: {lm_head: colwise}\n", 1)
    plan = plancc.load_plan(write_plan(text))
    assert {r.pattern: r.style.name for r in plan.tensor_parallel}["lm_head"] == "colwise_logits"
    data = tmp_path / "sep.jsonl"
    data.write_text('{"input_ids": [1, 2], "text": "a\u2028b"}\n', encoding="utf-8")
    assert read_jsonl(data, vocab_size=256).sequences == ((1, 2),)


# --------------------------------------------------------------------------- 8, 9: process faults
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_the_launcher_takes_every_worker_and_its_temp_folder_with_it(own_tmpdir):
    tmp = own_tmpdir
    launcher = subprocess.Popen([sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "100000"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in launcher.stdout:  # wait until the workers train
            if line.startswith("step "):
                break
        assert leftover_workers()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        assert no_workers_within(10), leftover_workers()
        assert not list(tmp.glob("plancc-*")) and not list(tmp.glob("torchelastic_*")), list(tmp.rglob("*"))
    finally:
        launcher.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "100000",
                                 "--timeout", "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        for line in launcher.stdout:
            if line.startswith("step "):
                break
        stopped = _worker_of_rank(1)
        os.kill(stopped, signal.SIGSTOP)
        _, err = launcher.communicate(timeout=240)
        assert launcher.returncode == 1
        assert "error: rank 1 failed:" in err
        assert no_workers_within(10), leftover_workers()
    finally:
        if stopped is not None:
            subprocess.run(["kill", "-CONT", str(stopped)], check=False)
        launcher.kill()


def _worker_of_rank(rank: int) -> int:
    for line in leftover_workers():
        pid = int(line.split()[0])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank}: {leftover_workers()}")


# --------------------------------------------------------------------------- 10, 11: checkpoint errors
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_disk_that_fills_during_save_is_one_line_and_the_last_checkpoint_survives(good, tmp_path):
    import resource

    ck = copy_of(good, tmp_path)
    before = snapshot(ck)

    def small_disk():  # writes past 64 KiB fail with EFBIG, as ENOSPC would on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    code, _, err = run("apply", QWEN3, "--steps", 3, "--resume", ck, "--save", ck, preexec_fn=small_disk)
    assert code == 1
    (line,) = [x for x in err.splitlines() if "[checkpoint]" in x]
    assert "saving step 3 failed" in line and "File too large" in line
    assert "Traceback" not in err
    assert {k: v for k, v in snapshot(ck).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


@pytest.mark.slow  # the shared checkpoint costs a launch
@pytest.mark.timeout(600)
def test_resume_problems_are_found_before_any_process_starts(good, cli, tmp_path):
    ck = copy_of(good, tmp_path)
    cases = []
    code, out, err = cli("apply", QWEN3, "--model", "tiny-qwen2", "--resume", ck)
    cases.append((code, out, err, "checkpoint is of Qwen3ForCausalLM"))
    code, out, err = cli("apply", QWEN3, "--resume", tmp_path / "missing")
    cases.append((code, out, err, "no such checkpoint folder"))
    (ck / "step-000002" / "plancc.json").write_text("{not json")
    code, out, err = cli("apply", QWEN3, "--resume", ck)
    cases.append((code, out, err, "unreadable checkpoint metadata"))
    for code, out, err, expected in cases:
        assert code == 1 and expected in err and "[checkpoint]" in err and "plancc apply:" not in out, err


@pytest.mark.slow  # the shared checkpoint costs a launch
@pytest.mark.timeout(600)
def test_a_truncated_shard_is_named_before_launch(good, cli, tmp_path):
    ck = copy_of(good, tmp_path)
    shard = ck / "step-000002" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    code, out, err = cli("apply", QWEN3, "--resume", ck)
    assert code == 1 and "plancc apply:" not in out
    assert f"{shard}: error: checkpoint shard __1_0.distcp holds 1000 bytes" in err


# --------------------------------------------------------------------------- long runs: Ctrl-C, SIGTERM
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ctrl-c", pytest.param("sigterm", marks=pytest.mark.extended)])
def test_an_interrupted_run_says_where_it_stopped_keeps_its_checkpoints_and_leaves_no_process(tmp_path, how):
    """Ctrl-C reaches the launcher and every worker at once (the terminal signals the whole
    process group); a scheduler's SIGTERM reaches the launcher alone. Either way: one line,
    128 + the signal, the periodic checkpoints intact, nothing left running."""
    ck = tmp_path / "ck"
    launcher = subprocess.Popen([sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "100000",
                                 "--save-every", "2", "--save", str(ck)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in launcher.stdout:
            if line.startswith("step    3/"):
                break
        if how == "ctrl-c":
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
        assert launcher.returncode == (130 if how == "ctrl-c" else 143), err
        assert "Traceback" not in err + out
        (said,) = [line for line in err.splitlines() if line.startswith("interrupted")]
        step = int(said.split()[3].rstrip(";"))
        assert step >= 3  # stopped at a step boundary after the one it was interrupted in
        newest = checkpoint.find(ck)
        assert said.endswith(f"last checkpoint: {newest}") and newest.name == f"step-{step - step % 2:06d}"
        assert no_workers_within(10), leftover_workers()
    finally:
        launcher.kill()


# --------------------------------------------------------------------------- round 3: a signal to one worker
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended)],
                         ids=["sigterm", "sigint"])
def test_a_signal_to_one_worker_stops_the_run_with_its_code_never_as_a_success(tmp_path, sig):
    """A scheduler or an operator may signal one worker rather than the launcher: the run still
    stopped early, so it says where, writes no export, and exits 128 + the signal."""
    export = tmp_path / "ex"
    launcher = subprocess.Popen([sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "100000",
                                 "--export-hf", str(export)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stdout:
            if line.startswith("step    2/"):
                break
        os.kill(_worker_of_rank(1), sig)
        out, err = launcher.communicate(timeout=120)
        assert launcher.returncode == 128 + sig, (out, err)
        (said,) = [line for line in err.splitlines() if line.startswith("interrupted at step")]
        assert said.endswith("last checkpoint: none") and "Traceback" not in err
        assert not export.exists()
        assert no_workers_within(10), leftover_workers()
    finally:
        launcher.kill()
