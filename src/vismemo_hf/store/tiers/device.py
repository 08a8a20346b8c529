"""The device tier (L1): decoded entries, K/V on the tier's device (GPU memory for a CUDA device); reads are
indexing. One per device of ``device_bytes``, each with its own budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.tiers.base import ENTRY, FITS, TierBase


def token_rows(kv: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``kv[tokens]``, as a view (no copy) when ``tokens`` is every token in order."""
    if tokens.numel() == kv.shape[0] and bool((tokens.cpu() == torch.arange(kv.shape[0])).all()):
        return kv
    return kv[tokens.to(kv.device)]


def layer_major(kv: torch.Tensor | None) -> torch.Tensor | None:
    """The same (N, L, 2, H, D) K/V, laid out layer by layer in memory (a view of an (L, 2, H, N, D) tensor): one
    layer's keys (or values) of every token are then one block, what a prefill copies into that layer whole."""
    if kv is None or kv.permute(1, 2, 3, 0, 4).is_contiguous():
        return kv
    return kv.permute(1, 2, 3, 0, 4).contiguous().permute(3, 0, 1, 2, 4)


class DeviceTier(TierBase):
    name = "device"
    holds = ENTRY
    admits = FITS

    def __init__(self, budget: int | None, device: str | torch.device = "cpu"):
        self.budget, self.device = budget, torch.device(device)
        self.lru: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0

    def __str__(self) -> str:
        return f"device tier {self.device}"

    def sizeof(self, entry: Entry) -> int:
        return entry.nbytes

    def put(self, key: str, entry: Entry) -> None:
        def move(t):  # asynchronous from pinned host memory (blobs read by the host, disk and remote tiers)
            return None if t is None else t.to(self.device, non_blocking=True)

        moved = replace(entry, embeds=move(entry.embeds), kv=layer_major(move(entry.kv)), deepstack=move(entry.deepstack))
        self.lru[key] = moved
        self.bytes += moved.nbytes

    def pop(self, key: str) -> Entry:
        entry = self.lru.pop(key)
        self.bytes -= entry.nbytes
        return entry

    def identity(self, key: str) -> tuple[str, str]:
        entry = self.lru[key]
        return entry.key, entry.fingerprint

    def full(self, key: str) -> Entry:
        return self.lru[key]

    def meta(self, key: str) -> Entry:
        return self.lru[key]

    def lookup(self, key: str) -> blob.LookupSection:
        entry = self.lru[key]
        return entry.descriptors, entry.token_sketches, entry.thumbnail, 0  # in memory: nothing read

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        out = token_rows(self.lru[key].full_kv(), tokens)[:, first_layer:]
        return out, out.numel() * out.element_size()

    def add_stats(self, group: dict, own: dict) -> None:
        """Each device's own stats, under ``devices`` (the group sums them)."""
        group.setdefault("devices", {})[str(self.device)] = own
