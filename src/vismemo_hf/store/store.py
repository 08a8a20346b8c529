"""Where entries live between requests (docs/METHOD.md §5): a chain of tiers, a catalog and an eviction policy.

``VisMemoStore`` is the interface the runtime talks to: ``put``; ``get`` (full read, an exact hit: promoted to
the first tier); ``candidates`` (the coarse lookup over the ``Catalog``'s descriptor index); ``lookup_section`` (a
candidate's lookup section, for the fine stage); ``peek`` (metadata only); ``get_tokens`` (sparse read of some
tokens' late layers, an approximate hit: never promotes); ``stats``.

The tiers form a chain, fastest first, built in one place (``tiers/chain.py``): device (L1) -> host (L2, and its
victim share) -> disk (L3) -> remote (L4, Redis). The store and its ``Placement`` use each tier only through the
``Tier`` protocol (``tiers/base.py``), asking what it holds and how entries come into it, never which tier it is. A
put lands in the first tier with room and, when a disk tier exists, through to disk in the background (restarts
and other processes see it); with a remote tier also there, in the background. A full tier gives up the entries
``ExactPriorityLRU`` chooses, each moving to the next tier of the chain that takes it (the disk tier already holds
it) or out. Every read checks the entry's own key and model and its bytes: anything wrong is a miss (logged,
removed). Nothing a disk directory holds makes the constructor fail: a damaged index is quarantined
(``stats()["quarantined"]``), an unusable directory leaves the store without its disk tier (logged).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vismemo_hf.core.features import checked_namespace, token_sketch
from vismemo_hf.presets import find, load
from vismemo_hf.store import blob
from vismemo_hf.store.background import Writer
from vismemo_hf.store.catalog import Catalog
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.eviction import ExactPriorityLRU
from vismemo_hf.store.faults import unexpected
from vismemo_hf.store.placement import Placement
from vismemo_hf.store.prefixes import PrefixBlocks
from vismemo_hf.store.tiers import ENTRY, NAMES, PUBLISH, Roles, Tier, TierUnavailable, chain
from vismemo_hf.store.writes import PendingWrites

if TYPE_CHECKING:
    from vismemo_hf.core.thresholds import LookupThresholds, ModelReference

#: a byte budget: ``1073741824``, ``"1GiB"``, ``"512 MB"``; None: unbounded
Bytes = int | float | str | None

logger = logging.getLogger(__name__)
#: errors a read raises for its arguments or the library's own code rather than for the stored bytes (whose checks
#: raise ``BlobError``, their I/O ``OSError``): such a read is a miss and the entry is not removed as corrupt
_NOT_THE_BLOB = (TypeError, AttributeError, NameError, AssertionError, IndexError)

_OPTIONS = {"device_bytes", "host_bytes", "disk_dir", "disk_bytes", "device", "protect", "victim_share", "priors",
            "prefix_bytes",
            "write_through", "remote_url", "remote_options", "kv_format", "keep_ratio", "thresholds", "secret",
            "namespace"}
#: the environment variable a store without an explicit ``secret`` takes its secret from
SECRET_ENV = "VISMEMO_STORE_SECRET"


def _device_budgets(device_bytes, device) -> dict:
    """{device: budget} of the device tiers: ``device_bytes`` as one budget on ``device``, or a mapping of devices
    to budgets (a model split over several GPUs keeps entries on each, each within its own budget)."""
    if isinstance(device_bytes, dict):
        if not device_bytes:
            raise ValueError("device_bytes as a mapping needs at least one device")
        return {str(name): parse_bytes(budget) for name, budget in device_bytes.items()}
    return {str(device): parse_bytes(device_bytes)}


def parse_bytes(value: Bytes) -> int | None:
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


def preset_options(name: str, overrides: dict) -> dict:
    """The ``VisMemoStore`` keywords of store preset ``name`` (a path or a file of ``configs/store/``): placeholders
    and environment variables expanded, ``overrides`` applied, unknown options an error."""
    file, preset = find("store", name), load("store", name)
    assert preset is not None  # without missing_ok, load raises for an unknown preset instead
    cfg = {**preset, **overrides}
    if cfg.get("disk_dir"):
        cfg["disk_dir"] = os.path.expandvars(str(cfg["disk_dir"]).replace("{cache_home}", str(user_cache_dir())))
    for name in ("remote_url", "secret"):  # e.g. a password from ${REDIS_PASSWORD}, a secret from ${MY_SECRET}
        if cfg.get(name):
            cfg[name] = os.path.expandvars(str(cfg[name]))
            unset = re.findall(r"\$\{?(\w+)", cfg[name])
            if unset:
                raise ValueError(f"{name} of {file} needs the environment variable(s) {unset}")
    unknown = set(cfg) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown store option(s) {sorted(unknown)} in {file}")
    return cfg


def _new_stats(names: Iterable[str]) -> dict:
    return {"hits": {"exact": 0, "approximate": 0, "miss": 0}, "hits_by_tier": {t: 0 for t in names},
            "puts": 0, "evictions": 0, "demotions": 0, "promotions": 0, "rejected": 0, "corrupt": 0, "forged": 0,
            "write_failures": 0, "bytes_read_full": 0, "bytes_read_sparse": 0, "bytes_read_lookup": 0,
            "exact_prefix_changed": 0, "approximate_prefix_changed": 0, "fallbacks": {},
            "writes_read_only": 0, "quarantined": 0}


def _prepared(entry: Entry, importance: torch.Tensor | None, keep_ratio: float | None, kv_format: str | None) -> Entry:
    """The entry as every tier will serve it: compressed (``keep_ratio``), K/V in ``kv_format``."""
    if keep_ratio is not None and entry.kv_tokens is None and keep_ratio < 1.0:
        score = (importance if importance is not None else entry.entropy).float().cpu()
        if score.shape != (entry.n_tokens,):
            raise ValueError(f"importance must hold one score per token ({entry.n_tokens}), got {tuple(score.shape)}")
        entry = entry.compressed(torch.topk(score, max(1, math.ceil(keep_ratio * entry.n_tokens))).indices)
    if kv_format is not None:  # what every tier will serve, the device tier included
        entry = replace(entry, kv=blob.round_trip(entry.full_kv(), kv_format))
    return entry


def _check_options(budgets: dict, host_bytes: int | None, disk_bytes: int | None, victim_share: float,
                   kv_format: str | None, keep_ratio: float | None) -> None:
    """ValueErrors of ``VisMemoStore``'s options that no tier checks itself."""
    for name, v in (("host_bytes", host_bytes), ("disk_bytes", disk_bytes), *budgets.items()):
        if v is not None and v < 0:
            raise ValueError(f"{'device_bytes of ' if name not in ('host_bytes', 'disk_bytes') else ''}{name} "
                             "must be >= 0 or None")
    if not 0.0 <= victim_share < 1.0:
        raise ValueError("victim_share must lie in [0, 1)")
    if kv_format not in (None, *blob.KV_FORMATS):
        raise ValueError(f"kv_format must be None or one of {sorted(blob.KV_FORMATS)}, got {kv_format!r}")
    if keep_ratio is not None and not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must lie in (0, 1] or be None, got {keep_ratio!r}")


class VisMemoStore(Roles, PendingWrites):
    """Entries of any number of models in a chain of tiers with byte budgets that are never exceeded.

    ``device_bytes`` / ``host_bytes``: RAM (GPU memory for ``device`` when ``device`` is a CUDA
    device) budgets, ``None`` = unbounded, ``0`` = tier off; ``device_bytes={"cuda:0": "8GiB", "cuda:1": "8GiB"}``
    gives every device its own budget (entries go to the first with room, and one device down when evicted; a hit
    moves each layer's K/V to the device that layer runs on, as accelerate's device map says). ``disk_dir`` +
    ``disk_bytes``: the disk tier (``diskcache`` directory, shareable between processes, persistent). ``protect``:
    second chances of an entry that served an exact hit. ``victim_share`` of ``host_bytes`` is
    reserved for entries ranked by ``priors`` (JSON file ``{key: weight}``) plus online reuse counts.
    ``remote_url`` (``redis://[:password@]host:port/db``, ``rediss://`` for TLS): the shared remote
    tier; ``remote_options``: ``RemoteTier`` keywords (``prefix``, ``timeout_s``, ``retry_s``, ``ttl_s``, ...).
    ``kv_format``: ``"int8"`` or ``"fp8"`` (e4m3) stores K/V in 8 bits with a fp16 scale per token, layer and head
    (about half the bytes of bf16); every tier then serves the same dequantized K/V. None: the model's dtype.
    ``keep_ratio``: compressed entries (docs/METHOD.md §4): keep the K/V of that share of each image's tokens, those
    VL-Cache ranks first (``put``'s ``importance``; patch entropy when none is given); a hit on such an entry
    masks or recomputes the missing ones (the policy's ``missing``). None: every token.
    ``thresholds``: ``vismemo calibrate`` presets (names or paths, one per model): a cache without thresholds of
    its own uses the one calibrated for its model.
    ``secret`` (str or bytes, >= 16 bytes; default: the ``VISMEMO_STORE_SECRET`` environment variable, ``False``:
    none): every blob this store writes is sealed with MACs only the secret's holders can make, and every blob it
    reads must carry valid ones (docs/METHOD.md §5): an unsealed, altered or planted blob is a miss, removed and
    counted in ``stats()["forged"]``. Every process sharing a disk directory or Redis tier needs the same secret.
    ``namespace``: the namespace of the caches on this store that name none (``VisMemoCache(namespace=...)``).
    ``prefix_bytes``: host RAM for prefix blocks (``runtime.prefix``: a request that starts as an earlier one did
    reuses that prefix's K/V whole); 0: none, None: unbounded.
    ``tiers``: the chain itself, fastest first, instead of the one ``tiers.chain`` builds from the options above (a
    tier of one's own among the built-in ones); the tiers then carry their own budgets, directory, server and seal.
    The built-in tiers stay reachable by name (``devices``, ``device``, ``host``, ``victim``, ``disk``, ``remote``).
    """

    def __init__(self, device_bytes: Bytes | dict[str, Bytes] = None, host_bytes: Bytes = 0,
                 disk_dir: str | os.PathLike[str] | None = None, disk_bytes: Bytes = None, *,
                 device: str | torch.device = "cpu", protect: int = 2, victim_share: float = 0.0,
                 priors: str | os.PathLike[str] | None = None, write_through: bool = True, remote_url: str | None = None,
                 remote_options: Mapping[str, object] | None = None, kv_format: str | None = None,
                 keep_ratio: float | None = None, thresholds: str | Iterable[str | LookupThresholds] | None = None,
                 secret: str | bytes | bool | None = None, namespace: str | None = None,
                 tiers: Iterable[Tier] | None = None, prefix_bytes: Bytes = "1GiB") -> None:
        budgets = _device_budgets(device_bytes, device)
        host_bytes, disk_bytes = parse_bytes(host_bytes), parse_bytes(disk_bytes)
        _check_options(budgets, host_bytes, disk_bytes, victim_share, kv_format, keep_ratio)
        if tiers is not None and (device_bytes is not None or host_bytes or disk_dir is not None or remote_url
                                  or remote_options or victim_share or str(device) != "cpu"):
            raise ValueError("a store given its tiers takes no tier options (device_bytes, host_bytes, victim_share, "
                             "disk_dir, remote_url, remote_options, device): each tier has its own")
        self.kv_format, self.keep_ratio, self.write_through = kv_format, keep_ratio, write_through
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or False
        if secret is True:  # a flag, not a secret: what Seal says of any value that is not one
            raise ValueError("a store secret must be a str or bytes of at least 16 bytes")
        seal = blob.Seal(secret) if secret is not False else None
        self.sealed = seal is not None
        #: keys the context sketches of this store's entries (``core.context``): derived from the secret, if any
        self.context_key = seal.context_key() if seal is not None else b""
        self.namespace = checked_namespace(namespace) if namespace is not None else None
        self.catalog = Catalog(thresholds)
        self.eviction = ExactPriorityLRU(protect)
        if tiers is None:
            tiers = chain(budgets, host_bytes, victim_share, disk_dir, disk_bytes, remote_url, remote_options, seal)
        self.tiers: list[Tier] = list(tiers)  # fastest first
        self._stats = _new_stats(dict.fromkeys([*NAMES, *(t.name for t in self.tiers)]))
        self.placement = Placement(self.tiers, self.catalog, self.eviction, self._stats, kv_format,
                                   json.loads(Path(priors).read_text()) if priors else {}, seal)
        self._lock = self.placement.lock
        self.writer = Writer(gated=True)  # entries built and stored between requests (``put_later``)
        self.completer = Writer("vismemo-complete", gated=True)  # entries nobody waits for (``put_when_idle``)
        prefix_budget = parse_bytes(prefix_bytes)
        self.prefixes = PrefixBlocks(prefix_budget) if prefix_budget != 0 else None
        self.writer.at_exit.append(self._flush_tiers)
        self._open_tiers()

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str | None = None, **overrides: object) -> VisMemoStore:
        """A store from a YAML preset: a path, or the name of a file in ``configs/store/``
        (default ``default``: small RAM tiers and a disk tier under the user's cache home); ``overrides`` replace
        the preset's options (``kv_format="int8"``, ...)."""
        return cls(**preset_options(path or "default", overrides))

    def _open_tiers(self) -> None:
        """Index what each tier holds already (a disk directory's blobs, a server's published entries), then trim it
        to its budget (oldest first). A fault ends that tier's indexing, logged: the store serves what it indexed,
        never failing to construct for what a tier holds (a directory changed or damaged since the tier opened it)."""
        for tier in self.tiers:
            try:
                self._take_news(tier)
                self.placement.make_room(tier, 0)
            except Exception as err:  # noqa: BLE001
                unexpected(err, f"{tier.name} indexing")
                logger.warning("vismemo: %s: indexing stopped (%s: %s); serving the %d entries indexed", tier,
                               type(err).__name__, err, len(tier.lru))

    def _take_news(self, tier: Tier) -> None:
        """Catalog what ``tier`` holds that the store has not been told (``Tier.news``); a blob that fails its
        checks is removed."""
        for key, fingerprint, grid, descriptors in tier.news(lambda key, err: self.placement.corrupt(tier, key, err)):
            self.catalog.add(key, fingerprint, grid, descriptors)

    # -- writing -----------------------------------------------------------------------------------
    def put(self, entry: Entry, importance: torch.Tensor | None = None) -> bool:
        """Store an entry (first tier with room; through to disk). False if it fits nowhere or is malformed.
        ``importance`` (N,): what a compressed store keeps first (``keep_ratio``)."""
        try:
            entry.check()
            if entry.kv is None:
                raise ValueError("an entry to store needs its K/V")
        except ValueError as err:
            logger.warning("vismemo: not storing a malformed entry: %s", err)
            self._stats["rejected"] += 1
            return False
        self.placement.settle_writes()
        entry = _prepared(entry, importance, self.keep_ratio, self.kv_format)
        with self._lock:
            if self.placement.tier_of(entry.key) is not None:
                return True
            encoded: list[bytes] = []  # the blob, made once when a tier needs it

            def data() -> bytes:
                if not encoded:
                    encoded.append(self.placement.encode(entry))
                return encoded[0]

            placed = self.placement.place_first(entry.key, entry, data)
            if self.write_through or not placed:
                placed = self.placement.write_through(entry.key, data) or placed
            placed = self.placement.publish(entry.key, entry, data, bool(encoded)) or placed
            if not placed:
                self._stats["rejected"] += 1
                return False
            self.catalog.add(entry.key, entry.fingerprint, entry.grid, entry.descriptors)
            self.catalog.add_pixels(entry.key, entry.patch_hashes)
            self._stats["puts"] += 1
            return True


    def clear(self) -> None:
        """Empty this process's tiers (a ``PUBLISH`` tier, the shared remote one, is left to those who share it)."""
        self.flush()
        with self._lock:
            for tier in (t for t in self.tiers if t.admits != PUBLISH):
                for key in list(tier.lru):
                    tier.discard(key)
            for key in list(self.catalog.where):
                self.placement.forget_if_gone(key)

    # -- reading -----------------------------------------------------------------------------------
    def _read(self, key: str, fingerprint: str, how: str, *args):
        """Read from the fastest tier holding ``key``; a foreign or corrupt blob is removed and gives None."""
        tier = self.placement.tier_of(key)
        if tier is not None and tier.pending(key):
            self.flush()
        if tier is None and how == "full":  # maybe published since the last index sync: one GET answers either way
            tier = next((t for t in self.tiers if t.holds_unseen and t.available()), None)
        if tier is None or self.catalog.fingerprint_of(key) not in (None, fingerprint):
            return None, None
        try:
            named = tier.identity(key)  # what the bytes themselves say they are, before any of them is used
            if named is not None and named != (key, fingerprint):
                raise blob.BlobError("blob of another key or model")
            out = getattr(tier, how)(key, *args)
            if isinstance(out, Entry) and (out.key, out.fingerprint) != (key, fingerprint):
                raise blob.BlobError("blob of another key or model")
            return out, tier
        except KeyError:  # deleted by another process, or evicted by the server
            tier.missing(key)
            self.placement.forget_if_gone(key)
            return None, None
        except TierUnavailable:  # the server, not the entry: keep it for when the server is back
            return None, None
        except _NOT_THE_BLOB as err:  # the read's own arguments or code, not the bytes: a miss, the entry kept
            unexpected(err, f"{tier.name} read")
            logger.warning("vismemo: %s read of %s failed (%s: %s); entry kept", tier.name, key[:12],
                           type(err).__name__, err)
            return None, None
        except Exception as err:  # noqa: BLE001 - corrupt, truncated, foreign, unreadable
            self.placement.corrupt(tier, key, err)
            return None, None

    def get(self, key: str, fingerprint: str) -> Entry | None:
        """Whole entry (an exact hit's full read); it earns protection and moves to the first tier."""
        self._wait_for(key)
        with self._lock:
            entry, tier = self._read(key, fingerprint, "full")
            if entry is None:
                return None
            self.catalog.add(key, entry.fingerprint, entry.grid, entry.descriptors)  # maybe new from the server
            self._stats["bytes_read_full"] += entry.nbytes
            self._stats["hits_by_tier"][tier.name] += 1
            self.eviction.exact_hit(key)
            self.placement.used(key)
            if tier.holds == ENTRY:  # decoded where the model reads it: served from where it is
                tier.touch(key)
                return entry
            if not tier.shared:
                tier.pop(key)
            if self.placement.place_first(key, entry):  # to the first tier holding entries with room
                self._stats["promotions"] += 1
                promoted = self.placement.tier_of(key)
                assert promoted is not None  # place_first has just put it there, under the lock
                return promoted.full(key)
            if not tier.shared:  # no room above: put it back where it was
                data = self.placement.encode(entry)
                if not self.placement.place(tier, key, data, len(data)):
                    self.placement.to_copy_or_drop(key, data)
            return entry

    def peek(self, key: str, fingerprint: str) -> Entry | None:
        """Metadata (encoder output, entropy, descriptors; ``kv`` may be None): no recency change, no K/V read."""
        self._wait_for(key)
        with self._lock:
            return self._read(key, fingerprint, "meta")[0]

    def get_tokens(self, key: str, fingerprint: str, tokens: torch.Tensor, first_layer: int) -> torch.Tensor | None:
        """K/V rows ``tokens`` at layers >= ``first_layer``: (|tokens|, L - first_layer, 2, H, D). Sparse, never
        promotes. Rows are token indices, except in a compressed entry (``ImageFeatures.stored_rows``)."""
        first_layer = operator.index(first_layer)  # a TypeError for the caller, before any tier is asked
        self._wait_for(key)
        with self._lock:
            out, tier = self._read(key, fingerprint, "tokens", tokens.to(torch.long).cpu(), first_layer)
            if out is None:
                return None
            kv, nbytes = out
            tier.touch(key)  # an access, but no promotion
            self._stats["bytes_read_sparse"] += nbytes
            self._stats["hits_by_tier"][tier.name] += 1
            self.placement.used(key)
            return kv

    def lookup_section(self, key: str, fingerprint: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Fine stage: a candidate's (descriptors, token sketches, thumbnail or None), its lookup section alone. A
        candidate still being written is scored from its announcement, without waiting for its write: most
        candidates turn out not to be the alias, and a miss then waited for another image's entry (an alias's K/V
        are read later, ``get_tokens``, and wait then)."""
        pending = self.pending_image(key)
        if pending is not None and pending.fingerprint == fingerprint and pending.embeds is not None:
            thumb = pending.thumbnail() if pending.thumbnail is not None else None
            return pending.descriptors, token_sketch(pending.embeds), thumb
        self._wait_for(key)
        with self._lock:
            out = self._read(key, fingerprint, "lookup")[0]
            if out is None:
                return None
            *section, nbytes = out
            self._stats["bytes_read_lookup"] += nbytes
            return tuple(section)

    def candidates(self, fingerprint: str, grid: tuple[int, int, int], descriptors: torch.Tensor, tau: float,
                   top_k: int) -> list[tuple[str, float]]:
        """Coarse stage: (key, mean centred regional cosine) of same-grid entries passing all four regions (entries
        still being written among them)."""
        with self._lock:
            for tier in self.tiers:  # what other processes published since the last look
                self._take_news(tier)
            return self.catalog.candidates(fingerprint, grid, descriptors, tau, top_k)

    def pixel_candidates(self, fingerprint: str, grid: tuple[int, int, int], hashes: torch.Tensor,
                         top_k: int) -> list[tuple[str, float]]:
        """Pixel-first stage: (key, share of its sampled distinctive tokens the image shows) of same-grid entries
        whose pixels the image shows at the same places (``store.pixels``), best first."""
        with self._lock:
            return self.catalog.pixel_index().candidates(fingerprint, grid, hashes, top_k)

    def knows_pixels(self, fingerprint: str, grid: tuple[int, int, int]) -> bool:
        """Whether the pixel-first index holds any entry of this model and grid."""
        with self._lock:
            return self.catalog.knows_pixels(fingerprint, grid)

    def note_pixels(self, key: str, hashes: torch.Tensor | None) -> None:
        """Index an entry a lookup found otherwise (exact key, encoder output) for later pixel-first lookups."""
        with self._lock:
            if not self.catalog.indexes_pixels(key):
                self.catalog.add_pixels(key, hashes)

    def reference(self, fingerprint: str) -> ModelReference | None:
        """The model's ``ModelReference`` (the means the lookup centres by); None until registered."""
        return self.catalog.reference(fingerprint)

    def set_reference(self, fingerprint: str, reference: ModelReference) -> None:
        with self._lock:
            self.catalog.set_reference(fingerprint, reference)

    def add_thresholds(self, preset: str | LookupThresholds) -> None:
        """Register calibrated lookup thresholds (a ``LookupThresholds``, preset name or path) for their model."""
        self.catalog.add_thresholds(preset)

    def thresholds_for(self, fingerprint: str) -> LookupThresholds | None:
        """The calibrated ``LookupThresholds`` of a model, or None."""
        return self.catalog.thresholds_for(fingerprint)

    def discard(self, key: str) -> None:
        """Remove ``key`` from every tier (an entry found unusable for its model); counted as corrupt."""
        self._wait_for(key)
        with self._lock:
            self._stats["corrupt"] += 1
            for tier in self.tiers:
                if key in tier:
                    tier.discard(key)
            self.placement.forget_if_gone(key)

    # -- bookkeeping -------------------------------------------------------------------------------
    def record(self, kind: str, prefix_changed: bool = False, fallback: str | None = None) -> None:
        """Count a served image by hit kind; ``prefix_changed``: a hit after another context before the image;
        ``fallback``: why a hit computed every token (``ImagePlan.fallback``)."""
        with self._lock:
            self._stats["hits"][str(kind)] += 1
            if str(kind) in ("exact", "approximate"):
                self._stats[f"{kind}_prefix_changed"] += int(prefix_changed)
            if fallback is not None:
                self._stats["fallbacks"][fallback] = self._stats["fallbacks"].get(fallback, 0) + 1

    def __contains__(self, key: str) -> bool:
        self._drain()
        return self.placement.tier_of(key) is not None

    def __len__(self) -> int:
        self._drain()
        return len(self.catalog)

    def tier_of(self, key: str) -> str | None:
        self._drain()
        tier = self.placement.tier_of(key)
        return None if tier is None else tier.name

    def stats(self) -> dict[str, Any]:
        self._drain()
        self.placement.settle_writes()
        with self._lock:
            tiers = _tier_stats(self.tiers)
            out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
            for tier in self.tiers:  # e.g. forged index records, damaged indexes moved aside
                for name, n in tier.counts().items():
                    out[name] = out.get(name, 0) + n
            out["wait_ms"] = self.writer.wait_ms
            out["dropped_at_exit"] = self.writer.dropped + self.completer.dropped
            return {**out, "sealed": self.sealed, "entries": len(self.catalog),
                    "bytes": sum(t["bytes"] for t in tiers.values()), "tiers": tiers}

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.completer.close()
        for tier in self.tiers:
            tier.close()


def _tier_stats(tiers: list[Tier]) -> dict:
    """Every tier's stats by name, each built-in name there even without its tier. Tiers of one name (the devices,
    the host tier and its victim share) are summed, each adding its own part (``Tier.add_stats``); a tier alone
    under its name gives all of its stats."""
    out = {name: {"bytes": 0, "budget": 0, "entries": 0} for name in NAMES}
    groups: dict[str, list] = {}
    for tier in tiers:
        groups.setdefault(tier.name, []).append((tier, tier.stats()))
    for name, group in groups.items():
        budgets = [own["budget"] for _, own in group]
        summed = {"bytes": sum(own["bytes"] for _, own in group), "budget": None if None in budgets else sum(budgets),
                  "entries": sum(own["entries"] for _, own in group)}
        for tier, own in group:
            if len(group) == 1:
                summed.update(own)
            tier.add_stats(summed, own)
        out[name] = summed
    return out


_DEFAULT: VisMemoStore | None = None


def default_store() -> VisMemoStore:
    """The process-wide store of ``VisMemoCache(store=None)``: the ``VISMEMO_STORE`` preset or path,
    else the embedded ``default`` preset (RAM tiers plus a disk tier under the user's cache home)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = VisMemoStore.from_config(os.environ.get("VISMEMO_STORE") or None)
    return _DEFAULT
