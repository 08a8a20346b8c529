"""What an exact hit waits for before its lookup can read the store: the exact key of its image's pixel values
(``core.features.exact_key``: BLAKE3 of every byte, on up to 8 threads for large images), against SHA-256 of the same
bytes on one thread and chunked on the same threads (the key's hash before BLAKE3), at Qwen-VL's row layout (3 x 2 x
16 x 16 values a patch, four patches a visual token) in float32 and bf16.

    python benchmarks/exact_key.py --tokens 256,1024,4096 --repeats 21

Writes results/perf/exact-key.md.
"""

import argparse
import hashlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import blake3
import torch

from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.core import features


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sha256_chunks(data: memoryview, pool: ThreadPoolExecutor, chunk: int = 4 << 20) -> bytes:
    h = hashlib.sha256()
    for digest in pool.map(lambda c: hashlib.sha256(c).digest(), [data[i: i + chunk] for i in range(0, len(data), chunk)]):
        h.update(digest)
    return h.digest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1024,4096", help="visual tokens per image (4 patch rows each)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="results/perf/exact-key.md")
    args = parser.parse_args()
    threads = features._threads()
    pool = ThreadPoolExecutor(threads)
    lines = header("The exact key's hash", "python benchmarks/exact_key.py " + " ".join(sys.argv[1:]), machine()) + [
        f"Median of {args.repeats} runs, ms; random pixel values, {threads} threads where a column says threads. "
        "`exact_key`: the library's key (BLAKE3, on the threads from `PARALLEL_BYTES` on); BLAKE3 alone on one "
        "thread and on the threads (a pool started per hasher); SHA-256 on one thread, and of 4 MB chunks on the "
        "same threads (how the key hashed every byte before BLAKE3; Qwen-VL's and GLM-4V's images then had only the "
        "first of each row's two frames hashed, half the bytes, once the repeats were compared).", "",
        "| visual tokens | dtype | MB | exact_key (BLAKE3) | BLAKE3, 1 thread | BLAKE3, threads | SHA-256, 1 thread | "
        "SHA-256, chunks on threads |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for dtype in (torch.float32, torch.bfloat16):
            pixels = torch.randn(4 * tokens, 3 * 2 * 16 * 16).to(dtype)
            data = memoryview(pixels.reshape(-1).view(torch.uint8).numpy())
            grid = (1, 2 * tokens, 2)
            key = median_ms(lambda p=pixels, g=grid: features.exact_key("fingerprint", p, g), args.repeats)
            single = median_ms(lambda d=data: blake3.blake3(d, max_threads=1).digest(), args.repeats)
            several = median_ms(lambda d=data: blake3.blake3(d, max_threads=threads).digest(), args.repeats)
            one = median_ms(lambda d=data: hashlib.sha256(d).digest(), args.repeats)
            chunked = median_ms(lambda d=data: sha256_chunks(d, pool), args.repeats)
            lines.append(f"| {tokens:,} | {str(dtype).removeprefix('torch.')} | {len(data) / 1e6:.1f} | {key:.2f} | "
                         f"{single:.2f} | {several:.2f} | {one:.1f} | {chunked:.1f} |")
    write(lines + [""], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
