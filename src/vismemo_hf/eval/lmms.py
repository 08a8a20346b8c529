"""lmms-eval backend ``vismemo`` (registered through the ``lmms_eval.models`` entry point).

    lmms-eval --model vismemo --model_args pretrained=vismemo-docqa-tiny \
        --tasks vismemo_synthdoc --include_path "$(vismemo tasks-path)"

One store lives for the whole run and requests are answered in document order, so hits happen
as in the stream. ``store`` names a store preset, and ``kv_format`` / ``keep_ratio`` model_args
set those store options (8-bit or compressed entries); every other model_arg goes to
``VisMemoCache`` (policy options, ``thresholds`` = a calibrated lookup preset, ``tau``, ...). The
hit kind of every answer is kept in ``HIT_KINDS`` (doc id -> kind) for the tasks'
``process_results`` (same process), which report ANLS per hit kind.
"""

from __future__ import annotations

import torch
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest
from tqdm import tqdm

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.eval.loading import load_model
from vismemo_hf.runtime.cache import DEFAULT_POLICY

HIT_KINDS: dict[str, str] = {}
#: model_args that configure the store rather than the cache
#: store options the backend takes from model_args (a store secret comes from VISMEMO_STORE_SECRET, never from
#: model_args, which lmms-eval writes into its results)
STORE_OPTIONS = ("kv_format", "keep_ratio", "namespace")


def _number(value):
    if not isinstance(value, str):
        return value
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None, "null": None}.get(value.lower(), value)


class VisMemoLMM(lmms):
    is_simple = True

    def __init__(self, pretrained: str = "vismemo-docqa-tiny", policy: str = DEFAULT_POLICY, store: str = "memory",
                 max_new_tokens: int = 16, dtype: str = "float32", device: str = "cpu", batch_size=1, **method_args):
        super().__init__()
        if int(batch_size) != 1:
            raise ValueError(f"the vismemo backend answers one request at a time, in stream order (a hit depends on "
                             f"what came before it); run with --batch_size 1, not {batch_size}")
        self.model, self.processor = load_model(pretrained, dtype=getattr(torch, dtype))
        self.model.to(device)
        enable(self.model)
        store_options = {k: (str if k == "namespace" else _number)(method_args.pop(k)) for k in STORE_OPTIONS
                         if k in method_args}
        self.store = VisMemoStore.from_config(store, **store_options)
        self.policy = policy
        self.options = {k: _number(v) for k, v in method_args.items()}
        self.max_new_tokens = int(max_new_tokens)

    def generate_until(self, requests) -> list[str]:
        answers = [""] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: requests[i].args[3])  # stream (document) order
        for i in tqdm(order, desc="vismemo", disable=len(order) < 2):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = requests[i].args
            doc = self.task_dict[task][split][doc_id]
            images = doc_to_visual(doc)
            images = images if isinstance(images, list) else [images]
            prefix = doc.get("prefix") or ""  # text before the image (stream rows may carry one)
            content = ([{"type": "text", "text": prefix}] if prefix else []) + [{"type": "image"} for _ in images]
            content.append({"type": "text", "text": context})
            text = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            inputs = self.processor(text=[text], images=images, return_tensors="pt").to(self.model.device)
            cache = VisMemoCache(store=self.store, policy=self.policy, **self.options)
            with torch.no_grad():
                out = self.model.generate(**inputs, cache=cache, do_sample=False,
                                          max_new_tokens=int(gen_kwargs.get("max_new_tokens", self.max_new_tokens)))
            answers[i] = self.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                                         skip_special_tokens=True).strip()
            HIT_KINDS[str(doc.get("id", f"{task}/{doc_id}"))] = ",".join(str(e.kind) for e in cache.events) or "text"
        return answers

    def generate_until_multi_round(self, requests) -> list[str]:
        return self.generate_until(requests)

    def loglikelihood(self, requests):
        raise NotImplementedError("the vismemo backend only generates")


def manifests():
    return [ModelManifest(model_id="vismemo", simple_class_path="vismemo_hf.eval.lmms.VisMemoLMM")]
