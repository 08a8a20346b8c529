"""``vismemo`` command line: ``vismemo demo`` runs the embedded default end to end."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings


def _demo_requests():
    from . import synthetic

    base = synthetic.page(1)
    return [
        ("base page", base, "What is the value of the first row?"),
        ("same page, other question", base, "Which key is in the last row?"),
        ("edited copy", synthetic.edited(1, row=2, value="9999"), "What is the value of the third row?"),
        ("shifted copy", synthetic.shifted(base, 3), "What is the value of the first row?"),
        ("unrelated page", synthetic.chart(4), "Which bar is the tallest?"),
    ]


def demo(args) -> int:
    import torch

    from . import VisMemoCache, VisMemoStore, enable
    from .testing import tiny_model

    torch.manual_seed(0)
    model, processor = tiny_model(args.family, seed=args.seed)
    enable(model)
    store = VisMemoStore()
    rows = []
    for name, image, question in _demo_requests():
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        cache = VisMemoCache(store=store, policy=args.policy)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=args.new_tokens, do_sample=False)
        total_ms = (time.perf_counter() - t0) * 1e3
        (event,) = cache.events
        answer = out[0, inputs["input_ids"].shape[1]:].tolist()
        rows.append({
            "request": name,
            "kind": str(event.kind),
            "alias": event.alias[:8] if event.alias else "-",
            "R": event.recomputed,
            "B": event.reused,
            "M": event.masked,
            "N": event.n_tokens,
            "prefill_ms": round(event.timings["prefill"], 1),
            "generate_ms": round(total_ms, 1),
            "answer_tokens": answer,
        })
    if args.json:
        print(json.dumps({"family": args.family, "requests": rows, "store": store.stats()}, indent=2))
        return 0
    print(f"vismemo demo: tiny random {args.family} model (CPU, fp32), policy {args.policy!r}; "
          "answers are token ids of an untrained model")
    header = f"{'request':<27} {'hit':<12} {'alias':<9} {'R/B/M of N':<13} {'prefill ms':>10}  answer tokens"
    print(header)
    print("-" * len(header))
    for r in rows:
        rbm = f"{r['R']}/{r['B']}/{r['M']} of {r['N']}"
        print(f"{r['request']:<27} {r['kind']:<12} {r['alias']:<9} {rbm:<13} {r['prefill_ms']:>10.1f}  {r['answer_tokens']}")
    s = store.stats()
    print(f"store: {s['entries']} entries, {s['bytes'] / 1024:.0f} KiB; hits {s['hits']}")
    return 0


def profile_vlcache(args) -> int:
    from pathlib import Path

    import yaml

    from .calibrate import layer_sensitivity
    from .models import load_model
    from .presets import config_dir

    model, processor = load_model(args.model, args.family)
    sensitivity = layer_sensitivity(model, processor, pairs=args.pairs, seed=args.seed)
    name = args.name or f"{Path(args.model).name}-{model.config.model_type}"
    out = Path(args.out) if args.out else config_dir() / "vlcache" / f"{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "vismemo profile-vlcache " + " ".join(sys.argv[2:]) if args.record_argv else None
    data = {
        "model": args.model,
        "family": model.config.model_type,
        "layers": len(sensitivity),
        "pairs": args.pairs,
        "command": command,
        "sensitivity": [round(x, 8) for x in sensitivity],
    }
    out.write_text("# VL-Cache layer-sensitivity profile (relative K/V deviation of reuse per layer)\n"
                   + yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {out} ({len(sensitivity)} layers)")
    return 0


def _bench(name: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(f"vismemo_hf.bench.{name}").main(args)

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vismemo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run five document requests through a tiny model (no downloads, no GPU)")
    p.add_argument("--family", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    p.add_argument("--policy", default="vismemo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=demo)
    p = sub.add_parser("profile-vlcache", help="compute VL-Cache's per-layer sensitivity profile on calibration pairs")
    p.add_argument("--model", default="tiny", help="a preset of configs/models/ (random weights) or a checkpoint folder")
    p.add_argument("--family", default=None, help="family for family-agnostic presets (default qwen2_vl)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="profile name (default MODEL-FAMILY)")
    p.add_argument("--out", default=None, help="output YAML (default configs/vlcache/NAME.yaml)")
    p.set_defaults(func=profile_vlcache, record_argv=argv is None)
    bench = sub.add_parser("bench", help="benchmarks (reports under results/)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    p = bench_sub.add_parser("compression", help="decoding KV bytes and decode time vs VL-Cache ratio")
    p.add_argument("--preset", default="medium")
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--ratios", default="0.1,0.25,0.5,1.0")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=448)
    p.add_argument("--height", type=int, default=336)
    p.add_argument("--out", default="results/compression")
    p.set_defaults(func=_bench("compression"))
    p = bench_sub.add_parser("store", help="sparse vs full I/O, disk throughput, exact-priority vs plain LRU")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--embed-dim", type=int, default=4096)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trace-requests", type=int, default=4000)
    p.add_argument("--capacities", default="25,50,100,200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/store")
    p.set_defaults(func=_bench("store"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' past_key_values rename notice
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
