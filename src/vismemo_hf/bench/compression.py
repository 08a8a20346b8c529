"""``vismemo bench compression``: decoding KV size and per-token decode time vs VL-Cache ratio."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from vismemo_hf import VisMemoCache, VisMemoStore, VLCacheCompression, enable
from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.eval import synthetic
from vismemo_hf.eval.loading import load_model
from vismemo_hf.progress import progress as progress_bar


def _kv_bytes(cache) -> int:
    return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)


def run(preset: str, family: str, ratios: list[float], new_tokens: int, repeats: int, size: tuple[int, int]):
    torch.manual_seed(0)
    model, processor = load_model(preset, family)
    enable(model)
    image = synthetic.page(1, size=size)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Read the form."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    n_visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    records = []
    bar = progress_bar(total=len(ratios) * (repeats + 1), desc="compression", unit="run")
    for ratio in ratios:
        times, size_bytes = [], None
        bar.set_postfix_str(f"ratio {ratio}")
        for _ in range(repeats + 1):  # first run warms up
            bar.update(1)
            compress = VLCacheCompression(ratio) if ratio < 1.0 else None
            cache = VisMemoCache(store=VisMemoStore(), policy="full", compress=compress)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                               min_new_tokens=new_tokens)
            total = (time.perf_counter() - t0) * 1e3
            prefill = cache.events[0].timings["prefill"]
            times.append((total - prefill) / (new_tokens - 1))
            size_bytes = _kv_bytes(cache)
        records.append({"ratio": ratio, "kv_bytes_after_generate": size_bytes,
                        "decode_ms_per_token": statistics.median(times[1:])})
    bar.close()
    return {"preset": preset, "family": family, "visual_tokens": n_visual, "prompt_tokens": inputs["input_ids"].shape[1],
            "new_tokens": new_tokens, "repeats": repeats, "records": records}


def main(args) -> int:
    ratios = [float(x) for x in args.ratios.split(",")]
    result = run(args.preset, args.family, ratios, args.new_tokens, args.repeats, (args.width, args.height))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench compression", args, ["preset", "family", "ratios", "new_tokens", "repeats",
                                                          "width", "height"])
    mach = machine()
    result.update(command=command, machine=mach)
    (out / "compression.json").write_text(json.dumps(result, indent=2))
    full = result["records"][-1]
    lines = header("VL-Cache compression: decoding KV and decode time vs ratio", command, mach)[:-1] + [
        f"Model: `{args.preset}` {args.family}, random weights, fp32; {result['visual_tokens']} visual of "
        f"{result['prompt_tokens']} prompt tokens; {args.new_tokens} greedy tokens; median of {args.repeats} runs "
        "after one warm-up; policy `full` (no reuse), so only compression differs.", "",
        "| ratio | KV bytes after generate | vs ratio 1.0 | decode ms / token |", "| --- | --- | --- | --- |",
    ]
    for r in result["records"]:
        lines.append(f"| {r['ratio']:.2f} | {r['kv_bytes_after_generate']:,} | "
                     f"{r['kv_bytes_after_generate'] / full['kv_bytes_after_generate']:.3f} | "
                     f"{r['decode_ms_per_token']:.2f} |")
    lines += ["", "The dropped slots are removed from each layer (not masked), so the KV shrinks; decode time on a "
              "CPU at this size is dominated by per-token Python and weight reads, not attention over the cache."]
    (out / "compression.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
