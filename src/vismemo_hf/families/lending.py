"""Vision towers that encode some of an image's tokens, lent the alias's tower K/V of the rest (encoder reuse,
docs/METHOD.md §1 step 2): the Qwen-VL families and GLM-4V, whose towers attend per image through the attention
interface that ``families.tower_kv`` records and lends to. A family file mixes ``LendingTower`` in before
``ModelAdapter`` and writes its ``encode_tokens`` (how its tower is handed a subset of patches at their places).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vismemo_hf.core.checks import all_finite


def subset_patches(items, merge: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """For ``items`` (pixels (P, C), grid, tokens (sorted)): the tokens' patch rows in one sequence, each patch's
    (h, w) position in its whole image (as the tower computes it from the grid), and the sequence's image bounds."""
    from transformers.vision_utils import get_vision_position_ids

    unit = merge**2
    rows, positions, lengths = [], [], [0]
    for pixels, grid, tokens in items:
        patch_rows = (tokens.to(torch.long)[:, None] * unit + torch.arange(unit)).reshape(-1)
        positions.append(get_vision_position_ids(torch.tensor([grid]), merge)[patch_rows])
        rows.append(pixels[patch_rows.to(pixels.device)])
        lengths.append(lengths[-1] + patch_rows.numel())
    return torch.cat(rows), torch.cat(positions), lengths


class LendingTower:
    """What a tower that keeps and lends its own K/V adds to an adapter (``ModelAdapter`` declares the defaults)."""

    partial_encoder: ClassVar[bool] = True

    if TYPE_CHECKING:  # what the ``ModelAdapter`` it is mixed into gives it, declared for the type checker only
        @property
        def base(self) -> Any: ...

    def lending(self, items, lent):
        """The context of a partial encode of ``items``: lent (``lent`` per image, an alias's tower K/V) the other
        patches of each image at every full-attention block, or (None) nothing."""
        from vismemo_hf.families import tower_kv

        if lent is None:
            return contextlib.nullcontext()
        unit, kept = self.merge**2, []
        for (_, _, tokens), kv in zip(items, lent):
            others = torch.ones(kv.shape[2] // unit, dtype=torch.bool)
            others[tokens.to(torch.long).cpu()] = False
            kept.append((kv, (torch.nonzero(others).flatten()[:, None] * unit + torch.arange(unit)).reshape(-1)))
        return tower_kv.lend(self.base.visual, kept)

    def encode_capturing(self, get_image_features, pixel_values, grids):
        """``encode``, and per image what gives its tower K/V when called (``families.tower_kv.capture``: laid out
        for later partial encodes by the entry's build, off the request's path); (outputs, None) when the tower runs
        flash attention (whose fused kernel has no place to lend K/V to)."""
        from vismemo_hf.families import tower_kv

        if not tower_kv.can_capture(self.base.visual):
            return self.encode(get_image_features, pixel_values, grids), None
        with tower_kv.capture(self.base.visual, self.tower_order(grids)) as kvs:
            out = self.encode(get_image_features, pixel_values, grids)
        return out, kvs

    def tower_order(self, grids) -> list[torch.Tensor | None]:
        """Per image, the patch order its full-attention blocks see (None: its own)."""
        return [None] * len(grids)

    def lendable(self, tower: torch.Tensor | None, patches: int) -> bool:
        """Whether ``tower`` (an entry's tower K/V) fits this tower for an image of ``patches`` patches and is
        finite: anything else (another model's, a damaged entry's) is never lent."""
        from vismemo_hf.families import tower_kv

        return tower is not None and tuple(tower.shape) == tower_kv.expected_shape(self.base.visual, patches) and \
            all_finite(tower, remember=True)

    @staticmethod
    def _lending(vision) -> tuple[int, int]:
        """(full-attention blocks, their width)."""
        width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL: embed_dim; hidden_size: out
        full = getattr(vision, "fullatt_block_indexes", None)
        return (len(full) if full is not None else vision.depth), width

    @classmethod
    def lent_flops(cls, vision, encoded: int, patches: int) -> float:
        """Each full-attention block: the encoded patches' queries over the other patches' lent keys."""
        if not cls.partial_encoder:
            return 0.0
        blocks, width = cls._lending(vision)
        return blocks * 4 * encoded * (patches - encoded) * width

    @classmethod
    def tower_kv_values(cls, vision, patches: int) -> int:
        if not cls.partial_encoder:
            return 0
        blocks, width = cls._lending(vision)
        return blocks * 2 * patches * width
