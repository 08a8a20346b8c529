"""The one way a request runs again: images that turn out to need computing in full after their prefill started.

Three places find it out, each at the earliest point from which the answer can still be plain transformers':

- ``Scope.ENCODE``: a plan computes in full an image that was lent its alias's encoder output (``ImageMatch.
  whole_encode``): plain transformers' answer needs the image's own whole encode, so the prefill starts again from
  it (``runner.run_prefill``), those images computed in full from the start.
- ``Scope.LAYERS``: a verified reuse failed its probes (``runtime.verify``) or its row's next token is unsure (the
  confidence guard): the layers run again from the first decision layer, from the states that entered it, those
  images computed in full (``runner.PrefillRunner``). One of them lent encoder output widens this to ``ENCODE``.
- ``Scope.SEQUENCE``: a watched answer's token is unsure during decoding (``runtime.watch``): the whole sequence so
  far is computed again by the model's own forward into the emptied cache.

A ``Rerun`` says which images, why (their ``ImagePlan.fallback``: ``"context"``, ``"uncertain"``, ``"recomputed"``,
``"miss"`` for an alias that could not be read) and from where. The state each scope throws away is thrown away in
one place per owner: the prefill runner's ``reset`` (alias reads, the cache's layers from the rerun's first layer,
the warmup statistics, the forward's layout and capture, the images' plans), ``VisMemoCache.restart`` (every layer)
and ``computed_in_full`` (the events already published).
"""

from __future__ import annotations

from enum import Enum


class Scope(Enum):
    """From where a request runs again (see the module docstring)."""

    ENCODE = "encode"
    LAYERS = "layers"
    SEQUENCE = "sequence"


class Rerun(Exception):
    """Raised where a run finds that ``images`` (image -> why) must be computed in full, to be handled where
    ``scope`` starts: ``run_prefill`` for ``ENCODE``, the runner's layer loop for ``LAYERS``."""

    def __init__(self, images: dict[int, str], scope: Scope) -> None:
        super().__init__(f"images {sorted(images)} computed in full, again from the {scope.value}")
        self.images, self.scope = dict(images), scope

    def widened(self, scope: Scope) -> Rerun:
        """The same images, run again from the wider ``scope``."""
        return Rerun(self.images, scope)


def computed_in_full(event, reason: str, step: int | None = None) -> None:
    """Mark a published ``CacheEvent`` as computed in full after all (``reason``; ``step``: the decoding step of a
    watched answer's repair)."""
    event.fallback = reason
    if step is not None:
        event.repaired_at = step
    event.recomputed, event.reused, event.masked = event.n_tokens, 0, 0
