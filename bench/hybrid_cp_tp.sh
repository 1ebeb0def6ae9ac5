#!/bin/bash
# cp=2 x tp=2 `plancc apply --verify` of the hybrid models (tiny configs as bench/hf_sweep.py makes
# them): one line per model; results in docs/models.md. Run from an environment with plancc installed.
cd "$(dirname "$0")/.."
for t in qwen3_next qwen3_5_text qwen3_5_moe_text nemotron_h jamba granitemoehybrid kimi_linear minimax bamba falcon_h1 olmo_hybrid bailing_hybrid; do
  d=${OUT:-/tmp/hybrid_cp_tp}/$t; rm -rf $d; mkdir -p $d
  python -c "
import sys; sys.path.insert(0, 'bench'); from pathlib import Path
from hf_sweep import tiny_config
from plancc.tools.import_hf import import_hf
f = tiny_config('$t', Path('$d/model')); Path('$d/plan.yaml').write_text(import_hf(f))" > /dev/null 2>&1
  out=$(timeout 900 plancc apply $d/plan.yaml --model $d/model --cp 2 --tp 2 --nproc-per-node 4 --steps 1 --verify 2>&1 | grep -E "verify|error" | grep -v "random-init\|Warn" | tail -2 | tr '\n' ' ')
  echo "$t | $out"
done
echo done
