"""Every path, file and flag a user names is checked before a process starts: one line with
the rule, exit 2 (usage) or 1 (plan, config, data), never a worker's traceback, a gloo error
from another rank, or a wait without end. Each test names the point of the issue it pins."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from .conftest import PLANS, forked_cli, run_cli

QWEN3 = PLANS / "qwen3.yaml"


def problem(err: str, rule: str) -> str:
    """The one line of ``err`` that reports ``rule``; no traceback anywhere."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.endswith(f"[{rule}]")]
    assert lines, err
    return lines[0]


@pytest.fixture
def lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [1 + i, 2, 3, 4]}) + "\n" for i in range(4)))
    return path


# --------------------------------------------------------------------------- 1: paths that are no regular file
@pytest.mark.timeout(60)
def test_a_plan_that_is_a_fifo_nobody_writes_to_is_refused_after_the_wait_not_waited_on(cli, tmp_path, monkeypatch):
    import plancc.inputs

    monkeypatch.setattr(plancc.inputs, "WRITER_WAIT_S", 0.5)
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    code, _, err = cli("validate", fifo)
    assert code == 2 and "nothing was written to it" in problem(err, "file-no-writer")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_an_endless_device_as_plan_or_data_is_refused_after_a_bounded_read(cli, device):
    code, _, err = cli("validate", device)
    assert code == 2 and "plancc reads at most 4 MiB" in problem(err, "file-too-large")
    code, out, err = cli("apply", QWEN3, "--data", device, "--steps", 1)
    assert code == 1 and "plancc apply:" not in out  # nothing launched
    assert "Traceback" not in err and ("[data-file]" in err or "[data-json]" in err)  # a data problem: exit 1


def test_a_folder_as_plan_is_named_as_a_folder(cli, tmp_path):
    code, _, err = cli("validate", tmp_path)
    assert code == 2 and "is a folder" in problem(err, "file-unreadable")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_from_a_fifo_with_one_writer_and_data_from_stdin_run_read_once(tmp_path, lines):
    """The launcher reads both once and hands their content to the workers: read twice, the
    FIFO's second reader would wait for a writer that already left, and stdin would be empty."""
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(QWEN3.read_bytes()), daemon=True)
    writer.start()
    with open(lines) as stdin:
        code, out, err = run_cli("logprobs", fifo, "--data", "/dev/stdin", "--timeout", 60, stdin=stdin)
    assert code == 0, err
    assert len([line for line in out.splitlines() if line.startswith('{"logprobs"')]) == 4
    writer.join(timeout=5)
    assert not writer.is_alive()  # exactly one reader came


def test_a_data_pipe_read_as_it_arrives_stops_at_twenty_bad_lines(tmp_path):
    from plancc.job.data import DataError, read_jsonl

    code = "import sys\nwhile True: sys.stdout.write('not json\\n'); sys.stdout.flush()"
    import subprocess

    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as proc:
        with pytest.raises(DataError) as info:
            read_jsonl(f"/dev/fd/{proc.stdout.fileno()}", vocab_size=256, wait_s=30)
        proc.kill()
    found = info.value.diagnostics
    assert len(found) == 21 and "the rest of the file was not read" in found[-1].message


# --------------------------------------------------------------------------- 2: a style written as a mapping
@pytest.mark.parametrize(
    "written",
    ["{style: {a: 1}}", "{style: {style: packed_colwise, blocks: 100000000000000000000}}", "{style: [colwise]}"],
)
def test_a_style_that_is_not_a_name_is_a_wrong_type_at_the_style_key(cli, write_plan, written):
    path = write_plan(QWEN3.read_text().replace("  lm_head: colwise_logits\n", f"  lm_head: {written}\n", 1))
    code, _, err = cli("validate", path)
    line = problem(err, "wrong-type")
    assert code == 1 and ":27:20:" in line and "expected a style name" in line


# --------------------------------------------------------------------------- 3: checkpoints
@pytest.fixture
def checkpoint_copy(tiny_checkpoint, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    return ck, ck / "step-000002"


def _rewrite_metadata(step: Path, change) -> None:
    from plancc.engine.checkpoint_reader import SafeFileSystemReader

    meta = SafeFileSystemReader(str(step)).read_metadata()
    meta.storage_meta = None
    change(meta)
    (step / ".metadata").write_bytes(pickle.dumps(meta))


def _set_all(attr, value):
    def change(meta):
        for info in meta.storage_data.values():
            setattr(info, attr, value)

    return change


def _chunks_not_a_list(meta):
    for entry in meta.state_dict_metadata.values():
        if hasattr(entry, "chunks"):
            entry.chunks = 3


def _map_as_list(meta):
    meta.state_dict_metadata = list(meta.state_dict_metadata.items())


def _storage_as_list(meta):
    meta.storage_data = list(meta.storage_data.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_map_as_list, "state_dict_metadata is list, not a mapping"),
        (_storage_as_list, "storage_data is list, not a mapping"),
        (_set_all("offset", "x"), "not byte counts"),
        (_set_all("offset", 1.5), "not byte counts"),
        (_chunks_not_a_list, "no list of chunks"),
    ],
)
def test_checkpoint_metadata_of_the_wrong_types_is_one_line_before_launch(cli, checkpoint_copy, change, said):
    ck, step = checkpoint_copy
    _rewrite_metadata(step, change)
    code, out, err = cli("apply", QWEN3, "--resume", ck, "--steps", 1)
    assert code == 1 and said in problem(err, "checkpoint") and "plancc apply:" not in out


def test_a_metadata_pickle_dcp_itself_cannot_load_is_refused_not_raised(checkpoint_copy, monkeypatch):
    """An allowed class given a state its own ``__setstate__`` rejects (an unknown memory format)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    from plancc.engine import checkpoint
    from plancc.engine.checkpoint_reader import SafeFileSystemReader

    _, step = checkpoint_copy
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (self.dtype, self.layout, False, 99, False))
    _rewrite_metadata(step, lambda meta: None)
    monkeypatch.undo()
    with pytest.raises(checkpoint.CheckpointError) as info:
        SafeFileSystemReader(str(step)).read_metadata()
    assert "refused checkpoint metadata" in info.value.diagnostics[0].message


@pytest.mark.parametrize("step", ["2", 2.5, -2, True])
def test_a_step_that_is_not_a_whole_number_at_least_zero_is_refused(checkpoint_copy, step):
    from plancc.engine import checkpoint

    _, step_dir = checkpoint_copy
    info = json.loads((step_dir / "plancc.json").read_text())
    (step_dir / "plancc.json").write_text(json.dumps({**info, "step": step}))
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.read_info(step_dir)
    assert "a step is a whole number >= 0" in caught.value.diagnostics[0].message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["folder", "link"])
def test_a_lock_that_is_a_folder_or_a_link_is_named_and_nothing_is_written_through_it(cli, tmp_path, kind):
    save = tmp_path / "ck"
    save.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    if kind == "folder":
        (save / ".lock").mkdir()
    else:
        (save / ".lock").symlink_to(target)
    code, out, err = cli("apply", QWEN3, "--save", save, "--steps", 1)
    assert code == 1 and f"is a {'folder' if kind == 'folder' else 'symbolic link'}" in problem(err, "checkpoint")
    assert target.read_text() == "keep" and "plancc apply:" not in out


# --------------------------------------------------------------------------- 4: model folders and configs
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The tiny Qwen3 saved by transformers (config.json + model.safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plancc.models import load_config

    folder = tmp_path_factory.mktemp("hf") / "tiny"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_config("tiny-qwen3")).save_pretrained(folder)
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    return copy


def _rewrite_header(folder: Path, change) -> None:
    import struct

    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    text, data = change(header, data)
    encoded = text.encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _duplicate(header, data):
    name = _by_offset(header)[1]
    return json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}}}", data


def _gap(header, data):
    last = _by_offset(header)[-1]
    start, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [start + 4, end + 4]
    return json.dumps(header), data[:start] + b"\0" * 4 + data[start:]


def _overlap(header, data):
    first, second = _by_offset(header)[:2]
    start = header[second]["data_offsets"][0] - 4  # borrows the first tensor's last 4 bytes
    header[second]["data_offsets"] = [start, start + (header[second]["data_offsets"][1] - start - 4)]
    return json.dumps(header), data


def _trailing(header, data):
    return json.dumps(header), data + b"garbage!"


def _metadata(header, data):
    return json.dumps({**header, "__metadata__": {"format": ["pt"]}}), data


def _million(header, data):
    end = len(data)
    junk = {f"junk.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [end, end]} for i in range(250_000)}
    return json.dumps({**header, **junk}), data


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_duplicate, "twice"),
        (_gap, "to no tensor"),
        (_overlap, "overlaps the tensor before it"),
        (_trailing, "after its last tensor"),
        (_metadata, "__metadata__ is not a mapping of strings"),
        (_million, "plancc reads at most 200000"),
    ],
)
def test_a_safetensors_header_safetensors_would_refuse_is_named_by_the_folder_check(hf_folder, tmp_path, change, said):
    from plancc.models import build_meta_model
    from plancc.runtime.hf_folder import check_folder

    folder = _copy(hf_folder, tmp_path)
    _rewrite_header(folder, change)
    (found,) = check_folder(folder, build_meta_model("tiny-qwen3"))
    assert found.rule == "weights" and said in found.message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_weights_that_are_a_folder_or_a_fifo_are_refused_not_taken_for_random_init(cli, hf_folder, tmp_path, kind):
    folder = _copy(hf_folder, tmp_path)
    weights = folder / "model.safetensors"
    weights.unlink()
    weights.mkdir() if kind == "folder" else os.mkfifo(weights)
    code, out, err = cli("apply", QWEN3, "--model", folder, "--steps", 1)
    assert code == 1 and "the weights file is" in problem(err, "weights") and "random init" not in err + out


def test_a_tied_folder_holding_a_distinct_lm_head_is_refused_one_holding_the_same_is_not(hf_folder, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from plancc.models import build_meta_model, load_config
    from plancc.runtime.hf_folder import check_folder

    config = load_config("tiny-qwen3-tied")
    folder = tmp_path / "tied"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    model = build_meta_model(folder)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, folder / "model.safetensors")
    assert check_folder(folder, model) == []  # the same values: tying loses nothing
    other = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file({**tensors, "lm_head.weight": other}, folder / "model.safetensors")
    (found,) = check_folder(folder, model)
    assert "transformers would untie them" in found.message and "tie_word_embeddings: false" in found.fix


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_folder_with_a_nan_weight_is_refused_by_logprobs_naming_the_tensor(hf_folder, tmp_path, lines):
    """NaN log-probs with exit 0 were the old answer; logprobs refuses such weights as save and
    export do."""
    from safetensors.torch import load_file, save_file

    folder = _copy(hf_folder, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, out, err = forked_cli("logprobs", QWEN3, "--model", folder, "--data", lines, "--format", "json",
                             "--nproc-per-node", 1)
    assert code == 1, err
    (found,) = [d for d in json.loads(out)["diagnostics"] if d["rule"] == "non-finite-weights"]
    assert "'model.norm.weight'" in found["message"] and found["severity"] == "error"
    assert "refused, no log-probs written" in found["message"] and "logprobs" not in json.loads(out)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"sliding_window": 0, "use_sliding_window": True}, "sliding_window is 0"),
        ({"sliding_window": -4, "use_sliding_window": True}, "sliding_window is -4"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1e4}}, "rope_theta is -10000.0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
    ],
)
def test_config_values_that_break_the_model_are_named_before_launch(cli, tmp_path, change, said):
    from plancc.models import presets

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**presets()["tiny-qwen3"].config, **change}))
    code, _, err = cli("validate", QWEN3, "--model", folder)
    assert code == 1 and said in problem(err, "model-config")


def test_heads_that_do_not_split_the_hidden_size_without_a_head_dim_are_refused(cli, tmp_path):
    from plancc.models import presets

    folder = tmp_path / "model"
    folder.mkdir()
    config = {**presets()["tiny-llama"].config, "hidden_size": 66}
    config.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = cli("validate", PLANS / "llama.yaml", "--model", folder)
    assert code == 1 and "66" in problem(err, "model-config")


def test_a_model_too_large_for_the_machine_says_the_bytes_per_rank_before_launch(cli):
    code, out, err = cli("apply", QWEN3, "--model", "qwen3-32b", "--steps", 1, "--device", "cpu")  # 256 GiB a rank
    line = problem(err, "memory")
    assert code == 1 and "GiB per rank" in line and "GiB available" in line and "plancc apply:" not in out


# --------------------------------------------------------------------------- 5: a batch beyond memory
def test_a_batch_beyond_memory_is_a_usage_error_naming_the_flag(cli):
    big = ("--seq-len", 32768, "--batch-size", 64)
    code, _, err = cli("apply", QWEN3, "--model", "qwen3-0.6b", *big, "--device", "cpu")
    line = problem(err, "usage")
    assert code == 2 and line.startswith("--batch-size:") and "logits need" in line


def test_the_memory_bound_counts_training_state_over_every_rank():
    """16 bytes a parameter split over the world, the logits and their gradient, and the
    seeded init's whole fp32 model: each term pinned on a model whose numbers are known."""
    from plancc.job.config import RunConfig
    from plancc.job.memory import memory_problems, need
    from plancc.layout import Layout
    from plancc.models import build_meta_model, load_config

    model, config = build_meta_model("tiny-qwen3"), load_config("tiny-qwen3")
    params = sum(p.numel() for p in model.parameters())
    cfg = RunConfig.of(plan="p.yaml", layout=Layout.infer(world_size=4, tp=2), batch_size=4, seq_len=32)
    got = need(cfg, model, config, longest=None, from_folder=False)
    assert got.state == -(-params * 16 // 4)
    assert got.logits == (4 // 2) * 32 * (256 // 2) * 4 * 2  # rows per dp rank x tokens x vocab/tp x fp32 x 2
    assert got.init == params * 4
    assert memory_problems(cfg, model, config, local_ranks=4, longest=None, from_folder=False, device="cpu",
                           host=1 << 40) == []
    (tight,) = memory_problems(cfg, model, config, local_ranks=4, longest=None, from_folder=False, device="cpu",
                               host=4 * got.device - 1)
    assert tight.rule in {"memory", "usage"}


# --------------------------------------------------------------------------- 6: launcher flags
@pytest.mark.parametrize(
    ("flags", "flag", "said"),
    [
        (("--nnodes", "2:1"), "--nnodes", "is not N or MIN:MAX"),
        (("--nnodes", "1:2:3"), "--nnodes", "is not N or MIN:MAX"),
        (("--rdzv-endpoint", "garbage::::"), "--rdzv-endpoint", "is not HOST:PORT"),
        (("--rdzv-endpoint", "node0:99999"), "--rdzv-endpoint", "is not HOST:PORT"),
        (("--nnodes", "2"), "--nnodes", "without --rdzv-endpoint"),
        (("--nproc-per-node", "100000", "--device", "cpu"), "--nproc-per-node", "CPU workers on"),
    ],
)
def test_launcher_flags_torchrun_would_trace_back_or_wait_on_are_usage_errors(cli, flags, flag, said):
    code, out, err = cli("apply", QWEN3, "--steps", 1, *flags)
    line = problem(err, "usage")
    assert code == 2 and line.startswith(f"{flag}:") and said in line and "plancc apply:" not in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rendezvous_no_other_node_joins_ends_after_timeout_with_one_line_naming_the_endpoint():
    from .distributed import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    code, _, err = run_cli("apply", QWEN3, "--steps", 1, "--nnodes", 2, "--rdzv-endpoint", endpoint, "--timeout", 10)
    line = problem(err, "rendezvous")
    assert code == 1 and endpoint in line and "--timeout 10 s" in line


# --------------------------------------------------------------------------- 7: the dry run's world size
def test_a_dry_run_beyond_the_largest_world_it_simulates_is_refused_at_once(cli):
    from plancc.tools.dryrun import MAX_WORLD

    code, _, err = cli("validate", QWEN3, "--world-size", 1_000_000, "--dry-run")
    assert code == 2 and f"at most {MAX_WORLD} ranks" in problem(err, "usage")
    assert cli("validate", QWEN3, "--world-size", 1_000_000)[0] == 0  # the plan itself checks at any size


# --------------------------------------------------------------------------- 8: plot
def test_plot_draws_metrics_holding_nan_inf_and_overflowing_values_as_gaps(cli, tmp_path):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(
        '{"step": 1, "loss": NaN, "grad_norm": Infinity}\n'
        '{"step": 2, "loss": 1e308, "grad_norm": 1.0}\n'
        '{"step": 3, "loss": -1e308, "grad_norm": NaN}\n'
        '{"step": 4, "loss": 2.0, "grad_norm": 1.0}\n'
    )
    code, out, err = cli("plot", metrics, "-o", tmp_path / "m.png")
    assert code == 0 and "Traceback" not in err and (tmp_path / "m.png").stat().st_size > 0


# --------------------------------------------------------------------------- 9: one line for a failed rank
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_mid_run_gives_the_rank_failed_line_and_no_traceback_on_the_terminal(tmp_path):
    import signal
    import subprocess

    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "plancc.cli", "apply", str(QWEN3), "--steps", "100000", "--metrics", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 240
    while (not metrics.exists() or metrics.stat().st_size == 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    # the launcher runs torch's agent in its own process: the workers are its children
    found = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "plancc.job.runner"], capture_output=True, text=True)
    os.kill(max(int(pid) for pid in found.stdout.split()), signal.SIGKILL)
    _, err = proc.communicate(timeout=200)
    line = problem(err, "rank-failed")
    assert proc.returncode == 1 and "SIGKILL" in line and "[rank0]:" not in err and "[rank1]:" not in err
    logs = Path(err.split("tracebacks: ")[1].split(";")[0])  # the ranks it took down wrote theirs
    assert "Connection" in (logs / "rank-0.log").read_text() or "Traceback" in (logs / "rank-0.log").read_text()
    shutil.rmtree(logs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_under_metrics_is_one_line_with_the_trace_in_the_ranks_log():
    code, _, err = forked_cli("apply", QWEN3, "--steps", 2, "--metrics", "/dev/full", "--nproc-per-node", 1)
    line = problem(err, "rank-failed")
    assert code == 1 and "No space left on device" in line
    log = err.split("its full traceback: ")[1].split(";")[0]
    assert "Traceback" in Path(log).read_text()
    shutil.rmtree(Path(log).parent)


# --------------------------------------------------------------------------- 11: torch's plan constructs
def test_a_shard_placement_on_a_dim_the_parameter_lacks_or_naming_no_parameter_is_a_diagnostic(cli, write_plan):
    placements = "    model.layers.*.mlp.down_proj.weight: shard(2)\n    model.nothing.weight: shard(1)\n"
    text = QWEN3.read_text().replace("fsdp:\n", f"fsdp:\n  shard_placement:\n{placements}", 1)
    code, _, err = cli("validate", write_plan(text))
    line = problem(err, "fsdp-shard-placement")
    assert code == 1 and "more it matches) has 2 dim(s)" in line and "shard(2)" in line  # one line per glob
    assert "matches no parameter" in problem(err, "glob-no-match")


def test_a_rule_for_the_root_is_resolved_and_shown_as_the_model(cli, write_plan):
    text = QWEN3.read_text().replace("  lm_head: colwise_logits\n", '  lm_head: colwise_logits\n  "": replicate\n', 1)
    code, out, err = cli("validate", write_plan(text), "--tp", 2)
    assert code == 0, err
    assert any(line.split()[:3] == ['""', "(the", "model)"] for line in out.splitlines()), out
