"""Where entries live between requests (METHOD §5): a differentiated hierarchical store.

``VisMemoStore`` is the interface the runtime talks to: ``put``; ``get`` (full read, an
exact hit: promoted to the device tier); ``candidates`` (the coarse lookup: the in-memory
descriptor index over every tier, ``index.py``); ``sketch`` (a candidate's lookup section, for
the fine stage); ``peek`` (metadata only: the chosen alias's encoder output for routing);
``get_tokens`` (sparse read of some tokens' late layers, an approximate hit: never promotes);
``stats``.

Tiers (``tiers.py``): device (L1) -> host (L2, with a victim share) -> disk (L3), and the
shared remote tier (``remote.py``, Redis, L4). Writes go to the fastest tier with room and,
when a disk tier exists, through to disk in the background (so restarts and other processes
see them); with a remote tier, also to Redis in the background (so other machines see them). Eviction is exact-priority LRU:
an entry that served an exact hit gets ``protect`` second chances; eviction demotes
L1 -> L2 -> (L3, which already holds it) -> gone. Every read checks the model
fingerprint and the blob's integrity: anything wrong is a miss (logged, removed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.index import DescriptorIndex
from vismemo_hf.store.remote import RemoteTier, RemoteUnavailable
from vismemo_hf.store.tiers import DeviceTier, DiskTier, HostTier, Tier

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk", "remote")


def _checked_device(device) -> torch.device:
    """``device`` as a torch device that exists on this machine (else a ValueError now, not at the first put)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"not a torch device: {device!r}") from err
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {device} does not exist here (CUDA devices: {torch.cuda.device_count()})")
    if device.type == "meta":
        raise ValueError("the device tier needs a device that holds data, not meta")
    return device


def parse_bytes(value) -> int | None:
    """``1073741824``, ``"1GiB"``, ``"512 MB"`` or ``None`` (unbounded)."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a byte size: {value!r}")
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(m.group(1)) * units[(m.group(2) or "").upper()])


def user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vismemo"


class VisMemoStore:
    """Entries of any number of models in up to three tiers with byte budgets that are never exceeded.

    ``device_bytes`` / ``host_bytes``: RAM (GPU memory for ``device`` when ``device`` is a CUDA
    device) budgets, ``None`` = unbounded, ``0`` = tier off. ``disk_dir`` + ``disk_bytes``: the
    disk tier (``diskcache`` directory, shareable between processes, persistent). ``protect``:
    second chances of an entry that served an exact hit. ``victim_share`` of ``host_bytes`` is
    reserved for entries ranked by ``priors`` (JSON file ``{key: weight}``) plus online reuse counts.
    ``remote_url`` (``redis://[:password@]host:port/db``, ``rediss://`` for TLS): the shared remote
    tier; ``remote_options``: ``RemoteTier`` keywords (``prefix``, ``timeout_s``, ``retry_s``, ``ttl_s``, ...).
    ``kv_format``: ``"int8"`` or ``"fp8"`` (e4m3) stores K/V in 8 bits with a fp16 scale per token, layer and head
    (about half the bytes of bf16); every tier then serves the same dequantized K/V. None: the model's dtype.
    ``keep_ratio``: compressed entries (METHOD §4): keep the K/V of that share of each image's tokens, those
    VL-Cache ranks first (``put``'s ``importance``; patch entropy when none is given); a hit on such an entry
    masks or recomputes the missing ones (the policy's ``missing``). None: every token.
    ``thresholds``: ``vismemo calibrate`` presets (names or paths, one per model): a cache without thresholds of
    its own uses the one calibrated for its model.
    """

    def __init__(self, device_bytes=None, host_bytes=0, disk_dir=None, disk_bytes=None, *, device="cpu",
                 protect: int = 2, victim_share: float = 0.0, priors=None, write_through: bool = True,
                 remote_url: str | None = None, remote_options: dict | None = None, kv_format: str | None = None,
                 keep_ratio: float | None = None, thresholds=None):
        device_bytes, host_bytes, disk_bytes = (parse_bytes(v) for v in (device_bytes, host_bytes, disk_bytes))
        device = _checked_device(device)
        for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 or None")
        if not 0.0 <= victim_share < 1.0:
            raise ValueError("victim_share must lie in [0, 1)")
        if kv_format not in (None, *blob.KV_FORMATS):
            raise ValueError(f"kv_format must be None or one of {sorted(blob.KV_FORMATS)}, got {kv_format!r}")
        self.kv_format = kv_format
        if keep_ratio is not None and not 0.0 < keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must lie in (0, 1] or be None, got {keep_ratio!r}")
        self.keep_ratio = keep_ratio
        self._thresholds = {}  # fingerprint -> calibrated LookupThresholds
        for preset in [thresholds] if isinstance(thresholds, str) else (thresholds or []):
            self.add_thresholds(preset)
        self.device = DeviceTier(device_bytes, device)
        main_host = None if host_bytes is None else int(host_bytes * (1 - victim_share))
        self.host = HostTier(main_host)
        self.victim = HostTier(None if host_bytes is None else host_bytes - main_host, name="host")
        self.disk = None
        if disk_dir is not None:
            try:
                self.disk = DiskTier(str(disk_dir), disk_bytes)
            except Exception as err:  # noqa: BLE001 - unwritable or unusable directory
                logger.warning("vismemo: disk tier %s unusable (%s: %s); serving without it", disk_dir,
                               type(err).__name__, err)
        self.remote = RemoteTier(remote_url, **(remote_options or {})) if remote_url else None
        self.protect_budget = protect
        self.write_through = write_through
        self._protect: dict[str, int] = {}
        self._reuse: dict[str, int] = {}
        self._priors: dict[str, float] = json.loads(Path(priors).read_text()) if priors else {}
        self._where: dict[str, tuple[str, tuple]] = {}  # key -> (fingerprint, grid) for the index
        self._index = DescriptorIndex()
        self._references: dict = {}  # fingerprint -> thresholds.ModelReference
        self._moving: set[str] = set()  # keys between two tiers during a demotion
        self._lock = threading.RLock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vismemo-disk") if self.disk else None
        self._pending_writes: list = []
        self._failed_writes: list[str] = []  # appended by the writer thread (list.append is atomic)
        self._stats = {
            "hits": {"exact": 0, "approximate": 0, "miss": 0},
            "hits_by_tier": {t: 0 for t in TIERS},
            "puts": 0, "evictions": 0, "demotions": 0, "promotions": 0, "rejected": 0, "corrupt": 0,
            "write_failures": 0, "bytes_read_full": 0, "bytes_read_sparse": 0, "bytes_read_lookup": 0,
            "exact_prefix_changed": 0, "writes_read_only": 0,
        }
        if self.disk is not None:
            self._rebuild_from_disk()
        self._sync_remote()

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str | None = None, **overrides) -> VisMemoStore:
        """A store from a YAML preset: a path, or the name of a file in ``configs/store/``
        (default ``default``: small RAM tiers and a disk tier under the user's cache home); ``overrides`` replace
        the preset's options (``kv_format="int8"``, ...)."""
        from vismemo_hf.presets import find, load

        name = path or "default"
        file, cfg = find("store", name), {**load("store", name), **overrides}
        if cfg.get("disk_dir"):
            cfg["disk_dir"] = os.path.expandvars(str(cfg["disk_dir"]).replace("{cache_home}", str(user_cache_dir())))
        if cfg.get("remote_url"):
            cfg["remote_url"] = os.path.expandvars(str(cfg["remote_url"]))  # e.g. a password from ${REDIS_PASSWORD}
            unset = re.findall(r"\$\{?(\w+)", cfg["remote_url"])
            if unset:
                raise ValueError(f"remote_url of {file} needs the environment variable(s) {unset}")
        unknown = set(cfg) - {"device_bytes", "host_bytes", "disk_dir", "disk_bytes", "device", "protect",
                              "victim_share", "priors", "write_through", "remote_url", "remote_options",
                              "kv_format", "keep_ratio", "thresholds"}
        if unknown:
            raise ValueError(f"unknown store option(s) {sorted(unknown)} in {file}")
        return cls(**cfg)

    def _rebuild_from_disk(self) -> None:
        """Index the blobs a directory already holds, then trim it to ``disk_bytes`` (oldest first)."""
        for key, header in self.disk.scan():
            self.disk.track(key, header.total_bytes)
            try:
                meta = self.disk.meta(key)
            except Exception as err:  # noqa: BLE001
                self._corrupt(self.disk, key, err)
                continue
            self._where[key] = (meta.fingerprint, tuple(meta.grid))
            self._index.add(meta.fingerprint, meta.grid, key, meta.descriptors)
        self._make_room(self.disk, 0)

    def _sync_remote(self) -> None:
        """Index what other processes published to the remote tier since the last look."""
        if self.remote is None:
            return
        for key, header, descriptors in self.remote.sync():
            self.remote.track(key, header)
            if key not in self._where:
                self._where[key] = (header.fingerprint, tuple(header.grid))
                self._index.add(header.fingerprint, header.grid, key, descriptors)

    # -- writing -----------------------------------------------------------------------------------
    def put(self, entry: Entry, importance: torch.Tensor | None = None) -> bool:
        """Store an entry (fastest tier with room; through to disk). False if it fits nowhere or is malformed.
        ``importance`` (N,): what a compressed store keeps first (``keep_ratio``)."""
        try:
            entry.check()
            if entry.kv is None:
                raise ValueError("an entry to store needs its K/V")
        except ValueError as err:
            logger.warning("vismemo: not storing a malformed entry: %s", err)
            self._stats["rejected"] += 1
            return False
        self._settle_writes()
        if self.keep_ratio is not None and entry.kv_tokens is None and self.keep_ratio < 1.0:
            score = (importance if importance is not None else entry.entropy).float().cpu()
            if score.shape != (entry.n_tokens,):
                raise ValueError(f"importance must hold one score per token ({entry.n_tokens}), got {tuple(score.shape)}")
            entry = entry.compressed(torch.topk(score, max(1, math.ceil(self.keep_ratio * entry.n_tokens))).indices)
        if self.kv_format is not None:  # what every tier will serve, the device tier included
            entry = replace(entry, kv=blob.round_trip(entry.kv, self.kv_format))
        with self._lock:
            if self._tier_of(entry.key) is not None:
                return True
            data = None
            placed = self._place(self.device, entry.key, entry, self.device.sizeof(entry))
            if not placed:
                data = self._encode(entry)
                placed = self._place(self.host, entry.key, data, len(data))
            if self.disk is not None and (self.write_through or not placed):
                data = data if data is not None else self._encode(entry)
                placed = self._write_disk(entry.key, data) or placed
            if self.remote is not None:
                self.remote.write_async(entry.key, (lambda d=data: d) if data is not None else
                                        (lambda e=entry: self._encode(e)), entry.descriptors)
                placed = True
            if not placed:
                self._stats["rejected"] += 1
                return False
            self._where[entry.key] = (entry.fingerprint, tuple(entry.grid))
            self._index.add(entry.fingerprint, entry.grid, entry.key, entry.descriptors)
            self._stats["puts"] += 1
            return True

    def _fits(self, tier, size: int) -> bool:
        return tier.budget is None or size <= tier.budget

    def _place(self, tier, key, item, size: int) -> bool:
        if not self._fits(tier, size) or tier.budget == 0:
            return False
        self._make_room(tier, size)
        tier.put(key, item)
        return True

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first (the victim share is part of the host tier)."""
        return [t for t in (self.device, self.host, self.victim, self.disk, self.remote) if t is not None]

    def _make_room(self, tier, size: int) -> None:
        """Exact-priority LRU: evict from the LRU end; a protected entry loses one protection and goes to the MRU end."""
        order = tier.lru
        while tier.budget is not None and tier.bytes + size > tier.budget and order:
            victim = next(iter(order))
            if self._protect.get(victim, 0) > 0:
                self._protect[victim] -= 1
                order.move_to_end(victim)
                continue
            self._evict(tier, victim)

    def _evict(self, tier, key: str) -> None:
        """Demote ``key`` one tier down (L1 -> L2 or victim -> L3 -> gone)."""
        self._stats["evictions"] += 1
        if tier is self.device:
            entry = tier.pop(key)
            data = self._encode(entry)
            with self._in_transit(key):  # making room below may evict its write-through copy: not a reason to forget it
                placed = self._place(self.host, key, data, len(data))
            if placed:
                self._stats["demotions"] += 1
                return
            return self._to_disk_or_drop(key, data)
        if tier is self.host:
            data = tier.pop(key)
            with self._in_transit(key):
                admitted = bool(self.victim.budget) and self._admit_victim(key, len(data))
                if admitted:
                    self.victim.put(key, data)
            if admitted:
                self._stats["demotions"] += 1
                return
            return self._to_disk_or_drop(key, data)
        if tier is self.victim:
            return self._to_disk_or_drop(key, tier.pop(key))
        tier.pop(key)  # disk: gone
        self._forget_if_gone(key)

    def _score(self, key: str) -> float:
        return self._priors.get(key, 0.0) + self._reuse.get(key, 0)

    def _admit_victim(self, key: str, size: int) -> bool:
        """Victim share: keep the entries with the best prior + reuse score; push lower-scored ones down."""
        if size > self.victim.budget or self._score(key) <= 0:
            return False
        while self.victim.bytes + size > self.victim.budget:
            weakest = min(self.victim.lru, key=self._score)
            if self._score(weakest) >= self._score(key):
                return False
            self._to_disk_or_drop(weakest, self.victim.pop(weakest))
        return True

    def _to_disk_or_drop(self, key: str, data: bytes) -> None:
        if self.disk is not None and (key in self.disk or self._write_disk(key, data)):
            self._stats["demotions"] += 1
            return
        self._forget_if_gone(key)

    def _write_disk(self, key: str, data: bytes) -> bool:
        if key in self.disk:
            return True
        if self.disk.read_only:
            self._stats["writes_read_only"] += 1
            return False
        if not self._fits(self.disk, len(data)) or self.disk.budget == 0:
            return False
        self._make_room(self.disk, len(data))
        self.disk.track(key, len(data))  # reserve now; the write itself runs in the background

        def write():  # on the single writer thread; never takes the store lock (flush() may hold it)
            try:
                self.disk.write(key, data)
            except Exception as err:  # noqa: BLE001 - disk full, unwritable directory, ...
                logger.warning("vismemo: disk write failed (%s: %s); serving continues without it",
                               type(err).__name__, err)
                self._failed_writes.append(key)  # settled under the lock by the next store call
                return
            # evicted while the write was queued: the file must not outlive its entry. Writes are serialised on
            # this thread, so a later put of the same key writes again after this delete.
            if key not in self.disk:
                self.disk.cache.delete(key)

        self._pending_writes.append(self._writer.submit(write))
        return True

    def flush(self) -> None:
        """Wait for background disk and remote writes."""
        pending, self._pending_writes = self._pending_writes, []
        for future in pending:
            future.result()
        if self.remote is not None:
            self.remote.flush()
        self._settle_writes()

    def _settle_writes(self) -> None:
        """Forget the disk entries whose background write failed."""
        while self._failed_writes:
            key = self._failed_writes.pop()
            with self._lock:
                self._stats["write_failures"] += 1
                if key in self.disk:
                    self.disk.discard(key)
                self._forget_if_gone(key)

    def _tier_of(self, key: str):
        for tier in (self.device, self.host, self.victim, self.disk, self.remote):
            if tier is not None and key in tier:
                return tier
        return None

    @contextmanager
    def _in_transit(self, key: str):
        """While ``key`` moves between tiers it is in none; it must not be forgotten meanwhile."""
        self._moving.add(key)
        try:
            yield
        finally:
            self._moving.discard(key)

    def _forget_if_gone(self, key: str) -> None:
        if key not in self._moving and self._tier_of(key) is None and key in self._where:
            fingerprint, grid = self._where.pop(key)
            self._index.remove(fingerprint, grid, key)
            self._protect.pop(key, None)

    def _corrupt(self, tier, key: str, err: Exception) -> None:
        logger.warning("vismemo: %s blob %s unusable (%s: %s); removed", tier.name, key[:12], type(err).__name__, err)
        self._stats["corrupt"] += 1
        tier.discard(key)
        self._forget_if_gone(key)

    def clear(self) -> None:
        """Empty this process's tiers (the shared remote tier is left to the processes that share it)."""
        with self._lock:
            self.flush()
            for tier in self.tiers:
                if tier.shared and tier is not self.disk:
                    continue
                for key in list(tier.lru):
                    tier.discard(key)
            for key in list(self._where):
                self._forget_if_gone(key)

    def _encode(self, entry: Entry) -> bytes:
        return blob.encode(entry, self.kv_format)

    # -- reading -----------------------------------------------------------------------------------
    def _read(self, key: str, fingerprint: str, how: str, *args):
        """Read from the fastest tier holding ``key``; a foreign or corrupt blob is removed and gives None."""
        self._wait_for(key)
        tier = self._tier_of(key)
        if tier is None and how == "full" and self.remote is not None and self.remote.available():
            tier = self.remote  # maybe published since the last index sync: one GET answers either way
        if tier is None or self._where.get(key, (fingerprint,))[0] != fingerprint:
            return None, None
        try:
            named = tier.identity(key)  # what the bytes themselves say they are, before any of them is used
            if named is not None and named != (key, fingerprint):
                raise blob.BlobError("blob of another key or model")
            out = getattr(tier, how)(key, *args)
            if isinstance(out, Entry) and (out.key, out.fingerprint) != (key, fingerprint):
                raise blob.BlobError("blob of another key or model")
            return out, tier
        except KeyError:
            if tier is self.disk:  # another process deleted it
                tier.discard(key)
            elif key in tier.lru:  # remote: evicted by the server, or deleted by another process
                tier.forget(key)
            self._forget_if_gone(key)
            return None, None
        except RemoteUnavailable:  # the server, not the entry: keep it for when the server is back
            return None, None
        except Exception as err:  # noqa: BLE001 - corrupt, truncated, foreign, unreadable
            self._corrupt(tier, key, err)
            return None, None

    def _wait_for(self, key: str) -> None:
        if self._pending_writes and self.disk is not None and key in self.disk and self._tier_of(key) is self.disk:
            self.flush()

    def get(self, key: str, fingerprint: str) -> Entry | None:
        """Whole entry (an exact hit's full read); it earns protection and moves to the device tier."""
        with self._lock:
            entry, tier = self._read(key, fingerprint, "full")
            if entry is None:
                return None
            if key not in self._where:  # found on the server before the index sync announced it
                self._where[key] = (entry.fingerprint, tuple(entry.grid))
                self._index.add(entry.fingerprint, entry.grid, key, entry.descriptors)
            self._stats["bytes_read_full"] += entry.nbytes
            self._stats["hits_by_tier"][tier.name] += 1
            self._protect[key] = self.protect_budget
            self._reuse[key] = self._reuse.get(key, 0) + 1
            if tier is self.device:
                tier.touch(key)
                return entry
            shared = tier.shared
            if not shared:
                tier.pop(key)
            if self._place(self.device, key, entry, self.device.sizeof(entry)):
                self._stats["promotions"] += 1
                return self.device.full(key)
            if not shared:  # no room above: put it back where it was
                data = self._encode(entry)
                if not self._place(tier, key, data, len(data)):
                    self._to_disk_or_drop(key, data)
            return entry

    def peek(self, key: str, fingerprint: str) -> Entry | None:
        """Metadata (encoder output, entropy, descriptors; ``kv`` may be None): no recency change, no K/V read."""
        with self._lock:
            return self._read(key, fingerprint, "meta")[0]

    def get_tokens(self, key: str, fingerprint: str, tokens: torch.Tensor, first_layer: int) -> torch.Tensor | None:
        """K/V rows ``tokens`` at layers >= ``first_layer``: (|tokens|, L - first_layer, 2, H, D). Sparse, never
        promotes. Rows are token indices, except in a compressed entry (``ImageFeatures.stored_rows``)."""
        with self._lock:
            out, tier = self._read(key, fingerprint, "tokens", tokens.to(torch.long).cpu(), first_layer)
            if out is None:
                return None
            kv, nbytes = out
            tier.touch(key)  # an access, but no promotion
            self._stats["bytes_read_sparse"] += nbytes
            self._stats["hits_by_tier"][tier.name] += 1
            self._reuse[key] = self._reuse.get(key, 0) + 1
            return kv

    def reference(self, fingerprint: str):
        """The model's ``thresholds.ModelReference`` (the means the lookup centres by); None until registered."""
        return self._references.get(fingerprint)

    def set_reference(self, fingerprint: str, reference) -> None:
        """Register a model's reference (the first registration of a fingerprint stays: every process computes the
        same one); the model's entries waiting for it are indexed now."""
        with self._lock:
            if fingerprint not in self._references:
                self._references[fingerprint] = reference
                self._index.set_center(fingerprint, reference.descriptor_mean)

    def add_thresholds(self, preset) -> None:
        """Register calibrated lookup thresholds (a ``LookupThresholds``, preset name or path) for their model."""
        from vismemo_hf.core.thresholds import LookupThresholds

        loaded = preset if isinstance(preset, LookupThresholds) else LookupThresholds.load(preset)
        if loaded.fingerprint is None:
            raise ValueError(f"lookup thresholds {preset!r} name no model fingerprint: write them with vismemo calibrate")
        self._thresholds[loaded.fingerprint] = loaded

    def thresholds_for(self, fingerprint: str):
        """The calibrated ``LookupThresholds`` of a model, or None."""
        return self._thresholds.get(fingerprint)

    def candidates(self, fingerprint: str, grid, descriptors: torch.Tensor, tau: float, top_k: int):
        """Coarse stage: (key, mean centred regional cosine) of same-grid entries passing all four regions."""
        with self._lock:
            self._sync_remote()
            return self._index.search(fingerprint, grid, descriptors, tau, top_k)

    def sketch(self, key: str, fingerprint: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fine stage: (descriptors, token sketches) of a candidate, read from its lookup section alone."""
        with self._lock:
            out = self._read(key, fingerprint, "lookup")[0]
            if out is None:
                return None
            descriptors, sketch, nbytes = out
            self._stats["bytes_read_lookup"] += nbytes
            return descriptors, sketch

    def discard(self, key: str) -> None:
        """Remove ``key`` from every tier (an entry found unusable for its model); counted as corrupt."""
        with self._lock:
            self._stats["corrupt"] += 1
            for tier in self.tiers:
                if key in tier:
                    tier.discard(key)
            self._forget_if_gone(key)

    # -- bookkeeping -------------------------------------------------------------------------------
    def record(self, kind: str, prefix_changed: bool = False) -> None:
        """Count a served image by hit kind; ``prefix_changed``: an exact hit after another text before it."""
        with self._lock:
            self._stats["hits"][str(kind)] += 1
            self._stats["exact_prefix_changed"] += int(prefix_changed)

    def __contains__(self, key: str) -> bool:
        return self._tier_of(key) is not None

    def __len__(self) -> int:
        return len(self._where)

    def tier_of(self, key: str) -> str | None:
        tier = self._tier_of(key)
        return None if tier is None else tier.name

    def stats(self) -> dict:
        self._settle_writes()
        with self._lock:
            tiers = {name: {"bytes": 0, "budget": 0, "entries": 0} for name in TIERS}
            for tier in (self.device, self.disk, self.remote):
                if tier is not None:
                    tiers[tier.name] = tier.stats()
            host, victim = self.host.stats(), self.victim.stats()
            tiers["host"] = {"bytes": host["bytes"] + victim["bytes"],
                             "budget": None if host["budget"] is None else host["budget"] + victim["budget"],
                             "entries": host["entries"] + victim["entries"], "victim_entries": victim["entries"],
                             "victim_bytes": victim["bytes"]}
            return {**{k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()},
                    "entries": len(self._where), "bytes": sum(t["bytes"] for t in tiers.values()), "tiers": tiers}

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()


def store_call(what: str, fn, default):
    """Run a store call; a fault is logged and gives ``default`` (a miss, no entry stored), never an error."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - any store failure must degrade, not break serving
        logger.warning("vismemo: store %s failed (%s: %s); continuing without it", what, type(err).__name__, err)
        return default


_DEFAULT: VisMemoStore | None = None


def default_store() -> VisMemoStore:
    """The process-wide store of ``VisMemoCache(store=None)``: the ``VISMEMO_STORE`` preset or path,
    else the embedded ``default`` preset (RAM tiers plus a disk tier under the user's cache home)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = VisMemoStore.from_config(os.environ.get("VISMEMO_STORE") or None)
    return _DEFAULT
