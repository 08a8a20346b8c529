"""Model-aware approximate lookup: the reference means that centre a model's embeddings, and its thresholds.

Hidden states are anisotropic, and how much depends on the model: on a random-weight tower any
two pages share most of their embedding, so raw cosines of unrelated pages pass any fixed
threshold. The lookup therefore compares embeddings *centred* by the model's reference means:
the mean L2-normalised token and the mean region descriptor of a fixed set of synthetic
images (text pages, forms of one template, screens, photos, textures) that the model's own tower encodes once per
process (``runtime.reference.model_reference``). ``LookupThresholds`` are ``tau`` (every centred regional cosine)
and ``tau_fine`` (mean centred token cosine); by default ``tau_fine`` also stays above the
model's most similar unrelated reference images. ``vismemo calibrate`` measures both for one
model and writes a preset (``configs/lookup/``) that ``VisMemoCache(thresholds=...)`` takes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from vismemo_hf.core.features import token_grid
from vismemo_hf.core.memo import TensorMemo
from vismemo_hf.core.pixel_first import MIN_SAME

#: how far above the model's most similar unrelated reference pair an adaptive ``tau_fine`` is kept
UNRELATED_MARGIN = 0.03
#: an adaptive pixel stage (no calibration): ``tau_pixel`` this far above the most similar unrelated reference
#: thumbnails, never below ``PIXEL_FLOOR``; candidates from a fine score of ``NEAR_FLOOR`` up get it (the
#: ``PIXEL_CANDIDATES`` best of them). 0: any candidate closer than an average unrelated image. A copy moved by part
#: of a token can score below another page of its layout (the GLM stand-ins' shifted forms, ``vismemo calibrate``:
#: 0.70 of them found with a floor of 0.3); the thumbnails, not the fine score, tell the two apart. The floor of
#: ``tau_pixel``: the reference images hold no two forms of one style, which reach 0.93 on the tiny Qwen3-VL model
#: (its calibrated preset's closest unrelated pair; ``results/lookup/tiny-qwen3_vl.md``)
PIXEL_MARGIN = 0.03
PIXEL_FLOOR = 0.95
NEAR_FLOOR = 0.0
#: the coarse threshold adaptive thresholds use: none (-1). The coarse stage ranks candidates for the fine and pixel
#: stages, which decide, and the ``top_k`` best go on; as a threshold it turned away copies those stages find: at 0.8
#: most moved and rescanned copies (``vismemo calibrate``'s defaults row on both readers' held-out pairs), at 0.2 and
#: at 0 forms of the tiny GLM-4V model moved by 3 px (their regions at 0.07 and -0.02, their thumbnails aligned at
#: 0.98; ``tests/test_pixel_stage.py``), while unrelated pages of one layout pass it anyway
ADAPTIVE_TAU = -1.0


@dataclass(frozen=True)
class ModelReference:
    """What the reference images tell about one model: the means that centre its embeddings, and the highest fine
    score (mean centred token cosine) between two unrelated reference images of the same kind."""

    descriptor_mean: torch.Tensor
    token_mean: torch.Tensor
    unrelated_fine: float
    #: the highest aligned thumbnail similarity (``aligned_similarity``) of two unrelated reference images of the
    #: same kind and grid; None: not measured (no adaptive pixel stage)
    unrelated_pixel: float | None = None


@dataclass(frozen=True)
class LookupThresholds:
    """``tau``: every centred regional cosine must exceed it (coarse stage); ``tau_fine``: the mean centred token
    cosine must reach it (fine stage). ``tau_pixel`` and ``tau_near`` (both or neither; calibrated presets, or
    derived per model with ``derive_pixel``, the default): a
    candidate below ``tau_fine`` but at or above ``tau_near`` also matches when its aligned thumbnail similarity
    (``aligned_similarity``) reaches ``tau_pixel`` -- a page moved by part of a token or zoomed by a few percent,
    whose tokens all changed although its pixels did not. ``fingerprint``: the model they were calibrated for
    (None: any). ``adaptive``: ``tau_fine`` is raised, per model, to ``UNRELATED_MARGIN`` above its most similar
    unrelated reference pair (on by default; off for calibrated presets and explicit values). ``same_pixels``: the
    pixel-first stage (``core.pixel_first``) takes a stored image as the alias when at least this share of the new
    image's tokens, and of its distinctive ones, show its pixels at the same places (None: no pixel-first stage)."""

    tau: float = 0.8
    tau_fine: float = 0.85
    fingerprint: str | None = None
    adaptive: bool = True
    tau_pixel: float | None = None
    tau_near: float | None = None
    same_pixels: float | None = MIN_SAME
    #: adaptive thresholds without a pixel stage derive one from the model's reference images (``for_model``): moved,
    #: rescaled and re-encoded copies are found without calibration (the stage does not admit partly changed copies,
    #: ``core.pixel_first.partly_changed``). What such a copy reuses is the policy's to decide: the default computes
    #: one whose tokens deviate too much in full (``AttendDeviatePolicy.drift_deviation``; on the tiny reader the
    #: pages it finds moved by 1-3 pixels, whose reuse answered as the unmoved page did)
    derive_pixel: bool = True

    def for_model(self, reference: ModelReference) -> LookupThresholds:
        """The thresholds as one model uses them (``adaptive`` resolved): the default ``tau`` as ``ADAPTIVE_TAU``,
        ``tau_fine`` from ``fine_for`` and, with ``derive_pixel`` and
        no pixel stage given, one derived as ``tau_fine`` is from the model's reference images (``tau_pixel``
        ``PIXEL_MARGIN`` above their most similar unrelated thumbnails, at least ``PIXEL_FLOOR``; ``tau_near``
        ``NEAR_FLOOR``): a moved, rescaled or re-encoded copy is found without calibration."""
        if not self.adaptive:
            return self
        tau_pixel, tau_near = self.tau_pixel, self.tau_near
        if self.derive_pixel and tau_pixel is None and reference.unrelated_pixel is not None:
            tau_pixel = round(min(0.99, max(PIXEL_FLOOR, reference.unrelated_pixel + PIXEL_MARGIN)), 4)
            tau_near = NEAR_FLOOR
        tau = ADAPTIVE_TAU if self.tau == LookupThresholds.tau else self.tau  # a tau given is kept
        return replace(self, tau=tau, tau_fine=self.fine_for(reference), tau_pixel=tau_pixel, tau_near=tau_near,
                       adaptive=False)

    def fine_for(self, reference: ModelReference) -> float:
        """The fine threshold for a model: at most 1 (a tower whose unrelated reference images score within
        ``UNRELATED_MARGIN`` of 1, a random one in transformers' own tests, matches token-identical copies only)."""
        if not self.adaptive:
            return self.tau_fine
        return min(1.0, max(self.tau_fine, reference.unrelated_fine + UNRELATED_MARGIN))

    @property
    def pixel_stage(self) -> bool:
        """Whether candidates just below ``tau_fine`` get the pixel stage."""
        return self.tau_pixel is not None

    def near(self, fine: float, tau_fine: float) -> bool:
        """A fine score that needs the pixel stage to match: below ``tau_fine``, at or above ``tau_near``."""
        return self.pixel_stage and self.tau_near is not None and self.tau_near <= fine < tau_fine

    def matches(self, fine: float, tau_fine: float, pixel: Callable[[], float], partly: bool = False) -> bool:
        """The fine rule: ``fine`` reaches ``tau_fine`` (the model's, ``fine_for``), or it is ``near``, not a
        ``partly`` changed copy (``core.pixel_first.partly_changed``) and ``pixel()`` (the aligned thumbnail
        similarity, computed only then) reaches ``tau_pixel``."""
        tau_pixel = self.tau_pixel
        return fine >= tau_fine or (tau_pixel is not None and self.near(fine, tau_fine) and not partly
                                    and pixel() >= tau_pixel)

    def __post_init__(self) -> None:
        for name in ("tau", "tau_fine", "tau_pixel", "tau_near"):
            value = getattr(self, name)
            if value is None and name in ("tau_pixel", "tau_near"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a cosine in [-1, 1], got {value!r}")
        if (self.tau_pixel is None) != (self.tau_near is None):
            raise ValueError("tau_pixel and tau_near go together: give both or neither")
        same = self.same_pixels
        if same is not None and (isinstance(same, bool) or not isinstance(same, (int, float)) or not 0 < same <= 1):
            raise ValueError(f"same_pixels must be a share in (0, 1] or None, got {same!r}")

    @classmethod
    def load(cls, name_or_path: str) -> LookupThresholds:
        """A preset of ``configs/lookup/`` by name, or a YAML path (``vismemo calibrate`` writes them)."""
        from vismemo_hf.presets import find, load

        cfg = load("lookup", name_or_path)
        assert cfg is not None  # without missing_ok, load raises for an unknown preset instead
        where = find("lookup", name_or_path)
        unknown = set(cfg) - {"tau", "tau_fine", "tau_pixel", "tau_near", "same_pixels", "fingerprint", "calibration"}
        if unknown:
            raise ValueError(f"unknown lookup option(s) {sorted(unknown)} in {where}")
        missing = {"tau", "tau_fine"} - set(cfg)
        if missing:
            raise ValueError(f"lookup thresholds {where} lack {sorted(missing)}")
        fingerprint = cfg.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ValueError(f"fingerprint in {where} must be a string, got {fingerprint!r}")
        return cls(cfg["tau"], cfg["tau_fine"], fingerprint, adaptive=False, tau_pixel=cfg.get("tau_pixel"),
                   tau_near=cfg.get("tau_near"), same_pixels=cfg.get("same_pixels", MIN_SAME))

    def as_dict(self) -> dict:
        return asdict(self)


def regional_cosines(a: torch.Tensor, b: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(4,) centred cosines of two images' region descriptors (the coarse rule, exactly)."""
    m = mean.float().cpu()
    return F.cosine_similarity(a.float().cpu() - m, b.float().cpu() - m, dim=-1)


def centred_tokens(embeds: torch.Tensor, token_mean: torch.Tensor) -> torch.Tensor:
    """(N, d) L2-normalised tokens centred by the model's mean token, normalised again: what the fine rule compares."""
    return F.normalize(F.normalize(embeds.float(), dim=-1) - token_mean.float().to(embeds.device), dim=-1)


#: the fine stage also compares a request's image with a cached one moved by up to this many visual tokens along
#: each axis (a page scrolled or moved by whole tokens), over the tokens both show
MAX_SHIFT = 1
#: the least share of the image a moved comparison must overlap
MIN_OVERLAP = 0.75


def best_shift(a: torch.Tensor, b: torch.Tensor, hw: tuple[int, int],
               max_shift: int = MAX_SHIFT) -> tuple[float, tuple[int, int]]:
    """(score, (dy, dx)): the highest mean cosine of ``a``'s rows (N, d, unit vectors of an h x w token grid) with
    ``b``'s moved by (dy, dx) tokens (token (r, c) of ``a`` against (r + dy, c + dx) of ``b``) over the tokens both
    hold, for |dy|, |dx| <= ``max_shift`` and an overlap of at least ``MIN_OVERLAP``. The unmoved comparison comes
    first and wins ties; a grid with other than h x w tokens (video frames) is compared unmoved only."""
    a, b = a.float(), b.float().to(a.device)
    h, w = hw
    best = (float((a * b).sum(-1).mean()), (0, 0))
    if a.shape[0] != h * w or b.shape != a.shape:
        return best
    grid_a, grid_b = a.reshape(h, w, -1), b.reshape(h, w, -1)
    shifts, scores = [], []
    for dy in range(-max_shift, max_shift + 1):
        for dx in range(-max_shift, max_shift + 1):
            if (dy, dx) == (0, 0) or (h - abs(dy)) * (w - abs(dx)) < MIN_OVERLAP * h * w:
                continue
            part_a = grid_a[max(0, -dy): h - max(0, dy), max(0, -dx): w - max(0, dx)]
            part_b = grid_b[max(0, dy): h - max(0, -dy), max(0, dx): w - max(0, -dx)]
            shifts.append((dy, dx))
            scores.append((part_a * part_b).sum(-1).mean())
    for shift, score in zip(shifts, torch.stack(scores).tolist() if scores else []):  # one read for every shift
        if score > best[0]:
            best = (score, shift)
    return best


def fine_score(a: torch.Tensor, b: torch.Tensor, grid: tuple[int, int, int], merge: int,
               token_mean: torch.Tensor, max_shift: int | None = None) -> tuple[float, tuple[int, int]]:
    """The fine rule at full width for two images' tokens (N, d) of one ``grid``: (score, shift) of ``best_shift``
    on their centred tokens (``max_shift``: its moves, default ``MAX_SHIFT``; 0 for a family whose copies are
    matched unmoved, ``ModelAdapter.movable``)."""
    return best_shift(centred_tokens(a, token_mean), centred_tokens(b, token_mean), token_grid(grid, merge)[1:],
                      MAX_SHIFT if max_shift is None else max_shift)


#: the pixel stage zooms a candidate's thumbnail by up to this factor either way (a crop or a rescan at another
#: scale) and moves it by up to one visual token (a scroll or shift by part of a token)
PIXEL_ZOOM = 1.06
_ZOOM_STEPS = 25
#: the largest move, in visual tokens, that a zoom about the centre may cause at the image's edge for the tokens
#: to line up with the cached image's (``zoom_drift``); a copy zoomed further is found but computed in full
MAX_ZOOM_DRIFT = 0.125


def _high_pass(x: torch.Tensor, k: int) -> torch.Tensor:
    """(B, 1, H, W) minus its k x k local mean: glyph and edge detail, not the page's shading."""
    return x - F.avg_pool2d(x, k, 1, k // 2, count_include_pad=False)


def _coordinates(n: int, scale: torch.Tensor, move: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis of n pixels sampled at ``scale * x + move`` (P each; normalised, ``align_corners=False``): (P, n)
    source coordinates, and 1 where a point lies inside the image (at least half a pixel from its edge), else 0."""
    x = (2 * torch.arange(n, dtype=torch.float32) + 1) / n - 1
    src = scale[:, None] * x[None] + move[:, None]
    return src, (src.abs() <= 1 - 1 / n).float()


def _warps(hb: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hb`` (H, W) sampled at each (zoom, ty, tx) of ``params`` (P, 3; moves in normalised units): (warps (P, H, W),
    zero where a warp has none of ``hb``'s pixels; (P, H) and (P, W) masks of that area, whose outer product is its
    mask). A zoom and a move act on each axis alone: the sampling grid and the mask are built per axis (an affine
    grid and a 2-D mask cost more than the sampling)."""
    h, w = hb.shape
    src_y, inside_y = _coordinates(h, params[:, 0], params[:, 1])
    src_x, inside_x = _coordinates(w, params[:, 0], params[:, 2])
    p = params.shape[0]
    grid = torch.stack([src_x[:, None, :].expand(p, h, w), src_y[:, :, None].expand(p, h, w)], -1)
    warped = F.grid_sample(hb.expand(p, 1, h, w), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return warped[:, 0], inside_y, inside_x


def _interior(n: int, k: int) -> torch.Tensor:
    """(n,) 1 on an axis of n thumbnail pixels away from its edges by half the high-pass kernel ``k`` and a pixel,
    else 0: a copy moved by a few pixels shows a border its original has not (a strip filled white, a cut edge),
    which the high pass turns into the strongest detail of a smooth image; all 1 when too little would be left."""
    margin = k // 2 + 1
    inside = torch.zeros(n)
    inside[margin: n - margin] = 1.0
    return inside if n - 2 * margin >= 4 else torch.ones(n)


def _inside_sums(x: torch.Tensor, inside_y: torch.Tensor, inside_x: torch.Tensor) -> torch.Tensor:
    """(P,) sums of each (H, W) plane of ``x`` (P or 1 of them) over its warp's area (the outer product of the
    masks), without building the (P, H, W) mask."""
    return (inside_y[:, None, :] @ x @ inside_x[:, :, None]).reshape(-1)


def zoom_drift(zoom: float, hw: tuple[int, int]) -> float:
    """How far, in visual tokens, a zoom by ``zoom`` about the centre moves the content at the edge of an h x w
    token grid."""
    return abs(zoom - 1.0) * max(hw) / 2


def fast_size(n: int) -> int:
    """The smallest length >= ``n`` whose only prime factors are 2, 3 and 5 (an FFT of it is fast; one of a length
    with larger factors, such as 119 = 7 x 17, is several times slower)."""
    while True:
        m = n
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        if m == 1:
            return n
        n += 1


#: what the refinement of ``aligned_similarity`` may add to the score of the best whole-pixel and whole-zoom-step
#: alignment, over the request's own loss of similarity when moved by half a pixel both ways (``_half_pixel_loss``):
#: at most 0.78 seen (copies moved by 2, 10 and 14 image pixels, a quarter to half a thumbnail pixel off the lattice;
#: a page turned by a degree 0.52, one scrolled 0.19; zooms, rescans, global changes 0.14 or less;
#: ``benchmarks/pixel_refine.py``, ``results/lookup/pixel-refine.md``); a search asked only whether a score is reached
#: stops when even this much more, with a margin, falls short
REFINE_GAIN = 1.5
REFINE_SLACK = 0.02


def _half_pixel_loss(ha: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> float:
    """1 minus the normalised correlation of the high-passed thumbnail ``ha`` with itself moved by half a pixel
    along both axes, on its interior (``rows``, ``cols``): what an alignment off by the lattice's worst half pixel
    loses on this image (sharp glyphs lose more than smooth shading)."""
    h, w = ha.shape
    moved, inside_y, inside_x = _warps(ha, torch.tensor([[1.0, 1.0 / h, 1.0 / w]]))
    inside_y, inside_x = inside_y * rows, inside_x * cols
    den = (_inside_sums(ha.square()[None], inside_y, inside_x)
           * _inside_sums(moved.square(), inside_y, inside_x)).sqrt().clamp_min(1e-8)
    return 1.0 - float(_inside_sums(ha * moved, inside_y, inside_x) / den)


#: the pixel stage's prepared thumbnails (``_request_side``, ``_candidate_side``): the request's, aligned with
#: each of its candidates, and the store's candidates, which come back as the same tensors; about 40 of the largest
#: thumbnails' candidate sides
_PREPARED = TensorMemo(128 << 20)


@dataclass(frozen=True)
class _Request:
    """A request's thumbnail prepared for ``aligned_similarity``: high-passed (``ha``), its interior masks, the
    conjugate spectrum of its interior at the correlation's ``size``, and its energy."""

    ha: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    size: tuple[int, int]
    spectrum: torch.Tensor
    energy: torch.Tensor

    @functools.cached_property
    def half_pixel_loss(self) -> float:
        return _half_pixel_loss(self.ha, self.rows, self.cols)


@dataclass(frozen=True)
class _Candidate:
    """A candidate's thumbnail prepared for ``aligned_similarity``: high-passed (``hb``), and the spectrum of each
    of its zooms (``zooms``) on the area it covers."""

    hb: torch.Tensor
    zooms: torch.Tensor
    spectrum: torch.Tensor


def _kernel(per_token: int) -> int:
    return 2 * (per_token // 2) + 3  # odd, a little wider than a token


def _correlation_size(shape, per_token: int) -> tuple[int, int]:
    return fast_size(shape[0] + per_token), fast_size(shape[1] + per_token)  # no move up to a token wraps around


def _request_side(a: torch.Tensor, per_token: int) -> _Request:
    def compute():
        h, w = a.shape
        k = _kernel(per_token)
        ha = _high_pass(a.float()[None, None] / 255, k)[0, 0]
        rows, cols = _interior(h, k), _interior(w, k)
        size = _correlation_size(a.shape, per_token)
        spectrum = torch.fft.rfft2(ha * (rows[:, None] * cols[None, :]), s=size).conj()
        energy = ha.square()
        return _Request(ha, rows, cols, size, spectrum, energy), 2 * ha.nbytes + 8 * spectrum.numel() + energy.nbytes

    return _PREPARED.get(a, ("request", per_token), compute)


def _candidate_side(b: torch.Tensor, per_token: int) -> _Candidate:
    def compute():
        hb = _high_pass(b.float()[None, None] / 255, _kernel(per_token))[0, 0]
        zooms = torch.linspace(1 / PIXEL_ZOOM, PIXEL_ZOOM, _ZOOM_STEPS)
        warped, inside_y, inside_x = _warps(hb, torch.stack([zooms, torch.zeros_like(zooms),
                                                             torch.zeros_like(zooms)], 1))
        warped = warped * (inside_y[:, :, None] * inside_x[:, None, :])
        spectrum = torch.fft.rfft2(warped, s=_correlation_size(b.shape, per_token))
        return _Candidate(hb, zooms, spectrum), hb.nbytes + 8 * spectrum.numel()

    return _PREPARED.get(b, ("candidate", per_token), compute)


def aligned_similarity(a: torch.Tensor, b: torch.Tensor, per_token: int, hopeless_below: float | None = None,
                       enough: float | None = None) -> tuple[float, float]:
    """The pixel stage of the fine lookup: the highest normalised cross-correlation of the high-passed thumbnails
    ``a`` (the request's) and ``b`` (a candidate's; (H, W) uint8 of ``per_token`` px per visual token) over ``b``
    zoomed by up to ``PIXEL_ZOOM`` either way and moved by up to one visual token, on the area both show (at least
    ``MIN_OVERLAP``) away from ``a``'s edges (``_interior``). Each zoom (steps of 0.5 %) takes its best move from one
    FFT cross-correlation; the three best are refined on finer grids. Returns (similarity, the zoom it found: point
    x of ``a``, from the centre, shows ``b``'s zoom * x); (-1, 1) when the thumbnails differ in shape.

    A caller that only asks whether the similarity reaches a value lets the search stop once the answer is known:
    ``hopeless_below`` -- the three best whole-pixel alignments score below it by more than refinement can add
    (``REFINE_GAIN`` times ``_half_pixel_loss`` plus ``REFINE_SLACK``): another page of a layout, most of a miss's
    candidates, costs a fifth of a full search; ``enough`` -- a score reaches it (exact: refining only raises the
    score). Either way the similarity returned is the best found so far, on the same side of the value as the full
    search's; the zoom is that alignment's."""
    if a.shape != b.shape or a.ndim != 2 or min(a.shape) < 4:
        return -1.0, 1.0
    h, w = a.shape
    mine, theirs = _request_side(a, per_token), _candidate_side(b, per_token)
    ha, hb, rows, cols, zooms = mine.ha, theirs.hb, mine.rows, mine.cols, theirs.zooms
    corr = torch.fft.irfft2(mine.spectrum * theirs.spectrum, s=mine.size)
    m = per_token
    corr = torch.roll(corr, (m, m), (1, 2))[:, : 2 * m + 1, : 2 * m + 1].reshape(_ZOOM_STEPS, -1)
    peak, where = corr.max(1)
    top = peak.argsort(descending=True)[:3]
    at = where[top]
    best = torch.stack([zooms[top], 2 * (at // (2 * m + 1) - m).float() / h, 2 * (at % (2 * m + 1) - m).float() / w], 1)
    steps = torch.tensor([float(zooms[1] - zooms[0]) / 2, 2 / h, 2 / w])
    offsets = torch.stack(torch.meshgrid(*[torch.arange(-1.0, 2.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
    energy_a = mine.energy

    def scores(params: torch.Tensor) -> torch.Tensor:  # (P,) normalised correlation of each alignment, -1 if too small
        warped, inside_y, inside_x = _warps(hb, params)
        overlap = inside_y.mean(1) * inside_x.mean(1)
        inside_y, inside_x = inside_y * rows, inside_x * cols
        den = (_inside_sums(energy_a[None], inside_y, inside_x)
               * _inside_sums(warped.square(), inside_y, inside_x)).sqrt().clamp_min(1e-8)
        ncc = _inside_sums(ha * warped, inside_y, inside_x) / den
        return torch.where(overlap >= MIN_OVERLAP, ncc, torch.full_like(ncc, -1.0))

    if hopeless_below is not None or enough is not None:
        lattice = scores(best)
        score, zoom = float(lattice.max()), float(best[int(lattice.argmax()), 0])
        if enough is not None and score >= enough:
            return score, zoom
        if hopeless_below is not None and \
                score + REFINE_GAIN * mine.half_pixel_loss + REFINE_SLACK < hopeless_below:
            return score, zoom
    score, zoom = -1.0, 1.0
    for _ in range(3):
        params = (best[:, None] + offsets[None] * steps).reshape(-1, 3)
        ncc = scores(params).reshape(len(best), -1)
        best = params.reshape(len(best), -1, 3)[torch.arange(len(best)), ncc.argmax(1)]
        if float(ncc.max()) > score:
            score, zoom = float(ncc.max()), float(best[int(ncc.max(1).values.argmax()), 0])
        if enough is not None and score >= enough:
            break
        steps = steps / 2
    return score, zoom


#: the least aligned thumbnail similarity (``aligned_similarity``) of a candidate the fine stage matched by its
#: tokens alone: another page of one layout can pass the tokens' rule (receipts of the base reader's streams,
#: ``benchmarks/stream_recall.py``), while the copies the fine stage finds (moved, rescanned, re-encoded, brightened,
#: cropped) align as closely as the pixel stage asks, and the closest unrelated calibration pairs of both readers
#: align less (``results/lookup/``); a copy that fails it is a miss (``runtime.lookup``; ``vismemo calibrate``'s rule
#: counts it so)
ENCODER_PIXEL_AGREE = 0.9


#: the most a copy's parts may move against its centre (turned, zoomed, bent: ``local_drift``), in visual tokens, for
#: its tokens to be reused from the cached image's; a copy warped further is found but computed in full
MAX_DRIFT = 0.045
#: the fewest regions whose move ``local_drift`` must find to judge a copy (fewer: a blank page says nothing)
MIN_REGIONS = 4
_MIN_NCC = 0.6


def local_drift(a: torch.Tensor, b: torch.Tensor, per_token: int) -> float:
    """How far, in visual tokens, parts of thumbnail ``a`` (the request's) are moved against ``b`` (the cached
    image's) beyond one common move: the largest move, at the regions found, of the affine warp that explains their
    moves. The common move is the best of the whole thumbnails' cross-correlation (up to a token either
    way); each region of 2-4 tokens a side with detail is then matched to ``b`` within two pixels of it (normalised
    cross-correlation of the high-passed thumbnails, the peak refined to part of a pixel by a Lucas-Kanade step,
    which gives exactly 0 for identical content), and an affine move is
    fitted to the regions by least squares, refitted without those it does not explain (an edit, a dialog). 0 when
    fewer than ``MIN_REGIONS`` regions match: nothing to judge. A page moved as a whole, edited or rescanned drifts by
    about 0 (up to about 0.03 token on the base reader's 16 x 16-token pages moved by 2-3 px, with a dialog, an edit
    or a JPEG rescan, 0.023 on the tiny reader's 8 x 6-token forms); a 16 x 16-token page turned by half a degree or
    zoomed by 1 % by 0.06-0.09, an 8 x 6 one turned by a degree or zoomed by 2 % by 0.06-0.09 (``tests/test_context.py``;
    an 8 x 6 form turned by half a degree, 0.03-0.04, is within ``MAX_DRIFT``)."""
    moves, centres = _region_moves(a, b, per_token)
    if len(moves) < MIN_REGIONS:
        return 0.0
    h, w = a.shape
    keep = torch.ones(len(moves), dtype=torch.bool)
    for _ in range(3):  # a least-squares affine move, refitted without the regions it does not explain (edits)
        design = torch.cat([torch.ones(int(keep.sum()), 1), centres[keep]], 1)
        fit = torch.linalg.lstsq(design, moves[keep]).solution  # (3, 2): the common move, then the warp
        residual = (torch.cat([torch.ones(len(moves), 1), centres], 1) @ fit - moves).abs().amax(1)
        keep = residual <= max(0.5, float(residual[keep].median()) * 3)
        if int(keep.sum()) < MIN_REGIONS:
            return 0.0
    return float((centres[keep] @ fit[1:]).abs().max()) / per_token  # at the regions found: no extrapolation


def _region_moves(a: torch.Tensor, b: torch.Tensor, per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((R, 2) moves (dy, dx), (R, 2) region centres from the image's centre), in thumbnail pixels, of the regions of
    ``a`` found in ``b`` (``local_drift``): every region's normalised cross-correlation at every move near the common
    one at once, the peak refined by one Lucas-Kanade step."""
    empty = torch.zeros(0, 2), torch.zeros(0, 2)
    if a.shape != b.shape or a.ndim != 2 or min(a.shape) < 2 * per_token:
        return empty
    ha, hb = _request_side(a, per_token).ha, _candidate_side(b, per_token).hb  # as the pixel stage prepared them
    h, w = a.shape
    m = per_token
    size = _correlation_size(a.shape, per_token)
    corr = torch.fft.irfft2(torch.fft.rfft2(hb, s=size) * torch.fft.rfft2(ha, s=size).conj(), s=size)
    corr = torch.roll(corr, (m, m), (0, 1))[: 2 * m + 1, : 2 * m + 1]
    gy, gx = divmod(int(corr.argmax()), corr.shape[1])
    gy, gx = gy - m, gx - m  # b's content at (y + gy, x + gx) is a's at (y, x)
    r = 2  # the search around the common move, in thumbnail pixels
    side = per_token * max(2, min(4, min(h, w) // per_token // 3))
    rows, cols = h // side, w // side
    ha = ha[: rows * side, : cols * side]
    pad = m + r + 1  # and a pixel for the gradients at the edge
    padded = F.pad(hb, (pad, pad, pad, pad))
    energy_a = F.avg_pool2d(ha.square()[None, None], side)[0, 0].reshape(-1)
    # every move near the common one at once: (M, ...) planes of b, each a little wider for the gradients at the edge
    tops = [(pad + gy + dy, pad + gx + dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1)]
    wide = torch.stack([padded[t - 1: t + rows * side + 1, c - 1: c + cols * side + 1] for t, c in tops])
    moved = wide[:, 1:-1, 1:-1]

    def pool(x):  # (M, H, W) -> (M, regions): each region's mean
        return F.avg_pool2d(x[:, None], side)[:, 0].reshape(len(tops), -1)

    surface = pool(ha * moved) / (energy_a * pool(moved.square())).sqrt().clamp_min(1e-12)
    # the part of a pixel left, by one Lucas-Kanade step at each move: a(x) ~ b(x + move) + grad b . delta
    # (exactly 0 for identical content, which a parabola through the correlation peak is not)
    grad_y = (wide[:, 2:, 1:-1] - wide[:, :-2, 1:-1]) / 2
    grad_x = (wide[:, 1:-1, 2:] - wide[:, 1:-1, :-2]) / 2
    err = ha - moved
    syy, sxx, sxy = pool(grad_y * grad_y), pool(grad_x * grad_x), pool(grad_y * grad_x)
    ey, ex = pool(grad_y * err), pool(grad_x * err)
    det = (syy * sxx - sxy * sxy).clamp_min(1e-12)
    refined = torch.stack([(sxx * ey - sxy * ex) / det, (syy * ex - sxy * ey) / det], 2).clamp(-1, 1)
    peak, where = surface.max(0)  # over the moves, per region
    best = refined[where, torch.arange(rows * cols)]  # (regions, 2)
    py, px = where // (2 * r + 1), where % (2 * r + 1)
    inside = (py > 0) & (py < 2 * r) & (px > 0) & (px < 2 * r)  # a peak at the search's edge may lie beyond it
    ok = (peak >= _MIN_NCC) & (energy_a > 1e-5) & inside
    moves = torch.stack([gy + py - r + best[:, 0], gx + px - r + best[:, 1]], 1)
    gr, gc = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    centres = torch.stack([(gr.reshape(-1) + 0.5) * side - h / 2, (gc.reshape(-1) + 0.5) * side - w / 2], 1).float()
    return moves[ok], centres[ok]
