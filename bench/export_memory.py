"""The export's peak host memory on rank 0, streamed shard by shard against the whole-model way
it replaced, side by side in one run (issue 56; results in docs/export_memory.md).

    torchrun --nproc-per-node 2 bench/export_memory.py [--model llama-3.2-1b] [--shard-gib 0.5] [--out F]

Two ranks (gloo, CPU, dp=2) hold a ``plancc.Policy`` of the preset's published config (bf16:
every real checkpoint's dtype; fp32 masters, each rank half of them). Each way writes the same
folder while a thread on rank 0 samples its resident memory every 5 ms; the figure is rank 0's
peak above its resident memory before the export (its shard of the model, which both ways hold).
(At one rank a "full" state dict is the rank's own tensors, no copy: the old way looks cheaper
there than it is on any real job.)

- ``streamed``: ``plancc.weights.export_hf`` (``engine.export``: a bucket gathered, cast to the
  config's dtype, written as one safetensors shard, then the next);
- ``whole model``: what export_hf did before -- the full state dict gathered on rank 0
  (``get_model_state_dict(full_state_dict, cpu_offload)``), a second model built on the CPU in
  the config's dtype, ``load_state_dict``, ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

PAGE = os.sysconf("SC_PAGE_SIZE")
GiB = 2**30


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """The largest resident memory seen while it runs (a thread reading /proc every 5 ms)."""

    def __enter__(self) -> PeakSampler:
        self.start, self.peak, self.running = resident(), resident(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, resident())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, resident())

    @property
    def above_start(self) -> int:
        return self.peak - self.start


def whole_model_export(policy, folder: Path) -> None:
    from plancc.models import build_model

    state = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        plain = build_model(policy.config, device="cpu")  # the config's dtype: bf16
        plain.load_state_dict(state, strict=False)
        plain.save_pretrained(str(folder))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--shard-gib", type=float, default=0.5)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    from plancc import Policy
    from plancc.models import load_config
    from plancc.weights import export_hf

    shard_bytes = int(args.shard_gib * GiB)
    config = load_config(args.model)
    plan = {"LlamaForCausalLM": "plans/llama.yaml", "Qwen3ForCausalLM": "plans/qwen3.yaml"}[config.architectures[0]]
    policy = Policy(plan, config, device="cpu")
    params = sum(p.numel() for p in policy.model.parameters())
    result = {
        "model": args.model,
        "parameters": params,
        "config_dtype": str(config.dtype),
        "masters_gib": params * 4 / GiB,
        "ranks": dist.get_world_size(),
        "shard_gib": shard_bytes / GiB,
    }
    tmp = tempfile.mkdtemp(prefix="plancc-export-memory-") if dist.get_rank() == 0 else ""
    shared = [tmp]
    dist.broadcast_object_list(shared, src=0)
    ways = (
        ("streamed", lambda f: export_hf(policy.model, policy.config, f, shard_bytes=shard_bytes)),
        ("whole model", lambda f: whole_model_export(policy, f)),
    )
    for way, export in ways:
        folder = Path(shared[0]) / way.replace(" ", "_")
        started = time.perf_counter()
        with PeakSampler() as sampler:
            export(folder)
        dist.barrier()
        written = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        result[way] = {
            "peak_above_model_gib": sampler.above_start / GiB,
            "seconds": time.perf_counter() - started,
            "written_gib": written / GiB,
        }
    result["ratio_whole_over_streamed"] = (
        result["whole model"]["peak_above_model_gib"] / result["streamed"]["peak_above_model_gib"]
    )
    if dist.get_rank() == 0:
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
