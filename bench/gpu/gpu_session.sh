#!/usr/bin/env bash
# One device call of a session (docs/gpu.md): Policy.train's throughput against a hand-written
# loop, the fake-world Policy cases, the kernels' tests, and apply / logprobs through the CLI on
# CUDA (--verify, microbatched and packed); POLICY_GPU=1 adds the one-GPU offload bench,
# RESUME=1 save / resume / export, SUGGEST_PEAK=1 the real step's peak against the fake world's
# (bench/suggest_real_peak.py); FAKE_CASES names the fake-world cases (default: all). Wheels of the
# pinned transformers (and jsonschema) travel in .whl: see docs/gpu.md.
. "$(dirname "$0")/gpu_setup.sh"
[ -n "${SUGGEST_PEAK:-}" ] && timeout 240 torchrun --nproc-per-node 1 bench/suggest_real_peak.py --out "$OUT/suggest_real_peak.json" \
  2>&1 | grep -v "^\[W" | tee "$OUT/suggest_real_peak.txt" | grep -v Warning
# Policy.train against a hand-written transformers + Liger loop (issue 40; liger travels in .whl)
timeout 240 torchrun --nproc-per-node 1 bench/gpu/train_gpu.py --steps ${TRAIN_STEPS:-3} --profile --out "$OUT/train_gpu.json" \
  2>&1 | grep -v "^\[W" | tee "$OUT/train_gpu.txt" | tail -30
timeout 150 python3 bench/gpu/policy_fake_world_gpu.py ${FAKE_CASES:+--cases $FAKE_CASES} --out "$OUT/fake_world_gpu.json" > "$OUT/fake_world_gpu.txt" 2>&1
tail -1 "$OUT/fake_world_gpu.txt"
[ -n "${POLICY_GPU:-}" ] && torchrun --nproc-per-node 1 bench/gpu/policy_gpu.py --out "$OUT/policy_gpu.json" 2>&1 | grep -v "^\[W" | tail -25
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels_gpu.py tests/test_document_attention.py 2>&1 | tail -2
A="timeout 100 python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1"
$A --steps 3 --verify 2>&1 | grep -v "^\[W" | tee "$OUT/apply_cuda.txt" | tail -9
$A --steps 2 --verify --micro-batch-size 2 --pack 2>&1 | grep -v "^\[W" | tee -a "$OUT/apply_cuda.txt" | tail -9
[ -n "${RESUME:-}" ] && $A --steps 4 --save /tmp/ck --export-hf /tmp/hf 2>&1 | grep -v "^\[W" | tail -3
[ -n "${RESUME:-}" ] && $A --steps 2 --resume /tmp/ck --lr 2e-3 2>&1 | grep -v "^\[W" | tee -a "$OUT/apply_cuda.txt" | tail -4
python3 -c "
import json, random
random.seed(0)
for _ in range(17): print(json.dumps({'input_ids': [random.randrange(256) for _ in range(random.randrange(1, 64))]}))" > /tmp/lp.jsonl
L="python3 -m plancc.cli logprobs plans/qwen3.yaml --data /tmp/lp.jsonl --device cuda --nproc-per-node 1 --verify --out /tmp/lp_out.jsonl"
$L --entropy 2>&1 | grep -v "^\[W" | tee "$OUT/logprobs_cuda.txt" | tail -2
$L --pack --batch-size 5 --temperature 0.7 2>&1 | grep -v "^\[W" | tee -a "$OUT/logprobs_cuda.txt" | tail -2
