"""Log-probs from hidden states: naive vs the logits path vs plancc's fused evaluator.

    python bench/logprobs.py                    # CPU: N=4096, H=1024, V=32768 fp32, tp=1 and tp=2 (gloo)
    python bench/logprobs.py --device cuda --n 16384 --h 4096 --v 151936 --dtype bfloat16   # one GPU

- naive: ``log_softmax(h @ W.T).gather`` (tp=2: each rank gathers the vocab of its logits first)
- logits: ``h @ W_local.T`` then ``plancc.logprobs.vocab_parallel_logprobs``
- fused: ``plancc.logprobs.fused_logprobs`` (backward recomputes each chunk: any downstream loss)
- fused-loss: ``plancc.logprobs.fused_nll_loss`` (a weighted sum of log-probs, the training
  loss: gradients formed in forward). fwd+bwd only.
- fused-token: ``plancc.logprobs.fused_token_loss`` with the same objective written as a
  per-token ``loss_fn`` (what an RL loss such as a clipped PPO objective goes through: its
  gradient w.r.t. each chunk's log-probs is taken by autograd in forward). fwd+bwd only.
- liger / cce (CUDA, tp=1, when installed): LigerFusedLinearCrossEntropyLoss and
  cut_cross_entropy.linear_cross_entropy with reduction="none", for comparison only.

fwd+bwd back-propagates ``sum(g * logprobs)`` with a fixed random ``g``. Extra memory is the
peak above h, W, the targets and g: on CPU every tensor allocation counted by torch's
MemTracker, on CUDA the allocator's peak. Time: median of repeats after a warm-up, every
method in the same process, side by side, timed round robin (each round runs every method
once). Ratios are method / naive at the same tp: "x naive" divides the medians, "paired" is
the median of each round's own ratio and "rounds" their range (this shared box's speed drifts
by 10-30% over minutes: a drift within a round slows both sides of that round's ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _naive(h, w, t, group):
    import torch
    import torch.distributed as dist

    logits = h @ w.T
    if group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_gather

        logits = torch.cat(all_gather(logits.contiguous(), group=group), dim=-1)
    return torch.log_softmax(logits.float(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def _logits_path(h, w, t, group):
    from plancc.logprobs import vocab_parallel_logprobs

    return vocab_parallel_logprobs(h @ w.T, t, group=group)


CHUNK = None  # --chunk: tokens per chunk of the fused path (default: plancc's choice)


def _fused(h, w, t, group):
    from plancc.logprobs import fused_logprobs

    return fused_logprobs(h, w, t, group=group, chunk_size=CHUNK)


def _liger(h, w, t, group):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return -LigerFusedLinearCrossEntropyLoss(reduction="none")(w, h, t)


def _cce(h, w, t, group):
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, t, reduction="none")


METHODS = {"naive": _naive, "logits": _logits_path, "fused": _fused, "liger": _liger, "cce": _cce}


def _available(name: str, device: str, tp: int) -> bool:
    if name in ("liger", "cce"):
        if device != "cuda" or tp != 1:
            return False
        try:
            __import__("liger_kernel" if name == "liger" else "cut_cross_entropy")
        except ImportError:
            return False
    return True


class _Peak:
    """Peak bytes allocated above the level at entry (CUDA allocator, or MemTracker on CPU)."""

    def __init__(self, device: str, *inputs):
        self.device, self.inputs = device, inputs

    def __enter__(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            # the inputs are known up front: views of them made inside are not new memory
            self.tracker = MemTracker()
            self.tracker.track_external(*self.inputs)
            self.base = self._total("current")
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.tracker.__exit__(*exc)
            self.extra = self._total("peak") - self.base
        return False

    def _total(self, which):
        return int(sum(d["Total"] for d in self.tracker.get_tracker_snapshot(which).values()))


def _reference(h, w, t, group):
    """fp64 log-probs of the whole vocabulary, a chunk of tokens at a time (max abs error column)."""
    import torch
    import torch.distributed as dist

    out = []
    for lo in range(0, h.shape[0], 1024):
        x = h[lo : lo + 1024].double() @ w.double().T
        if group is not None and dist.get_world_size(group) > 1:
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x, group=group)
            x = torch.cat(parts, dim=-1)
        out.append(torch.log_softmax(x, -1).gather(-1, t[lo : lo + 1024].unsqueeze(-1)).squeeze(-1))
    return torch.cat(out)


def measure(args, group=None, tp=1, rank=0):
    import torch

    from plancc.logprobs import fused_nll_loss, fused_token_loss

    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    v_local = args.v // tp
    h = torch.randn(args.n, args.h, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(args.v, args.h, generator=gen) * 0.02)[rank * v_local : (rank + 1) * v_local].to(device, dtype)
    t = torch.randint(0, args.v, (args.n,), generator=gen).to(device)
    g = torch.rand(args.n, generator=gen).to(device)
    rows = {}

    def run(name, phase):
        if phase == "fwd":
            with torch.no_grad():
                return METHODS[name](h, w, t, group)
        hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        if name == "fused-loss":
            loss, _ = fused_nll_loss(hh, ww, t, -g, group=group, chunk_size=CHUNK)
            loss.backward()
        elif name == "fused-token":
            loss, _ = fused_token_loss(hh, ww, t, lambda lp, i: (g[i] * lp).sum(), group=group, chunk_size=CHUNK)
            loss.backward()
        else:
            (METHODS[name](hh, ww, t, group) * g).sum().backward()
        return hh.grad, ww.grad

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    names = [n for n in METHODS if _available(n, device, tp)]
    ref = _reference(h, w, t, group) if args.errors else None
    for phase in ("fwd", "fwd+bwd"):
        timed = []
        for name in names + (["fused-loss", "fused-token"] if phase == "fwd+bwd" else []):
            try:
                run(name, phase)  # warm-up: kernels, thread pools, allocator
                with _Peak(device, h, w, t, g) as peak:
                    out = run(name, phase)
                error = (out.double() - ref).abs().max().item() if (ref is not None and phase == "fwd") else None
                del out
                rows[f"{name} {phase}"] = {"times": [], "extra_bytes": peak.extra, "error": error}
                timed.append(name)
            except (MemoryError, torch.OutOfMemoryError):
                rows[f"{name} {phase}"] = {"seconds": float("nan"), "extra_bytes": float("nan"), "oom": True}
            except (AssertionError, RuntimeError, ValueError) as exc:
                if name not in ("liger", "cce"):
                    raise
                # the peers' own limits (CCE's backward takes only 16-bit inputs): a row that says so
                print(f"{name} {phase}: not run ({type(exc).__name__}: {exc})")
        # round robin: every method once per round, so a shared machine's drift during the run
        # (this box's speed moves by 10-30% over minutes) falls on all of them alike
        for _ in range(args.repeats):
            for name in timed:
                sync()
                t0 = time.perf_counter()
                run(name, phase)
                sync()
                rows[f"{name} {phase}"]["times"].append(time.perf_counter() - t0)
        naive_times = rows[f"naive {phase}"]["times"] if "naive" in timed else None
        for name in timed:
            row = rows[f"{name} {phase}"]
            times = row.pop("times")
            row["seconds"] = statistics.median(times)
            if naive_times is not None:
                # each round's own ratio: a drift that lasts a round slows both sides of it
                row["round_ratios"] = [t / b for t, b in zip(times, naive_times, strict=True)]
    itemsize = torch.tensor([], dtype=dtype).element_size()
    rows["_sizes"] = {
        "logits_fp32_bytes": args.n * v_local * 4,
        "grads_bytes": (args.n * args.h + v_local * args.h) * itemsize,
    }
    return rows


def _tp_worker(args_json):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    args = argparse.Namespace(**json.loads(args_json))
    global CHUNK
    CHUNK = args.chunk
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    try:
        return measure(args, group=dist.group.WORLD, tp=dist.get_world_size(), rank=dist.get_rank())
    finally:
        dist.destroy_process_group()


def report(rows, tp, args):
    sizes = rows.pop("_sizes")
    logits_b, grads_b = sizes["logits_fp32_bytes"], sizes["grads_bytes"]
    print(f"\ntp={tp}  N={args.n} H={args.h} V={args.v} {args.dtype} on {args.device}: "
          f"fp32 logits per rank {logits_b / 2**20:.0f} MiB, grads of h and W {grads_b / 2**20:.0f} MiB")
    print(f"{'method':<20}{'seconds':>9}{'x naive':>9}{'paired':>8}{'rounds':>13}{'extra MiB':>11}"
          f"{'extra/logits':>14}{'max abs err':>13}")
    for key, row in rows.items():
        name, phase = key.rsplit(" ", 1)
        base = rows[f"naive {phase}"]["seconds"]
        extra = row["extra_bytes"]
        over = extra - (grads_b if phase == "fwd+bwd" else 0)  # what it holds beyond the gradients
        err = "" if row.get("error") is None else f"{row['error']:>13.1e}"
        ratios = row.get("round_ratios") or [float("nan")]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{key:<20}{row['seconds']:>9.3f}{row['seconds'] / base:>9.3f}{statistics.median(ratios):>8.3f}"
              f"{spread:>13}{extra / 2**20:>11.1f}{over / logits_b:>14.3f}{err}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--h", type=int, default=1024)
    parser.add_argument("--v", type=int, default=32768)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk of the fused path")
    parser.add_argument("--errors", action="store_true", help="max abs error of each forward against fp64")
    args = parser.parse_args()
    global CHUNK
    CHUNK = args.chunk
    import torch

    if args.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 2)
    print("extra/logits: extra memory (fwd+bwd: beyond the gradients of h and W) over the fp32 logits' bytes")
    for tp in args.tp:
        if tp == 1:
            rows = measure(args)
        else:
            from tests.distributed import launch

            results = launch(_tp_worker, tp, json.dumps(vars(args)), timeout_s=1800)
            rows = results[0]
        report(rows, tp, args)


if __name__ == "__main__":
    main()
