"""The pixel-first lookup's rule and the tokens an approximate hit encodes (docs/METHOD.md §1, step 2).

A new image that shows, token for token, the pixels of a stored one at the same places except in a few tokens is
that image edited: the stored entry is its alias, the tokens whose pixels differ are what changed, and neither
needs the vision tower to tell. So is one whose changes leave whole rows of tokens untouched that hold part of its
content (``region_share``): a region changed (an inverted, tinted or inserted row, a popup, two rows swapped) in an
image that is otherwise the stored one; another page, even of the same layout, changes text in nearly every row. With encoder
reuse (a routing's ``reuses_encoder``) the tower then runs only for the changed tokens and the context its attention
gives them (``encoder_tokens``), and every other token keeps the alias's encoder output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the least share of a new image's tokens, and of its distinctive ones, that must show the alias's pixels
MIN_SAME = 0.75
#: tokens around each changed one encoded with it (the context the tower's attention gives it)
ENCODE_HALO = 2


def distinctive(hashes: torch.Tensor) -> torch.Tensor:
    """(N,) True at the tokens whose pixel hash occurs once in the image (text, rules, figures; not the background
    every page of a layout shares)."""
    _, inverse, counts = torch.unique(hashes, return_inverse=True, return_counts=True)
    return counts[inverse] == 1


#: the least share of an image's distinctive tokens outside the band of token rows its changes lie in, for a copy
#: changed in a region to be the candidate edited (``region_share``); ``REGION_SAME_TOP`` when the band starts at the
#: first row, ``REGION_SAME_TWO`` when the changes lie in two bands (two rows swapped, two regions edited); more than
#: ``MAX_BANDS`` bands are never a region. Another page of the same layout changes text in rows all over it and leaves
#: less outside one band (less still unless the band starts at the first row) or two than an inverted, tinted or
#: covered region, an inserted row, two rows swapped or cells edited in two rows leave: the bounds sit between the
#: shares ``results/lookup/pixel-shares.md`` measures on the readers' pages (``benchmarks/pixel_shares.py``)
REGION_SAME = 0.1
REGION_SAME_TOP = 0.25
REGION_SAME_TWO = 0.3
MAX_BANDS = 2
#: and at least this many distinctive tokens outside the bands: one token is no evidence (a new chart page of the
#: tiny reader's held-out perturbation stream, with few distinctive tokens, kept one, and
#: ``benchmarks/stream_recall.py`` counted it an approximate hit before this rule)
REGION_KEPT = 2


def band_share(mine: torch.Tensor, theirs: torch.Tensor,
               rows: torch.Tensor | None) -> tuple[float, bool, int, int] | None:
    """(share of the image's distinctive tokens outside the bands, whether the first band starts at its first row
    of distinctive tokens, how many bands, how many distinctive tokens lie outside them) when its changed distinctive
    tokens (hashes ``mine`` against ``theirs``) lie in at most ``MAX_BANDS`` bands of token rows (``rows``: (N,) the
    row of each token; a band is a run of rows with changes, bands are apart by rows with none; rows without
    distinctive tokens do not count); None when they do not, when nothing distinctive changed, or when unknown."""
    if rows is None or mine.shape != theirs.shape or rows.shape != mine.shape:
        return None
    own = distinctive(mine)
    n_own = int(own.sum())
    if not n_own:
        return None
    rows = rows.to(mine.device)
    bearing = torch.unique(rows[own])  # sorted rows with distinctive tokens
    touched = torch.isin(bearing, rows[own & (mine != theirs)])
    at = torch.nonzero(touched).flatten()
    if not at.numel():
        return None
    bands = 1 + int((at[1:] - at[:-1] > 1).sum())
    if bands > MAX_BANDS:
        return None
    kept = int((own & ~torch.isin(rows, bearing[touched])).sum())
    return kept / n_own, int(at[0]) == 0, bands, kept


def region_share(mine: torch.Tensor, theirs: torch.Tensor, rows: torch.Tensor | None) -> float:
    """``band_share``'s share when it reaches ``REGION_SAME`` (``REGION_SAME_TOP`` for one band from the first row,
    ``REGION_SAME_TWO`` for two bands) with at least ``REGION_KEPT`` distinctive tokens outside, else 0."""
    found = band_share(mine, theirs, rows)
    if found is None:
        return 0.0
    share, top, bands, kept = found
    need = REGION_SAME_TWO if bands > 1 else REGION_SAME_TOP if top else REGION_SAME
    return share if share >= need and kept >= REGION_KEPT else 0.0


def pixel_changes(mine: torch.Tensor | None, theirs: torch.Tensor | None,
                  min_same: float = MIN_SAME, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """(N,) True at the tokens whose pixels differ from the candidate's, when the image is the candidate edited: at
    least ``min_same`` of its tokens, and of its distinctive tokens, show the candidate's pixels at the same place,
    or (with the token ``rows`` known) its changes lie in one or two bands of rows and the rest holds enough of its
    content (``region_share``); else None (another image, a moved or re-encoded copy: the encoder-based stages decide)."""
    if mine is None or theirs is None or mine.shape != theirs.shape or not mine.numel():
        return None
    same = mine == theirs
    own = distinctive(mine)
    edited = float(same.float().mean()) >= min_same and \
        (not bool(own.any()) or float(same[own].float().mean()) >= min_same)
    if not edited and not region_share(mine, theirs, rows):
        return None
    return ~same


def region_changed(mine: torch.Tensor | None, theirs: torch.Tensor | None, rows: torch.Tensor | None) -> bool:
    """Whether the image is the candidate with a region changed beyond a local edit: more than ``LOCAL_CHANGE`` of
    its distinctive tokens changed, all in one or two bands of rows with enough of them outside (``region_share``)."""
    if mine is None or theirs is None or mine.shape != theirs.shape or not mine.numel():
        return False
    own = distinctive(mine)
    if not bool(own.any()):
        return False
    return 1.0 - float((mine == theirs)[own].float().mean()) > LOCAL_CHANGE and region_share(mine, theirs, rows) > 0


#: the pixel stage (aligned thumbnails) admits copies moved, zoomed or re-encoded, which change every distinctive
#: token, and local edits; a copy with at least ``PARTLY_SAME`` of its distinctive tokens' pixels identical to the
#: candidate's at the same place and more than ``LOCAL_CHANGE`` changed (an inserted row moves everything below it)
#: is left to the encoder stages, whose fine score it failed: its unchanged tokens' K/V were computed beside content
#: that is no longer there (on the tiny reader such aliases changed answers in the context report's insert-row class)
PARTLY_SAME = 0.25
LOCAL_CHANGE = 0.25


def partly_changed(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> bool:
    """Whether the image (patch hashes ``mine``) is the candidate (``theirs``) with part of it changed beyond a local
    edit, judged on its distinctive tokens (a moved copy keeps only its background's pixels); False when unknown."""
    if mine is None or theirs is None or mine.shape != theirs.shape or not mine.numel():
        return False
    own = distinctive(mine)
    if not bool(own.any()):
        return False
    same = float((mine == theirs)[own].float().mean())
    return same >= PARTLY_SAME and 1.0 - same > LOCAL_CHANGE


def row_share(changed: torch.Tensor, rows: torch.Tensor) -> float:
    """The largest share of one token row's tokens that ``changed`` ((N,) bool) marks; ``rows``: each token's row."""
    if not changed.numel():
        return 0.0
    rows = rows.to(torch.long).cpu()
    counts = torch.bincount(rows).clamp_min(1)
    hits = torch.bincount(rows, weights=changed.cpu().float(), minlength=counts.numel())
    return float((hits / counts).max())


def encoder_tokens(changed: torch.Tensor, hw: tuple[int, int], halo: int = ENCODE_HALO,
                   window: int | None = None) -> torch.Tensor:
    """(k,) sorted tokens to encode for the ``changed`` ones ((N,) bool over a ``hw`` token grid): each with the
    tokens within ``halo`` of it, and with ``window`` (a windowed tower's window side, in tokens) every window any
    of them falls in, so that a window's attention is computed as in the whole image."""
    h, w = hw
    grid = changed.reshape(1, 1, h, w).float()
    if halo > 0:
        grid = F.max_pool2d(grid, 2 * halo + 1, stride=1, padding=halo)
    grid = grid[0, 0] > 0
    if window:
        rows, cols = -(-h // window), -(-w // window)
        padded = F.pad(grid.float(), (0, cols * window - w, 0, rows * window - h))
        hit = F.max_pool2d(padded[None, None], window)[0, 0] > 0
        grid = hit.repeat_interleave(window, 0).repeat_interleave(window, 1)[:h, :w]
    return torch.nonzero(grid.reshape(-1)).flatten()
