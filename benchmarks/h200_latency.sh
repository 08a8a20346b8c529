#!/usr/bin/env bash
# The GPU benchmarks (prepared for a lent H200), each against plain transformers on a never-enabled copy of the
# same random bf16 weights, at Qwen3-VL-8B's geometry:
#   1. vismemo bench overhead: host syncs per kind at 4 and 36 layers (also CUDA's own count), fixed cost per layer,
#      share of a hit's prefill outside the kernels;
#   2. vismemo bench latency: TTFT (with its stages, fetch_wait among them), decoding step and whole generate at 32
#      and 256 new tokens, 1K-8K visual tokens, with the TTFT floors (encoder included) of every kind.
# Writes overhead/ and latency.* under the folder given as $1 (default results/perf/gpu); about 7 minutes.
set -euo pipefail
out=${1:-results/perf/gpu}
python -m pip install -q -e . >/dev/null 2>&1 || pip install -q -e .
python -m vismemo_hf.cli -q bench overhead --preset qwen3-vl-8b --layers 4,36 --lengths 1024,4096 \
    --policies attend-deviate --repeats 3 --dtype bfloat16 --device cuda --out "$out/overhead"
python -m vismemo_hf.cli -q bench latency --preset qwen3-vl-8b --lengths 1024,2048,4096,8192 \
    --policies attend-deviate,vismemo,cacheblend --repeats 3 --new-tokens 32 --long-tokens 256 \
    --dtype bfloat16 --device cuda --out "$out"
