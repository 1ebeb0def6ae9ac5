"""What every rank of a step agrees on before it reduces anything: the metrics of the caller's
loss by name (a name some ranks' loss does not give counts 0 there; the same names in another
order are summed by name), and the rows themselves (the fingerprint of a tp group's rows stays
exact whatever dtype the masks beside them have)."""

import pytest

from .conftest import PLANS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_are_summed_by_name_whatever_each_rank_reports():
    from .agreement_worker import _global_batch, uneven_metric_names
    from .distributed import launch

    results = launch(uneven_metric_names, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3", [{"dp": 2}, {"tp": 2}])
    batch = _global_batch()
    big_rows = float((batch["input_ids"] >= 128).any(1).sum())
    rows = float(batch["input_ids"].shape[0])
    for rank, out in results.items():
        # dp2: rank 0's loss never reports big_rows, rank 1's does; the keys come in another order
        assert out["{'dp': 2}"] == {"big_rows": big_rows, "z_rows": rows, "a_twice_rows": 2 * rows}, rank
        # tp2: both ranks hold the whole batch (one copy of each row), the keys in another order
        assert out["{'tp': 2}"] == {"big_rows": big_rows, "z_rows": rows, "a_twice_rows": 2 * rows}, rank
        assert "were given different rows" in out["different_rows"], rank


GENEROUS_S = 60  # a hang waits for the process group's timeout (120 s here; 600 s by default)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [{"dp": 2}, {"pp": 2}], ids=["dp2", "pp2"])
def test_one_ranks_failure_is_every_ranks_within_seconds_and_the_policy_goes_on(tmp_path, layout):
    """Rank 0's file work (publishing a checkpoint, writing an export) and a consumer of
    ``weights()`` that raises on rank 0 or on rank 1: every rank raises within seconds (none waits
    in a barrier or a gather for the process group's timeout), every rank leaves the failed call
    at the same point, and the next ``logprobs`` and ``save`` work as before. With pipeline
    stages too (a consumer raising on one rank hung pp2 past 240 s before the stages streamed
    through ``Policy``'s transport)."""
    from .agreement_worker import failures_agreed
    from .distributed import launch

    results = launch(failures_agreed, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3", str(tmp_path), layout)
    for rank, out in results.items():
        saving = out["save: rank 0's folder read-only while publishing"]
        assert saving["outcome"].startswith("CheckpointError") and "rank 0: OSError" in saving["outcome"], rank
        assert "Read-only file system" in saving["outcome"]
        shards = out["save: rank 1's shard folder read-only"]
        assert shards["outcome"].startswith("CheckpointError") and "rank 1: OSError" in shards["outcome"], rank
        exporting = out["export: rank 0's folder read-only"]
        assert exporting["outcome"].startswith("PlanError") and "Read-only file system" in exporting["outcome"], rank
        for failing in (0, 1):
            consumer = out[f"weights(): the consumer raises on rank {failing}"]
            if rank == failing:  # its own exception goes on
                assert consumer["outcome"].startswith("RuntimeError: the consumer on rank"), consumer
            else:  # the peer is told who stopped, at its next settle
                assert consumer["outcome"].startswith("AgreedRefitError"), consumer
                assert f"rank {failing}, bucket" in consumer["outcome"] and "stopped taking weights" in consumer["outcome"]
        # settled every 4 buckets: the peer takes the buckets up to the next settle after the
        # failing rank's bucket b (before every bucket: it stops right after b), then raises
        sizes, consumed = out["tensors per bucket"], out["consumed"]
        failed_in = next(b for b in range(len(sizes)) if sum(sizes[: b + 1]) > 3)  # the 4th tensor's bucket
        for every in (None, 4):
            case = out[f"weights({'' if every is None else f'agree_every={every}'}): the consumer raises on rank 1"]
            if rank == 0:
                settled_at = min(-(-(failed_in + 1) // (every or 1)) * (every or 1), len(sizes))
                assert f"rank 1, bucket {failed_in + 1}:" in case["outcome"], case
                assert consumed[f"1/{every}"] == sum(sizes[:settled_at]), (every, consumed, sizes, failed_in)
        assert sum(sizes[: -(-(failed_in + 1) // 4) * 4]) > sum(sizes[: failed_in + 1])  # the two cadences differ
        for case, row in out.items():
            if isinstance(row, dict) and "outcome" in row:
                assert row["seconds"] < GENEROUS_S and row["same_logprobs"], (rank, case, row)
        assert out["saved after the failures"].endswith("step-000000")
    assert (tmp_path / "ck" / "step-000000" / "plancc.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dropout_masks_differ_across_dp_ranks_and_agree_across_tp_ranks():
    """One seed for every rank drew the same dropout masks on every dp rank (each holding other
    rows: no dropout across the batch); tp ranks hold the same activations and must drop alike."""
    from .agreement_worker import dropout_streams
    from .distributed import launch

    results = launch(dropout_streams, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3", [{"dp": 2}, {"tp": 2}])
    for out in results.values():
        dp_ranks, tp_ranks = out["{'dp': 2}"], out["{'tp': 2}"]
        assert dp_ranks[0] != dp_ranks[1]
        assert tp_ranks[0] == tp_ranks[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pruning_that_fails_on_rank_0_stops_the_run_with_one_line_on_every_rank(tmp_path, monkeypatch):
    import time

    from .conftest import forked_cli

    monkeypatch.setenv("PLANCC_FAULT", "prune:readonly@0")
    started = time.monotonic()
    code, out, err = forked_cli("apply", PLANS / "qwen3.yaml", "--steps", 3, "--save", tmp_path / "ck",
                                "--save-every", 1, "--keep", 1)
    assert time.monotonic() - started < 120  # one run of 3 steps; a hang would wait the 300 s timeout
    assert code == 1, err
    (line,) = [x for x in err.splitlines() if "[checkpoint]" in x]
    assert "removing checkpoints beyond --keep 1 failed: rank 0: OSError" in line and "Traceback" not in err
    assert (tmp_path / "ck" / "step-000002" / "plancc.json").is_file()  # the new checkpoint is complete


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_metric_no_step_can_sum_is_refused_on_every_rank_and_the_next_step_trains():
    """A loss's metric named as the step's own keys (loss, grad_norm) or not a name, or a value that
    is no scalar -- returned on every rank or on rank 1 alone -- is one BatchError on every rank,
    naming it; the next step trains (at dp2, tp2 and pp2). At tp2 and pp2, ranks handed the same rows with other advantages or
    another token mask are refused too (the loss reads those fields alike on every tp rank)."""
    from .agreement_worker import BAD_METRICS, GOOD_METRICS, metric_fuzz
    from .distributed import launch

    results = launch(metric_fuzz, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3", [{"dp": 2}, {"tp": 2}, {"pp": 2}])
    for rank, by_layout in results.items():
        for layout, found in by_layout.items():
            for name, value, _ in BAD_METRICS:
                outcome = found[f"{name!r}={value!r}"]
                assert outcome.startswith("BatchError") and repr(name) in outcome, (rank, layout, name, outcome)
                assert found[f"then {name!r}={value!r}"] is True, (rank, layout, name)
            # summed over the step's microbatches and dp shares: each good metric as often
            good = found["good"]
            times = {good[name] / float(value) for name, value in GOOD_METRICS}
            assert len(times) == 1 and times.pop() >= 1, (rank, layout, good)
        for layout in ("{'tp': 2}", "{'pp': 2}"):
            for field in ("advantages", "token_mask"):
                outcome = by_layout[layout][field]
                assert outcome.startswith("BatchError") and "different values of their other fields" in outcome, (
                    layout, outcome)
