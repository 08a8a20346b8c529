"""The coarse lookup index (docs/METHOD.md §1, step 3) at the scale of a real store.

Descriptors of real towers are wide (4,096-d for Qwen3-VL-8B) and anisotropic: every image's
descriptors share a large model-specific component, so raw cosines of unrelated pages are high.
The index therefore keeps, per entry, each region descriptor *centred* by its model's reference
mean (``set_center``), randomly projected to ``region_dim`` dimensions (an orthonormal projection:
cosines are kept up to a small error) and normalised, the four regions side by side, in fp16:
``4 x region_dim x 2`` bytes (1 KiB at 128) instead of 64 KiB of fp32 descriptors.

Per (fingerprint, grid) a faiss index answers inner-product queries: exhaustive while the group is
small, an inverted file (IVF, trained on the group's own vectors and retrained as it grows) beyond
``ivf_from`` entries. The inner product of two such vectors is the sum of the four regional cosines;
the candidates it ranks first are then checked region by region against ``tau - margin``, the margin
covering the projection's error so that the exact rule's answers are kept (``vismemo bench lookup``
measures that recall). Entries of a model whose reference mean is not known yet wait, projected.
"""

from __future__ import annotations

import math
import sys

import faiss
import numpy as np
import torch

from vismemo_hf.core.features import projection

#: projected width of one region descriptor
REGION_DIM = 128
#: inverted lists of the largest IVF
MAX_LISTS = 1024


def projection_margin(dim: int, region_dim: int, tau: float) -> float:
    """How far below ``tau`` a projected cosine may fall for an exact pass: 4 standard deviations of the
    projection's error at ``tau`` (about (1 - tau^2) / sqrt(region_dim)); 0 when nothing is projected. What it
    lets through in excess, the lookup's exact check on the candidate's own descriptors rejects."""
    if dim <= region_dim:
        return 0.0
    return 4.0 * (1.0 - tau * tau) / math.sqrt(region_dim) + 1e-3


class _Group:
    """The entries of one (fingerprint, grid): a faiss index over their projected vectors, and the id <-> key maps."""

    def __init__(self, width: int, ivf_from: int, nprobe: int) -> None:
        self.width, self.ivf_from, self.nprobe = width, ivf_from, nprobe
        self.index = self._flat()
        self.trained_at = 0  # entries when the IVF was last trained (0: exhaustive)
        self.ids: dict[str, int] = {}
        self.keys: dict[int, str] = {}
        self._next = 0

    def _flat(self):
        return faiss.IndexIDMap2(faiss.IndexScalarQuantizer(self.width, faiss.ScalarQuantizer.QT_fp16,
                                                            faiss.METRIC_INNER_PRODUCT))

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, keys: list[str], vectors: np.ndarray) -> None:
        first = {k: i for i, k in reversed(list(enumerate(keys)))}  # a key given twice counts once
        fresh = [i for k, i in first.items() if k not in self.ids]
        if not fresh:
            return
        ids = np.arange(self._next, self._next + len(fresh), dtype=np.int64)
        self._next += len(fresh)
        for i, id_ in zip(fresh, ids.tolist()):
            self.ids[keys[i]] = id_
            self.keys[id_] = keys[i]
        self.index.add_with_ids(np.ascontiguousarray(vectors[fresh]), ids)
        if (len(self) >= self.ivf_from and not self.trained_at) or (
                0 < self.trained_at < MAX_LISTS**2 // 4 and len(self) >= 4 * self.trained_at):
            self._retrain()

    def remove(self, key: str) -> None:
        id_ = self.ids.pop(key)
        del self.keys[id_]
        self.index.remove_ids(np.array([id_], dtype=np.int64))

    def _retrain(self) -> None:
        """Rebuild as an IVF trained on the current vectors: about 2 sqrt(n) lists, retrained at every fourfold growth
        until the list count reaches ``MAX_LISTS`` (then lists just grow: a query still scans ``nprobe`` of them)."""
        ids = np.fromiter(self.keys, dtype=np.int64, count=len(self.keys))
        vectors = self.index.reconstruct_batch(ids)
        nlist = min(MAX_LISTS, int(2 * math.sqrt(len(ids))))
        ivf = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(self.width), self.width, nlist,
                                            faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        ivf.cp.min_points_per_centroid = 1  # quiet: a sample of 32 per list is enough here
        sample = np.random.default_rng(len(ids)).permutation(len(ids))[: 32 * nlist]
        ivf.train(vectors[sample])
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]  # faiss's own stubs omit DirectMap
        ivf.nprobe = self.nprobe
        ivf.add_with_ids(vectors, ids)
        self.index, self.trained_at = ivf, len(ids)

    def search(self, query: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, summed scores, reconstructed vectors) of the ``count`` best entries."""
        scores, ids = self.index.search(query[None], min(count, len(self)))
        keep = ids[0] >= 0
        ids, scores = ids[0][keep], scores[0][keep]
        vectors = self.index.reconstruct_batch(ids) if len(ids) else np.zeros((0, self.width), np.float32)
        return ids, scores, vectors

    @property
    def nbytes(self) -> int:
        """Bytes of the faiss index: fp16 codes and ids, and for an IVF its id -> list map (a hash table, about
        48 bytes per entry)."""
        return len(self) * (self.width * 2 + 8 + (48 if self.trained_at else 0))


class DescriptorIndex:
    """Coarse index over every stored entry: per (fingerprint, grid), entries whose four centred regional cosines
    all exceed ``tau`` (``search``). ``region_dim``: projected width of a region; ``ivf_from``: group size from
    which an inverted file replaces the exhaustive scan; ``nprobe``: lists an IVF query visits."""

    def __init__(self, region_dim: int = REGION_DIM, ivf_from: int = 4096, nprobe: int = 16) -> None:
        self.region_dim, self.ivf_from, self.nprobe = region_dim, ivf_from, nprobe
        self._centers: dict[str, torch.Tensor] = {}  # fingerprint -> full-width reference mean
        self._groups: dict[tuple, _Group] = {}
        self._pending: dict[str, dict[str, tuple[tuple, torch.Tensor]]] = {}  # no center yet: projected, raw
        self._where: dict[str, tuple] = {}

    @staticmethod
    def _group_key(fingerprint: str, grid) -> tuple:
        return fingerprint, tuple(int(g) for g in grid)

    # -- centring ----------------------------------------------------------------------------------
    def center(self, fingerprint: str) -> torch.Tensor | None:
        return self._centers.get(fingerprint)

    def set_center(self, fingerprint: str, mean: torch.Tensor) -> None:
        """The reference mean descriptor of a model; entries of that model waiting for it are indexed now. The
        first mean of a fingerprint stays (every process computes the same one)."""
        if fingerprint in self._centers:
            return
        self._centers[fingerprint] = mean.detach().float().cpu().reshape(-1)
        by_grid: dict[tuple, list] = {}
        for key, (grid, projected) in self._pending.pop(fingerprint, {}).items():
            by_grid.setdefault(grid, []).append((key, projected))
        for grid, items in by_grid.items():  # one batch per grid (a reopened store may hold many)
            self._insert(fingerprint, grid, [k for k, _ in items], torch.stack([p for _, p in items]))

    def _project(self, descriptors: torch.Tensor) -> torch.Tensor:
        """(..., 4, d) -> (..., 4, p) projected (not centred, not normalised)."""
        d = descriptors.shape[-1]
        return descriptors.float().cpu() @ projection(d, self.region_dim)

    def _vectors(self, fingerprint: str, projected: torch.Tensor) -> np.ndarray:
        """(n, 4, p) projected -> (n, 4p) centred, each region normalised: what faiss holds and is asked."""
        mean = self._centers[fingerprint]
        centered = projected - (mean @ projection(mean.shape[0], self.region_dim))
        unit = torch.nn.functional.normalize(centered, dim=-1)
        return unit.reshape(unit.shape[0], -1).numpy().astype(np.float32)

    # -- contents ----------------------------------------------------------------------------------
    def add(self, fingerprint: str, grid, key: str, descriptors: torch.Tensor) -> None:
        self.add_many(fingerprint, grid, [key], descriptors[None])

    def add_many(self, fingerprint: str, grid, keys: list[str], descriptors: torch.Tensor) -> None:
        """Index ``keys`` with their (n, 4, d) descriptors (a key already indexed is left as it is)."""
        grid = tuple(int(g) for g in grid)
        projected = self._project(descriptors)
        if fingerprint not in self._centers:
            waiting = self._pending.setdefault(fingerprint, {})
            for key, row in zip(keys, projected):
                if key not in self._where:
                    waiting[key] = (grid, row)
                    self._where[key] = self._group_key(fingerprint, grid)
            return
        self._insert(fingerprint, grid, keys, projected)

    def _insert(self, fingerprint: str, grid, keys: list[str], projected: torch.Tensor) -> None:
        gk = self._group_key(fingerprint, grid)
        group = self._groups.get(gk)
        if group is None:
            group = self._groups[gk] = _Group(projected.shape[-2] * projected.shape[-1], self.ivf_from, self.nprobe)
        group.add(keys, self._vectors(fingerprint, projected))
        for key in keys:
            self._where[key] = gk

    def remove(self, fingerprint: str, grid, key: str) -> None:
        gk = self._where.pop(key, None)
        if gk is None:
            return
        self._pending.get(fingerprint, {}).pop(key, None)
        group = self._groups.get(gk)
        if group is not None and key in group.ids:
            group.remove(key)
            if not len(group):
                del self._groups[gk]

    def __len__(self) -> int:
        return len(self._where)

    @property
    def nbytes(self) -> int:
        """Bytes the index holds: the faiss indices, and the key <-> id maps with their keys and ids (waiting
        entries not included)."""
        maps = [self._where] + [m for g in self._groups.values() for m in (g.ids, g.keys)]
        python = sum(sys.getsizeof(m) for m in maps) + sum(sys.getsizeof(k) for k in self._where)
        python += sum(sys.getsizeof(i) for g in self._groups.values() for i in g.keys)
        return sum(g.nbytes for g in self._groups.values()) + python

    # -- search ------------------------------------------------------------------------------------
    def search(self, fingerprint: str, grid, descriptors: torch.Tensor, tau: float, top_k: int,
               margin: float | None = None) -> list[tuple[str, float]]:
        """Keys whose four centred regional cosines all exceed ``tau`` (within the projection's ``margin``), best
        mean first, at most ``top_k``, with their (projected) mean cosine. Nothing before ``set_center``."""
        group = self._groups.get(self._group_key(fingerprint, grid))
        if group is None or top_k <= 0 or fingerprint not in self._centers:
            return []
        d = descriptors.shape[-1]
        if margin is None:
            margin = projection_margin(d, self.region_dim, tau)
        query = self._vectors(fingerprint, self._project(descriptors)[None])[0]
        regions = descriptors.shape[-2]
        ids, scores, vectors = group.search(query, max(4 * top_k, 32))
        if not len(ids):
            return []
        per_region = (vectors.reshape(len(ids), regions, -1) * query.reshape(regions, -1)).sum(-1)
        passing = (per_region > tau - margin).all(-1)
        ranked = sorted(((float(per_region[i].mean()), int(ids[i])) for i in np.flatnonzero(passing)), reverse=True)
        return [(group.keys[id_], score) for score, id_ in ranked[:top_k]]
