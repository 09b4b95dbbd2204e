#!/usr/bin/env bash
# One GPU (sized for an H200, < 10 minutes): a Wan 1.3B-size random-weight transformer at 480p x 81 frames in
# bf16 (bench/gpu/wan_480p.py: fv vs diffusers WanPipeline, fv + STA, fv + FBCache, FastWan's 3-step
# fixed-timestep loop eager and under torch.compile), then the STA attention op at 4k-32k tokens with 12
# heads of 128 (bench/sta_attention.py: fraction of the 1/kept limit, compiles over 7 lengths), then the
# scheduling policies fifo / fair / auto on the seeded trace (bench/trace_falsifier.py, both regimes).
# Writes wan_480p.json, sta_attention_gpu.json and trace_falsifier_gpu.json (+ .png) under OUT_DIR; each
# part runs under its own timeout and rewrites its JSON as it goes, so a timeout keeps what finished.
# --smoke runs the same scripts at tiny sizes on the CPU (tests/test_gpu_script_smoke.py).
#
# Usage: bash bench/gpu/run.sh OUT_DIR [--smoke]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash bench/gpu/run.sh OUT_DIR [--smoke]}
mkdir -p "$out"
if [ "${2:-}" = "--smoke" ]; then
  python bench/gpu/wan_480p.py --smoke --out "$out/wan_480p_smoke.json"
  python -m bench.trace_falsifier --smoke --out "$out/trace_falsifier_smoke.json"
  exec python bench/sta_attention.py --smoke --out "$out/sta_attention_smoke.json"
fi
status=0
timeout 350 python bench/gpu/wan_480p.py --device cuda --steps 10 --out "$out/wan_480p.json" || status=$?
timeout 110 python bench/sta_attention.py --device cuda --dtype bfloat16 --heads 12 --head-dim 128 \
  --block-size 128 --sweep-heads 12 --repeats 10 --out "$out/sta_attention_gpu.json" || status=$?
timeout 120 python -m bench.trace_falsifier --device cuda --threads 4 --requests 24 --loads 1 2 3 --rounds 2 \
  --out "$out/trace_falsifier_gpu.json" || status=$?
exit "$status"
