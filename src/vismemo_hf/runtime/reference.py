"""A model's lookup reference (``core.thresholds.ModelReference``), computed with the model's own vision tower."""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from vismemo_hf.core.features import region_descriptors, thumb_per_token
from vismemo_hf.core.images import IMAGE_KINDS, reference_images
from vismemo_hf.core.thresholds import ModelReference, aligned_similarity, fine_score

logger = logging.getLogger(__name__)


def encode_images(adapter, get_image_features, images) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
    """(embeds, grid) of each image through the model's own tower, in one batch."""
    items = adapter.processed_images(adapter.image_processor()(images=[im.convert("RGB") for im in images],
                                                               return_tensors="pt"))
    dtype = next(adapter.model.parameters()).dtype
    device = next(adapter.model.parameters()).device
    with torch.no_grad():
        encoded = adapter.encode_images(get_image_features, [(p.to(device=device, dtype=dtype), g, x)
                                                             for p, g, x in items])
    return [(e.float().cpu(), g) for (e, _), (_, g, _) in zip(encoded, items)]


def thumbnails(adapter, images) -> list[torch.Tensor | None]:
    """The lookup's thumbnail of each image (``ModelAdapter.thumbnail_of``), from the model's own processor output."""
    processor = adapter.image_processor()
    out = []
    for image in images:
        (pixels, grid, extra), = adapter.processed_images(processor(images=[image.convert("RGB")], return_tensors="pt"))
        made = adapter.thumbnail_of(pixels, grid, extra)
        out.append(made() if made is not None else None)
    return out


def model_reference(adapter, get_image_features) -> ModelReference:
    """Encode the reference images with the model's tower: their mean region descriptor and mean L2-normalised
    token centre the lookup; pairs of the same kind give the unrelated-pair fine score and, from their thumbnails,
    the unrelated-pair pixel score (``aligned_similarity``) an adaptive pixel stage keeps above."""
    images = reference_images()
    encoded = encode_images(adapter, get_image_features, images)
    descriptors = torch.stack([region_descriptors(e, g, adapter.merge) for e, g in encoded])
    token_mean = torch.cat([F.normalize(e, dim=-1) for e, _ in encoded]).mean(0)
    pairs = [(i, j) for i in range(len(encoded)) for j in range(i + 1, len(encoded))
             if i % len(IMAGE_KINDS) == j % len(IMAGE_KINDS) and encoded[i][1] == encoded[j][1]]
    unrelated = [fine_score(encoded[i][0], encoded[j][0], encoded[i][1], adapter.merge, token_mean,
                             adapter.max_shift)[0]
                 for i, j in pairs]
    thumbs = thumbnails(adapter, images)
    pixel = [aligned_similarity(a, b, thumb_per_token(adapter.thumbnail_hw(encoded[i][1])))[0]
             for i, j in pairs for a, b in [(thumbs[i], thumbs[j])] if a is not None and b is not None]
    return ModelReference(descriptors.mean((0, 1)), token_mean, max(unrelated), max(pixel) if pixel else None)


#: model references computed in this process, by fingerprint (a new store of a known model reuses them)
_REFERENCES: dict[str, ModelReference] = {}
_COMPUTING = threading.Lock()


def reference_for(adapter, get_image_features) -> ModelReference:
    """The model's reference, computed with its tower once per process and weights (threads asking together wait
    for one computation)."""
    fp = adapter.fingerprint
    found = _REFERENCES.get(fp)
    if found is not None:
        return found
    with _COMPUTING:
        if fp not in _REFERENCES:
            if len(_REFERENCES) >= 16:
                _REFERENCES.pop(next(iter(_REFERENCES)))
            _REFERENCES[fp] = model_reference(adapter, get_image_features)
        return _REFERENCES[fp]


def prepare(adapter, get_image_features) -> None:
    """Compute the model's reference now (``enable``), so that no request pays for it. A model that cannot encode
    the reference images yet (weights still on ``meta``, say) computes it on its first approximate lookup."""
    if not adapter.approximate:
        return
    if torch.get_default_device().type == "meta" or any(p.is_meta for p in adapter.model.parameters()):
        logger.info("vismemo: the model is on meta; its lookup reference is computed on the first lookup")
        return
    try:
        reference_for(adapter, get_image_features)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        logger.info("vismemo: the lookup reference is computed on the first lookup instead (%s: %s)",
                    type(err).__name__, err)
