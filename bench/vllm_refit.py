"""The refit from a plancc policy into a running vLLM, against the host copy bound.

    python bench/vllm_refit.py [--vllm-python .venv-vllm/bin/python] [--hidden 512] [--layers 4]

A Qwen3 of heads 64 (``--hidden``, ``--layers``, vocabulary 8192, fp32) as a policy on 2 gloo
ranks at dp=2 and at tp=2, refitting one vLLM at tensor parallel 1 and then one at 2 (vLLM's
weight-transfer protocol, the ``plancc_gloo`` backend: each worker its own slices), 3 refits
each, the median. The bound beside it, measured in the same run on the driving rank: one host
copy of every byte the refit delivers (``torch.Tensor.copy_`` of a buffer that large), the
least a refit through host memory costs. Prints one table (docs/rollout.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import launch  # noqa: E402


def _config(hidden: int, layers: int):
    from plancc.models import load_config

    config = load_config("tiny-qwen3")
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 3 * hidden, layers
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = hidden // 64, max(1, hidden // 256), 64
    config.vocab_size = 8192
    config.layer_types = ["full_attention"] * layers
    return config


def refit_worker(vllm_python: str, vllm_tp: int, hidden: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.engine.vllm_rollout import VLLMRollout, VLLMSpec
    from plancc.layout import Layout

    out = {}
    rollout = None
    try:
        for name, sizes in (("dp2", {"dp": 2}), ("tp2", {"tp": 2})):
            policy = plancc.Policy("plans/qwen3.yaml", _config(hidden, layers), layout=Layout(**sizes), device="cpu")
            if rollout is None:
                rollout = VLLMRollout(VLLMSpec(python=vllm_python, tensor_parallel_size=vllm_tp), policy.config)
            times, sent = [], 0
            for i in range(4):
                dist.barrier()
                report = rollout.refit(policy, version=f"{name}-{i}")
                if i:  # the first refit warms the buffers
                    times.append(report["seconds"])
                sent = sum(report["bytes_per_worker"])
            src = torch.empty(sent // 4 + 1, dtype=torch.float32)
            dst = torch.empty_like(src)
            copies = []
            for _ in range(3):
                start = time.perf_counter()
                dst.copy_(src)
                copies.append(time.perf_counter() - start)
            out[name] = {"seconds": statistics.median(times), "bytes": sent, "copy_s": statistics.median(copies),
                         "per_worker": report["bytes_per_worker"]}
            del policy
    finally:
        if rollout is not None:
            rollout.close()
        dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("PLANCC_VLLM_PYTHON", ".venv-vllm/bin/python"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print("| policy -> vLLM | MiB delivered (per worker) | refit s (median of 3) | host copy bound s | refit / bound |")
    print("|---|---|---|---|---|")
    for vllm_tp in (1, 2):
        got = launch(refit_worker, 2, args.vllm_python, vllm_tp, args.hidden, args.layers, timeout_s=900)[0]
        for name, row in got.items():
            per = " / ".join(f"{b / 2**20:.1f}" for b in row["per_worker"])
            print(f"| {name} -> vLLM tp{vllm_tp} | {row['bytes'] / 2**20:.1f} ({per}) | {row['seconds']:.3f} "
                  f"| {row['copy_s']:.4f} | {row['seconds'] / row['copy_s']:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
