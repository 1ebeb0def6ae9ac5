#!/usr/bin/env bash
# One device call for issue 60 (docs/gpu.md, "compiled blocks against torchtitan"): plancc eager
# and compiled (bench/gpu/titan_gpu.py), then torchtitan's own trainer eager and compiled on the
# same model and rows (bench/gpu/torchtitan_synthetic.py), one table, and where each one's device
# time goes (one profiled step of each compiled way, kernels by class); then the colocated refit
# against the device copy bound (bench/gpu/colocated_gpu.py) and, with REFERENCE=1, the
# reference's log-probs against the policy's (bench/gpu/reference_gpu.py). Wheels in .whl: the
# pinned transformers, jsonschema, torchtitan 0.2.2 and what it imports that the machine lacks
# (torchdata, datasets, dill, multiprocess, tyro, docstring-parser, typeguard, shtab, tomli).
. "$(dirname "$0")/gpu_setup.sh"
SEQ=${SEQ:-8192} ROWS=${ROWS:-2} STEPS=${STEPS:-6} WARMUP=${WARMUP:-3}
# WAYS: plancc's ways (eager compiled kept); PROFILED: the one profiled (none: PROFILED=)
P=${PROFILED-kept}
timeout 300 torchrun --nproc-per-node 1 bench/gpu/titan_gpu.py --seq-len $SEQ --batch $ROWS --steps $STEPS \
  --warmup $WARMUP --ways ${WAYS:-eager compiled kept} ${P:+--profile $P} \
  --out "$OUT/titan_gpu.json" 2>&1 | grep -v "^\[W" | tee "$OUT/titan_gpu.txt" | tail -40
TT="--experimental.custom_import bench.gpu.torchtitan_synthetic --model.name plancc_llama --model.flavor 1B
  --training.seq_len $SEQ --training.local_batch_size $ROWS --metrics.log_freq 1 --metrics.disable_color_printing
  --lr_scheduler.warmup_steps 1 --activation_checkpoint.mode none --optimizer.lr 1e-5 --job.dump_folder /tmp/torchtitan"
[ "${TT_EAGER:-1}" = 1 ] && timeout ${TT_EAGER_S:-100} torchrun --nproc-per-node 1 -m torchtitan.train $TT --training.steps $((STEPS + WARMUP)) \
  > "$OUT/torchtitan_eager.log" 2>&1
grep -E "step: |Error|error" "$OUT/torchtitan_eager.log" | tail -2
# one more step, profiled: the step after the timed ones (TT_PROFILE=0: none)
LAST=$((STEPS + WARMUP + 1))
TTP="--profiling.enable_profiling --profiling.profile_freq $LAST --profiling.profiler_warmup 1 --profiling.profiler_active 1"
[ "${TT_PROFILE:-1}" = 1 ] || { LAST=$((STEPS + WARMUP)); TTP=; }
[ "${TT_COMPILED:-1}" = 1 ] && timeout ${TT_COMPILED_S:-150} torchrun --nproc-per-node 1 -m torchtitan.train $TT --training.steps $LAST --compile.enable \
  $TTP > "$OUT/torchtitan_compiled.log" 2>&1
grep -E "step: |Error|error" "$OUT/torchtitan_compiled.log" | tail -2
python3 bench/gpu/titan_gpu.py --merge "$OUT/titan_gpu.json" \
  --torchtitan-logs "$OUT/torchtitan_eager.log" "$OUT/torchtitan_compiled.log" | tee -a "$OUT/titan_gpu.txt"
TRACE=$(find /tmp/torchtitan -name "rank0_trace.json" | head -1)
[ -n "$TRACE" ] && python3 bench/gpu/titan_gpu.py --summarize-trace "$TRACE" | tee -a "$OUT/titan_gpu.txt"
# COLOCATED: the bucket sizes in MiB ("256 1024"); COLOCATED_PROFILE=1: one refit under cProfile
[ -n "${COLOCATED:-}" ] && timeout 120 torchrun --nproc-per-node 1 bench/gpu/colocated_gpu.py --bucket-mib $COLOCATED \
  ${COLOCATED_PROFILE:+--profile} --out "$OUT/colocated_gpu.json" 2>&1 | grep -v "^\[W" | tail -45
[ -n "${REFERENCE:-}" ] && timeout 70 torchrun --nproc-per-node 1 bench/gpu/reference_gpu.py \
  --out "$OUT/reference_gpu.json" 2>&1 | grep -v "^\[W" | tail -8
true
