"""`plancc apply --pp 2 --verify` at every layout and schedule the suite's 4 ranks allow: one line
each with the verify report's numbers (logits, loss, gradients against fp64, the losses after
the steps), for docs/pipeline.md.

    python bench/pipeline_verify.py [--steps 2]

A 4-layer Qwen3-shaped model folder (seeded) so that the two-stages-a-rank schedules have a
layer a stage; rows of 5-39 tokens from a data file (every length its own schedule step), the
plan's activation checkpointing on. Each line is a fresh `plancc apply` (its own launcher and
ranks); the whole sweep takes some minutes on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [
    ("1f1b", ["--pp", "2"]),
    ("1f1b", ["--pp", "2", "--dp", "2"]),
    ("1f1b", ["--pp", "2", "--tp", "2"]),
    ("1f1b", ["--pp", "2", "--tp", "2", "--sp"]),
    ("1f1b", ["--pp", "2", "--cp", "2"]),
    ("interleaved_1f1b", ["--pp", "2"]),
    ("interleaved_1f1b", ["--pp", "2", "--cp", "2"]),
    ("zero_bubble", ["--pp", "2"]),
    ("zero_bubble", ["--pp", "2", "--tp", "2"]),
    ("zbv", ["--pp", "2", "--dp", "2"]),
    ("dualpipev", ["--pp", "2"]),
]
SCHEDULE_LINES = {
    "1f1b": "schedule: 1f1b\n  microbatches: 4\n",
    "interleaved_1f1b": "schedule: interleaved_1f1b\n  virtual_stages_per_rank: 2\n  microbatches: 4\n",
    "zero_bubble": "schedule: zero_bubble\n  virtual_stages_per_rank: 2\n  microbatches: 4\n",
    "zbv": "schedule: zbv\n  virtual_stages_per_rank: 2\n  microbatches: 4\n",
    "dualpipev": "schedule: dualpipev\n  virtual_stages_per_rank: 2\n  microbatches: 4\n",
}
NUMBERS = {
    "logits": r"logits\s+max \|diff\| (\S+)",
    "loss": r"loss\s+\|diff\| (\S+)",
    "grads vs fp64": r"against fp64: sharded (\S+),",
    "fp32 vs fp64": r"unsharded fp32 (\S+) \(",
    "after steps": r"loss after step \d+: \|diff\| (\S+)\n(?!.*loss after step)",
}


def _model_folder(where: Path) -> Path:
    import torch

    from plancc.models import build_model, load_config

    config = load_config("tiny-qwen3")
    config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
    torch.manual_seed(7)
    build_model(config, device="cpu").save_pretrained(where / "model")
    return where / "model"


def _rows(where: Path, count: int = 8) -> Path:
    rng = random.Random(11)
    path = where / "rows.jsonl"
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"input_ids": [rng.randrange(1, 200) for _ in range(rng.randint(5, 39))]}) + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    plan_text = (ROOT / "plans" / "qwen3.yaml").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        model, data = _model_folder(where), _rows(where)
        print(
            "| schedule | layout | logits max abs | loss | gradients vs fp64 (fp32's) | loss after last step | verify |"
        )
        print("|---|---|---|---|---|---|---|")
        for schedule, flags in LAYOUTS:
            plan = where / f"{schedule}.yaml"
            plan.write_text(plan_text.replace("schedule: 1f1b\n", SCHEDULE_LINES[schedule]))
            ranks = 2 * (2 if any(f in flags for f in ("--dp", "--tp", "--cp")) else 1)
            command = [sys.executable, "-c", "from plancc.cli import main; main()", "apply", str(plan), "--model", str(model), "--data", str(data),
                       "--nproc-per-node", str(ranks), "--verify", "--steps", str(args.steps), "--batch-size", "8",
                       *flags]  # fmt: skip
            done = subprocess.run(
                command, capture_output=True, text=True, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}
            )
            out = done.stdout + done.stderr
            found = {k: (m.group(1) if (m := re.search(p, out, re.S)) else "-") for k, p in NUMBERS.items()}
            verdict = "OK" if "verify: OK" in out else f"rc {done.returncode}: {out.strip().splitlines()[-1][:80]}"
            print(f"| {schedule} | {' '.join(flags)} | {found['logits']} | {found['loss']} | "
                  f"{found['grads vs fp64']} ({found['fp32 vs fp64']}) | {found['after steps']} | {verdict} |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
