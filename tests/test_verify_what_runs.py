"""`--verify` checks the run the user asked for: the model folder's own weights (a bf16 folder,
as every real checkpoint is), the checkpoint of `--resume` with its optimizer state and its next
batches, the microbatching; what it cannot check is refused with a reason, never dropped."""

import re

import pytest
import torch

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"


def _first_loss(out: str) -> float:
    (line,) = [x for x in out.splitlines() if x.startswith("  both from ")]
    return float(re.search(r"the unsharded loss on the first batch ([0-9.]+)", line).group(1))


def _expected_first_loss(folder) -> float:
    """The mean next-token NLL of the folder's model, by plain transformers, on `apply`'s first
    synthetic batch (4 rows of 32 tokens, seed 0)."""
    from transformers import AutoModelForCausalLM

    from plancc.job.data import synthetic_batch

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = synthetic_batch(0, seed=0, batch_size=4, seq_len=32, vocab_size=model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


@pytest.fixture
def bf16_folder(tmp_path):
    """The tiny Qwen3 with weights of its own (seed 7), saved as a bf16 Hugging Face folder."""
    from plancc.models import build_model, load_config

    torch.manual_seed(7)
    model = build_model(load_config("tiny-qwen3"), device="cpu", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_compares_the_folders_own_weights(bf16_folder):
    code, out, err = forked_cli("apply", QWEN3, "--model", bf16_folder, "--tp", 2, "--steps", 1, "--verify",
                                "--micro-batch-size", 2)
    assert code == 0, err + out
    assert "verify: OK" in out
    assert f"both from safetensors from {bf16_folder}" in out and "--micro-batch-size 2" in out
    assert _first_loss(out) == pytest.approx(_expected_first_loss(bf16_folder), abs=2e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_with_resume_compares_the_checkpoints_weights_moments_and_next_batch(tiny_checkpoint):
    ck, resumed_losses = tiny_checkpoint  # step 2; the resumed run's losses of steps 3 and 4
    code, out, err = forked_cli("apply", QWEN3, "--tp", 2, "--steps", 1, "--verify", "--resume", ck)
    assert code == 0, err + out
    assert "verify: OK" in out and "both from the checkpoint of step 2" in out
    # the loss of step 3 is the one the resumed run reported on the same batch with the same weights
    assert _first_loss(out) == pytest.approx(resumed_losses[0], abs=1e-5)  # verify's loss bar


@pytest.mark.parametrize(("flags", "said"), [
    (["--param-dtype", "bfloat16"], "does not check --param-dtype bfloat16"),
    (["--save", "ck"], "--save would be ignored"),
])
def test_what_verify_cannot_check_is_refused_not_dropped(cli, flags, said):
    code, out, err = cli("apply", QWEN3, "--verify", *flags)
    assert code == 2 and said in out + err and "[usage]" in out + err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_on_a_bf16_folder_trains_and_saves_fp32_masters_and_exports_bf16(bf16_folder, tmp_path):
    import json

    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    code, out, err = forked_cli("apply", QWEN3, "--model", bf16_folder, "--steps", 1, "--save", tmp_path / "ck",
                                "--export-hf", tmp_path / "out", "--lr", "1e-6")
    assert code == 0, err
    metadata = FileSystemReader(str(tmp_path / "ck" / "step-000001")).read_metadata()
    saved = {name: entry.properties.dtype for name, entry in metadata.state_dict_metadata.items()
             if hasattr(entry, "properties") and ("weight" in name or "exp_avg" in name)}
    assert saved and set(saved.values()) == {torch.float32}, saved  # masters and AdamW moments
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
