"""A user's first week: output other tools can read, flags refused before launch, torchrun's
spellings, a version. Launches carry the same checks where they already run: one JSON
document from a successful and from a failed `apply` (tests/test_reliability.py), log-probs
on stdout without --out (tests/test_runner.py); the own-loop recipe is tests/test_own_loop.py,
several plans in one call tests/test_reliability.py."""

from __future__ import annotations

import json

import pytest

from .conftest import PLANS

QWEN3 = PLANS / "qwen3.yaml"


def one_json_document(stdout: str) -> dict:
    return json.loads(stdout)  # fails on anything before or after the one document


@pytest.mark.parametrize("args,code", [
    (("validate", QWEN3), 0),
    (("validate", QWEN3, "--model", "qwen3-8b", "--tp", 16), 1),
    (("validate", QWEN3, PLANS / "llama.yaml"), 0),
    (("apply", QWEN3, "--tp", 3), 2),                    # a layout that cannot exist
    (("apply", QWEN3, "--param-dtype", "bf17"), 2),       # a flag checked before launch
    (("logprobs", QWEN3, "--data", PLANS / "missing.jsonl"), 1),
])
def test_format_json_is_one_document_on_stdout_for_every_outcome(cli, args, code):
    got, out, _ = cli(*args, "--format", "json")
    assert got == code
    doc = one_json_document(out)
    assert isinstance(doc["diagnostics"], list)
    assert (code == 0) == (not any(d["severity"] == "error" for d in doc["diagnostics"]))


def test_flags_that_would_fail_inside_workers_are_refused_before_launch(cli):
    code, out, err = cli("apply", QWEN3, "--device", "cuda")
    import torch

    if not torch.cuda.is_available():
        assert code == 2 and "torch sees no CUDA device" in err and "plancc apply:" not in out
    code, _, err = cli("apply", QWEN3, "--device", "tpu")
    assert code == 2 and "--device 'tpu' is neither cpu nor cuda" in err


def test_torchrun_spellings_and_a_version(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.startswith("plancc ")
    code, _, err = cli("apply", QWEN3, "--nproc_per_node", 2, "--max_restarts", 0, "--tp", 3)
    assert code == 2 and "[mesh-sizes]" in err  # the torchrun spellings parsed; the layout refused
    import plancc

    diag = plancc.Diagnostic(rule="r", message="m", loc=plancc.SourceLoc(path="p", line=1, column=2))
    assert str(diag) == "p:1:2: error: m [r]"


def test_a_metrics_file_that_cannot_be_written_is_refused_before_launch(cli, tmp_path):
    code, out, err = cli("apply", QWEN3, "--metrics", tmp_path / "no" / "such" / "m.jsonl")
    assert code == 1 and "--metrics names a file in" in err and "[output]" in err and "plancc apply:" not in out


def test_plot_draws_a_metrics_file_and_places_a_broken_line(cli, tmp_path):
    rows = [{"step": s, "loss": 5.5 - 0.1 * s, "grad_norm": 1.5, "lr": 1e-3, "tokens_per_s": 900.0 + s}
            for s in range(1, 6)]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = cli("plot", metrics, "-o", tmp_path / "loss.png")
    assert code == 0 and "plotted 5 steps" in out
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    metrics.write_text(json.dumps(rows[0]) + "\n" + '{"step": 2, "loss": \n')
    code, _, err = cli("plot", metrics, "-o", tmp_path / "broken.png")
    assert code == 1 and f"{metrics}:2:1: error:" in err and "[metrics-file]" in err
    assert not (tmp_path / "broken.png").exists()


@pytest.mark.parametrize("flag", ["--save-every", "--keep"])
def test_periodic_checkpoint_flags_without_a_folder_are_refused_before_launch(cli, flag):
    code, out, err = cli("apply", QWEN3, flag, 2)
    assert code == 2 and f"{flag} 2 without --save" in err and "plancc apply:" not in out


def test_a_glob_typo_leaves_the_rest_of_the_plan_bound_and_counts_read_right(cli, write_plan):
    """A rule whose glob binds nothing is reported; the rest of the plan is bound and checked (one
    report), its units counted as they bound -- never a 0 for units the typo did not touch."""
    typo = write_plan(QWEN3.read_text().replace("model.layers.*.mlp.up_proj", "model.layer.*.mlp.up_proj"))
    code, out, err = cli("validate", typo)
    assert code == 1 and "[glob-no-match]" in err and "fsdp units: 37 " in out  # embed_tokens + 36 layers
    code, out, _ = cli("validate", typo, "--format", "json")
    assert json.loads(out)["summary"]["fsdp_units"] == 37
    code, out, _ = cli("validate", QWEN3, "--model", "tiny-qwen3")
    assert "   1 module\n" in out and " 1 modules" not in out


def test_torchrun_master_port_names_the_rendezvous(cli, monkeypatch):
    from plancc.job import launch

    seen = {}
    monkeypatch.setattr(launch, "launch", lambda opts, cfg, **inputs: seen.setdefault("opts", opts) and 1 / 0)
    with pytest.raises(ZeroDivisionError):  # stopped right where the job would start
        cli("apply", QWEN3, "--master_port", 29577, "--master-addr", "127.0.0.2", "--nnodes", 1)
    assert seen["opts"].rdzv_endpoint == "127.0.0.2:29577"


def test_sizes_from_the_command_line_are_reported_at_the_plan_file_not_a_line_of_it(cli):
    code, _, err = cli("validate", QWEN3, "--tp", 3, "--world-size", 4)
    assert code == 1 and f"{QWEN3}: error: cp=1 x tp=3 does not fit world size 4" in err and "[mesh-sizes]" in err
    code, _, err = cli("validate", QWEN3, "--model", "tiny-qwen3", "--tp", 2, "--sp", "--seq-len", 33)
    assert code == 1 and f"{QWEN3}: error: sequence length 33" in err and "[sequence-length]" in err
