"""plancc.Policy on one GPU: offload / onload, and weights out by bucket, measured.

    torchrun --nproc-per-node 1 bench/gpu/policy_gpu.py [--model qwen3-0.6b] [--rows 8] [--seq 512]

Two policies from the same seed train side by side: A is offloaded and onloaded between its two
steps, B is not; their weights must stay bitwise equal. Prints (and writes as JSON with --out):
device memory before / after ``offload()`` and their ratio, the peak extra memory of
``weights()`` against its bound (bucket + the largest tensor), and the time and peak of the
seed's way of getting the same tensors (``get_model_state_dict(full_state_dict=True)``); then
a policy with its reference on the device: what ``offload()`` frees (the reference included)
and the reference's log-probs after the round trip against before.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_report import report  # noqa: E402


def nll(lp, mb, norm):
    from plancc.engine.batches import default_token_mask

    mask = default_token_mask(mb["attention_mask"]).to(lp.dtype)
    return -(lp * mask).sum() / norm.tokens, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--plan", default="plans/qwen3.yaml")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    import plancc

    mib = 2**20
    adamw = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}}
    a = plancc.Policy(args.plan, args.model, device="cuda", optimizer=adamw)
    b = plancc.Policy(args.plan, args.model, device="cuda", optimizer=adamw)
    vocab = a.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, vocab, (args.rows, args.seq), generator=gen),
        "attention_mask": torch.ones(args.rows, args.seq, dtype=torch.long),
    }
    result: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    a.train(batch, nll, micro_batch_size=2)
    b.train(batch, nll, micro_batch_size=2)
    def timed(run) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    torch.cuda.empty_cache()
    # memory of the whole process: both policies; A's share is what offload frees
    before = torch.cuda.memory_allocated()
    free_before = torch.cuda.mem_get_info()[0]  # what another process could allocate
    result["offload_s"] = timed(a.offload)
    after = torch.cuda.memory_allocated()
    # the driver's view: offload hands the freed blocks back (empty_cache), not to torch's cache
    result["freed_for_other_processes_bytes"] = torch.cuda.mem_get_info()[0] - free_before
    result["onload_s"] = timed(a.onload)
    # A's own footprint: what B (identical, never offloaded) holds
    result["policy_bytes_on_device"] = before / 2
    result["after_offload_bytes_of_A"] = after - before / 2
    result["after_offload_ratio"] = (after - before / 2) / (before / 2)
    a.train(batch, nll, micro_batch_size=2)
    b.train(batch, nll, micro_batch_size=2)
    # a second round trip: the pinned host buffers of the first are reused
    result["second_offload_s"] = timed(a.offload)
    result["second_onload_s"] = timed(a.onload)
    a.train(batch, nll, micro_batch_size=2)
    b.train(batch, nll, micro_batch_size=2)
    sa, sb = a.model.state_dict(), b.model.state_dict()

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    result["bitwise_after_round_trip"] = all(torch.equal(full(sa[k]), full(sb[k])) for k in sa)
    del b, sb
    torch.cuda.empty_cache()
    # weights out by bucket: the peak above what is held before
    bucket = args.bucket_mib * mib
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    largest, count, total = 0, 0, 0
    for _, tensor in a.weights(bucket_bytes=bucket):
        largest = max(largest, tensor.numel() * tensor.element_size())
        total += tensor.numel() * tensor.element_size()
        count += 1
    torch.cuda.synchronize()
    result["weights_s"] = time.perf_counter() - t0
    result["weights_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    result["weights_bound_bytes"] = bucket + largest
    result["weights_tensors"] = count
    result["weights_total_bytes"] = total
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    state = get_model_state_dict(a.model, options=StateDictOptions(full_state_dict=True))
    for _, tensor in state.items():
        tensor.sum()  # one tensor at a time, as the seed's refit hands them on
    torch.cuda.synchronize()
    result["seed_full_state_dict_s"] = time.perf_counter() - t0
    result["seed_full_state_dict_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    del state, a
    torch.cuda.empty_cache()
    # a policy with its reference on the device: offload takes the reference off too, and the
    # reference's log-probs after the round trip are the same bits
    c = plancc.Policy(args.plan, args.model, device="cuda", optimizer=adamw, reference=True)
    c.train(batch, nll, micro_batch_size=2)
    rows = {k: v[:2] for k, v in batch.items()}
    reference_before = c.reference_logprobs(rows)
    held = torch.cuda.memory_allocated()
    reference_bytes = sum(t.numel() * t.element_size() for t in c._reference.device_tensors())
    c.offload()
    result["reference_bytes"] = reference_bytes
    result["reference_policy_left_on_device_bytes"] = torch.cuda.memory_allocated()
    result["reference_policy_freed_bytes"] = held - torch.cuda.memory_allocated()
    c.onload()
    result["reference_bitwise_after_round_trip"] = torch.equal(c.reference_logprobs(rows), reference_before)
    report(result, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
