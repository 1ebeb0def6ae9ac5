"""The fake world's measured peak against a real step's, on one rank: does the dry run's memory
measurement (``plancc.tools.measured_memory``, what ``plancc suggest --verify-top`` trusts) hold
what a real device holds? And suggest's prediction beside both.

    python bench/suggest_real_peak.py [--device cuda] [--only LABEL ...] [--fake] [--where] [--out F]

Each case runs the measured step for real on a world of one rank (nccl on CUDA, gloo on the
CPU): the model built on meta, parallelized by the plan (FSDP2, bf16 compute over fp32
masters), materialized with random weights, AdamW's state made by a first step, then one step
of the fused token loss under ``FSDPMemTracker``, the device allocator's peak beside it
(``torch.cuda.max_memory_allocated``). The same case measured in the fake world and predicted by
suggest (at the device's lm_head chunking) follow. Latest results: docs/suggest.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

GiB = 2**30

# (plan, model, seq_len, checkpointing)
CASES = [
    ("plans/qwen3.yaml", "qwen3-0.6b:2", 512, "none"),  # small: a CPU runs it in seconds
    ("plans/qwen3.yaml", "qwen3-0.6b", 4096, "none"),
    ("plans/qwen3.yaml", "qwen3-0.6b", 4096, "full"),
    ("plans/qwen3.yaml", "qwen3-0.6b", 8192, "plan"),
    ("plans/qwen3_moe.yaml", "qwen3-30b-a3b:2", 4096, "none"),
    ("plans/qwen3_moe.yaml", "qwen3-30b-a3b:4", 4096, "none"),
    ("plans/qwen3_moe.yaml", "qwen3-30b-a3b:2", 4096, "full"),
]


def real_step(plan, config, seq_len: int, checkpointing: str, device: str, where_peak: bool = False) -> dict:
    """One step on this rank for real: the allocator's peak over the step and the tracker's by kind."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from plancc.layout import Layout
    from plancc.models import build_model
    from plancc.runtime.materialize import materialize
    from plancc.runtime.mesh import build_mesh
    from plancc.runtime.parallelize import parallelize
    from plancc.tools.measured_memory import MeasuredMemory, _with_checkpointing, adamw_with_state, training_step

    model = build_model(config, device="meta", dtype=torch.float32)
    plan, ac = _with_checkpointing(plan, model, checkpointing)
    mesh = build_mesh(Layout(), device_type=device)
    parallelize(model, plan, mesh, param_dtype=torch.bfloat16, activation_checkpointing=ac)
    materialize(model, device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    optimizer = adamw_with_state(model)
    ids = torch.randint(0, int(config.vocab_size), (1, seq_len), device=device)
    cuda = device == "cuda"
    phases: dict = {}

    def phase(name: str) -> None:  # the allocator's peak since the last phase began
        if cuda:
            torch.cuda.synchronize()
            phases[name] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if cuda else 0
    if cuda and where_peak:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((ids,))
    with tracker:  # the fake world's measured step, for real
        training_step(model, optimizer, ids, mark=phase)
    holders = None
    if cuda and where_peak:
        holders = peak_holders(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    by_kind = MeasuredMemory.of(next(iter(tracker.get_tracker_snapshot("peak").values())))
    del model, optimizer, tracker
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    allocator = max(phases.values(), default=0)
    return {
        "allocator_peak": allocator,
        "resident_before": resident,
        "tracker": by_kind,
        "phases": phases,
        "holders": holders,
    }


def peak_holders(snapshot: dict, top: int = 14) -> tuple[int, list[tuple[str, int]]]:
    """Replays the allocator's recorded events: the most bytes allocated at once during the
    recording (beyond what was allocated before it) and, at that moment, the live bytes by the
    innermost Python frame of plancc, transformers or torch that allocated them."""
    traces = snapshot["device_traces"][0]
    live: dict = {}
    current = best = 0
    best_at = -1
    for i, event in enumerate(traces):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])
        if current > best:
            best, best_at = current, i
    held: dict = {}
    for event in traces[: best_at + 1]:
        if event["action"] == "alloc":
            held[event["addr"]] = event
        elif event["action"] == "free_completed":
            held.pop(event["addr"], None)
    sites: dict = {}
    for event in held.values():
        site = "<no Python frame: autograd's C++ or a kernel>"
        frames = event.get("frames", [])
        ours = [f for f in frames if "/plancc/" in f["filename"] or "/transformers/" in f["filename"]]
        torchs = [f for f in frames if "/torch/" in f["filename"] and "/_tools/" not in f["filename"]]
        for frame in (ours or torchs)[:1]:
            site = f"{'/'.join(frame['filename'].split('/')[-2:])}:{frame['line']} {frame['name']}"
        sites[site] = sites.get(site, 0) + event["size"]
    return best, sorted(sites.items(), key=lambda kv: -kv[1])[:top]


def one_case(label: str, device: str, where_peak: bool, out: str) -> None:
    """The child process of one case: a world of one rank, the real step, its row as JSON."""
    import torch
    from suggest_memory import _model

    from plancc.compiler.plan import load_plan
    from plancc.models import load_config

    plan_path, name, seq_len, ac = next(c for c in CASES if label == f"{c[1]} {c[2]} {c[3]}")
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(0)
    real = real_step(load_plan(plan_path), load_config(_model(name)), seq_len, ac, device, where_peak)
    real["tracker"] = vars_of(real["tracker"])
    with open(out, "w") as f:
        json.dump(real, f)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="*", default=[""], help="the cases whose label holds one of these")
    parser.add_argument("--fake", action="store_true", help="also measure each case in the fake world here")
    parser.add_argument("--where", action="store_true", help="what the allocator holds at each case's peak (CUDA)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process of one case
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        one_case(args.case, args.device, args.where, args.row)
        return

    import socket
    import subprocess
    import tempfile

    from suggest_memory import _model, predicted

    from plancc.compiler.plan import load_plan
    from plancc.layout import Layout
    from plancc.models import load_config
    from plancc.tools.measured_memory import measure_step_memory

    rows = []
    print(f"{'model':<16} {'seq':>6} {'ac':<5} {'real':>8} {'tracker':>8} {'fake':>8} {'predicted':>9}  predicted/real")
    for plan_path, name, seq_len, ac in CASES:
        label = f"{name} {seq_len} {ac}"
        if not any(o in label for o in args.only):
            continue
        started = time.perf_counter()
        # each case in a process of its own: a model parallelized by FSDP outlives its last
        # reference here (its hooks' cycles), and the next case would measure its memory too
        with socket.socket() as s, tempfile.NamedTemporaryFile(suffix=".json") as row_file:
            s.bind(("127.0.0.1", 0))
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1])}
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            s.close()
            command = [sys.executable, __file__, "--case", label, "--device", args.device, "--row", row_file.name]
            done = subprocess.run(
                command + (["--where"] if args.where else []), env=env, capture_output=True, text=True
            )
            if done.returncode != 0:
                print(f"{label}: not measured: {done.stderr.strip().splitlines()[-1:]}")
                continue
            with open(row_file.name) as f:
                real = json.load(f)
        plan, model_name = load_plan(plan_path), _model(name)
        row: dict = {"model": name, "seq_len": seq_len, "checkpointing": ac, **real}
        fake = None
        if args.fake:
            fake = measure_step_memory(plan, load_config(model_name), Layout(), seq_len=seq_len, checkpointing=ac)
            row["fake"] = vars_of(fake)
        want = predicted(plan, model_name, Layout(), seq_len, ac, device=args.device)
        row["predicted"] = vars_of(want) | {"total": want.total}
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        peak = real["allocator_peak"] or real["tracker"]["total"]
        tracked, faked = real["tracker"]["total"] / GiB, fake.total / GiB if fake else float("nan")
        print(
            f"{name:<16} {seq_len:>6} {ac:<5} {real['allocator_peak'] / GiB:>7.2f}G {tracked:>7.2f}G {faked:>7.2f}G "
            f"{want.total / GiB:>8.2f}G  {want.total / peak:.2f} ({want.at})"
        )
        print(f"    real by kind: { {k: round(v / GiB, 2) for k, v in real['tracker'].items()} }")
        print(f"    allocator's peak by phase: { {k: round(v / GiB, 2) for k, v in real['phases'].items()} }")
        if real["holders"]:
            best, sites = real["holders"]
            total = (real["resident_before"] + best) / GiB
            print(f"    at the peak: {total:.2f} G, {best / GiB:.2f} G beyond the resident:")
            for site, size in sites:
                print(f"      {size / GiB:7.3f} G  {site}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "cases": rows}, f, indent=1)


def vars_of(measured) -> dict:
    return {k: getattr(measured, k) for k in measured.__slots__}


if __name__ == "__main__":
    main()
