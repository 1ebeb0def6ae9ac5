"""`plancc apply` and `plancc logprobs` on a small model with Qwen's 151,936-token vocabulary:
peak memory with the fused lm_head evaluator against the logits path (PLANCC_FUSED_LM_HEAD=0),
and the losses / log-probs of both.

    python bench/fused_memory.py          # 1 layer, hidden 128, batch 2 x 1024, CPU, 1 process
    git worktree add /tmp/before be953e3 && python bench/fused_memory.py --baseline /tmp/before

Peak memory is the largest resident set of any process of the run (the worker), read with
getrusage(RUSAGE_CHILDREN) in a fresh wrapper process per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "tie_word_embeddings": False, "max_position_embeddings": 2048,
}
WRAPPER = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
           "sys.stderr.write(p.stderr[-2000:] if p.returncode else ''); "
           "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); print(p.stdout)")


def run(args: list[str], fused: bool, code_dir: str | None = None) -> tuple[int, str]:
    env = {**os.environ, "PLANCC_FUSED_LM_HEAD": "1" if fused else "0"}
    if code_dir:  # another plancc checkout (e.g. the commit before the fused evaluator), with its own plan
        env["PYTHONPATH"] = code_dir
        args = [str(Path(code_dir) / a) if a.startswith("plans/") else a for a in args]
    cmd = [sys.executable, "-c", WRAPPER, sys.executable, "-m", "plancc.cli", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    head, _, rest = out.partition("\n")
    code, peak = map(int, head.split())
    if code != 0:
        raise SystemExit(f"{' '.join(args)} failed ({code})")
    return peak, rest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="a checkout of an earlier plancc: its run is the 'before' column")
    args_ = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(CONFIG))
        data = Path(tmp) / "data.jsonl"
        with data.open("w") as f:
            for i in range(2):
                f.write(json.dumps({"input_ids": [(i * 7919 + j * 104729) % 151936 for j in range(1024)]}) + "\n")
        logits_bytes = 2 * 1024 * 151936 * 4
        common = ["--model", str(config), "--nproc-per-node", "1", "--tp", "1", "--format", "json"]
        apply = ["apply", "plans/qwen3.yaml", *common, "--steps", "2", "--batch-size", "2", "--seq-len", "1024"]
        logprobs = ["logprobs", "plans/qwen3.yaml", *common, "--data", str(data), "--batch-size", "2"]
        print(f"fp32 logits of one batch (2 x 1024 x 151936): {logits_bytes / 2**20:.0f} MiB")
        before = "baseline MiB" if args_.baseline else "logits path MiB"
        print(f"{'command':<10}{before:>17}{'fused MiB':>11}{'saved MiB':>11}{'saved/logits':>14}  same numbers")
        for name, args in (("apply", apply), ("logprobs", logprobs)):
            (base, base_out), (fused, fused_out) = run(args, False, args_.baseline), run(args, True)
            a, b = json.loads(base_out), json.loads(fused_out)
            if name == "apply":
                diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a["history"], b["history"], strict=True))
            else:
                diff = max(abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"], strict=True)
                           for x, y in zip(p, q, strict=True))
            print(f"{name:<10}{base / 2**20:>17.0f}{fused / 2**20:>11.0f}{(base - fused) / 2**20:>11.0f}"
                  f"{(base - fused) / logits_bytes:>14.2f}  max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
