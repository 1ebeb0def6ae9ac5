"""Resharded refit: a rollout engine of its own at tp=2 gets from a policy at tp=2 only its own
shard of each weight, straight from the policy ranks that hold it (bytes received per receiver
rank <= 1.05 x its shard), and its sharded model then gives the policy's log-probs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("ranks", "layout"), [(2, {"tp": 2}), (2, {"dp": 2}), (4, {"dp": 2, "tp": 2})], ids=["tp2", "dp2", "dp2xtp2"]
)
def test_each_engine_rank_receives_only_its_shard_and_computes_the_policys_logprobs(tmp_path, ranks, layout):
    """At tp2 both layouts line up (policy rank t sends rank t its shard); at dp2 the policy's
    FSDP rows cut across the engine's tp shards and each engine rank assembles its shard from
    both policy ranks' pieces; at dp2 x tp2 the column-sharded weights are FSDP's strided shards
    (no box of the tensor): the policy gathers those and rank 0 sends each engine rank its part."""
    import torch

    from .distributed import free_port, launch
    from .reshard_worker import policy_side

    port = free_port()
    manifest, out = tmp_path / "manifest.json", tmp_path / "engine.pt"
    engine = subprocess.Popen([sys.executable, "-m", "tests.reshard_worker", str(port), str(manifest), str(out)],
                              cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        policy = launch(policy_side, ranks, port, str(manifest), layout)
        log, _ = engine.communicate(timeout=300)
    finally:
        engine.kill()
    assert engine.returncode == 0, log[-3000:]
    receivers = torch.load(out)
    slices = {got["start"]: got["logprobs"] for got in policy.values()}  # tp ranks of a slice: the same rows
    want = torch.cat([slices[start] for start in sorted(slices)])
    for rank, got in receivers.items():
        assert 0 < got["received"] <= 1.05 * got["shard"], (rank, got["received"], got["shard"])
        assert (got["logprobs"] - want).abs().max() <= 1e-5, rank
    # the whole model crossed once: every policy rank sent its own part
    assert all(p["sent"] > 0 for p in policy.values())
