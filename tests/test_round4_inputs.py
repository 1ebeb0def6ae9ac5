"""Round 4 of the adversarial pass (issue 56): sizes past any job are refused with the largest
that makes sense, in bounded time; a symbolic-link loop is a diagnostic, not a traceback;
log-probs written to stdout keep the log on stderr; a temperature whose log-probs overflow is
refused."""

import os
import subprocess
import sys
import time

import pytest

from .conftest import PLANS

QWEN3 = PLANS / "qwen3.yaml"
HUGE = "9" * 400
GENEROUS_S = 60  # each answers in ~2 s; the old code never answered (a range() over 10^12)


@pytest.mark.parametrize(("flags", "flag", "said"), [
    (["--gpu-memory", f"{HUGE}GB"], "--gpu-memory", "a 410-digit number"),
    (["--seq-len", HUGE], "--seq-len", "a 400-digit number"),
    (["--gpus", "1073741824"], "--gpus", "1,073,741,824"),
    (["--gpus", "1000000000000"], "--gpus", "1,000,000,000,000"),
    (["--tokens-per-step", "0"], "--tokens-per-step", "less than one sequence"),
    (["--tokens-per-step", "5000"], "--tokens-per-step", "not whole sequences of 4,096"),
])
def test_suggest_refuses_sizes_no_search_can_use_with_the_largest_that_makes_sense(cli, flags, flag, said):
    args = {"--gpus": "8", "--gpu-memory": "80GiB", **dict(zip(flags[::2], flags[1::2], strict=True))}
    started = time.monotonic()
    code, out, err = cli("suggest", QWEN3, "--model", "qwen3-8b", *[x for kv in args.items() for x in kv])
    assert time.monotonic() - started < GENEROUS_S
    assert code == 2, out + err
    (line,) = [x for x in err.splitlines() if x.startswith(f"{flag}: error:")]
    assert said in line and "[usage]" in line and "Traceback" not in err


def test_validate_answers_a_world_size_of_a_trillion(cli):
    started = time.monotonic()
    code, out, err = cli("validate", QWEN3, "--world-size", "1000000000000", "--tp", "7")
    assert time.monotonic() - started < GENEROUS_S
    assert code == 1 and "[mesh-sizes]" in out + err and "(153 more, up to 1000000000000)" in out + err


@pytest.mark.parametrize("flags", [
    ["apply", QWEN3, "--save", "{loop}"],
    ["apply", QWEN3, "--export-hf", "{loop}"],
    ["apply", QWEN3, "--metrics", "{loop}"],
    ["apply", QWEN3, "--metrics", "{loop}/m.jsonl"],
    ["logprobs", QWEN3, "--data", "{data}", "--out", "{loop}"],
])
def test_a_symbolic_link_loop_is_a_diagnostic_before_launch(cli, tmp_path, flags):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    code, out, err = cli(*[str(f).format(loop=loop, data=data) for f in flags])
    assert code == 1 and "[path-loop]" in err and "Traceback" not in err and "plancc " not in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_logprobs_to_dev_stdout_keeps_the_log_on_stderr(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5, 6, 7]}\n')
    proc = subprocess.run([sys.executable, "-m", "plancc.cli", "logprobs", str(QWEN3), "--data", str(data),
                           "--out", "/dev/stdout", "--nproc-per-node", "1"],
                          capture_output=True, text=True, timeout=240, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith('{"logprobs": [0.0, ') for line in lines), proc.stdout
    assert "plancc logprobs:" in proc.stderr


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-7])
def test_a_temperature_whose_logprobs_overflow_is_refused(temperature):
    from plancc.engine.policy import check_temperature

    with pytest.raises(ValueError, match="below 1e-06"):
        check_temperature(temperature)
    check_temperature(1e-6)  # the coldest one allowed, as --temperature's own bound


def test_a_hub_id_is_refused_with_the_weightless_preset_offered_as_a_choice(cli):
    code, out, err = cli("apply", QWEN3, "--model", "Qwen/Qwen3-0.6B")
    assert code == 2 and "[unknown-model]" in err and "Hub id" in err
    (fix,) = [line for line in err.splitlines() if line.strip().startswith("fix:")]
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in fix and "--model qwen3-0.6b" in fix and "random weights" in fix


def test_a_run_on_a_presets_random_weights_says_so():
    from plancc.job.config import RunConfig
    from plancc.job.preflight import notices
    from plancc.layout import Layout

    for model in ("qwen3-0.6b", None):
        cfg = RunConfig.of(plan=str(QWEN3), layout=Layout(dp=1), model=model, mode="logprobs")
        (found,) = [d for d in notices(cfg) if d.rule == "random-init"]
        assert "random weights" in found.message and found.format().count("warning:") == 1

