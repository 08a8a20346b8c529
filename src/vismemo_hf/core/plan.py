"""Plans: what happens to each visual token of one image at each decoder layer.

A plan is plain data made by a routing policy (``policies/``) and executed by the
prefill runner (``runtime/runner.py``). Token indices are positions inside the image (0..N-1), so a
plan does not depend on where the image sits in the request.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field, replace
from enum import Enum
from typing import Final, Literal

import torch


class HitKind(str, Enum):
    EXACT = "exact"
    APPROXIMATE = "approximate"
    MISS = "miss"

    def __str__(self) -> str:  # prints as "exact", not "HitKind.EXACT"
        return self.value


def _index(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).reshape(-1)


@dataclass
class ImagePlan:
    """Routing of one image.

    Layers ``< warmup_layers`` compute every visual token. From ``warmup_layers`` on,
    ``recompute`` tokens are computed, ``reuse`` tokens take their K/V from the alias
    entry and ``mask`` tokens are left out of attention (prefill and decoding).
    ``recompute``, ``reuse`` and ``mask`` partition ``range(n_tokens)``.

    ``reuse_from`` (aligned with ``reuse``, each >= ``warmup_layers``) lets a reused token
    stay computed for more layers first: token ``reuse[j]`` is computed below layer
    ``reuse_from[j]`` and reused from it on (per-layer budgets such as VL-Cache's). The
    computed set therefore never grows with depth.
    """

    kind: HitKind
    n_tokens: int
    warmup_layers: int
    recompute: torch.Tensor
    reuse: torch.Tensor
    mask: torch.Tensor
    alias: str | None = None
    reuse_from: torch.Tensor | None = None
    #: after prefill, give decoding the alias's K/V of the masked tokens (layers >= warmup), so tokens
    #: generated later can still attend to them
    restore_masked: bool = False
    #: a hit computed in full, and why: ``"context"`` (the text or images before the image changed its K/V too
    #: much to reuse), ``"uncertain"`` (after another context, the model is unsure of the answer), ``"changed"``
    #: (the page changed everywhere), ``"warp"`` (a zoomed or turned copy: its tokens do not line up with the alias's),
    #: ``"recomputed"`` (a routing that recomputes every token of an image lent encoder output: computed from its
    #: whole encode, ``runtime.rerun.Rerun``)
    fallback: str | None = None
    #: tokens of ``recompute`` that verify the reuse of the rest (a changed context's probes): computed at every
    #: layer, their K/V are compared with the alias's; when their mean relative deviation (the largest over the
    #: layers so far), scaled by the share of the image reused, exceeds ``verify_tolerance``, the image is computed
    #: in full from its decision layer on (``runtime/verify.py``)
    verify: torch.Tensor | None = None
    verify_tolerance: float = 0.0
    #: and, after the last layer, when the model's next token at the end of the image's row has a top probability
    #: below this, the image is computed in full too (``fallback == "uncertain"``): an unsure answer is one any
    #: approximation may change
    verify_confidence: float = 0.0
    #: and the first this many generated tokens are watched too (``runtime/watch.py``): a step whose top probability
    #: is below ``verify_confidence`` has the whole sequence computed again in full first
    verify_watch: int = 0
    #: False: the sets partition the tokens by construction (``exact``, ``full``), not checked again (the check sorts
    #: every token of the image, on every miss)
    checked: InitVar[bool] = True

    def __post_init__(self, checked: bool = True) -> None:
        self.kind = HitKind(self.kind)
        self.recompute, self.reuse, self.mask = (_index(x) for x in (self.recompute, self.reuse, self.mask))
        if self.reuse_from is None:
            self.reuse_from = torch.full_like(self.reuse, self.warmup_layers)
        self.reuse_from = _index(self.reuse_from)
        if not checked:
            return
        if self.reuse_from.shape != self.reuse.shape or bool((self.reuse_from < self.warmup_layers).any()):
            raise ValueError("reuse_from needs one layer per reused token, none below warmup_layers")
        seen = torch.cat([self.recompute, self.reuse, self.mask])
        if seen.numel() != self.n_tokens or torch.unique(seen).numel() != self.n_tokens:
            raise ValueError(
                f"plan sets must partition the {self.n_tokens} visual tokens: got |R|={self.recompute.numel()}, "
                f"|B|={self.reuse.numel()}, |M|={self.mask.numel()} with overlaps or gaps"
            )
        if seen.numel() and (seen.min() < 0 or seen.max() >= self.n_tokens):
            raise ValueError(f"plan indices out of range 0..{self.n_tokens - 1}")
        if self.warmup_layers < 0:
            raise ValueError("warmup_layers must be >= 0")
        if self.kind is not HitKind.MISS and self.alias is None and self.reuse.numel():
            raise ValueError("a plan that reuses tokens needs an alias")
        if self.verify is not None:
            self.verify = _index(self.verify)
            if not bool(torch.isin(self.verify, self.recompute).all()):
                raise ValueError("the tokens that verify a plan must be recomputed")

    @property
    def _layers_from(self) -> torch.Tensor:
        """``reuse_from``, which ``__post_init__`` always fills in (None only as a constructor argument)."""
        assert self.reuse_from is not None  # set by __post_init__
        return self.reuse_from

    def computed_at(self, layer: int) -> torch.Tensor:
        """Visual tokens whose hidden states go through ``layer`` (sorted)."""
        if layer < self.warmup_layers:
            return torch.arange(self.n_tokens)
        late = self.reuse[self._layers_from > layer]
        return torch.cat([self.recompute, late]).sort().values if late.numel() else self.recompute

    def _reuse_layers(self) -> list[int]:
        """``reuse_from`` sorted, as host ints: read once per plan, so that the per-layer questions below read no
        tensor value (on a GPU each read would wait for the stream)."""
        cached = self.__dict__.get("_reuse_layers_cache")
        reuse_from = self._layers_from
        if cached is None or cached[0] is not reuse_from:
            cached = (reuse_from, sorted(reuse_from.tolist()))
            self.__dict__["_reuse_layers_cache"] = cached
        return cached[1]

    def computed_count_at(self, layer: int) -> int:
        """``len(computed_at(layer))`` without building the set."""
        if layer < self.warmup_layers:
            return self.n_tokens
        layers = self._reuse_layers()
        return self.recompute.numel() + len(layers) - bisect.bisect_right(layers, layer)

    def reused_count_at(self, layer: int) -> int:
        """``len(reused_at(layer))`` without building the set: with the layer it names the reused set (the sets
        nest with depth)."""
        return bisect.bisect_right(self._reuse_layers(), layer)

    def reuse_selected_at(self, layer: int) -> torch.Tensor:
        """Boolean over ``reuse``: which of them take alias K/V at ``layer``."""
        return self._layers_from <= layer

    def reused_at(self, layer: int) -> torch.Tensor:
        """Visual tokens whose K/V at ``layer`` come from the alias entry."""
        return self.reuse[self.reuse_selected_at(layer)]

    def limited_to(self, features: ImageFeatures, missing: str) -> ImagePlan:
        """This plan with the reused tokens the alias entry holds no K/V for (a compressed entry) masked
        (``missing="mask"``, docs/METHOD.md §4) or recomputed (``"recompute"``). Tokens the alias does not show at
        all (``features.outside``: moved into view) are recomputed, whether the plan reused or masked them."""
        outside = features.outside
        gap, unseen = ~features.stored(self.reuse), torch.isin(self.mask, outside)
        if not bool(gap.any()) and not bool(unseen.any()):
            return self
        moved, keep = self.reuse[gap], ~gap
        new = torch.isin(moved, outside) if missing == "mask" else torch.ones(moved.shape, dtype=torch.bool)
        recompute = torch.cat([self.recompute, moved[new], self.mask[unseen]]).sort().values
        mask = torch.cat([self.mask[~unseen], moved[~new]]).sort().values
        return replace(self, recompute=recompute, reuse=self.reuse[keep], mask=mask,
                       reuse_from=self._layers_from[keep])

    @property
    def complete(self) -> bool:
        """True when every token is computed at every layer: the K/V can become an entry."""
        return self.recompute.numel() == self.n_tokens

    @classmethod
    def exact(cls, n_tokens: int, alias: str) -> ImagePlan:
        """Every visual token reused at every layer; only text is computed."""
        return cls(HitKind.EXACT, n_tokens, 0, _index([]), torch.arange(n_tokens), _index([]), alias, checked=False)

    @classmethod
    def full(cls, kind: HitKind, n_tokens: int, alias: str | None = None, fallback: str | None = None) -> ImagePlan:
        """Every visual token computed at every layer (a miss, a policy that reuses nothing, or a hit that cannot
        be reused safely: ``fallback`` says why)."""
        return cls(kind, n_tokens, 0, torch.arange(n_tokens), _index([]), _index([]), alias, fallback=fallback,
                   checked=False)


class _Later(Enum):
    LATER = "later"


#: a value computed on first use
_LATER: Final = _Later.LATER


class ImageFeatures:
    """What routing may know about an image without touching K/V: identity, encoder output, patch entropy and the
    hash of each token's pixels. ``pixel_features``: what computes the entropy and the patch hashes, each on its
    first use instead (a miss never needs them before its prefill, so they stay off the request's critical path,
    and a hit whose routing reads the hashes alone never computes the entropy). ``kv_tokens``: tokens whose
    K/V the stored entry holds (a compressed entry, docs/METHOD.md §4); None: every token. ``rows``: what gives the
    row of each token (``token_rows``) when the tokens are not one row-major grid (the family adapter's
    ``token_rows``, given these features); ``heights``: what gives their heights on one scale of rows
    (``token_heights``; the adapter's ``hash_rows``, given the patch hashes and the grid)."""

    def __init__(self, key: str, grid: tuple[int, int, int], embeds: torch.Tensor, entropy: torch.Tensor | None = None,
                 patch_hashes: torch.Tensor | None = None, kv_tokens: torch.Tensor | None = None,
                 pixel_features: tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor | None]] | None = None,
                 rows: Callable[[ImageFeatures], torch.Tensor | None] | None = None,
                 heights: Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor] | None = None) -> None:
        self.key, self.grid, self.embeds, self.kv_tokens = key, grid, embeds, kv_tokens
        later = pixel_features is not None and patch_hashes is None
        self._entropy = entropy
        self._patch_hashes: torch.Tensor | Literal[_Later.LATER] | None = _LATER if later else patch_hashes
        self._pixel_features = pixel_features
        self._rows_of, self._heights_of = rows, heights

    @property
    def entropy(self) -> torch.Tensor:
        """(N,) normalised patch entropy in [0, 1] (ValueError when neither given nor computable)."""
        if self._entropy is None and self._pixel_features is not None:
            self._entropy = self._pixel_features[0]()
        if self._entropy is None:
            raise ValueError(f"image {self.key[:12]}: its patch entropy is unknown")
        return self._entropy

    @property
    def patch_hashes(self) -> torch.Tensor | None:
        """(N,) int64 hash of each token's pixels (None when unknown)."""
        if self._patch_hashes is _LATER:
            assert self._pixel_features is not None  # _LATER is set only with pixel_features
            self._patch_hashes = self._pixel_features[1]()
        return self._patch_hashes

    @property
    def n_tokens(self) -> int:
        return self.embeds.shape[0]

    @property
    def token_hw(self) -> tuple[int, int]:
        """(rows, columns) of the image's visual tokens, row-major (a video's frames stacked as rows)."""
        t, h, w = self.grid
        merge = max(1, round((t * h * w / max(1, self.n_tokens)) ** 0.5))
        return self.n_tokens // max(1, w // merge), max(1, w // merge)

    @property
    def token_rows(self) -> torch.Tensor:
        """(N,) the row of each visual token in reading order, rows in runs: ``token_hw``'s rows, or the family's
        own (LLaVA-OneVision's base view and tile rows, each ended by a newline token)."""
        rows = self._rows_of(self) if self._rows_of is not None else None
        return rows if rows is not None else torch.arange(self.n_tokens) // self.token_hw[1]

    @property
    def token_heights(self) -> torch.Tensor:
        """(N,) the height of each visual token on one scale of rows for the whole image, what a changed region's
        band of rows is judged on (``core.pixel_first.region_changed``): ``token_rows``, unless the tokens show the
        image more than once (LLaVA-OneVision's base view and tiles, ``hash_rows`` of its adapter)."""
        heights_of = self._heights_of
        hashes = self.patch_hashes if heights_of is not None else None
        return heights_of(hashes, self.grid) if heights_of is not None and hashes is not None else self.token_rows

    def stored(self, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean over ``tokens``: those whose K/V the stored entry holds."""
        if self.kv_tokens is None:
            return torch.ones(tokens.shape, dtype=torch.bool)
        return torch.isin(tokens.cpu(), self.kv_tokens)

    def stored_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of the stored K/V that hold ``tokens`` (each must be stored)."""
        tokens = tokens.to(torch.long).cpu()
        if self.kv_tokens is None:
            return tokens
        rows = torch.searchsorted(self.kv_tokens, tokens).clamp(max=max(0, self.kv_tokens.numel() - 1))
        if tokens.numel() and not bool((self.kv_tokens[rows] == tokens).all()):
            raise ValueError(f"image {self.key[:12]}: the stored entry holds no K/V for some requested tokens")
        return rows

    @property
    def outside(self) -> torch.Tensor:
        """Tokens at which this image shows nothing of the cached one (see ``moved``): none."""
        return torch.zeros(0, dtype=torch.long)

    @property
    def shift(self) -> tuple[int, int]:
        """(dy, dx) visual tokens this cached image is seen moved by (``moved``): none."""
        return (0, 0)

    def moved(self, shift: tuple[int, int], hw: tuple[int, int]) -> ImageFeatures:
        """This cached image as seen by a request that shows its content moved by ``shift`` = (dy, dx) visual tokens
        on an h x w grid (``hw``): token (r, c) of the request is this image's (r + dy, c + dx)."""
        if tuple(shift) == (0, 0):
            return self
        dy, dx = shift
        return MovedFeatures(self, (dy, dx), hw)


class MovedFeatures(ImageFeatures):
    """A cached image seen through a shift (a scrolled or moved page, ``ImageFeatures.moved``): everything indexed
    by the request's token positions. Tokens the shift brings into view (``outside``) have no cached K/V."""

    def __init__(self, cached: ImageFeatures, shift: tuple[int, int], hw: tuple[int, int]) -> None:
        (dy, dx), (h, w) = shift, hw
        if h * w != cached.n_tokens:
            raise ValueError(f"a shift needs one frame of {cached.n_tokens} tokens, got a {h} x {w} grid")
        r, c = torch.meshgrid(torch.arange(h) + dy, torch.arange(w) + dx, indexing="ij")
        shown = ((r >= 0) & (r < h) & (c >= 0) & (c < w)).reshape(-1)
        source = (r.clamp(0, h - 1) * w + c.clamp(0, w - 1)).reshape(-1)
        held = shown.clone()
        held[shown] = cached.stored(source[shown])
        self._rows = torch.full((h * w,), -1, dtype=torch.long)
        self._rows[held] = cached.stored_rows(source[held])
        self._outside, self._shift = torch.nonzero(~shown).flatten(), (dy, dx)
        device = cached.embeds.device
        embeds = cached.embeds[source.to(device)] * shown.to(device, cached.embeds.dtype)[:, None]
        hashes = cached.patch_hashes
        super().__init__(cached.key, cached.grid, embeds, cached.entropy[source],
                         None if hashes is None else torch.where(shown, hashes[source], -1),
                         kv_tokens=torch.nonzero(held).flatten())

    @property
    def outside(self) -> torch.Tensor:
        return self._outside

    @property
    def shift(self) -> tuple[int, int]:
        return self._shift

    def stored_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self._rows[tokens.to(torch.long).cpu()]
        if bool((rows < 0).any()):
            raise ValueError(f"image {self.key[:12]}: the stored entry holds no K/V for some requested tokens")
        return rows


@dataclass
class WarmupSignals:
    """What the warmup layers observed for one image: everything a policy may route by.

    ``attention``: (warmup layers, heads, window rows, N) attention probabilities from the
    observation-window queries to this image's visual tokens (rows of the softmax over all
    keys, not renormalised). Collected for policies with ``needs_attention``.
    ``key_deviation`` / ``value_deviation``: (warmup layers, N) squared distance between the K (V)
    this request computed for each visual token and the alias's cached K (V) at that layer (keys
    re-rotated to this request's offset), summed over heads and dims and divided by the layer's
    mean squared norm of the cached K (V) over the image: 0 where nothing differs, about 2 for
    unrelated vectors. Collected for policies with ``needs_deviation`` (their prefetch reads the
    alias's K/V of every token from layer 0).
    ``fresh_kv`` / ``cached_kv``: (K, V) of this image's tokens at the check layer (the first layer
    after warmup), each (KV heads, N, D), projected from this request's hidden states / read from
    the alias (keys re-rotated). Collected for policies with ``needs_check_kv``.
    ``span``: (first, end) request columns of the image in its row; ``window``: the request columns
    of the observation window (text after the row's last image, else its last 16 tokens).
    ``prefix_changed``: a hit whose context before the image (text, earlier images and videos) differs from the
    alias entry's: its K/V from layer 1 on were computed after another context; ``context_change``: then the tokens
    of text by which the two contexts differ (``core.context.context_change``; None: unknown, or other images or
    videos before the image).
    """

    attention: torch.Tensor | None = None
    key_deviation: torch.Tensor | None = None
    value_deviation: torch.Tensor | None = None
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    cached_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    span: tuple[int, int] | None = None
    window: torch.Tensor | None = None
    prefix_changed: bool = False
    context_change: int | None = None

    @property
    def check_deviation(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key, value) deviation at the check layer, scaled like ``key_deviation``: (N,) each."""
        if self.fresh_kv is None or self.cached_kv is None:
            return None
        both = torch.stack([relative_deviation(f, c, host=False) for f, c in zip(self.fresh_kv, self.cached_kv)])
        return tuple(both.cpu())  # one read


def relative_deviation(fresh: torch.Tensor, cached: torch.Tensor, host: bool = True) -> torch.Tensor:
    """(H, N, D) x 2 -> (N,): squared distance per token over the mean squared norm of ``cached``; on the host
    (a read) unless ``host=False`` (the caller reads several at once)."""
    fresh, cached = fresh.float(), cached.float().to(fresh.device)
    scale = cached.pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
    out = (fresh - cached).pow(2).sum(dim=(0, 2)) / scale
    return out.cpu() if host else out


@dataclass
class CacheEvent:
    """Record of one image of one request: what was found and what it cost (milliseconds)."""

    kind: HitKind
    alias: str | None
    key: str
    row: int
    n_tokens: int
    recomputed: int
    reused: int
    masked: int
    score: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    plan: ImagePlan | None = field(default=None, repr=False)
    #: a hit whose context before the image (text, earlier images, videos) differs from the alias entry's
    prefix_changed: bool = False
    #: then the tokens of text by which the two contexts differ (None: unknown, or other images or videos before it)
    context_change: int | None = None
    #: bytes of alias K/V this request read (a full entry for exact hits from a lower tier, ranges otherwise)
    bytes_read: int = 0
    #: bytes the fine lookup stage read: the candidates' lookup sections (descriptors, thumbnails, token sketches)
    lookup_bytes: int = 0
    #: approximate hits on a moved copy: the request's token (r, c) reused the alias's (r + dy, c + dx)
    shift: tuple[int, int] = (0, 0)
    #: approximate hits the lookup's pixel stage accepted: the aligned thumbnail similarity (else None)
    pixel_score: float | None = None
    #: a hit computed in full, and why (``ImagePlan.fallback``: "context", "uncertain", "changed", "warp" or
    #: "recomputed")
    fallback: str | None = None
    #: a plan with probes (``ImagePlan.verify``): its last estimate of the reused tokens' deviation (``runtime/verify``)
    verify_estimate: float | None = None
    #: approximate hits: how far parts of the copy move against its centre, in visual tokens (``local_drift``)
    drift: float = 0.0
    #: a watched answer (``ImagePlan.verify_watch``) whose sequence was computed in full at this generated token
    repaired_at: int | None = None
    #: the image's tokens the vision tower ran for (0: an exact hit; fewer than ``n_tokens``: an approximate hit found
    #: by its pixels, which encodes its changed tokens only; -1: not known)
    encoded_tokens: int = -1
    #: which lookup stage found the alias: "key", "pixels", "encoder" or "thumbnail" (None: a miss)
    found_by: str | None = None

    def as_dict(self) -> dict:
        return {
            "kind": str(self.kind),
            "alias": self.alias,
            "key": self.key,
            "row": self.row,
            "n_tokens": self.n_tokens,
            "recomputed": self.recomputed,
            "reused": self.reused,
            "masked": self.masked,
            "score": self.score,
            "prefix_changed": self.prefix_changed,
            "context_change": self.context_change,
            "bytes_read": self.bytes_read,
            "lookup_bytes": self.lookup_bytes,
            "shift": list(self.shift),
            "pixel_score": self.pixel_score,
            "fallback": self.fallback,
            "verify_estimate": self.verify_estimate,
            "drift": self.drift,
            "repaired_at": self.repaired_at,
            "encoded_tokens": self.encoded_tokens,
            "found_by": self.found_by,
            "timings": dict(self.timings),
        }
