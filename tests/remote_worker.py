"""One serving process of the two-process Redis test: ``python remote_worker.py URL ROLE`` prints JSON.

``writer``: serves the base page (a miss) with local RAM tiers + the remote tier.
``reader``: serves an edited copy and the base page through its own local tiers + the remote tier,
then, with no remote tier, its own full prefill of the base page and its own approximate run of
the edited copy (base first, then the edit) as references.
"""

import json
import os
import sys

os.environ.setdefault("VISMEMO_STORE", "memory")
sys.path.insert(0, os.path.dirname(__file__))

from transformers import DynamicCache  # noqa: E402

import vismemo_hf  # noqa: E402

from conftest import _enabled_tiny, build_inputs, generate, page_set  # noqa: E402

OPTS = dict(policy="vismemo", reuse_ratio=0.5, entropy_threshold=1.0)


def run(model, processor, image, cache):
    tokens, scores = generate(model, build_inputs(processor, [image]), cache, 4)
    return {"tokens": tokens.tolist(), "scores": scores.tolist(),
            "kind": str(cache.events[0].kind) if getattr(cache, "events", None) else "none"}


def main(url: str, role: str) -> None:
    model, processor = _enabled_tiny("qwen2_vl")
    images = page_set()
    remote = vismemo_hf.VisMemoStore(remote_url=url, remote_options={"refresh_s": 0})
    out = {}
    if role == "writer":
        out["base"] = run(model, processor, images["base"], vismemo_hf.VisMemoCache(store=remote, **OPTS))
    else:
        # the edited copy first, so that its approximate hit reads Redis (an exact hit would promote the base)
        out["edit"] = run(model, processor, images["edit"], vismemo_hf.VisMemoCache(store=remote, **OPTS))
        out["base"] = run(model, processor, images["base"], vismemo_hf.VisMemoCache(store=remote, **OPTS))
        out["full_base"] = run(model, processor, images["base"], DynamicCache())
        out["full_edit"] = run(model, processor, images["edit"], DynamicCache())
        local = vismemo_hf.VisMemoStore()
        run(model, processor, images["base"], vismemo_hf.VisMemoCache(store=local, **OPTS))
        out["local_edit"] = run(model, processor, images["edit"], vismemo_hf.VisMemoCache(store=local, **OPTS))
    remote.flush()
    out["stats"] = remote.stats()
    remote.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
