#!/usr/bin/env bash
# The GPU benchmarks (prepared for a lent H200), each against plain transformers on a never-enabled copy of the
# same random bf16 weights, at Qwen3-VL-8B's geometry:
#   1. vismemo bench latency: TTFT (with its stages, fetch_wait among them), decoding step and whole generate at 32
#      and 256 new tokens, 1K-8K visual tokens, with the TTFT floors (encoder included) of every kind;
#   2. vismemo bench overhead: host syncs per kind at 4 and 36 layers (also CUDA's own count), fixed cost per layer,
#      share of a hit's prefill outside the kernels.
# Writes latency.* and overhead/ under the folder given as $1 (default results/perf/gpu). Each step has its own time
# limit (LATENCY_S, OVERHEAD_S seconds) so that one that runs long leaves the other its time; the latency report is
# rewritten after each length, so a step cut short keeps the lengths it finished.
set -uo pipefail
out=${1:-results/perf/gpu}
py=${PYTHON:-python3}
if ! "$py" -c "import vismemo_hf" 2>/dev/null; then
  "$py" -m pip install -q -e . || { echo "vismemo_hf is not importable and could not be installed"; exit 1; }
fi
"$py" -c "import torch, transformers, vismemo_hf; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0))"
timeout "${LATENCY_S:-400}" "$py" -m vismemo_hf.cli -q bench latency --preset qwen3-vl-8b --lengths 1024,2048,4096,8192 \
    --policies attend-deviate,vismemo,cacheblend --repeats 3 --new-tokens 32 --long-tokens 256 \
    --dtype bfloat16 --device cuda --out "$out" || echo "bench latency stopped (status $?)"
timeout "${OVERHEAD_S:-150}" "$py" -m vismemo_hf.cli -q bench overhead --preset qwen3-vl-8b --layers 4,36 \
    --lengths 1024,4096 --policies attend-deviate --repeats 3 --dtype bfloat16 --device cuda --out "$out/overhead" \
    || echo "bench overhead stopped (status $?)"
