"""The host tier (L2): blobs as uint8 tensors in RAM (pinned when CUDA exists); sparse reads gather. Its victim
share is a second host tier (``ranked``): it takes only entries the host tier gives up, those ranked best by prior
+ reuse."""

from __future__ import annotations

from collections import OrderedDict

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.tiers.base import BYTES, FITS, RANKED, TierBase


class HostTier(TierBase):
    name = "host"
    holds = BYTES

    def __init__(self, budget: int | None, name: str = "host", seal: blob.Seal | None = None, ranked: bool = False):
        self.budget, self.name, self.seal = budget, name, seal
        self.admits = RANKED if ranked else FITS
        self.lru: OrderedDict[str, tuple[blob.BlobHeader, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.pin = torch.cuda.is_available()

    def __str__(self) -> str:
        return f"{self.name} tier{' (victim share)' if self.admits == RANKED else ''}"

    def put(self, key: str, data: bytes) -> None:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.pin:
            tensor = tensor.pin_memory()
        self.lru[key] = (blob.parse_header(data[: blob.HEADER_SIZE], self.seal), tensor)
        self.bytes += tensor.numel()

    def pop(self, key: str) -> bytes:
        _, tensor = self.lru.pop(key)
        self.bytes -= tensor.numel()
        return tensor.numpy().tobytes()

    def identity(self, key: str) -> tuple[str, str]:
        header = self.lru[key][0]
        return header.key, header.fingerprint

    def full(self, key: str) -> Entry:
        header, data = self.lru[key]
        return blob.decode_entry(header, data)

    def meta(self, key: str) -> Entry:
        header, data = self.lru[key]
        return blob.decode_meta(header, data[header.meta_start :])  # views of the blob: no copy

    def lookup(self, key: str) -> blob.LookupSection:
        header, data = self.lru[key]
        section = data[header.meta_start : header.meta_start + header.lookup_bytes]
        return (*blob.decode_lookup(header, section), header.lookup_bytes)

    @staticmethod
    def _blocks(header, data, tokens, first_layer) -> torch.Tensor:
        region = data[blob.HEADER_SIZE : header.meta_start].view(header.kv_count, header.token_bytes)
        start = first_layer * header.layer_bytes
        return blob.decode_blocks(header, region[tokens][:, start:], first_layer, tokens)

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        header, data = self.lru[key]
        kv = self._blocks(header, data, tokens.cpu(), first_layer)
        return kv, tokens.numel() * header.token_range(0, first_layer)[1]

    def add_stats(self, group: dict, own: dict) -> None:
        """The victim share's entries and bytes, named apart (the group counts them with the host tier's)."""
        if self.admits == RANKED:
            group["victim_entries"], group["victim_bytes"] = own["entries"], own["bytes"]
