"""Watching the first tokens of an answer whose prefill reused K/V after another context (``ImagePlan.verify_watch``).

A reuse verified by probes (``runtime/verify.py``) still leaves the reused tokens a little off a full prefill's. An
answer the model is sure of does not change by that; one it is unsure of may (a digit it nearly reads otherwise).
So for the first ``steps`` generated tokens every decoding step's next-token distribution is looked at (one host sync
a step, for these requests only): when its top probability falls below the plan's ``verify_confidence``, the whole
sequence so far (the prompt and the tokens generated) is computed again by the model's own forward into the cache,
which then holds exactly what a full prefill and decoding would, and the step's output comes from it. The tokens
generated before were ones the model was sure of.

Greedy decoding and sampling of any batch are repaired; beam search reorders the watched rows with the cache; other
cache operations (``crop``, ``batch_select_indices``, ``batch_repeat_interleave``) end the watch.
"""

from __future__ import annotations

import logging

import torch

from vismemo_hf.runtime.rerun import computed_in_full

logger = logging.getLogger(__name__)


class Watch:
    """What recomputing a watched request needs: the text model's inputs of its prefill and of each step since."""

    def __init__(self, inputs_embeds, position_ids, visual_pos_masks, deepstack_visual_embeds, threshold: float,
                 steps: int, events: list, whole=None) -> None:
        #: what gives (inputs_embeds, deepstack features) of the prefill with the images lent their alias's encoder
        #: output given their own whole encode (``runner.whole_encoded``), called once a repair needs it; None: none was
        self.whole = whole
        self.embeds = [inputs_embeds]
        self.positions = [position_ids]
        self.visual_pos_masks, self.deepstack = visual_pos_masks, deepstack_visual_embeds
        self.threshold, self.steps_left, self.events = threshold, steps, events
        self.step = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search chose these rows: the recorded inputs follow them."""
        self._own_encodes()
        self.embeds = [e.index_select(0, index.to(e.device)) for e in self.embeds]
        self.positions = [p.index_select(p.ndim - 2, index.to(p.device)) for p in self.positions]
        if self.visual_pos_masks is not None:
            self.visual_pos_masks = self.visual_pos_masks.index_select(0, index.to(self.visual_pos_masks.device))

    def _own_encodes(self) -> None:
        """The prefill's inputs from the images' own whole encodes (``whole``), before anything is computed from them."""
        if self.whole is not None:
            self.embeds[0], self.deepstack = self.whole()
            self.whole = None

    def after_step(self, text, kwargs: dict, out, cache, head, own_forward):
        """After a decoding step of ``text`` (the text model) with ``kwargs``: ``out``, or the step's output from the
        whole sequence computed again when the model is unsure of its next token."""
        embeds, positions, mask = kwargs.get("inputs_embeds"), kwargs.get("position_ids"), kwargs.get("attention_mask")
        if embeds is None or positions is None or (mask is not None and mask.ndim != 2) or head is None:
            cache.watch = None  # nothing to recompute from: the watch ends
            return out
        self.embeds.append(embeds)
        self.positions.append(positions)
        self.step += 1
        self.steps_left -= 1
        top = torch.softmax(head(out.last_hidden_state[:, -1:]).float(), -1).amax(-1)
        if bool((top >= self.threshold).all()):
            if self.steps_left <= 0:
                cache.watch = None
            return out
        logger.info("vismemo: unsure of token %d of an answer after a reuse (top probability %.3f): computing the "
                    "sequence in full", self.step, float(top.min()))
        q = embeds.shape[1]
        self._own_encodes()
        full_embeds = torch.cat(self.embeds, dim=1)
        full_positions = torch.cat(self.positions, dim=-1)
        visual = self.visual_pos_masks
        if visual is not None:
            visual = torch.cat([visual, visual.new_zeros(visual.shape[0], full_embeds.shape[1] - visual.shape[1])], 1)
        cache.watch = None
        cache.restart()  # a ``Rerun`` from the sequence (``runtime.rerun``): every layer forgotten
        rest = {k: v for k, v in kwargs.items() if k not in ("inputs_embeds", "position_ids", "attention_mask",
                                                             "past_key_values", "cache", "cache_position",
                                                             "visual_pos_masks", "deepstack_visual_embeds",
                                                             "use_cache")}
        extra = {"visual_pos_masks": visual, "deepstack_visual_embeds": self.deepstack} if visual is not None else {}
        full = own_forward(text, inputs_embeds=full_embeds, attention_mask=mask, position_ids=full_positions,
                           cache=cache, use_cache=True, **extra, **rest)
        cache.rewound_to(full_embeds.shape[1] - q)  # the step's own q columns are added when its forward closes
        out.last_hidden_state = full.last_hidden_state[:, -q:]
        for event in self.events:
            computed_in_full(event, "uncertain", self.step)
        return out
