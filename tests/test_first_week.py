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
