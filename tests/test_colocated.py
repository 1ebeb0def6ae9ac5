"""Weights to a colocated consumer in another process by handle (CUDA IPC on a GPU; here on the
CPU, shared memory, the same code path), bucket by bucket: what arrives equals export_hf bitwise."""

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_colocated_consumer_gets_export_hfs_weights_by_handle(tmp_path):
    import torch
    from safetensors.torch import load_file

    from .colocated_worker import policy_side
    from .distributed import launch

    out = tmp_path / "received.pt"
    results = launch(policy_side, 2, str(out), str(tmp_path / "hf"), 32 * 1024)
    assert results[0]["consumer_exit"] == 0 and results[0]["shared"] > 0, results
    got = torch.load(out)
    want = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_refit_failure_is_one_error_on_every_rank_naming_rank_bucket_and_cause():
    """Rank 0 failing to pack bucket 2, rank 1's gather of bucket 2 raising, the consumer dying
    after its first bucket, the consumer hanging: each rank raises the same WeightChannelError
    (rank, bucket, cause) within the timeout, meets its peers at a barrier after, and a clean
    refit works."""
    from .colocated_worker import refit_failures
    from .distributed import launch

    modes = ["pack", "gather", "dies", "hangs"]
    results = launch(refit_failures, 2, modes)
    want = {"pack": "rank 0, bucket 2: RuntimeError: injected failure (pack:raise@0#2)",
            "gather": "rank 1, bucket 2: RuntimeError: injected failure (gather:raise@1#2)",
            "dies": "rank 0, bucket 2: WeightChannelError: the colocated consumer is gone",
            "hangs": "rank 0, bucket 1: WeightChannelError: the colocated consumer did not take bucket 1 within 3s"}
    for mode in modes:
        errors = {rank: got[mode] for rank, got in results.items()}
        assert len({e["error"] for e in errors.values()}) == 1, errors  # the same error on every rank
        error = errors[0]
        assert error["type"] == "AgreedRefitError" and want[mode] in error["error"], (mode, error)
        assert all(e["seconds"] < 60 for e in errors.values()), errors  # a hang bound, not a timing
    assert results[0]["after"] > 0
