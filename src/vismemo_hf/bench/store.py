"""``vismemo bench store``: sparse vs full I/O, disk throughput, exact-priority vs plain LRU, and
(``--remote redis://...``) the shared Redis tier's full and sparse reads next to the local disk tier's.

No model is needed: entries are random tensors with a real model's K/V geometry.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vismemo_hf.bench.report import header, machine
from vismemo_hf.progress import progress as progress_bar
from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.remote import safe_url
from vismemo_hf.store.store import VisMemoStore


def synthetic_entry(key: str, n_tokens: int, layers: int, heads: int, head_dim: int, embed_dim: int,
                    dtype=torch.bfloat16, seed: int = 0) -> Entry:
    g = torch.Generator().manual_seed(seed)
    return Entry(key=key, fingerprint="bench", grid=(1, 2, 2 * n_tokens),
                 embeds=torch.randn(n_tokens, embed_dim, generator=g).to(dtype), deepstack=None,
                 descriptors=torch.nn.functional.normalize(torch.randn(4, embed_dim, generator=g), dim=-1),
                 entropy=torch.rand(n_tokens, generator=g),
                 kv=torch.randn(n_tokens, layers, 2, heads, head_dim, generator=g).to(dtype), offset=0,
                 patch_hashes=torch.arange(n_tokens))


#: the secret of the benchmark's sealed stores (docs/METHOD.md §5)
BENCH_SECRET = "vismemo bench store secret"


def sparse_io(geometry: dict, beta: float, warmup: int, tmp: Path, secret=None) -> list[dict]:
    """Bytes an approximate hit reads (host gather, disk ranges) vs the floor beta*(L-W)/L of the entry's K/V."""
    out = []
    entry = synthetic_entry("sparse", **geometry)
    assert entry.kv is not None  # synthetic entries always carry their K/V
    n, layers = geometry["n_tokens"], geometry["layers"]
    kv_bytes = entry.kv.numel() * entry.kv.element_size()
    blob_bytes = len(blob.encode(entry))
    tokens = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: math.ceil(beta * n)].sort().values
    for tier, kwargs in (("host", dict(device_bytes=0, host_bytes=None)),
                         ("disk", dict(device_bytes=0, host_bytes=0, disk_dir=tmp / f"sparse{bool(secret)}",
                                       disk_bytes=None))):
        store = VisMemoStore(**kwargs, secret=secret or False)
        store.put(entry)
        store.flush()
        t0 = time.perf_counter()
        store.get_tokens("sparse", "bench", tokens, warmup)
        ms = (time.perf_counter() - t0) * 1e3
        stats = store.stats()
        read = stats["bytes_read_sparse"]
        out.append({"tier": tier, "tokens_read": len(tokens), "bytes_read": read, "kv_bytes": kv_bytes,
                    "blob_bytes": blob_bytes, "read_over_kv": read / kv_bytes,
                    "floor": beta * (layers - warmup) / layers, "ms": ms,
                    "ranges": stats["tiers"]["disk"]["range_reads"] if tier == "disk" else None})
        store.close()
    return out


def host_throughput(geometry: dict, repeats: int, secret=None) -> dict:
    """Full-entry read through the host tier (checks + decode of a blob in RAM) vs a raw copy of the same bytes."""
    store = VisMemoStore(device_bytes=0, host_bytes=None, secret=secret or False)
    entry = synthetic_entry("full", **geometry)
    store.put(entry)
    assert store.host is not None  # host_bytes=None: an unbounded host tier
    _, data = store.host.lru["full"]
    tier_s, raw_s = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        store.host.full("full")
        tier_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        data.clone()
        raw_s.append(time.perf_counter() - t0)
    tier, raw = statistics.median(tier_s[1:]), statistics.median(raw_s[1:])
    size = data.numel()
    return {"bytes": size, "tier_GBps": size / tier / 1e9, "raw_GBps": size / raw / 1e9, "tier_over_raw": raw / tier,
            "tier_ms": tier * 1e3, "raw_ms": raw * 1e3}


def disk_throughput(geometry: dict, repeats: int, tmp: Path, secret=None) -> dict:
    """Full-entry read through the disk tier (parse + checks + decode) vs a raw sequential read of the same file."""
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp / f"throughput{bool(secret)}", disk_bytes=None,
                         secret=secret or False)
    entry = synthetic_entry("full", **geometry)
    assert entry.kv is not None  # synthetic entries always carry their K/V
    assert store.disk is not None  # disk_dir given: the store has a disk tier
    store.put(entry)
    store.flush()
    with store.disk.cache.get("full", read=True) as handle:
        path = handle.name
    size = os.path.getsize(path)
    tier_s, raw_s, stream_s = [], [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        store.disk.full("full")
        tier_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:  # the bytes into memory: a fresh buffer of the file's size
            f.readinto(torch.empty(size, dtype=torch.uint8).numpy().data)
        raw_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:  # the bytes streamed through one reused 16 MiB buffer (kept nowhere)
            while f.read(1 << 24):
                pass
        stream_s.append(time.perf_counter() - t0)
    payload = entry.kv.contiguous().view(torch.uint8).reshape(entry.n_tokens, entry.n_layers, -1)
    crc_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        blob.block_hashes(entry.kv)
        crc_s.append(time.perf_counter() - t0)
    store.close()
    tier, raw, stream = (statistics.median(x[1:]) for x in (tier_s, raw_s, stream_s))
    return {"bytes": size, "tier_GBps": size / tier / 1e9, "raw_GBps": size / raw / 1e9, "tier_over_raw": raw / tier,
            "tier_ms": tier * 1e3, "raw_ms": raw * 1e3, "stream_ms": stream * 1e3, "tier_over_stream": stream / tier,
            "crc_ms": statistics.median(crc_s) * 1e3, "kv_bytes": payload.numel()}


def _server_bytes(client, cluster: bool) -> int:
    """Bytes the server (every node of a cluster) has sent so far (``INFO stats``)."""
    if not cluster:
        return client.info("stats")["total_net_output_bytes"]
    return sum(v["total_net_output_bytes"] for v in client.info("stats", target_nodes=client.ALL_NODES).values())


def _raw_transfer(client, name: str, size: int, repeats: int) -> float:
    """GB/s of the blob's bytes moved by redis-py alone (8 MiB GETRANGEs, four per pipelined round trip, on one
    connection, kept nowhere): what this client and machine can move, before any check or copy."""
    from vismemo_hf.store.remote import READ_BATCH, READ_CHUNK

    spans = [(start, min(size, start + READ_CHUNK) - 1) for start in range(0, size, READ_CHUNK)]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for i in range(0, len(spans), READ_BATCH):
            pipe = client.pipeline(transaction=False)
            for start, end in spans[i : i + READ_BATCH]:
                pipe.getrange(name, start, end)
            pipe.execute()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times[1:]) / 1e9


def remote_vs_disk(geometry: dict, beta: float, warmup: int, repeats: int, urls: list[str], tmp: Path) -> list[dict]:
    """Median full read (an exact hit) and sparse read (an approximate hit) through a store whose only tier is
    the local disk, then, for each URL (one server or a cluster), one whose only tier is Redis; bytes counted by
    the client and by the server(s)."""
    import redis
    from redis.cluster import RedisCluster

    entry = synthetic_entry("remote-bench", **geometry)
    n = geometry["n_tokens"]
    tokens = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: math.ceil(beta * n)].sort().values
    prefix = f"vismemo-bench-{os.getpid()}"
    out = []
    setups: list[tuple[str, str | None, dict[str, Any]]] = [
        ("disk", None, dict(disk_dir=tmp / "remote-vs-disk", disk_bytes=None))]
    setups += [("remote", url, dict(remote_url=url, remote_options={"prefix": prefix, "timeout_s": 10.0}))
               for url in urls]
    for tier, url, kwargs in setups:
        store = VisMemoStore(device_bytes=0, host_bytes=0, **kwargs)
        store.put(entry)
        store.flush()
        if store.tier_of(entry.key) != tier:
            raise RuntimeError(f"the entry did not reach the {tier} tier (is {safe_url(url or '')} reachable?)")
        cluster = tier == "remote" and store.remote is not None and store.remote.link.is_cluster
        server = (RedisCluster if cluster else redis.Redis).from_url(url) if url else None
        row: dict[str, Any] = {"tier": tier if not url else f"remote ({'cluster' if cluster else 'one server'})",
               "url": safe_url(url) if url else None, "blob_bytes": len(blob.encode(entry)), "tokens_read": len(tokens)}
        for what, read in (("full", lambda s=store: s.get(entry.key, "bench")),
                           ("sparse", lambda s=store: s.get_tokens(entry.key, "bench", tokens, warmup))):
            times: list[float] = []
            sent: list[int] = []
            for _ in range(repeats + 1):
                before = _server_bytes(server, cluster) if server is not None else 0
                t0 = time.perf_counter()
                if read() is None:
                    raise RuntimeError(f"{what} read from the {tier} tier failed")
                times.append(time.perf_counter() - t0)
                if server is not None:
                    sent.append(_server_bytes(server, cluster) - before)
            row[f"{what}_ms"] = statistics.median(times[1:]) * 1e3
            if what == "full":
                row["full_GBps"] = row["blob_bytes"] / (row["full_ms"] / 1e3) / 1e9
            if server is not None:
                row[f"{what}_server_bytes"] = int(statistics.median(sent[1:]))
        if server is not None:
            assert store.remote is not None  # a server: the store's tier is the remote one
            row["client_limit_GBps"] = _raw_transfer(server, store.remote._blob_key(entry.key), row["blob_bytes"],
                                                     repeats)
        stats = store.stats()
        row["sparse_bytes"] = stats["bytes_read_sparse"] // (repeats + 1)
        if server is not None:
            row["client_bytes"] = stats["tiers"]["remote"]["bytes_read"]
            for key in server.scan_iter(f"{prefix}:*"):
                server.delete(key)
        out.append(row)
        store.close()
    return out


def synthetic_trace(n_requests: int, seed: int = 0, families: int = 60, variants: int = 4, repeat_p: float = 0.45,
                    variant_p: float = 0.35, zipf: float = 1.1) -> list[tuple[str, str]]:
    """(image, family base) requests: repeats of past images (Zipf-distributed by recency rank: long-tailed
    reuse intervals), near-duplicate variants of family bases, and new images."""
    rng = random.Random(seed)
    seen: list[str] = []
    trace = []
    weights = [1 / (r + 1) ** zipf for r in range(5000)]
    for i in range(n_requests):
        u = rng.random()
        if seen and u < repeat_p:
            rank = rng.choices(range(min(len(seen), 5000)), weights=weights[: min(len(seen), 5000)])[0]
            image = seen[-1 - rank]
        elif u < repeat_p + variant_p:
            fam = min(int(rng.paretovariate(1.2)) - 1, families - 1)
            image = f"f{fam}v{rng.randrange(variants)}"
        else:
            image = f"new{i}"
        trace.append((image, image.split("v")[0] + "v0" if image.startswith("f") else image))
        seen.append(image)
    return trace


def replay_into(store: VisMemoStore, trace) -> dict:
    """Replay a trace: exact hit if the image is stored, approximate hit if its family base is, else a miss
    that stores the image. Returns the hit rate by kind."""
    counts = {"exact": 0, "approximate": 0, "miss": 0}
    for image, base in trace:
        if store.get(image, "bench") is not None:
            counts["exact"] += 1
        elif base != image and store.get_tokens(base, "bench", torch.tensor([0]), 1) is not None:
            counts["approximate"] += 1
        else:
            counts["miss"] += 1
            store.put(_tiny_entry(image))
            store.flush()
    return {k: v / len(trace) for k, v in counts.items()}


def replay(trace, capacity_entries: int, protect: int, entry_bytes_of) -> dict:
    """Hit rates through a device-tier store of ``capacity_entries`` entries."""
    return replay_into(VisMemoStore(device_bytes=capacity_entries * entry_bytes_of, protect=protect), trace)


def _tiny_entry(key: str) -> Entry:
    return synthetic_entry(key, n_tokens=4, layers=2, heads=1, head_dim=4, embed_dim=4, dtype=torch.float32)


def run(args) -> dict:
    if args.warmup >= args.layers:
        raise ValueError(f"--warmup ({args.warmup}) must be below --layers ({args.layers}): a sparse read starts after "
                         "the warmup layers")
    geometry = dict(n_tokens=args.tokens, layers=args.layers, heads=args.kv_heads, head_dim=args.head_dim,
                    embed_dim=args.embed_dim)
    capacities = [int(c) for c in args.capacities.split(",")]
    bar = progress_bar(total=6 + bool(args.remote) + 2 * len(capacities), desc="store", unit="step")

    def step(what: str, measure, *arguments):
        bar.set_postfix_str(what)
        result = measure(*arguments)
        bar.update(1)
        return result

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sparse = step("sparse I/O", sparse_io, geometry, args.beta, args.warmup, tmp)
        throughput = step("disk throughput", disk_throughput, geometry, args.repeats, tmp)
        host = step("host throughput", host_throughput, geometry, args.repeats)
        sealed = {"sparse_io": step("sealed sparse I/O", sparse_io, geometry, args.beta, args.warmup, tmp, BENCH_SECRET),
                  "disk_throughput": step("sealed disk throughput", disk_throughput, geometry, args.repeats, tmp,
                                          BENCH_SECRET),
                  "host_throughput": step("sealed host throughput", host_throughput, geometry, args.repeats,
                                          BENCH_SECRET)}
        remote = step("remote tier", remote_vs_disk, geometry, args.beta, args.warmup, args.repeats, args.remote,
                      tmp) if args.remote else None
    trace = synthetic_trace(args.trace_requests, seed=args.seed)
    size = _tiny_entry("x").nbytes
    lru = {}
    for capacity in capacities:
        lru[capacity] = {"plain": step(f"trace at {capacity}, plain LRU", replay, trace, capacity, 0, size),
                         "exact_priority": step(f"trace at {capacity}, exact priority", replay, trace, capacity, 2,
                                                size)}
    bar.close()
    return {"geometry": geometry, "beta": args.beta, "warmup_layers": args.warmup, "sparse_io": sparse,
            "disk_throughput": throughput, "host_throughput": host, "sealed": sealed, "remote": remote,
            "trace_requests": len(trace), "lru": lru}


def _sealed_lines(result: dict, args) -> list[str]:
    plain, sealed = result, result["sealed"]
    lines = ["## Sealed blobs (a store secret) vs unsealed", "",
             "| read | unsealed GB/s | sealed GB/s | raw GB/s | unsealed / raw | sealed / raw |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, key in (("disk tier, full", "disk_throughput"), ("host tier, full", "host_throughput")):
        a, b = plain[key], sealed[key]
        lines.append(f"| {name} | {a['tier_GBps']:.2f} | {b['tier_GBps']:.2f} | {b['raw_GBps']:.2f} | "
                     f"{a['tier_over_raw']:.2f} | {b['tier_over_raw']:.2f} |")
    for a, b in zip(plain["sparse_io"], sealed["sparse_io"]):
        lines.append(f"| {a['tier']} tier, sparse ({a['tokens_read']} tokens) | {a['bytes_read'] / a['ms'] / 1e6:.2f} | "
                     f"{b['bytes_read'] / b['ms'] / 1e6:.2f} | - | - | - |")
    lines += ["", "Sealed: the header's HMAC-SHA256, then AES-GMAC tags in place of the CRC-32C checks (docs/METHOD.md "
              "§5): a full read checks the whole K/V region's tag in one pass, a sparse read the tag of every "
              "(token, layer) block it read. Raw: the same bytes read without any "
              f"check (disk: into a fresh buffer; host: a copy). Medians of {args.repeats} after one warm-up."]
    return lines


def main(args) -> int:
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = (f"vismemo bench store --tokens {args.tokens} --layers {args.layers} --kv-heads {args.kv_heads} "
               f"--head-dim {args.head_dim} --embed-dim {args.embed_dim} --beta {args.beta} --warmup {args.warmup} "
               f"--repeats {args.repeats} --trace-requests {args.trace_requests} --capacities {args.capacities} "
               f"--seed {args.seed}" + "".join(f" --remote {safe_url(url)}" for url in args.remote or []))
    mach = machine(note="disk: the working tree's filesystem")
    result.update(command=command, machine=mach)
    (out / "store.json").write_text(json.dumps(result, indent=2))
    g = result["geometry"]
    lines = header("Store benchmark", command, mach) + [
             f"Entry geometry: {g['n_tokens']} visual tokens x {g['layers']} layers x {g['heads']} KV heads x "
             f"{g['head_dim']} head dim, bf16 (the K/V of Qwen3-VL-8B at this visual length), random values.", "",
             f"## Sparse I/O of an approximate hit (beta = {args.beta}, W = {args.warmup})", "",
             "| tier | tokens read | bytes read | entry K/V bytes | read / K/V | floor beta(L-W)/L | byte ranges | ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["sparse_io"]:
        lines.append(f"| {r['tier']} | {r['tokens_read']} | {r['bytes_read']:,} | {r['kv_bytes']:,} | "
                     f"{r['read_over_kv']:.4f} | {r['floor']:.4f} | {r['ranges'] if r['ranges'] is not None else '-'} | "
                     f"{r['ms']:.1f} |")
    lines += ["", "The excess over the floor is the 8-byte integrity hash stored with each layer of each token.", "",
              "## Full-entry reads vs a raw read of the same bytes", ""]
    t, h = result["disk_throughput"], result["host_throughput"]
    lines += [f"{t['bytes']:,} bytes. Disk tier {t['tier_GBps']:.2f} GB/s ({t['tier_ms']:.0f} ms: read into a fresh "
              f"buffer, header, metadata digest and per-block CRC-32C checks, decode without copies) against a raw "
              f"read of the file into a fresh buffer {t['raw_GBps']:.2f} GB/s ({t['raw_ms']:.0f} ms): tier / raw = "
              f"{t['tier_over_raw']:.2f}; streaming the file through one reused 16 MiB buffer, which keeps nothing, "
              f"takes {t['stream_ms']:.0f} ms (tier / stream = {t['tier_over_stream']:.2f}). The CRC-32C of the "
              f"K/V alone takes {t['crc_ms']:.0f} ms. "
              f"Host tier {h['tier_GBps']:.2f} GB/s ({h['tier_ms']:.0f} ms: checks and decode of the blob in RAM) "
              f"against a raw copy of it {h['raw_GBps']:.2f} GB/s ({h['raw_ms']:.0f} ms): tier / raw = "
              f"{h['tier_over_raw']:.2f}. Medians of {args.repeats} after one warm-up; the file stays in the page "
              "cache (not dropped: no privilege), so the disk rows compare CPU costs, not the disk.", "",
              *_sealed_lines(result, args), "",
              f"## Exact-priority LRU vs plain LRU ({result['trace_requests']} synthetic requests)", "",
              "| capacity (entries) | policy | exact | approximate | miss |", "| --- | --- | --- | --- | --- |"]
    for cap, both in result["lru"].items():
        for name, rates in both.items():
            lines.append(f"| {cap} | {name} | {rates['exact']:.3f} | {rates['approximate']:.3f} | {rates['miss']:.3f} |")
    lines += ["", "## Shared remote tier (Redis) vs local disk tier", ""]
    if result["remote"] is None:
        lines.append("Not run (no `--remote URL`).")
    else:
        lines += ["| tier | full read ms | full read GB/s | redis-py alone GB/s | sparse read ms | sparse K/V bytes | "
                  "bytes the server sent: sparse | bytes the server sent: full | blob bytes |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["remote"]:
            sent = [f"{r[k]:,}" if k in r else "-" for k in ("sparse_server_bytes", "full_server_bytes")]
            limit = f"{r['client_limit_GBps']:.2f}" if "client_limit_GBps" in r else "-"
            lines.append(f"| {r['tier']} | {r['full_ms']:.1f} | {r['full_GBps']:.2f} | {limit} | {r['sparse_ms']:.1f} | "
                         f"{r['sparse_bytes']:,} | {sent[0]} | {sent[1]} | {r['blob_bytes']:,} |")
        lines += ["", f"Median of {args.repeats} after one warm-up; sparse = {result['remote'][0]['tokens_read']} "
                  f"tokens (beta = {args.beta}) at layers >= {args.warmup}: one GETRANGE for the header, then one "
                  "pipelined round trip of one GETRANGE per token. Bytes the server sent: growth of "
                  "`total_net_output_bytes` in Redis `INFO stats` (includes RESP framing and the INFO reply that "
                  "reads it). Full reads (the header, then 8 MiB GETRANGEs, four per pipelined round trip, on up to "
                  "four connections at once, into one buffer) include the checksum checks and the decode; `redis-py "
                  "alone`: the same GETRANGEs on one connection with nothing done to their bytes, the client's and "
                  "this machine's limit (server, client and every node share its cores)."]
    lines += ["", "Trace: `synthetic_trace` in `vismemo_hf/bench/store.py` (repeats by Zipf recency rank, "
              "near-duplicate variants of Pareto-popular families, new images)."]
    (out / "store.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
