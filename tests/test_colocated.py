"""Weights to a colocated consumer in another process by handle (CUDA IPC on a GPU; here on the
CPU, shared memory, the same code path), bucket by bucket: what arrives equals export_hf bitwise."""

import re

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_a_colocated_consumer_gets_export_hfs_weights_by_handle_through_two_buffers(tmp_path, layout):
    """From pipeline stages too: each tensor whole from the stage that holds it, a tied weight once."""
    import torch
    from safetensors.torch import load_file

    from .colocated_worker import policy_side
    from .distributed import launch

    out = tmp_path / "received.pt"
    results = launch(policy_side, 2, str(out), str(tmp_path / "hf"), 32 * 1024, layout)
    assert results[0]["consumer_exit"] == 0 and results[0]["shared"] > 0, results
    got = torch.load(out)
    want = load_file(tmp_path / "hf" / "model.safetensors")
    weights = got["weights"]
    assert sorted(weights) == sorted(want) and all(torch.equal(weights[k], want[k]) for k in want)
    # many 32 KiB buckets, two buffers: each mapped once for the refit, not once per bucket
    assert results[0]["shared"] > 4 * 32 * 1024 and got["buffers"] == 2, got["buffers"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_refit_failure_is_one_error_on_every_rank_naming_rank_bucket_and_cause():
    """Rank 0 failing to pack bucket 2, rank 1's gather of bucket 2 raising, the consumer dying
    after its first bucket, the consumer hanging: each rank raises the same WeightChannelError
    (rank, bucket, cause) within the timeout, meets its peers at a barrier after, and a clean
    refit works. A consumer's failure is seen while rank 0 is at most two buckets past the one
    the consumer did not take (two buffers: bucket k is packed while the consumer takes k - 1)."""
    from .colocated_worker import refit_failures
    from .distributed import launch

    modes = ["pack", "gather", "dies", "hangs"]
    results = launch(refit_failures, 2, modes)
    want = {"pack": "rank 0, bucket 2: RuntimeError: injected failure (pack:raise@0#2)",
            "gather": "rank 1, bucket 2: RuntimeError: injected failure (gather:raise@1#2)",
            "dies": "WeightChannelError: the colocated consumer is gone (its end closed) before taking bucket 2",
            "hangs": "rank 0, bucket 3: WeightChannelError: the colocated consumer did not take bucket 1 within 3s"}
    for mode in modes:
        errors = {rank: got[mode] for rank, got in results.items()}
        assert len({e["error"] for e in errors.values()}) == 1, errors  # the same error on every rank
        error = errors[0]
        assert error["type"] == "AgreedRefitError" and want[mode] in error["error"], (mode, error)
        if mode == "dies":  # seen sending bucket 3 (the pipe closed) or awaiting bucket 2's answer at 4
            assert re.search(r"rank 0, bucket [34]: ", error["error"]), error
        assert all(e["seconds"] < 60 for e in errors.values()), errors  # a hang bound, not a timing
    assert results[0]["after"] > 0
