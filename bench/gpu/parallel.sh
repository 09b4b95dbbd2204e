#!/usr/bin/env bash
# Parallel groups on GPUs (NCCL): bench/parallel.py with a Wan 1.3B-size random-weight transformer at
# 480x832 (17, 33 and 81 frames): one process, sp=2 and cfg=2 on 2 GPUs, sp=2,cfg=2 when 4 are present.
# Writes parallel_gpu.json (+ .png) under OUT_DIR. --smoke runs the same script at tiny sizes on the CPU.
#
# Usage: bash bench/gpu/parallel.sh OUT_DIR [--smoke]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash bench/gpu/parallel.sh OUT_DIR [--smoke]}
mkdir -p "$out"
if [ "${2:-}" = "--smoke" ]; then
  exec python bench/parallel.py --smoke --out "$out/parallel_smoke.json"
fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "bench/gpu/parallel.sh: needs 2 GPUs, found $gpus" >&2
  exit 1
fi
plans=(sp=2 cfg=2)
if [ "$gpus" -ge 4 ]; then
  plans+=(sp=2,cfg=2)
fi
python bench/parallel.py --device cuda --size gpu --repeats 5 --plans "${plans[@]}" --out "$out/parallel_gpu.json"
