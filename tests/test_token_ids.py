"""A token id outside the model's vocabulary is bad input, refused before any forward with a
``BatchError`` naming the row and position on every rank. Before, the embedding raised an
IndexError on the rank that held it (a device-side assert on CUDA) while its peers waited in
FSDP's next all-gather until the collective timeout."""

import pytest
import torch

from plancc.engine.batches import BatchError, check_batch


def _batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("bad", [256, 10_000, -1, -100])
def test_an_id_outside_the_vocabulary_is_named_with_its_row_and_position(bad):
    ids = torch.zeros((3, 8), dtype=torch.long)
    ids[2, 6] = bad
    with pytest.raises(BatchError, match=rf"row 2 position 6 holds token id {bad}, outside the vocabulary \[0, 256\)"):
        check_batch(_batch(ids), vocab_size=256)


def test_ids_inside_the_vocabulary_pass():
    check_batch(_batch(torch.full((2, 4), 255, dtype=torch.long)), vocab_size=256)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_rank_with_a_bad_id_fails_every_rank_at_once_and_changes_nothing():
    from .distributed import launch
    from .token_ids_worker import one_rank_with_an_id_outside_the_vocabulary

    results = launch(one_rank_with_an_id_outside_the_vocabulary, 2, "plans/qwen3.yaml", "tiny-qwen3", timeout_s=120)
    for rank, got in results.items():
        assert got["error"].startswith("rank 1: row 1 position 5 holds token id"), (rank, got)
        assert got["unchanged"], (rank, got)
