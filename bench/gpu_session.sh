#!/usr/bin/env bash
# One device call of a session (docs/gpu.md): the fake-world Policy cases, the one-GPU Policy
# bench (offload as another process sees it), the kernels' tests, and apply / logprobs --verify
# through the CLI on CUDA. Wheels of the pinned transformers travel in .whl (see docs/gpu.md).
set -uo pipefail
OUT=${OUT:-/tmp/plancc-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# torch < 2.13's torchrun has no --shutdown-timeout
python3 -c "import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 13) else 1)" \
  || sed -i '/--shutdown-timeout=/d' plancc/job/launch.py
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } | tee "$OUT/gpu.txt"
python3 bench/policy_fake_world_gpu.py --out "$OUT/fake_world_gpu.json" > "$OUT/fake_world_gpu.txt" 2>&1
tail -2 "$OUT/fake_world_gpu.txt"
torchrun --nproc-per-node 1 bench/policy_gpu.py --out "$OUT/policy_gpu.json" 2>&1 | grep -v "^\[W" | tail -25
python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels_gpu.py 2>&1 | tail -2
python3 -m plancc.cli apply plans/qwen3.yaml --device cuda --nproc-per-node 1 --steps 3 --verify 2>&1 | grep -v "^\[W" | tee "$OUT/apply_cuda.txt" | tail -12
python3 - <<'PY' > /tmp/lp.jsonl
import json, random
random.seed(0)
for _ in range(16):
    print(json.dumps({"input_ids": [random.randrange(256) for _ in range(random.randrange(4, 64))]}))
PY
python3 -m plancc.cli logprobs plans/qwen3.yaml --data /tmp/lp.jsonl --device cuda --nproc-per-node 1 --entropy --verify --out /tmp/lp_out.jsonl 2>&1 | grep -v "^\[W" | tee "$OUT/logprobs_cuda.txt" | tail -4
