"""Log-prob evaluator benchmark: plancc vs naive ``log_softmax(logits.float()).gather`` vs the
reference (NeMo-RL) un-chunked vocab-parallel design, re-written here for comparison only.

    python bench/logits_evaluator.py                 # CPU: [4, 1024, 32768], bf16 and fp32, tp=1 and tp=2 (gloo)
    python bench/logits_evaluator.py --device cuda   # one GPU: tp=1, memory from the CUDA allocator

Every measurement runs in a fresh process. Extra memory is the peak above what the process
held with the logits (and targets) allocated: peak RSS delta on CPU (ru_maxrss), peak
allocated bytes on CUDA (torch.cuda.max_memory_allocated). Time is the median of repeats.
Ratios are plancc / naive; the targets are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPE = (4, 1024, 32768)


# --------------------------------------------------------------------------- the three designs
def naive(logits, targets, group):
    import torch
    import torch.distributed as dist

    if group is not None and dist.get_world_size(group) > 1:  # a naive user gathers the vocab first
        import warnings

        from torch.distributed.nn.functional import all_gather

        warnings.filterwarnings("ignore", category=UserWarning)
        logits = torch.cat(all_gather(logits.contiguous(), group=group), dim=-1)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def reference_design(logits, targets, group):
    """The reference's un-chunked design: fp32 copy, softmax kept for backward."""
    import torch
    import torch.distributed as dist

    class Ref(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):
            rank = dist.get_rank(group) if group is not None else 0
            v = x.shape[-1]
            start = rank * v
            x = x.float()
            m = x.max(dim=-1, keepdim=True).values
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x = x - m
            e = x.exp()
            s = e.sum(dim=-1, keepdim=True)
            if group is not None:
                dist.all_reduce(s, group=group)
            mask = (t < start) | (t >= start + v)
            local_t = (t - start).clamp(0, v - 1)
            picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
            picked[mask] = 0.0
            if group is not None:
                dist.all_reduce(picked, group=group)
            out = picked - s.squeeze(-1).log()
            e.div_(s)
            ctx.save_for_backward(e, local_t, mask)
            return out

        @staticmethod
        def backward(ctx, g):
            softmax, local_t, mask = ctx.saved_tensors
            grad = -softmax * g.unsqueeze(-1)
            onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0)
            onehot[mask] = 0
            grad += onehot * g.unsqueeze(-1)
            return grad, None

    return Ref.apply(logits, targets)


def plancc_design(logits, targets, group):
    from plancc.logprobs import vocab_parallel_logprobs

    return vocab_parallel_logprobs(logits, targets, group=group)


IMPLS = {"plancc": plancc_design, "naive": naive, "reference": reference_design}


# --------------------------------------------------------------------------- one measurement
def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(impl, dtype_name, phase, device, group=None, tp=1, repeats=3, shape=SHAPE):
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    b, s, v = shape
    v_local = v // tp
    logits = torch.randn(b, s, v_local, device=device, dtype=dtype)  # no larger temporary: it would raise the baseline peak
    targets = torch.randint(0, v, (b, s), device=device)
    grad_out = torch.ones(b, s, device=device)
    if phase == "fwd+bwd":
        logits.requires_grad_(True)
    fn = IMPLS[impl]

    def once():
        if phase == "fwd":
            with torch.no_grad():
                return fn(logits, targets, group)
        out = fn(logits, targets, group)
        out.backward(grad_out)
        grad = logits.grad
        logits.grad = None
        return grad

    # Warm up on a sliver first: the first call of a kernel maps its code pages (RSS) and
    # sizes thread pools, which is not the algorithm's memory.
    small = logits[:1, :4].detach().clone().requires_grad_(phase == "fwd+bwd")
    if phase == "fwd":
        with torch.no_grad():
            fn(small, targets[:1, :4], group)
    else:
        fn(small, targets[:1, :4], group).backward(grad_out[:1, :4])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = once()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes()
        result = once()
        extra = max(0, _rss_bytes() - base)
    del result
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"extra_bytes": extra, "seconds": statistics.median(times),
            "logits_bytes": logits.numel() * logits.element_size()}


def _tp_worker(impl, dtype_name, phase):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    try:
        return measure(impl, dtype_name, phase, "cpu", group=dist.group.WORLD, tp=dist.get_world_size())
    finally:
        dist.destroy_process_group()


def run_one(impl, dtype_name, phase, tp, device, shape=SHAPE):
    if tp == 1:
        cmd = [sys.executable, __file__, "--one", json.dumps([impl, dtype_name, phase, device, list(shape)])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    from tests.distributed import launch

    results = launch(_tp_worker, tp, impl, dtype_name, phase, timeout_s=900)
    return max(results.values(), key=lambda r: r["extra_bytes"])  # the worst rank


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one")
    parser.add_argument("--tp", type=int, nargs="*", default=None)
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--shape", type=int, nargs=3, default=list(SHAPE), help="batch seq vocab")
    args = parser.parse_args()
    if args.one:
        impl, dtype_name, phase, device, shape = json.loads(args.one)
        import torch

        if device == "cpu":
            torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        try:
            print(json.dumps(measure(impl, dtype_name, phase, device, shape=tuple(shape))))
        except (MemoryError, torch.OutOfMemoryError):  # reported as a row, not a crash
            print(json.dumps({"extra_bytes": float("nan"), "seconds": float("nan"), "logits_bytes": 1, "oom": True}))
        return
    tps = args.tp or ([1, 2] if args.device == "cpu" else [1])
    shape = tuple(args.shape)
    print(f"logits {list(shape)} on {args.device}; extra memory = peak above the logits; time = median of 3")
    print(f"{'dtype':<9}{'tp':>3} {'phase':<8} {'impl':<10}{'extra MiB':>10}{'x logits':>9}{'ms':>9}"
          f"{'mem/naive':>10}{'time/naive':>11}")
    for dtype_name in args.dtypes:
        for tp in tps:
            for phase in ("fwd", "fwd+bwd"):
                rows = {impl: run_one(impl, dtype_name, phase, tp, args.device, shape) for impl in IMPLS}
                for impl, r in rows.items():
                    n = rows["naive"]
                    mem_ratio = r["extra_bytes"] / n["extra_bytes"] if n["extra_bytes"] else float("nan")
                    print(f"{dtype_name:<9}{tp:>3} {phase:<8} {impl:<10}{r['extra_bytes'] / 2**20:>10.1f}"
                          f"{r['extra_bytes'] / r['logits_bytes']:>9.3f}{r['seconds'] * 1e3:>9.1f}"
                          f"{mem_ratio:>10.3f}{r['seconds'] / n['seconds']:>11.3f}", flush=True)


if __name__ == "__main__":
    main()
