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
