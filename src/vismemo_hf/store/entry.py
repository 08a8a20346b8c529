"""An entry: everything the store keeps for one image under one model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vismemo_hf.core.context import SIZE as CONTEXT_SIZE
from vismemo_hf.core.features import token_sketch
from vismemo_hf.core.plan import ImageFeatures


@dataclass
class Entry:
    """Everything kept for one image under one model.

    ``kv`` is patch-first: (N tokens, L layers, 2 (K, V), KV heads, head dim), so the
    late-layer K/V of one token is one contiguous block. Keys are RoPE-rotated at
    ``offset``, the M-RoPE start position of the image when it was computed.
    """

    key: str
    fingerprint: str
    grid: tuple[int, int, int]
    embeds: torch.Tensor
    deepstack: torch.Tensor | None
    descriptors: torch.Tensor
    entropy: torch.Tensor
    kv: torch.Tensor | None
    offset: int
    patch_hashes: torch.Tensor | None = None
    #: hash of the text (and earlier images) before the image when its K/V were computed
    #: (``lookup.prefix_digest``; 32 hex digits, "" when unknown)
    prefix: str = ""
    #: layer count, taken from ``kv`` when present (a metadata-only view has ``kv=None``)
    n_layers: int = 0
    #: (N, SKETCH_DIM) fp16 token sketches for the fine lookup stage (computed from ``embeds`` when not given)
    sketch: torch.Tensor | None = None
    #: a compressed entry (docs/METHOD.md §4): the sorted tokens whose K/V ``kv`` holds, row by row; None: every token
    kv_tokens: torch.Tensor | None = None
    #: (H, W) uint8 luma thumbnail for the lookup's pixel stage (``core.features.thumbnail``); None: not kept
    thumbnail: torch.Tensor | None = None
    #: (``core.context.SIZE``,) int64 sketch of that context (``core.context.context_sketch``): how far a later
    #: request's context moved from it; None: not kept (a changed context then counts as unknown)
    context: torch.Tensor | None = None
    #: (F full-attention tower blocks, 2 (K, V), patches, width) the vision tower's own rotated K/V of the image
    #: (``families.tower_kv``), lent to an edited copy's partial encode; None: not kept
    tower_kv: torch.Tensor | None = None
    #: (T,) int64 digest of each tile a tower encodes alone (LLaVA-OneVision's any-resolution views,
    #: ``VisionTower.tile_digests``): an edited copy re-encodes only the tiles whose digest differs; None: not kept
    tile_digests: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kv is not None:
            self.n_layers = self.kv.shape[1]
        if self.sketch is None:
            self.sketch = token_sketch(self.embeds)

    @property
    def n_tokens(self) -> int:
        return self.embeds.shape[0]

    @property
    def token_sketches(self) -> torch.Tensor:
        """``sketch``, which ``__post_init__`` always fills in (None only as a constructor argument)."""
        assert self.sketch is not None  # set by __post_init__
        return self.sketch

    def full_kv(self) -> torch.Tensor:
        """``kv``; ValueError for a metadata-only view (``kv=None``)."""
        if self.kv is None:
            raise ValueError(f"entry {self.key[:12]}: a metadata-only view holds no K/V")
        return self.kv

    @property
    def nbytes(self) -> int:
        tensors = [self.embeds, self.descriptors, self.entropy, self.token_sketches]
        tensors += [t for t in (self.kv, self.deepstack, self.patch_hashes, self.kv_tokens, self.thumbnail,
                                 self.context, self.tower_kv, self.tile_digests)
                    if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def features(self) -> ImageFeatures:
        return ImageFeatures(self.key, self.grid, self.embeds, self.entropy, self.patch_hashes, self.kv_tokens)

    @property
    def kv_count(self) -> int:
        """Tokens whose K/V the entry holds."""
        return self.n_tokens if self.kv_tokens is None else self.kv_tokens.numel()

    def compressed(self, keep: torch.Tensor) -> Entry:
        """The entry holding the K/V of the tokens ``keep`` only (any order; as a compressed entry)."""
        rows = self.features().stored_rows(keep.to(torch.long).unique().sort().values)
        tokens = rows if self.kv_tokens is None else self.kv_tokens[rows]
        kv = self.full_kv()
        return replace(self, kv=kv[rows.to(kv.device)], kv_tokens=tokens.cpu())

    def check(self) -> None:
        """Raise if the entry is inconsistent with itself (a corrupt entry must never be used)."""
        n = self.n_tokens
        if self.kv_tokens is not None and (self.kv_tokens.ndim != 1 or (self.kv_tokens.numel() and (
                int(self.kv_tokens.min()) < 0 or int(self.kv_tokens.max()) >= n
                or bool((self.kv_tokens[1:] <= self.kv_tokens[:-1]).any())))):
            raise ValueError(f"entry {self.key[:12]}: kv_tokens must be sorted distinct tokens of 0..{n - 1}")
        rows = self.kv_count
        if self.kv is not None and (self.kv.ndim != 5 or self.kv.shape[2] != 2 or self.kv.shape[0] != rows):
            raise ValueError(f"entry {self.key[:12]}: kv must be ({rows}, L, 2, H, D), got {tuple(self.kv.shape)}")
        if self.entropy.shape[0] != n or self.descriptors.shape[0] != 4 or self.token_sketches.shape[0] != n:
            raise ValueError(f"entry {self.key[:12]}: token counts disagree")
        if self.patch_hashes is not None and self.patch_hashes.shape != (n,):
            raise ValueError(f"entry {self.key[:12]}: patch hash count disagrees")
        if self.thumbnail is not None and (self.thumbnail.ndim != 2 or self.thumbnail.dtype != torch.uint8):
            raise ValueError(f"entry {self.key[:12]}: the thumbnail must be (H, W) uint8")
        if self.context is not None and (self.context.shape != (CONTEXT_SIZE,) or self.context.dtype != torch.int64):
            raise ValueError(f"entry {self.key[:12]}: the context sketch must be ({CONTEXT_SIZE},) int64")
        if self.deepstack is not None and self.deepstack.shape[1] != n:
            raise ValueError(f"entry {self.key[:12]}: deepstack token count disagrees")
        if self.tower_kv is not None and (self.tower_kv.ndim != 4 or self.tower_kv.shape[1] != 2
                                          or self.tower_kv.shape[2] % max(1, n) or not self.tower_kv.shape[2]):
            raise ValueError(f"entry {self.key[:12]}: tower K/V must be (F, 2, patches, width), a whole number of "
                             f"patches per token, got {tuple(self.tower_kv.shape)}")
        if self.tile_digests is not None and (self.tile_digests.ndim != 1 or self.tile_digests.dtype != torch.int64
                                              or not 0 < self.tile_digests.numel() <= max(1, n)):
            raise ValueError(f"entry {self.key[:12]}: tile digests must be (T,) int64, at most one per token")
