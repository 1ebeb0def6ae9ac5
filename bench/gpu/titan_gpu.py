"""plancc eager, plancc with compiled blocks and torchtitan's own trainer, one GPU, the same model
and the same kind of rows (issue 60, point 5): tokens/s and MFU side by side.

    torchrun --nproc-per-node 1 bench/gpu/titan_gpu.py [--seq-len 8192] [--batch 2] [--steps 6]
        [--ways eager compiled kept] [--profile kept] [--out titan_gpu.json]
    python bench/gpu/titan_gpu.py --merge titan_gpu.json --torchtitan-logs eager.log compiled.log
    python bench/gpu/titan_gpu.py --summarize-trace rank0_trace.json

The model is Llama 3.2 1B's shape with an untied output layer (``llama-3.2-1b`` with
``tie_word_embeddings: false``; torchtitan's Llama has no tied output): fp32 master weights, bf16
compute, AdamW, gradients clipped at 1.0, no activation checkpointing (the plan's
``activation_checkpointing`` emptied, torchtitan's ``--activation_checkpoint.mode none``). A step
is ``--batch`` rows of ``--seq-len`` uniform random token ids, causal attention over the whole row.
plancc's policies (``--ways``: the plan as it is; with ``compile: {backend: inductor}``; and that
with ``fsdp: {reshard_after_forward: false}``) train in one process, steps alternating between
them, AdamW in its fused form as torchtitan's (``--fused-adamw 0``: torch's default); the first
``--warmup`` steps of each (compilation included) are not timed. ``--profile WAY`` runs one more
step of a way under the profiler (device time by class of kernel) and one under CUDA's sync debug
mode (every call that waits for the device, by line). plancc's step is
``Policy.train(batch, token_loss=token_nll)``: the fused lm_head, logits never whole.

torchtitan runs in processes of its own (``bench/gpu/gpu_titan.sh`` launches it with the spec of
``bench/gpu/torchtitan_synthetic.py``); ``--torchtitan-logs`` reads their step lines (``tps:``) and
puts them in the same table, after the same number of warm-up steps. MFU here counts one formula
for all three ways: 6 x matmul parameters x tokens plus causal attention (6 x layers x heads x
head_dim x seq_len^2 x rows), over the bf16 dense peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from train_gpu import PEAK_BF16, model_flops  # noqa: E402  # one MFU formula for the GPU benches

STEP_LINE = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def torchtitan_tps(path: str, warmup: int, until: int) -> list[float]:
    """The tokens/s of steps ``warmup + 1 .. until`` in a torchtitan log (``--metrics.log_freq 1``;
    a step after ``until`` is the profiled one)."""
    found = []
    with open(path, errors="replace") as f:
        for line in f:
            match = STEP_LINE.search(ANSI.sub("", line))
            if match and warmup < int(match.group(1)) <= until:
                found.append(float(match.group(2).replace(",", "")))
    return found


KERNEL_CLASSES = (  # (class, a regular expression on the kernel's name), first match wins
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|sm90_|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("optimizer, norms", r"adam|multi_tensor|foreach"),
    ("compiled (triton)", r"^triton_|triton"),
    ("copies, casts", r"copy|memcpy|memset|cast|cat_|catarray|fill"),
    ("elementwise", r"elementwise"),
    ("reductions", r"reduce"),
    ("collectives", r"nccl"),
)


def print_classes(title: str, kernels: list[tuple[str, float]]) -> dict:
    """Device time by class of kernel, and the three longest kernels of each class."""
    by: dict[str, list[tuple[str, float]]] = {}
    for name, seconds in kernels:
        kind = next((k for k, rx in KERNEL_CLASSES if re.search(rx, name, re.IGNORECASE)), "other")
        by.setdefault(kind, []).append((name, seconds))
    total = sum(seconds for _, seconds in kernels)
    print(f"  {title}: device busy {total * 1e3:.1f} ms")
    for kind, found in sorted(by.items(), key=lambda kv: -sum(s for _, s in kv[1])):
        print(f"    {kind:20s} {sum(s for _, s in found) * 1e3:8.1f} ms  x{len(found)}")
        for name, seconds in sorted(found, key=lambda ns: -ns[1])[:3]:
            print(f"      {seconds * 1e3:8.2f} ms  {name[:100]}")
    return {kind: sum(s for _, s in found) for kind, found in by.items()}


def _is_kernel(event, device_type) -> bool:
    """A kernel or copy on the device: not a user annotation drawn on the device's timeline (with
    CPU activity recorded, ``Optimizer.step#AdamW.step`` and FSDP's ranges appear there too and
    would be counted as device time, and would cover the gaps inside them)."""
    return event.device_type == device_type.CUDA and not getattr(event, "is_user_annotation", False)


def print_idle(events) -> None:
    """Where the device waits for the host in a profiled step: every gap between kernels (and
    before the first), by what the host was running at the gap's end -- the CPU ops that hold
    that moment, outermost to innermost (the one that launched the kernel after the gap is
    among them), three levels -- summed, largest first."""
    import bisect

    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if _is_kernel(e, DeviceType))
    every_cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if not kernels or not every_cpu:
        return

    def chain(e) -> list:
        out = []
        while e is not None:
            out.append(e)
            e = e.cpu_parent
        return out[::-1]  # outermost first

    # the outer three levels of every thread's ops (the innermost of a thousand aten calls says little)
    cpu = sorted((e for e in every_cpu if len(chain(e)) <= 3), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in cpu]
    start = min(e.time_range.start for e in every_cpu)
    gaps, busy_until = [], start
    for k_start, k_end in kernels:
        if k_start - busy_until > 5:  # microseconds: a launch's own latency is not counted
            gaps.append((busy_until, k_start))
        busy_until = max(busy_until, k_end)
    by: dict[str, list[float]] = {}
    for g_start, g_end in gaps:
        moment = g_end - 1
        last = bisect.bisect_right(starts, moment)
        holding = [e for e in cpu[max(0, last - 400) : last] if e.time_range.end > moment]
        latest = max(holding, key=lambda e: e.time_range.start, default=None)
        where = " > ".join(e.name[:40] for e in chain(latest)) if latest is not None else "(no CPU op)"
        slot = by.setdefault(where, [0.0, 0])
        slot[0] += (g_end - g_start) / 1e3
        slot[1] += 1
    total = sum(v[0] for v in by.values())
    print(
        f"  device idle in the step: {total:.1f} ms in {len(gaps)} gaps (first kernel {(kernels[0][0] - start) / 1e3:.1f} ms in)"
    )
    for where, (ms, count) in sorted(by.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"    {ms:7.2f} ms  x{count:<4d} {where}")


def table(result: dict, torchtitan_logs: list[str] | None, out: str | None) -> None:
    """Prints the ways side by side (torchtitan's from its logs, when given) and writes ``out``."""
    if torchtitan_logs:
        for name, path in zip(("torchtitan eager", "torchtitan compiled"), torchtitan_logs, strict=True):
            seen = (
                torchtitan_tps(path, result["warmup"], result["warmup"] + result["timed_steps"])
                if os.path.exists(path)
                else []
            )
            result[name] = {"steps": seen} if seen else None
    tokens = result["rows"] * result["seq_len"]
    print(f"{result['model']} bf16 on {result['device']}: {result['rows']} rows x {result['seq_len']} tokens a step")
    first = next(n for n in result if n.startswith("plancc "))
    base = statistics.median(result[first]["steps"])
    names = [n for n in result if n.startswith("plancc ")] + ["torchtitan eager", "torchtitan compiled"]
    for name in names:
        way = result.get(name)
        if not way:
            print(f"  {name:20s} not run")
            continue
        rate = statistics.median(way["steps"])
        way["tokens_per_s"], way["mfu"] = rate, rate / tokens * result["step_flops"] / result["peak_flops"]
        extra = f"  peak {way['peak_gib']:5.1f} GiB  losses {way['losses']}" if "peak_gib" in way else ""
        print(f"  {name:20s} {rate:10,.0f} tokens/s  MFU {way['mfu']:6.1%}  x{rate / base:.2f} of {first}{extra}")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--plan", default="plans/llama.yaml")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="rows per step")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per way (compilation)")
    parser.add_argument("--torchtitan-logs", nargs=2, metavar=("EAGER", "COMPILED"), default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--merge", default=None, help="no training: this run's JSON and --torchtitan-logs, one table")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model of the same family")
    parser.add_argument(
        "--ways", nargs="+", default=["eager", "compiled", "kept"], choices=["eager", "compiled", "kept"]
    )
    parser.add_argument("--fused-adamw", type=int, default=1, help="AdamW(fused=) for plancc (torchtitan's default)")
    parser.add_argument("--profile", default=None, help="one more step of this way (eager, compiled, kept) profiled")
    parser.add_argument("--summarize-trace", default=None, help="no training: a chrome trace's kernel classes")
    args = parser.parse_args()
    if args.summarize_trace:
        with open(args.summarize_trace) as f:
            events = json.load(f)["traceEvents"]
        kernels = [(e["name"], e["dur"] / 1e6) for e in events if e.get("cat") == "kernel" and "dur" in e]
        print_classes(f"trace {args.summarize_trace}", kernels)
        return
    if args.merge:
        with open(args.merge) as f:
            table(json.load(f), args.torchtitan_logs, args.out or args.merge)
        return

    import torch

    import plancc
    from plancc.compiler.plan import CompileSpec, TargetList
    from plancc.engine.losses import token_nll
    from plancc.models import load_config

    config = load_config(args.model)
    config.tie_word_embeddings = False
    if args.tiny:
        for key, value in {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "head_dim": 16,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 256,
        }.items():
            setattr(config, key, value)
    eager_plan = dataclasses.replace(plancc.load_plan(args.plan), activation_checkpointing=TargetList())
    compiled_plan = dataclasses.replace(eager_plan, compile=CompileSpec())
    every = {
        "eager": ("plancc eager", eager_plan),
        "compiled": ("plancc compiled", compiled_plan),
        # the plan's `fsdp: {reshard_after_forward: false}`: each unit's bf16 weights kept from
        # forward to backward (on one rank nothing is sharded: resharding only casts again)
        "kept": ("plancc compiled kept", dataclasses.replace(compiled_plan, fsdp_reshard_after_forward=False)),
    }
    plans = dict(every[key] for key in args.ways)
    # torchtitan's optimizer: AdamW, its fused implementation
    optimizer = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5, "fused": args.fused_adamw}}
    policies = {
        name: plancc.Policy(plan, config, device=args.device, param_dtype="bfloat16", optimizer=optimizer)
        for name, plan in plans.items()
    }
    some = next(iter(policies.values())).model
    flops = model_flops(some, [args.seq_len] * args.batch)
    cuda = args.device == "cuda"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device), float("nan"))
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in policies}
    losses: dict[str, list[float]] = {name: [] for name in policies}
    memory: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        order = list(policies) if step % 2 == 0 else list(reversed(policies))
        for name in order:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            loss = policies[name].train(batch, token_loss=token_nll)["loss"]
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - started)
                used = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
                memory[name] = max(memory.get(name, 0.0), used)
            losses[name].append(round(float(loss), 5))
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            policies[every[args.profile][0]].train(batch, token_loss=token_nll)
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
        from torch.autograd import DeviceType

        kernels = [(e.name, e.device_time_total / 1e6) for e in prof.events() if _is_kernel(e, DeviceType)]
        print(f"  profiled step of {args.profile}: wall {wall:.3f} s")
        print_classes(args.profile, kernels)
        try:  # an analysis: its failure must not lose the run's figures
            print_idle(prof.events())
        except Exception as exc:
            print(f"  device idle: not analysed ({type(exc).__name__}: {exc})")
    syncs: dict[str, int] = {}
    if args.profile and cuda:  # where a step waits for the device: each synchronizing call, by line
        import collections
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            policies[every[args.profile][0]].train(batch, token_loss=token_nll)
        torch.cuda.set_sync_debug_mode(0)
        where = collections.Counter(
            f"{w.filename.split('site-packages/')[-1].split('/work/')[-1]}:{w.lineno}"
            for w in caught
            if "synchroniz" in str(w.message)
        )
        syncs = dict(where)
        print(f"  synchronizing calls in one step of {args.profile}: {sum(where.values())}")
        for line, count in where.most_common(12):
            print(f"    {count:3d}  {line}")
    tokens = args.batch * args.seq_len
    result: dict = {
        "device": device,
        "torch": torch.__version__,
        "model": f"{args.model} (untied)",
        "rows": args.batch,
        "seq_len": args.seq_len,
        "warmup": args.warmup,
        "timed_steps": args.steps,
        "step_flops": flops,
        "peak_flops": peak,
        "synchronizing_calls": syncs,
    }
    for name in policies:
        result[name] = {"steps": [tokens / t for t in times[name]], "peak_gib": memory[name], "losses": losses[name]}
    table(result, args.torchtitan_logs, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
