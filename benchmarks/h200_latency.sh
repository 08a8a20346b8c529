#!/usr/bin/env bash
# The GPU benchmarks (prepared for a lent H200), each against plain transformers on a never-enabled copy of the
# same random bf16 weights, at Qwen3-VL-8B's geometry:
#   0. vismemo bench workload: streams as users send them (a chat, mixed single-image traffic, an agent keeping two
#      screenshots), back to back with one store, 1,024 visual tokens an image: gpu/workload;
#   1. vismemo bench latency: TTFT (with its stages, fetch_wait among them), decoding step and whole generate at 32
#      and 128 new tokens, 1K and 4K visual tokens, with the TTFT floors (encoder included) of every kind; the
#      stores keep decoded entries in host memory (the default);
#   2. the same for the default routing with the stores' entries on the GPU (--store-device model): gpu/store-on-gpu,
#      and on the disk tier alone (--store-device disk; fetch_wait of a read from disk): gpu/store-on-disk;
#   3. vismemo bench overhead: host syncs per kind at 4 and 36 layers (also CUDA's own count and its callers), fixed
#      cost per layer, share of a hit's prefill outside the kernels: gpu/overhead.
# Writes under the folder given as $1 (default results/perf/gpu). Each step has its own time limit (LATENCY_S,
# STORE_S, DISK_S, OVERHEAD_S seconds) so that one that runs long leaves the others theirs; the latency reports are
# rewritten after each length, so a step cut short keeps the lengths it finished. At most the five limits (9.1
# minutes) plus the model builds. PRESET, DTYPE, DEVICE, LENGTHS (latency and overhead), DISK_LENGTH, LAYERS,
# WORKLOAD_MODEL and WORKLOAD_STREAMS override the defaults (tests/test_gpu_script.py runs the same steps on the CPU
# with the tiny preset).
set -uo pipefail
out=${1:-results/perf/gpu}
py=${PYTHON:-python3}
if ! "$py" -c "import vismemo_hf" 2>/dev/null; then
  "$py" -m pip install -q -e . || { echo "vismemo_hf is not importable and could not be installed"; exit 1; }
fi
"$py" -c "import torch, transformers, vismemo_hf; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
common=(--preset "${PRESET:-qwen3-vl-8b}" --dtype "${DTYPE:-bfloat16}" --device "${DEVICE:-cuda}")
lengths=${LENGTHS:-1024,4096}
timeout "${WORKLOAD_S:-150}" "$py" -m vismemo_hf.cli -q bench workload --models "${WORKLOAD_MODEL:-qwen3-vl-8b}" \
    --streams "${WORKLOAD_STREAMS:-chat,mixed,agent-2}" --rounds 1 --dtype "${DTYPE:-bfloat16}" \
    --device "${DEVICE:-cuda}" --out "$out/workload" || echo "bench workload stopped (status $?)"
timeout "${LATENCY_S:-190}" "$py" -m vismemo_hf.cli -q bench latency "${common[@]}" --lengths "$lengths" \
    --policies attend-deviate,vismemo,cacheblend --repeats 2 --new-tokens 32 --long-tokens 128 --unstored-miss --out "$out" \
    || echo "bench latency stopped (status $?)"
timeout "${STORE_S:-90}" "$py" -m vismemo_hf.cli -q bench latency "${common[@]}" --lengths "$lengths" \
    --policies attend-deviate --repeats 2 --new-tokens 32 --long-tokens 0 --store-device model \
    --out "$out/store-on-gpu" || echo "bench latency (store on the GPU) stopped (status $?)"
timeout "${DISK_S:-60}" "$py" -m vismemo_hf.cli -q bench latency "${common[@]}" --lengths "${DISK_LENGTH:-4096}" \
    --policies attend-deviate --repeats 1 --new-tokens 8 --long-tokens 0 --store-device disk \
    --out "$out/store-on-disk" || echo "bench latency (store on disk) stopped (status $?)"
timeout "${OVERHEAD_S:-100}" "$py" -m vismemo_hf.cli -q bench overhead "${common[@]}" --layers "${LAYERS:-4,36}" \
    --lengths "$lengths" --policies attend-deviate --repeats 3 --out "$out/overhead" \
    || echo "bench overhead stopped (status $?)"
