"""Query-key pairs a prefill's SDPA calls compute, and how fast, for a miss and for an approximate hit.

    python benchmarks/attention_efficiency.py --tokens 4096 [--policy attend-deviate]

Wraps the SDPA call the attention function makes, on the latency bench's default preset, and prints for each
prefill: its time, the time and number of SDPA calls, the query-key pairs they computed (a causal call counts
half its square) and the pairs their masks let through, and pairs per millisecond. Used to explain why an
approximate hit costs more than its FLOP floor (``results/perf/README.md``).
"""

import argparse
import time

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.latency import any_size, page_pair, request_inputs, timed_prefill
from vismemo_hf.eval.loading import load_model
from vismemo_hf.runtime import attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-vl-8b-narrow")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--policy", default=None, help="routing of the hit (default: VisMemoCache's)")
    args = parser.parse_args()
    model, processor = load_model(args.preset)
    enable(model)
    patch = model.config.vision_config.patch_size
    any_size(processor, model)
    base, edited = page_pair(args.tokens, patch)
    miss_in, edit_in = request_inputs(processor, base), request_inputs(processor, edited)
    store = VisMemoStore()
    timed_prefill(model, miss_in, VisMemoCache(store=store))  # the alias entry
    routing = {"policy": args.policy} if args.policy else {}
    stats = dict(ms=0.0, computed=0.0, visible=0, calls=0)
    sdpa = attention.sdpa_attention_forward

    def counted(module, q, k, v, mask, **kwargs):
        t0 = time.perf_counter()
        out = sdpa(module, q, k, v, mask, **kwargs)
        stats["ms"] += (time.perf_counter() - t0) * 1e3
        causal = mask is None and q.shape[2] == k.shape[2]
        stats["computed"] += q.shape[2] * k.shape[2] * (0.5 if causal else 1.0)
        stats["visible"] += int(mask.sum()) if mask is not None else q.shape[2] * (q.shape[2] + 1) // 2
        stats["calls"] += 1
        return out

    attention.sdpa_attention_forward = counted
    try:
        for name, inputs, opts in (("miss", miss_in, {}), ("approximate hit", edit_in, routing)):
            timed_prefill(model, inputs, VisMemoCache(store=VisMemoStore() if name == "miss" else store,
                                                      store_misses=False, **opts))  # warm-up
            stats.update(ms=0.0, computed=0.0, visible=0, calls=0)
            out = timed_prefill(model, inputs, VisMemoCache(store=VisMemoStore() if name == "miss" else store,
                                                            store_misses=False, **opts))
            print(f"{name}: prefill {out['timings']['prefill']:.0f} ms, SDPA {stats['ms']:.0f} ms in {stats['calls']} "
                  f"calls, pairs computed {stats['computed']:.3g}, visible {stats['visible']:.3g}, "
                  f"{stats['computed'] / stats['ms'] / 1e3:.1f}k pairs/ms")
    finally:
        attention.sdpa_attention_forward = sdpa


if __name__ == "__main__":
    main()
