"""transformers' packed-sequence check (a read of the device at the start of every forward
given no attention mask) is answered from the host where plancc knows its answer -- rows whose
positions the model makes itself, without context parallelism -- and left to transformers
everywhere else."""

import pytest
import torch
from transformers import masking_utils

from plancc.runtime import unpacked_rows as hint


@pytest.fixture
def calls(monkeypatch):
    """transformers' own check, counted (wherever it is called from: the wrapper is in its place)."""
    hint._install()
    seen = []
    original = hint._transformers_check

    def counted(position_ids):
        seen.append(position_ids)
        return original(position_ids)

    monkeypatch.setattr(hint, "_transformers_check", counted)
    return seen


def _tiny_llama():
    from plancc.models import build_model, load_config

    torch.manual_seed(0)
    return build_model(load_config("tiny-llama"), device="cpu")


def test_the_known_answer_is_transformers_own_for_positions_the_model_makes():
    for rows, seq in [(1, 2), (2, 8), (3, 17)]:
        made = torch.arange(seq).unsqueeze(0).expand(rows, -1)  # what the model makes given none
        assert hint._transformers_check(made) is None


def test_inside_the_hint_the_check_is_not_run_and_outside_it_is(calls):
    model = _tiny_llama()
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])  # three documents in one row
    with hint.unpacked_rows(model, {"input_ids": packed}):
        assert masking_utils.find_packed_sequence_indices(torch.arange(8)[None]) is None
    assert calls == []
    # positions the caller gives (packed rows) are transformers' to judge, inside or out
    with hint.unpacked_rows(model, {"input_ids": packed, "position_ids": packed}):
        inside = masking_utils.find_packed_sequence_indices(packed)
    outside = masking_utils.find_packed_sequence_indices(packed)
    assert len(calls) == 2 and torch.equal(inside, outside) and outside.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]


def test_plancc_forward_asks_the_device_nothing_and_equals_the_model(calls):
    import plancc

    model = _tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got = plancc.logprobs.token_logprobs(model, ids)
    assert calls == []  # the mask builder took the host's answer
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    want = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None]).squeeze(2)
    assert len(calls) == 1  # the model called directly: transformers' own check
    torch.testing.assert_close(got[:, 1:], want, rtol=1e-5, atol=1e-5)


def test_packed_documents_keep_transformers_check(calls):
    import plancc

    model = _tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    plancc.logprobs.token_logprobs(model, ids, cu_seqlens=cu)
    assert calls, "packed rows: their positions restart per document, transformers finds the documents"
