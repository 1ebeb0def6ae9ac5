"""What a refit spends on the host, pinned by behaviour: a logger quieted for a block drops its
records below the threshold and nothing else (without touching any logger's level), the
reverse weight conversion gives what transformers gives while its mapping is found once per
model, a refit's plan (the names streamed, the manifest) is found once per model and the next
refit reads its state dict once, and a one-rank mesh's weights come out as they are (no gather)."""

import logging

import pytest


def test_a_quieted_logger_drops_only_its_records_below_the_threshold_and_only_inside_the_block(caplog):
    from plancc.errors import quiet_logger

    child = logging.getLogger("plancc_test_quiet.child")
    parent = logging.getLogger("plancc_test_quiet")
    levels = (parent.level, child.level)
    with caplog.at_level(logging.INFO):
        with quiet_logger("plancc_test_quiet"):
            child.warning("dropped")
            parent.info("dropped too")
            child.error("kept")
            logging.getLogger("elsewhere").warning("kept elsewhere")
        child.warning("kept after")
    said = [record.getMessage() for record in caplog.records]
    assert said == ["kept", "kept elsewhere", "kept after"]
    assert (parent.level, child.level) == levels and not parent.filters and not child.filters


@pytest.mark.timeout(120)
def test_the_reverse_conversion_is_transformers_own_with_its_mapping_found_once(monkeypatch):
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    from plancc.engine import streaming
    from plancc.models import build_model, load_config

    # a MoE model: its experts are stored fused and saved per expert (a real conversion)
    config = load_config("tiny-qwen3-moe")
    model, fresh = build_model(config, device="cpu"), build_model(config, device="cpu")
    fresh.load_state_dict(model.state_dict())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    want = revert_weight_conversion(fresh, dict(state))
    assert sorted(want) != sorted(state), "the fixture converts something"
    calls = []
    real = streaming.get_model_conversion_mapping
    monkeypatch.setattr(streaming, "get_model_conversion_mapping", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(3):
        got = streaming.reverted(model, dict(state))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert len(calls) == 1


@pytest.mark.timeout(120)
def test_a_refits_plan_is_found_once_per_model_and_describes_what_is_streamed():
    import torch

    from plancc.engine import streaming
    from plancc.models import build_model, load_config

    model = build_model(load_config("tiny-qwen3-tied"), device="cpu")
    reads = []
    own = model.state_dict
    model.state_dict = lambda *a, **k: reads.append(1) or own(*a, **k)
    refits = []
    for _ in range(2):
        reads.clear()
        manifest = streaming.manifest_buckets(model, bucket_bytes=4096)
        streamed = [[(n, tuple(t.shape), t.dtype) for n, t in b] for b in streaming.weight_buckets(model, bucket_bytes=4096)]
        refits.append((manifest, streamed, len(reads)))
    (first, streamed, first_reads), (again, streamed_again, next_reads) = refits
    assert first == streamed == again == streamed_again and len(first) > 4
    # the next refit reads no state dict: the plan is known, the entries are the parameters themselves
    assert (first_reads, next_reads) == (2, 0)
    state = own()
    values = [item for b in streaming.weight_buckets(model, bucket_bytes=4096) for item in b]
    assert values and all(torch.equal(value, state[name]) and not value.requires_grad for name, value in values)
    with torch.no_grad():  # a value changed in place is streamed as it is now
        model.lm_head.weight.add_(1.0)
    tied = dict(item for b in streaming.weight_buckets(model, bucket_bytes=4096) for item in b)
    assert torch.equal(tied["model.embed_tokens.weight"], model.lm_head.weight)


def test_a_model_with_nothing_to_convert_gets_its_state_back_as_is():
    import torch

    from plancc.engine import streaming

    model = torch.nn.Linear(2, 2)
    state = {"weight": torch.ones(2, 2)}
    assert streaming.reverted(model, state) is state


@pytest.mark.timeout(240)
def test_a_one_rank_policys_weights_come_out_without_a_gather():
    from .distributed import launch
    from .export_worker import one_rank_weights_without_a_gather

    assert launch(one_rank_weights_without_a_gather, 1)[0] == {"names": True, "equal": True}
