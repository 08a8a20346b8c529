"""``vismemo bench lookup``: coarse-lookup latency, memory and recall against 10^3..10^6 stored entries.

Descriptors are synthetic but shaped like a real tower's: per region a large shared model
component (anisotropy), one of 16 page templates, the page's own content, and per stored copy
a noise whose size varies by copy and region, so that pages come in clusters of 4 near-duplicates whose centred
cosines straddle ``tau``, among unrelated pages. Entries are generated and indexed in chunks
(10^6 x 4 x 4,096 fp32 would be 64 GB). Recall is measured against the exact rule (all four
full-width centred cosines > tau, best mean first, top k) computed over every entry.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.progress import progress as progress_bar
from vismemo_hf.store.index import DescriptorIndex

logger = logging.getLogger(__name__)

CLUSTER = 4  # stored near-duplicate copies per page
TEMPLATES = 16
CHUNK_PAGES = 1024


class ClusteredDescriptors:
    """Deterministic region descriptors: page p, copy j -> normalize(model + template + content_p + noise_pj)."""

    def __init__(self, dim: int, seed: int = 0):
        self.dim, self.seed = dim, seed
        g = torch.Generator().manual_seed(seed)
        self.model = 2.0 * F.normalize(torch.randn(1, dim, generator=g), dim=-1)  # one direction every token shares
        self.templates = 0.6 * F.normalize(torch.randn(TEMPLATES, 4, dim, generator=g), dim=-1)

    def _content(self, chunk: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + chunk + 1)
        return F.normalize(torch.randn(CHUNK_PAGES, 4, self.dim, generator=g), dim=-1)

    def copies(self, pages: torch.Tensor, content: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """(len(pages), 4, dim) unit descriptors of one noisy copy of each page (noise size uniform in [0.15, 0.9])."""
        scale = 0.15 + 0.75 * torch.rand(len(pages), 4, 1, generator=g)
        noise = scale * F.normalize(torch.randn(len(pages), 4, self.dim, generator=g), dim=-1)
        return F.normalize(self.model + self.templates[pages % TEMPLATES] + content + noise, dim=-1)

    def chunk(self, chunk: int, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, descriptors) of the CLUSTER copies of the first ``n_pages`` pages of a chunk."""
        pages = torch.arange(chunk * CHUNK_PAGES, chunk * CHUNK_PAGES + n_pages).repeat_interleave(CLUSTER)
        content = self._content(chunk)[:n_pages].repeat_interleave(CLUSTER, dim=0)
        g = torch.Generator().manual_seed(self.seed * 104729 + chunk)
        return pages, self.copies(pages, content, g)

    def page(self, page: int, g: torch.Generator) -> torch.Tensor:
        """A fresh noisy copy of a stored page (a near-duplicate query)."""
        content = self._content(page // CHUNK_PAGES)[page % CHUNK_PAGES][None]
        return self.copies(torch.tensor([page]), content, g)[0]

    def unrelated(self, g: torch.Generator) -> torch.Tensor:
        """A page that is not stored, of one of the same templates."""
        content = F.normalize(torch.randn(1, 4, self.dim, generator=g), dim=-1)
        return self.copies(torch.randint(0, TEMPLATES, (1,), generator=g), content, g)[0]

    def reference_mean(self, count: int = 512) -> torch.Tensor:
        """The centring mean, as ``model_reference`` computes it: the mean descriptor of unrelated reference pages."""
        g = torch.Generator().manual_seed(self.seed + 99)
        return torch.stack([self.unrelated(g) for _ in range(count)]).mean((0, 1))


def _key(page: int, copy: int) -> str:
    """A 64-hex-digit key, as long as a real one (the index's key maps are part of its memory)."""
    return f"{page:056x}{copy:08x}"


def run_size(n: int, dim: int, queries: int, recall_queries: int, tau: float, top_k: int, groups: int,
             seed: int = 0, bar=None) -> dict:
    """One size's figures; ``bar``: a progress bar advanced once per chunk of entries indexed."""
    data = ClusteredDescriptors(dim, seed)
    mean = data.reference_mean()
    index = DescriptorIndex()
    index.set_center("fp", mean)
    g = torch.Generator().manual_seed(seed + 1)
    n_pages = max(1, n // CLUSTER)

    def near():
        page = int(torch.randint(0, n_pages, (1,), generator=g))
        return (1, 32, 32 + 2 * (page % groups)), data.page(page, g)

    def unrelated():
        return (1, 32, 32 + 2 * int(torch.randint(0, groups, (1,), generator=g))), data.unrelated(g)

    probes = [near() if q % 2 == 0 else unrelated() for q in range(queries)]  # timed: half unrelated pages
    recall_probes = [near() for _ in range(recall_queries)]  # only near-duplicates have exact answers
    centred_q = torch.stack([d for _, d in recall_probes]) - mean  # (Q, 4, dim)
    centred_q = F.normalize(centred_q, dim=-1)
    passing: list[dict[int, float]] = [{} for _ in recall_probes]  # exact rule: row -> mean cosine, per query
    probe_group = torch.tensor([(grid[2] - 32) // 2 for grid, _ in recall_probes])
    t_add, first = 0.0, 0
    for chunk in range((n_pages + CHUNK_PAGES - 1) // CHUNK_PAGES):
        pages, desc = data.chunk(chunk, min(CHUNK_PAGES, n_pages - chunk * CHUNK_PAGES))
        keys = [_key(p, j % CLUSTER) for j, p in enumerate(pages.tolist())]
        t0 = time.perf_counter()
        for grp in range(groups):
            sel = torch.nonzero(pages % groups == grp).flatten()
            if len(sel):
                index.add_many("fp", (1, 32, 32 + 2 * grp), [keys[i] for i in sel.tolist()], desc[sel])
        t_add += time.perf_counter() - t0
        cos = torch.einsum("qrd,nrd->qnr", centred_q, F.normalize(desc - mean, dim=-1))
        ok = (cos > tau).all(-1) & ((pages[None] % groups) == probe_group[:, None])
        for q, i in torch.nonzero(ok).tolist():
            passing[q][first + i] = float(cos[q, i].mean())
        first += len(pages)
        if bar is not None:
            bar.update(1)
    entries = len(index)
    key_of = [_key(p, c) for p in range(n_pages) for c in range(CLUSTER)]
    found = wanted = best_found = with_answers = 0
    for (grid, desc), rows in zip(recall_probes, passing):
        got = {k for k, _ in index.search("fp", grid, desc, tau, top_k)}
        want = [key_of[i] for i in sorted(rows, key=rows.__getitem__, reverse=True)[:top_k]]
        found += len(set(want) & got)
        wanted += len(want)
        if want:
            with_answers += 1
            best_found += want[0] in got
    for grid, desc in probes[:10]:  # warm-up
        index.search("fp", grid, desc, tau, top_k)
    times = []
    for grid, desc in probes[:queries]:
        t0 = time.perf_counter()
        index.search("fp", grid, desc, tau, top_k)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "entries": entries, "median_ms": statistics.median(times),
        "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))], "queries": queries,
        "index_bytes_per_entry": index.nbytes / entries, "add_us_per_entry": t_add / entries * 1e6,
        "recall": found / max(1, wanted), "best_recall": best_found / max(1, with_answers),
        "recall_queries": recall_queries, "exact_answers": wanted, "queries_with_answers": with_answers,
    }


def main(args) -> int:
    sizes = [int(float(x)) for x in args.sizes.split(",")]
    records = []
    chunks = sum((max(1, n // CLUSTER) + CHUNK_PAGES - 1) // CHUNK_PAGES for n in sizes)
    with progress_bar(total=chunks, desc="lookup", unit="chunk") as bar:
        for n in sizes:
            bar.set_postfix_str(f"{n:,} entries")
            records.append(run_size(n, args.dim, args.queries, args.recall_queries, args.tau, args.top_k, args.groups,
                                    bar=bar))
            r = records[-1]
            logger.info(f"{r['entries']:,} entries: median {r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
                        f"{r['index_bytes_per_entry']:.0f} B/entry, recall {r['recall']:.4f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench lookup", args, ["sizes", "dim", "queries", "recall_queries", "tau", "top_k",
                                                    "groups"])
    mach = machine()
    (out / "lookup.json").write_text(json.dumps({"command": command, "machine": mach, "records": records}, indent=2))
    lines = header("Coarse approximate lookup vs number of cached entries", command, mach) + [
        f"Descriptor index (`store/index.py`): 4 region descriptors of dimension {args.dim} per entry, centred by the "
        "reference mean, each projected to 128 dimensions and stored in fp16 in a faiss index (exhaustive below "
        "4,096 entries per grid, an inverted file above). Entries are spread over "
        f"{args.groups} grid(s) and come in clusters of {CLUSTER} near-duplicates among unrelated pages; half of the "
        "timed queries are fresh noisy copies of stored pages, half unrelated pages. Latency: one query, projection "
        "included, after 10 warm-up queries. Memory: faiss codes, ids and id map, and the Python key maps with their "
        "64-character keys, per entry. Recall: the share of "
        f"the exact rule's answers (all four full-width centred cosines > {args.tau}, top {args.top_k}) that the "
        f"index returns, over {args.recall_queries} near-duplicate queries; best: the share of queries whose best "
        "exact answer is returned.", "",
        "| entries | median ms | p99 ms | bytes / entry | recall | best recall | exact answers | add us / entry |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['entries']:,} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['index_bytes_per_entry']:.0f} | "
              f"{r['recall']:.4f} | {r['best_recall']:.4f} | {r['exact_answers']} | {r['add_us_per_entry']:.0f} |"
              for r in records]
    (out / "lookup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
