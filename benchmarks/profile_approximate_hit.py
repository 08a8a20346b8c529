"""cProfile of one approximate hit (default routing, or --policy; --exact: an exact hit) on the latency bench's
default preset.

    python benchmarks/profile_approximate_hit.py --tokens 2048 --threads 1

Prints the stage timings of the profiled prefill, the share of its time spent in SDPA and the
functions with the most own time. Used to find where an approximate hit's time goes.
"""

import argparse
import cProfile
import pstats

import torch

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.latency import any_size, page_pair, request_inputs, timed_prefill
from vismemo_hf.eval.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-vl-8b-narrow")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--policy", default=None, help="routing of the hit (default: VisMemoCache's)")
    parser.add_argument("--exact", action="store_true", help="profile an exact hit (the stored page itself)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, processor = load_model(args.preset)
    enable(model)
    patch = model.config.vision_config.patch_size
    any_size(processor, model)
    base, edited = page_pair(args.tokens, patch)
    store = VisMemoStore()
    timed_prefill(model, request_inputs(processor, base), VisMemoCache(store=store))  # the alias entry
    edit_in = request_inputs(processor, base if args.exact else edited)
    routing = {"policy": args.policy} if args.policy else {}
    timed_prefill(model, edit_in, VisMemoCache(store=store, store_misses=False, **routing))  # warm-up
    profile = cProfile.Profile()
    profile.enable()
    out = timed_prefill(model, edit_in, VisMemoCache(store=store, store_misses=False, **routing))
    profile.disable()
    stats = pstats.Stats(profile)
    total = stats.total_tt
    sdpa = sum(v[2] for k, v in stats.stats.items() if k[2] == "<built-in method torch._C._nn.scaled_dot_product_attention>")
    print(f"{out['kind']} hit, {out['n_tokens']} visual tokens, R/B/M {out['recomputed']}/{out['reused']}/{out['masked']}")
    print("stages (ms):", {k: round(v, 1) for k, v in out["timings"].items()})
    print(f"profiled {total:.2f} s, SDPA {sdpa:.2f} s ({sdpa / total:.0%})")
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
