#!/usr/bin/env bash
# The plan's compile: section with inductor (generated C++ kernels on CPU, Triton on CUDA):
# `plancc apply --verify` at dp=2, tp=2 + SP and pp=2 with each decoder block compiled, against the
# unsharded eager model; the eager run beside it for the wall time of both.
#   bash bench/compiled_blocks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
plan=$(mktemp --suffix=.yaml)
trap 'rm -f "$plan"' EXIT
{ cat plans/qwen3.yaml; echo "compile: true"; } > "$plan"
for layout in "--dp 2" "--tp 2 --sp" "--pp 2"; do
  for which in eager compiled; do
    file=plans/qwen3.yaml; [ "$which" = compiled ] && file=$plan
    start=$(date +%s)
    out=$(plancc apply "$file" --nproc-per-node 2 $layout --verify --steps 2 2>&1 || true)
    verdict=$(echo "$out" | grep -E "^verify:" || echo "failed: $(echo "$out" | tail -1)")
    grads=$(echo "$out" | grep -E "against fp64" | sed 's/.*sharded \([^,]*\),.*/\1/' || true)
    echo "$which $layout: $verdict (gradients vs fp64 $grads) in $(( $(date +%s) - start )) s"
  done
done
