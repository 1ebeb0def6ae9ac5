"""plancc.Policy, the RL policy engine: one ``train`` call on a global batch cut over dp ranks
and microbatches gives the loss and the updated parameters of the unsharded model trained on the
whole batch in one pass with the same loss -- the loss within 1e-5 relative; every parameter's
(clipped) gradient within 1e-5 of its own size from the unsharded model's in fp64, or, where fp32
itself misses that, as near as 4x the unsharded fp32 model trained on the same microbatches; the
updated parameters within 1e-5 of the whole update (a weight near 1.0, a norm's, moves by so
little that one fp32 ulp of it is 3e-5 of its own update) -- at every layout and every way of
cutting the batch; a loss normalized per rank does not. Log-probs of the policy and of the
frozen reference, weights out by bucket, bad input refused on every rank."""

import pytest

from plancc.engine.batches import BatchError, Microbatch, check_batch, plan_microbatches, split_to_count

TOLERANCE = 1e-5
EXACT_FACTOR = 4  # plancc.job.verify.EXACT_FACTOR
ONE = {}
UNEVEN = {"micro_batch_size": 3}  # 4 rows per rank: 3 + 1
BUDGET = {"max_tokens": 30}
PACKED = {"micro_batch_size": 2, "pack": True}
ALL_CUTS = [ONE, UNEVEN, BUDGET, PACKED]
LOSSES = ["nll", "grpo", "seq_mean_token_mean"]


def _cases(cuts, losses=LOSSES):
    return [(loss, cut) for loss in losses for cut in cuts]


# the same sums as per-token terms through train(token_loss=): the 3-matmul lm_head path
TOKEN_LOSSES = ["nll_tokens", "grpo_tokens"]

LAYOUTS = [
    # (ranks, plan, model, layout, cases)
    # one rank (a policy on one GPU): no collective, the step's sums and norm read in one go,
    # transformers' packed-row check answered from the host for unpacked rows (llama's mask path)
    pytest.param(
        1,
        "plans/llama.yaml",
        "tiny-llama",
        {},
        _cases([ONE, UNEVEN, PACKED], ["grpo"]) + _cases([ONE], ["nll_tokens"]),
        id="one-rank",
    ),
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"dp": 2},
        _cases(ALL_CUTS) + _cases([UNEVEN, PACKED], ["grpo_tokens"]),
        id="dp2",
    ),
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"tp": 2, "sp": True},
        _cases([ONE, PACKED, BUDGET]) + _cases([PACKED, BUDGET], ["grpo_tokens"]),
        id="tp2-sp",
    ),
    pytest.param(
        2, "plans/qwen3.yaml", "tiny-qwen3", {"cp": 2}, _cases([UNEVEN, PACKED], LOSSES + TOKEN_LOSSES), id="cp2"
    ),
    pytest.param(
        4, "plans/qwen3.yaml", "tiny-qwen3", {"cp": 2, "tp": 2}, _cases([BUDGET], ["grpo", "grpo_tokens"]), id="cp2xtp2"
    ),
    pytest.param(
        4, "plans/qwen3.yaml", "tiny-qwen3", {"dp": 2, "tp": 2}, _cases([UNEVEN], ["grpo", "nll_tokens"]), id="dp2xtp2"
    ),
    pytest.param(
        2, "plans/qwen3_moe.yaml", "tiny-qwen3-moe", {"ep": 2}, _cases([ONE, BUDGET], ["grpo", "grpo_tokens"]), id="ep2"
    ),
    # pipeline stages (engine.pipeline.pipeline_steps): rows of every length unpadded, one schedule step a
    # length, each rank comparing the parameters of its own stages
    pytest.param(
        2,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"pp": 2},
        _cases([ONE, UNEVEN, BUDGET, PACKED]) + _cases([ONE, PACKED], ["grpo_tokens"]),
        id="pp2",
    ),
    pytest.param(
        4,
        "plans/qwen3.yaml",
        "tiny-qwen3",
        {"pp": 2, "tp": 2},
        _cases([BUDGET, PACKED], ["grpo", "grpo_tokens"]),
        id="pp2xtp2",
    ),
    pytest.param(
        4, "plans/qwen3.yaml", "tiny-qwen3", {"pp": 2, "dp": 2}, _cases([UNEVEN], ["grpo", "nll_tokens"]), id="pp2xdp2"
    ),
    # expert parallelism inside each stage: each pipeline rank's experts over its own dp pair
    pytest.param(
        4,
        "plans/qwen3_moe.yaml",
        "tiny-qwen3-moe",
        {"pp": 2, "ep": 2},
        _cases([UNEVEN], ["grpo", "grpo_tokens"]),
        id="pp2xep2",
    ),
    # context parallelism inside each stage: a stage's layers see their cp rank's half of a row;
    # whole layers checkpointed, so a packed microbatch's attention is recomputed in its backward
    # after the schedule laid out the next one (its documents' layout put back: CPContext.restore)
    pytest.param(
        4,
        "plans/qwen3.yaml#checkpoint=model.layers.*",
        "tiny-qwen3",
        {"pp": 2, "cp": 2},
        _cases([UNEVEN, BUDGET, PACKED], ["grpo", "grpo_tokens"]),
        id="pp2xcp2",
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("ranks", "plan", "model", "layout", "cases"), LAYOUTS)
def test_the_policy_bars_hold_at_every_layout(tmp_path, ranks, plan, model, layout, cases):
    """One list of layouts, pp's included, for every bar of the policy: one train call equals the
    unsharded model on the whole batch (every loss and cutting), the weights out are the model's
    bitwise, and a saved policy loaded into a fresh one trains the next step identically."""
    from .distributed import launch
    from .policy_worker import train_cases

    results = launch(train_cases, ranks, plan, model, layout, cases, str(tmp_path / "ckpt"))
    for rank, got in results.items():
        assert got["refit_bitwise"] and got["refit_compared"] > 0, (rank, got["refit_compared"])
        assert got["refit_missing"] == [], (rank, got["refit_missing"])
        assert got["resumed"] == (True, True, True), (rank, got["resumed"])
        for row in got["cases"]:
            # the attention saw this rank's shard of every row: cp's, not a whole copy
            assert row["sequence_shards"] == ([layout["cp"]] if layout.get("cp", 1) > 1 else []), (rank, row)
            assert row["loss_diff"] <= TOLERANCE, (rank, row)
            assert row["grad_norm_diff"] <= TOLERANCE, (rank, row)  # clipping would hide a scaled gradient
            counted, attended = row["input_tokens"]  # the whole batch's, not the loss's nor this rank's
            assert counted == attended > row["tokens"], (rank, row)
            ratio, name, error, bar, compared = row["gradient"]
            assert ratio <= 1.0 and compared > 0, (rank, row["loss"], row["cutting"], name, error, bar)
            bar = max(TOLERANCE, EXACT_FACTOR * row["fp32_update_diff"])
            assert row["update_diff"] <= bar, (rank, row["worst_parameter"], row["fp32_update_diff"], row)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loss_normalized_per_rank_is_not_the_global_batch_loss(tmp_path):
    """The same check with the mean taken over what each microbatch holds: the check must fail."""
    from .distributed import launch
    from .policy_worker import train_cases

    cases = [("nll_per_rank", UNEVEN)]
    results = launch(train_cases, 2, "plans/qwen3.yaml", "tiny-qwen3", {"dp": 2}, cases, str(tmp_path / "ckpt"))
    for rank, got in results.items():
        (row,) = got["cases"]
        assert row["update_diff"] > 100 * TOLERANCE, (rank, row)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_reference_on_the_device_in_bf16_gives_the_host_fp32_references_logprobs_bitwise():
    """``reference="device"`` (the default) keeps the reference in the compute dtype on the
    device, ``"host"`` in fp32 host memory: under bf16 compute FSDP casts either to the same bf16
    weights, so the reference's log-probs are the same bits, and the initial weights' own. On the
    device the swap trades the flat shards FSDP gathers from (no bytes copied, no buffer for the
    policy's weights); in host memory it copies. Either way the policy's parameters keep their
    storage and come back bitwise; ``offload()`` moves a device reference with the parameters."""
    from .distributed import launch
    from .policy_worker import reference_places

    for rank, r in launch(reference_places, 2, "plans/qwen3.yaml", "tiny-qwen3", {"dp": 2}).items():
        assert r["dtypes"] == ("torch.bfloat16", "torch.float32"), (rank, r)
        assert r["same"] and r["initial"] and r["bitwise_after"], (rank, r)
        assert r["swapped_by_reference"] == (True, False) and r["same_storage"], (rank, r)
        # offload() takes the device reference off the device with the parameters; the host one is there
        assert r["offloaded_with_params"] == (True, False), (rank, r)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_logprobs_reference_weights_and_bad_input(tmp_path):
    from .distributed import launch
    from .policy_worker import logprobs_reference_weights

    results = launch(
        logprobs_reference_weights, 2, "plans/qwen3.yaml", "tiny-qwen3-tied", {"tp": 2}, str(tmp_path / "hf")
    )
    for rank, got in results.items():
        assert got["logprobs"] <= TOLERANCE and got["entropy"] <= TOLERANCE, (rank, got)
        assert got["reference"] <= TOLERANCE, (rank, got)
        assert got["policy_moved"] > 1e-3, (rank, got)  # the step moved the policy, not the reference
        assert got["weights_bitwise"] and got["optimizer_bitwise"], (rank, got)
        assert got["weights_names_equal"] and got["weights_bitwise"], (rank, got)
        assert "rank 0" in got["bad_rows"] and "advantages" in got["bad_rows"], (rank, got)
        assert "ref_logprobs" in got["missing_field"], (rank, got)
        assert "not finite" in got["non_finite"], (rank, got)
        assert "max_tokens=3" in got["budget"], (rank, got)
        assert got["unchanged_after_bad"], (rank, got)


# ----------------------------------------------------------------------------- cutting, no ranks
def test_a_token_budget_keeps_every_microbatch_within_it_and_balanced():
    lengths = [16, 3, 9, 12, 5, 7, 16, 2]
    plan = plan_microbatches(lengths, micro_batch_size=None, max_tokens=20)
    assert sorted(r for mb in plan for r in mb) == list(range(8))
    assert all(sum(lengths[r] for r in mb) <= 20 for mb in plan)
    assert len(plan) == 4  # 70 tokens: four bins of at most 20


def test_microbatch_counts_are_evened_by_splitting_then_by_empty_passes():
    assert split_to_count([[0, 1, 2, 3]], 3) == [[0], [1], [2, 3]]
    assert split_to_count([[0]], 2) == [[0], []]


def test_a_packed_microbatch_puts_every_position_back():
    import torch

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = (ids != 0).long()
    mb = Microbatch.of({"input_ids": ids, "attention_mask": mask}, [0, 1], multiple=4, pack=True)
    assert mb.cu_seqlens.tolist() == [0, 4, 8]
    values = torch.arange(8, dtype=torch.float32)[None, :]
    assert mb.unpack(values).tolist() == [[0, 1, 2, 0], [4, 5, 0, 0]]


@pytest.mark.parametrize(
    ("batch", "found"),
    [
        ({"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}, "is a list"),
        ({"input_ids": "ids"}, "no 'attention_mask'"),
    ],
)
def test_a_batch_that_is_not_tensors_is_refused_by_name(batch, found):
    with pytest.raises(BatchError, match=found):
        check_batch(batch)


def test_rows_that_disagree_are_refused_by_field():
    import torch

    ids = torch.ones((3, 4), dtype=torch.long)
    with pytest.raises(BatchError, match="'advantages'"):
        check_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "advantages": torch.ones(2)})
    with pytest.raises(BatchError, match="'old_logprobs' has 5 positions"):
        check_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "old_logprobs": torch.ones(3, 5)})
    with pytest.raises(BatchError, match="row 2 has 4 tokens, more than max_tokens=3"):
        mask = torch.ones_like(ids)
        mask[:2, 3] = 0
        check_batch({"input_ids": ids, "attention_mask": mask}, max_tokens=3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_saved_policy_loads_at_another_layout(tmp_path):
    from .distributed import launch
    from .policy_worker import save_then_load_elsewhere

    results = launch(
        save_then_load_elsewhere, 2, "plans/qwen3.yaml", "tiny-qwen3", str(tmp_path / "ckpt"), {"dp": 2}, {"tp": 2}
    )
    for rank, got in results.items():
        assert got["step"] == 1, (rank, got)
        assert got["logprobs"] <= TOLERANCE, (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slices_that_do_not_fit_the_layout_are_refused_on_every_rank():
    from .distributed import launch
    from .policy_worker import slices_that_do_not_fit

    for rank, got in launch(slices_that_do_not_fit, 4, "plans/qwen3.yaml", "tiny-qwen3").items():
        assert "dp ranks hold [4, 3] rows" in got["uneven"], (rank, got)
        assert "one tp / cp group were given different rows" in got["tp_differs"], (rank, got)
        assert got["unchanged"], (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("plan", "model", "layout"),
    [
        pytest.param("plans/qwen3.yaml", "tiny-qwen3", {"dp": 2}, id="dense-dp2"),
        pytest.param("plans/qwen3_moe.yaml", "tiny-qwen3-moe", {"ep": 2}, id="moe-ep2"),
        pytest.param("plans/phi3.yaml", "tiny-phi3", {"tp": 2}, id="packed-qkv-tp2"),
        # experts in stages: the pp2 x ep2 policy bars and test_pipeline's offload and weights-out bars cover it
        pytest.param("plans/qwen3_moe.yaml", "tiny-qwen3-moe", {"pp": 2}, id="moe-pp2", marks=pytest.mark.extended),
    ],
)
def test_offload_round_trip_and_weights_out(tmp_path, plan, model, layout):
    from .distributed import launch
    from .policy_worker import offload_round_trip_and_weights

    for rank, got in launch(offload_round_trip_and_weights, 2, plan, model, layout, str(tmp_path / "hf")).items():
        assert "offloaded" in got["offloaded_train"], (rank, got)
        assert "reference_logprobs" in got["offloaded_reference"] and "offloaded" in got["offloaded_reference"], got
        assert "Policy.train: the policy's optimizer state is offloaded" in got["optimizer_offloaded"], (rank, got)
        assert got["optimizer_offloaded_logprobs"], (rank, got)
        assert got["bitwise"], (rank, got)
        assert got["names_equal"] and got["bitwise_export"], (rank, got)
        assert got["buckets_bounded"], (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2"])
def test_weights_out_take_a_bucket_of_memory_not_the_model(tmp_path, layout):
    """Measured per rank (tests/live_bytes.py): streaming weights() holds at most bucket_bytes +
    the largest tensor, where the seed's full state dict holds the whole model."""
    from plancc.models import load_config

    from .distributed import launch
    from .policy_worker import weights_peak_memory

    config = load_config("tiny-qwen3")
    config.vocab_size, config.hidden_size, config.intermediate_size, config.head_dim = 8192, 256, 1024, 64
    config.save_pretrained(tmp_path / "wide")
    bucket = 2 * 2**20
    results = launch(weights_peak_memory, 2, "plans/qwen3.yaml", str(tmp_path / "wide" / "config.json"), layout, bucket)
    for rank, got in results.items():
        assert 0 < got["stream"] <= bucket + got["largest"], (rank, got)
        assert got["seed"] >= 0.9 * got["total"], (rank, got)  # the whole model at once


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [{"dp": 2}, {"tp": 2}], ids=["dp2", "tp2"])
def test_train_at_the_samplers_temperature_gives_a_ratio_of_exactly_one_at_step_zero(layout):
    from .distributed import launch
    from .policy_worker import ratio_at_temperatures

    temperatures = (0.6, 1.0, 1.3)
    results = launch(ratio_at_temperatures, 2, "plans/qwen3.yaml", "tiny-qwen3", layout, temperatures)
    for rank, got in results.items():
        for t in temperatures:
            assert got[t]["ratio_off"] == 0.0, (rank, t, got)  # the same computation, bit for bit
            if t != 1.0:  # the untempered log-probs are not the sampler's: the bias the option removes
                assert got[t]["t1_off"] > 1e-3, (rank, t, got)
        assert "must be finite and > 0" in got["inf"], (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dropped_policy_is_freed_without_the_garbage_collector():
    """An RL loop that builds a new Policy gets the old one's optimizer state back as it drops
    it: no reference cycle through a policy (its offloader once held a closure over it) waits
    for a collection."""
    from .distributed import launch
    from .policy_worker import dropped_policies_freed

    for rank, freed in launch(dropped_policies_freed, 1, "plans/qwen3.yaml", "tiny-qwen3").items():
        assert freed == {"True": [True] * 2, "host": [True] * 2, "False": [True] * 2}, (rank, freed)


def test_what_an_offloaded_policy_refuses_depends_on_what_each_call_reads():
    """Log-probs and weights out read the parameters; a step and a checkpoint the optimizer's
    state too. Each refusal names the call and what is away."""
    import torch

    from plancc.engine.offload import Offloader

    model = torch.nn.Linear(2, 2)
    memory = Offloader(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def refusal(what, **needs):
        try:
            memory.require_onloaded(what, **needs)
        except RuntimeError as exc:
            return str(exc)
        return None

    memory.offload(params=False, optimizer=True)
    assert refusal("logprobs") is None
    assert refusal("train", optimizer=True) == (
        "Policy.train: the policy's optimizer state is offloaded; call onload() first"
    )
    memory.offload(params=True, optimizer=False)
    assert refusal("weights") == "Policy.weights: the policy's parameters are offloaded; call onload() first"
    assert refusal("save", optimizer=True) == (
        "Policy.save: the policy's parameters and optimizer state are offloaded; call onload() first"
    )
    memory.onload()
    assert refusal("train", optimizer=True) is None and memory.offloaded == []


def test_divergence_is_not_bad_input():
    """A caller catching ``BatchError`` (a batch it can fix) does not swallow a diverged step."""
    from plancc.engine.policy import NonFiniteError

    assert not issubclass(NonFiniteError, BatchError) and issubclass(NonFiniteError, ArithmeticError)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [{"dp": 2}, {"pp": 2}])
def test_offload_on_one_rank_or_calls_out_of_step_are_one_error_on_every_rank(layout):
    """offload() called on rank 0 alone, then train and logprobs on both: rank 0 refused alone before
    (its peer waited in a collective: "Connection closed by peer" at dp2, a hang at pp2). Now every
    rank raises within seconds, naming the rank; ranks calling different methods are told so; the
    next calls in step train."""
    from .distributed import launch
    from .policy_worker import calls_out_of_step

    for rank, got in launch(calls_out_of_step, 2, "plans/qwen3.yaml", "tiny-qwen3", layout).items():
        for call in ("train", "logprobs"):
            assert got[call].startswith(f"RuntimeError: Policy.{call}: the policy's parameters"), (rank, got)
            assert "offloaded on rank 0 (offload() was called there alone)" in got[call], (rank, got)
            assert got[f"{call} seconds"] < 30, (rank, got)  # no collective waited for its timeout
        assert got["in step"] == "ran" and got["after"] == "ran", (rank, got)
        assert "the ranks called different methods (rank 0 logprobs, rank 1 train)" in got["different calls"], got
