"""Weights to a rollout engine in another process with no disk: the manifest first, then the
weights bucket by bucket over a channel of its own (plancc.weight_channel). What arrives equals
export_hf bitwise, with two buckets on the wire at once (the sender packing the next while one
is sent, the receiver's next arriving while one is loaded) in two buffers of the receiver's,
each at most the largest bucket of its turn, and the sender holding its two buffers and one
gathered tensor at most; a receiver that expects another
manifest fails on both sides with a clear error, one that never joins is an error within the
timeout, and one that dies mid-transfer is an error on every policy rank naming the bucket and
the peer, with the weights unchanged and a new channel working."""

import pytest

BUCKET = 32 * 1024


def _receiver(*args):
    """A receiver process (``tests.channel_worker.main(ARGS)``, forked from the test forkserver),
    its output captured."""
    from .channel_worker import main
    from .distributed import ForkedProcess

    return ForkedProcess(main, [str(a) for a in args])


def _run(tmp_path, tamper, in_flight=None, agree_every=None, bucket=BUCKET):
    from .channel_worker import policy_side
    from .distributed import launch

    port = str(tmp_path / "port")  # the policy opens the channel on a port the system picks, written here
    manifest, received = tmp_path / "manifest.json", tmp_path / "received.pt"
    flight = [] if in_flight is None else ["60", in_flight]
    receiver = _receiver(f"file:{port}", manifest, received, "1" if tamper else "0", *flight)
    try:
        results = launch(policy_side, 2, "plans/qwen3.yaml", "tiny-qwen3-tied", port, bucket, str(manifest),
                         str(tmp_path / "hf"), in_flight, agree_every)
        out, _ = receiver.communicate(timeout=180)
    finally:
        receiver.kill()
    return results, receiver.returncode, out, received


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_receiver_gets_what_export_hf_writes_two_buckets_in_flight(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    from plancc.engine.channel import entry_nbytes

    # gloo's default is one bucket at a time; two (nccl's default) pipelined here, the policy's
    # ranks agreeing on failures every 3 buckets (a GPU's cadence) rather than before each
    # buckets of several tensors each, so that holding one gathered bucket would show
    results, code, out, received = _run(tmp_path, tamper=False, in_flight=2, agree_every=3, bucket=3 * BUCKET)
    assert code == 0, out
    assert "error" not in results[0] and results[0]["sent"] > 0, results
    got = torch.load(received)
    want = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    sizes = [int(b["bytes"]) for b in manifest["buckets"]]
    assert len(sizes) > 3  # several turns of both buffers
    buffers, nbytes = int(out.split("BUFFERS")[1].split()[0]), int(out.split("BYTES")[1].split()[0])
    assert buffers == 2 and nbytes == max(sizes[0::2]) + max(sizes[1::2]), (out, sizes)
    # the sender holds its two buffers and the tensor being gathered, never a whole gathered
    # bucket beside them (which held 2 x 64 KiB more here: tensors gathered a bucket at a time)
    largest = max(entry_nbytes(t) for b in manifest["buckets"] for t in b["tensors"])
    assert nbytes < results[0]["peak"] <= nbytes + largest, (results[0]["peak"], nbytes, largest, sizes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_receiver_expecting_another_manifest_fails_on_both_sides(tmp_path):
    results, code, out, _ = _run(tmp_path, tamper=True)
    assert code == 3 and "manifest differs from the policy's" in out, out
    assert "manifest differs" in results[0]["error"], results


def test_a_receiver_that_never_joins_is_an_error_within_the_timeout():
    import time

    import plancc

    from .distributed import free_port

    started = time.monotonic()
    with pytest.raises(plancc.WeightChannelError, match="1 of 2 members joined within 2s"):
        plancc.weight_channel("127.0.0.1", free_port(), rank=0, world_size=2, backend="gloo", timeout=2)
    assert time.monotonic() - started < 60  # bounded: a hang would hit the test's timeout instead


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model_name, layout", [("tiny-qwen3-tied", {"tp": 2}), ("tiny-qwen3", {"pp": 2})], ids=["tp2", "pp2"]
)
def test_a_receiver_that_dies_mid_transfer_leaves_the_weights_and_a_new_channel_works(tmp_path, model_name, layout):
    """At tp2, and with pipeline stages (where a receiver dying mid-send hung pp2 past 240 s
    before the stages sent through ``Policy``'s transport)."""
    import torch
    from safetensors.torch import load_file

    from .channel_worker import policy_side_twice
    from .distributed import launch

    # each channel on a port the system gives rank 0 (told through a file): nothing to collide with
    ports = [str(tmp_path / "port0"), str(tmp_path / "port1")]
    manifest, received = tmp_path / "manifest.json", tmp_path / "received.pt"
    dying = _receiver("dying", f"file:{ports[0]}", manifest)
    good = _receiver(f"file:{ports[1]}", manifest, received, "0")
    try:
        results = launch(policy_side_twice, 2, "plans/qwen3.yaml", model_name, ports, BUCKET, str(manifest),
                         str(tmp_path / "hf"), layout)
        out, _ = good.communicate(timeout=120)
    finally:
        dying.kill()
        good.kill()
    for rank, got in results.items():
        error = got["error_0"]
        assert "bucket" in error and "receivers" in error, (rank, error)  # which bucket, which peer
        assert got["unchanged"], (rank, got)  # the policy's weights are as they were
        assert got["sent_1"] > 0 or rank != 0, (rank, got)  # rank 0 sends over the new channel
        assert "error_1" not in got, (rank, got)
    assert good.returncode == 0, out
    got = torch.load(received)
    want = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fault",
    ["send:kill@0#2", pytest.param("gather:kill@1#2", marks=pytest.mark.extended)],
    ids=["sender-dies", "another-policy-rank-dies"],
)
def test_a_policy_that_dies_mid_transfer_ends_the_receiver_within_the_timeout_naming_peer_and_bucket(
    tmp_path, monkeypatch, fault
):
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .channel_worker import policy_side
    from .distributed import launch

    port = str(tmp_path / "port")
    manifest, received = tmp_path / "manifest.json", tmp_path / "received.pt"
    receiver = _receiver(f"file:{port}", manifest, received, "0", "10")
    monkeypatch.setenv("PLANCC_FAULT", fault)  # a policy rank dies before bucket 2 (sending it, gathering it)
    try:
        with pytest.raises(ChildFailedError):
            launch(policy_side, 2, "plans/qwen3.yaml", "tiny-qwen3-tied", port, BUCKET, str(manifest),
                   str(tmp_path / "hf"))
        died = time.monotonic()
        out, _ = receiver.communicate(timeout=120)
        waited = time.monotonic() - died
    finally:
        receiver.kill()
    assert receiver.returncode == 3, out
    (line,) = [x for x in out.splitlines() if x.startswith("ERROR:")]
    assert "bucket 1 of" in line and "the policy (channel rank 0)" in line, line
    assert waited < 60, waited  # the channel's timeout (10 s), not a hang
    assert not received.exists()


@pytest.mark.skipif(not __import__("torch").distributed.is_nccl_available(), reason="NCCL: CUDA builds of torch only")
def test_the_nccl_channel_is_built_with_the_channels_timeout():
    from datetime import timedelta

    from plancc.engine.channel import nccl_options

    assert nccl_options(timedelta(seconds=7))._timeout == timedelta(seconds=7)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_policy_with_pipeline_stages_sends_every_stages_weights(tmp_path):
    """Refit from stages: the receiver gets every tensor of the whole model (the first stage's and
    the last's, from the ranks that hold them), one bucket at a time, equal to ``weights()``."""
    import json

    import torch

    from .channel_worker import pipeline_policy_side
    from .distributed import launch

    port = str(tmp_path / "port")
    manifest, received, whole = tmp_path / "manifest.json", tmp_path / "received.pt", tmp_path / "whole.pt"
    receiver = _receiver(f"file:{port}", manifest, received, "0")
    try:
        results = launch(pipeline_policy_side, 2, "plans/qwen3.yaml", "tiny-qwen3", port, BUCKET, str(manifest),
                         str(whole))
        out, _ = receiver.communicate(timeout=180)
    finally:
        receiver.kill()
    assert receiver.returncode == 0, out
    assert results[0]["sent"] > 0 and results[1]["sent"] == 0, results
    got, want = torch.load(received), torch.load(whole)
    assert sorted(got) == sorted(want) and "lm_head.weight" in got and "model.embed_tokens.weight" in got
    assert all(torch.equal(got[k], want[k]) for k in want)
    sizes = [int(b["bytes"]) for b in json.loads(manifest.read_text())["buckets"]]
    buffers, nbytes = int(out.split("BUFFERS")[1].split()[0]), int(out.split("BYTES")[1].split()[0])
    assert buffers == 1 and nbytes == max(sizes), (out, sizes)  # gloo's default: one bucket at a time
