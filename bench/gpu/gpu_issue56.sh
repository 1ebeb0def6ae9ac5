#!/usr/bin/env bash
# One device call for issue 56 (docs/gpu.md, "the run you verify"): fp32 masters under bf16
# compute on CUDA against bf16 masters (bench/gpu/masters_gpu.py), the masters test on CUDA, --verify
# on a bf16 folder's own weights and on a resumed checkpoint, a resume that continues the same
# schedule, and a failure of rank 0's file work agreed through nccl. Wheels of the pinned
# transformers (and jsonschema) travel in .whl, as for bench/gpu/gpu_session.sh.
. "$(dirname "$0")/gpu_setup.sh"
timeout 240 torchrun --nproc-per-node 1 bench/gpu/masters_gpu.py --out "$OUT/masters_gpu.json" 2>&1 | grep -v "^\[W" | tail -30
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_master_weights.py 2>&1 | tail -2
A="timeout 100 python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1"
python3 -c "
import torch
from plancc.models import build_model, load_config
torch.manual_seed(7)
build_model(load_config('tiny-qwen3'), device='cpu', dtype=torch.bfloat16).save_pretrained('/tmp/hf16')"
{
  $A --model /tmp/hf16 --steps 2 --verify --micro-batch-size 2 2>&1 | grep -v "^\[W" | tail -10
  $A --steps 4 --save /tmp/ck --save-every 2 --metrics /tmp/straight.jsonl 2>&1 | grep -v "^\[W" | tail -2
  $A --steps 4 --resume /tmp/ck/step-000002 --metrics /tmp/resumed.jsonl 2>&1 | grep -v "^\[W" | grep -E "resumed|note|step "
  python3 -c "
import json
s = [json.loads(l) for l in open('/tmp/straight.jsonl')][2:]
r = [json.loads(l) for l in open('/tmp/resumed.jsonl')]
for a, b in zip(s, r): print('step', a['step'], b['step'], 'lr', a['lr'], b['lr'], 'loss', a['loss'], b['loss'], 'diff', abs(a['loss'] - b['loss']))"
  $A --steps 1 --verify --resume /tmp/ck/step-000002 2>&1 | grep -v "^\[W" | tail -10
  start=$(date +%s.%N)
  PLANCC_FAULT=meta:readonly@0 $A --steps 1 --save /tmp/ck2 2>&1 | grep -v "^\[W" | tail -3
  echo "exit ${PIPESTATUS[0]} after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s"
} | tee "$OUT/apply_cuda_issue56.txt"
