"""A user's own data: prompt masking from a line's ``labels`` (-100: not counted) or
``loss_mask``, the loss counting exactly those tokens -- the step's reported loss equals plain
transformers' ``labels=`` loss on the same rows -- a field the run does not read named once,
and ``--seq-len`` meaning one thing with and without ``--data``."""

import json

import pytest
import torch

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"


def _lines():
    gen = torch.Generator().manual_seed(11)

    def ids(n):
        return torch.randint(0, 256, (n,), generator=gen).tolist()

    first, second, third, fourth = ids(10), ids(7), ids(12), ids(5)
    return [
        {"input_ids": first, "labels": [-100] * 4 + first[4:]},
        {"input_ids": second, "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
        {"input_ids": third},  # every token counts
        {"input_ids": fourth, "labels": [-100, -100, *fourth[2:]], "source": "web"},
    ]


def _expected_loss(lines) -> float:
    """transformers' own causal-LM loss with ``labels`` (-100 where a token does not count and
    at padding), on the seeded weights ``plancc apply`` starts from: the mean over the batch."""
    from plancc.engine.build import seeded_model
    from plancc.models import load_config

    model = seeded_model(load_config("tiny-qwen3"), 0)
    width = max(len(line["input_ids"]) for line in lines)
    ids = torch.zeros(len(lines), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, line in enumerate(lines):
        n = len(line["input_ids"])
        ids[row, :n] = torch.tensor(line["input_ids"])
        mask[row, :n] = 1
        if "labels" in line:
            labels[row, :n] = torch.tensor(line["labels"])
        elif "loss_mask" in line:
            keep = torch.tensor(line["loss_mask"]).bool()
            labels[row, :n] = torch.where(keep, ids[row, :n], torch.full_like(ids[row, :n], -100))
        else:
            labels[row, :n] = ids[row, :n]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_step_loss_counts_exactly_the_tokens_labels_and_loss_mask_say(tmp_path):
    lines = _lines()
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = forked_cli("apply", QWEN3, "--data", data, "--steps", 1, "--batch-size", 4,
                                "--metrics", tmp_path / "m.jsonl")
    assert code == 0, err
    (step,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert step["loss"] == pytest.approx(_expected_loss(lines), abs=1e-5)
    # the field the run does not read, named once
    (warning,) = [x for x in err.splitlines() if "[data-unused-field]" in x]
    assert "'source'" in warning
    assert "the loss counts the tokens its labels / loss_mask count" in out
    assert "rows as they are (the longest 12 tokens" in out


def test_a_line_whose_labels_are_not_its_tokens_is_refused_at_its_line(cli, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 3], "labels": [-100, 7, 3]}\n')
    code, out, err = cli("apply", QWEN3, "--data", data)
    assert code == 1 and f"{data}:2:1: error: labels[1] is 7" in err and "[data-mask]" in err


def test_a_line_longer_than_the_model_takes_is_refused_by_apply_unless_seq_len_cuts_it(cli, tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"input_ids": [1] * 600}) + "\n" + json.dumps({"input_ids": [2, 3]}) + "\n")
    code, out, err = cli("apply", QWEN3, "--data", data)
    assert code == 1 and f"{data}:1:1: error: the line has 600 tokens" in err and "[data-too-long]" in err
    code, out, err = cli("apply", QWEN3, "--data", data, "--seq-len", 1000)
    assert code == 2 and "--seq-len 1000 is beyond the model's max_position_embeddings (512)" in err
