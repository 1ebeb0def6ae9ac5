#!/usr/bin/env bash
# The CUDA path on a GPU machine (see docs/gpu.md for what was measured). Writes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/plancc-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# 1. nccl + CUDA: train with --verify (fp32) and with bf16 mixed precision
python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1 --steps 3 --verify 2>&1 | grep -v "^\[W" | tee "$OUT/apply_verify_cuda.txt"
python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1 --steps 5 --param-dtype bfloat16 2>&1 | grep -v "^\[W" | tee "$OUT/apply_bf16_cuda.txt"
python3 -m plancc.cli apply plans/gemma3.yaml --device cuda --nproc-per-node 1 --steps 3 --verify 2>&1 | grep -v "^\[W" | tee -a "$OUT/apply_verify_cuda.txt"
# 2. logprobs through the CLI on CUDA
python3 - <<'PY' > /tmp/lp.jsonl
import json, random
random.seed(0)
for _ in range(16):
    print(json.dumps({"input_ids": [random.randrange(256) for _ in range(random.randrange(4, 64))]}))
PY
python3 -m plancc.cli logprobs plans/qwen3.yaml --data /tmp/lp.jsonl --device cuda --nproc-per-node 1 --verify 2>&1 | grep -v "^\[W" | tee "$OUT/logprobs_cuda.txt"
# 3. evaluator benchmark on the GPU: the issue's shape, then an RL-sized one (16k tokens, Qwen vocab)
python3 bench/logprobs.py --device cuda 2>&1 | tee "$OUT/bench_logprobs_cuda.txt"
python3 bench/logprobs.py --device cuda --shape 1 16384 151936 --dtypes bfloat16 2>&1 | tee -a "$OUT/bench_logprobs_cuda.txt"
# 4. bf16 vs fp32 log-probs of the same weights (what a bf16 policy costs in exactness)
python3 bench/bf16_logprobs.py 2>&1 | tee "$OUT/bf16_logprobs.txt"
