#!/usr/bin/env bash
# One-shot GPU check, prepared for a lent GPU machine (the device tool runs it in the repository root
# with $OUT as the folder whose files come back). The machine's image already has torch with CUDA,
# triton and numpy; moewatch installs over them offline, without dependencies.
#   run: bash scripts/gpu_check.sh [--quick]   (not yet run on a GPU: time it the first time)
# Results: $OUT/gpu_check.json (kernel match and speed, NCCL EP checks, probe overhead on the GPU, the
# engine adapters' no-sync step clock eager and under a CUDA graph: engine_clock; moewatch's EPLB policy
# on device-resident inputs against the same inputs on the CPU, and with two GPUs and vLLM installed a
# short vLLM run with EPLB and the policy: engine_policy)
# and $OUT/env.txt. Exit status is gpu_check's: 0 only when every check passed.
set -uo pipefail
OUT="${OUT:-/tmp/moewatch-gpu}"
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} > "$OUT/env.txt" 2>&1
python3 -m pip install --quiet --no-deps --no-build-isolation -e . >> "$OUT/env.txt" 2>&1 \
  || { echo "install failed; see $OUT/env.txt"; exit 3; }
python3 -m moewatch.tools.gpu_check "$@" > "$OUT/gpu_check.json"
status=$?
cat "$OUT/env.txt" "$OUT/gpu_check.json"
exit $status
