#!/usr/bin/env bash
# The CUDA path on a GPU machine (see docs/gpu.md for what was measured). Writes to $OUT.
# Liger / Cut Cross-Entropy rows appear when those packages are installed (comparison only).
set -uo pipefail
OUT=${OUT:-/tmp/plancc-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# 1. the fused evaluator's Triton kernels against fp64 and against the PyTorch chunk math
python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels_gpu.py 2>&1 | tail -3 | tee "$OUT/kernels.txt"
# 2. nccl + CUDA: train with --verify (fp32; the fused loss path) and with bf16 mixed precision
python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1 --steps 3 --verify 2>&1 | grep -v "^\[W" | tee "$OUT/apply_cuda.txt"
python3 -m plancc.cli apply plans/gemma3.yaml --device cuda --nproc-per-node 1 --steps 3 --verify 2>&1 | grep -v "^\[W" | tee -a "$OUT/apply_cuda.txt"
python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1 --steps 5 --param-dtype bfloat16 2>&1 | grep -v "^\[W" | tee -a "$OUT/apply_cuda.txt"
# 3. logprobs through the CLI on CUDA (fused evaluator), with entropy
python3 - <<'PY' > /tmp/lp.jsonl
import json, random
random.seed(0)
for _ in range(16):
    print(json.dumps({"input_ids": [random.randrange(256) for _ in range(random.randrange(4, 64))]}))
PY
python3 -m plancc.cli logprobs plans/qwen3.yaml --data /tmp/lp.jsonl --device cuda --nproc-per-node 1 --entropy --verify --out /tmp/lp_out.jsonl 2>&1 | grep -v "^\[W" | tee "$OUT/logprobs_cuda.txt"
# 4. evaluator benchmark: the issue's RL shape (16k tokens, Qwen vocab, bf16), then the CPU table's shape
python3 bench/logprobs.py --device cuda --n 16384 --h 4096 --v 151936 --dtype bfloat16 --tp 1 --repeats 5 --errors 2>&1 | tee "$OUT/bench_logprobs_cuda.txt"
python3 bench/logprobs.py --device cuda --tp 1 --repeats 5 --errors 2>&1 | tee -a "$OUT/bench_logprobs_cuda.txt"
