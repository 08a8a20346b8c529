#!/usr/bin/env bash
# Latency bench on one GPU (prepared for a lent H200): Qwen3-VL-8B geometry, random bf16 weights, 1K-8K visual
# tokens, every kind against a never-enabled copy of the same weights (TTFT, decoding step, whole generate at 32
# and 256 new tokens). Writes latency.md / .json / .png to the folder given as $1 (default results/perf/h200).
set -euo pipefail
out=${1:-results/perf/h200}
python -m pip install -q -e . >/dev/null 2>&1 || pip install -q -e .
python -m vismemo_hf.cli bench latency --preset qwen3-vl-8b --lengths 1024,2048,4096,8192 \
    --policies attend-deviate,vismemo,cacheblend --repeats 3 --new-tokens 32 --long-tokens 256 \
    --dtype bfloat16 --device cuda --out "$out"
