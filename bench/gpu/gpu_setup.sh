# Sourced by the device-call scripts (bench/gpu/gpu_session.sh, bench/gpu/gpu_issue56.sh): $OUT made, the
# carried wheels (.whl: the pinned transformers, jsonschema) installed, the launcher fitted to the
# machine's torch, and the card and versions recorded in $OUT/gpu.txt.
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
