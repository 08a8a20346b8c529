"""lmms-eval backend ``vismemo`` (registered through the ``lmms_eval.models`` entry point).

    lmms-eval --model vismemo --model_args pretrained=vismemo-docqa-tiny \
        --tasks vismemo_synthdoc --include_path "$(vismemo tasks-path)"

Every task has a store of its own by default (``store_scope=task``): its requests are answered in its document
order on a fresh store, entries under a namespace of their own (``NAMESPACE/TASK``, or ``TASK``) so that even a
disk or Redis tier the tasks share never gives one task a hit on another's pages. A task's hit kinds are then the
same whichever tasks run with it. ``store_scope=run`` keeps one store for the whole run (tasks answered one after
another, in the order lmms-eval hands over their requests, so a later task can hit what an earlier one stored).
``store`` names a store preset, and ``kv_format`` / ``keep_ratio`` / ``namespace`` model_args set those store
options (8-bit or compressed entries); every other model_arg goes to ``VisMemoCache`` (policy options,
``thresholds`` = a calibrated lookup preset, ``tau``, ...). The hit kind of every answer, and its fallback (a hit
computed in full, and why), are kept in ``ANSWERS`` ((task, doc id) -> ``Answer``) for the tasks'
``process_results`` (same process), which report ANLS per hit kind and count the requests of each kind
(``answers_miss`` / ``answers_exact`` / ``answers_approximate`` / ``answers_fallback`` in the results JSON).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.eval.loading import load_model
from vismemo_hf.progress import progress
from vismemo_hf.runtime.cache import DEFAULT_POLICY
from vismemo_hf.store.store import preset_options


@dataclass(frozen=True)
class Answer:
    """What one request realised: its hit kind (one per image, comma-joined; ``text`` without images) and the first
    fallback among its images' events (``CacheEvent.fallback``: "context", "uncertain", "changed", "warp",
    "recomputed"), if any."""

    kind: str
    fallback: str | None = None


#: (task name, doc id) -> the realised ``Answer`` of that request (the tasks' ``process_results`` read it)
ANSWERS: dict[tuple[str, str], Answer] = {}
#: store options the backend takes from model_args (a store secret comes from VISMEMO_STORE_SECRET, never from
#: model_args, which lmms-eval writes into its results)
STORE_OPTIONS = ("kv_format", "keep_ratio", "namespace")
STORE_SCOPES = ("task", "run")


def _number(value):
    if not isinstance(value, str):
        return value
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None, "null": None}.get(value.lower(), value)


def doc_key(doc, doc_id) -> str:
    """The id a request's answer is recorded under: the stream row's ``id``, else its index in the task."""
    return str(doc.get("id", doc_id))


class VisMemoLMM(lmms):
    is_simple = True

    def __init__(self, pretrained: str = "vismemo-docqa-tiny", policy: str = DEFAULT_POLICY, store: str = "memory",
                 max_new_tokens: int = 16, dtype: str = "float32", device: str = "cpu", batch_size=1,
                 store_scope: str = "task", **method_args):
        super().__init__()
        if int(batch_size) != 1:
            raise ValueError(f"the vismemo backend answers one request at a time, in stream order (a hit depends on "
                             f"what came before it); run with --batch_size 1, not {batch_size}")
        if store_scope not in STORE_SCOPES:
            raise ValueError(f"store_scope must be one of {STORE_SCOPES} (a store per task, or one for the run), "
                             f"got {store_scope!r}")
        self.model, self.processor = load_model(pretrained, dtype=getattr(torch, dtype))
        self.model.to(device)
        enable(self.model)
        overrides = {k: (str if k == "namespace" else _number)(method_args.pop(k)) for k in STORE_OPTIONS
                     if k in method_args}
        self.store_scope = store_scope
        self.store_options = preset_options(store, overrides)  # a bad preset or option fails here, not mid-run
        self.stores: dict[str | None, VisMemoStore] = {}  # None: the run's store
        self.policy = policy
        # every request looks for approximate hits unless the run says otherwise: an evaluation measures the policy,
        # not whether its hits pay on this machine (``runtime.gate``)
        self.options = {"approximate": "always", **{k: _number(v) for k, v in method_args.items()}}
        # a bad policy, policy option or thresholds preset (another model's included) fails here, not mid-run
        VisMemoCache(store=VisMemoStore(), policy=self.policy, model=self.model, **self.options)
        self.max_new_tokens = int(max_new_tokens)

    def store_for(self, task: str) -> VisMemoStore:
        """The store ``task``'s requests use: its own (``store_scope=task``) or the run's."""
        scope = task if self.store_scope == "task" else None
        if scope not in self.stores:
            options = dict(self.store_options)
            if scope is not None:
                options["namespace"] = f"{options['namespace']}/{task}" if options.get("namespace") else task
            self.stores[scope] = VisMemoStore(**options)
        return self.stores[scope]

    def generate_until(self, requests) -> list[str]:
        answers = [""] * len(requests)
        tasks = list(dict.fromkeys(r.args[4] for r in requests))  # lmms-eval's task order
        # each task's requests together, in stream (document) order: a hit depends on what came before it
        order = sorted(range(len(requests)), key=lambda i: (tasks.index(requests[i].args[4]), requests[i].args[3]))
        for i in progress(order, desc="vismemo", disable=len(order) < 2):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = requests[i].args
            doc = self.task_dict[task][split][doc_id]
            images = doc_to_visual(doc)
            images = images if isinstance(images, list) else [images]
            prefix = doc.get("prefix") or ""  # text before the image (stream rows may carry one)
            content = ([{"type": "text", "text": prefix}] if prefix else []) + [{"type": "image"} for _ in images]
            content.append({"type": "text", "text": context})
            text = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            inputs = self.processor(text=[text], images=images, return_tensors="pt").to(self.model.device)
            cache = VisMemoCache(store=self.store_for(task), policy=self.policy, **self.options)
            with torch.no_grad():
                out = self.model.generate(**inputs, cache=cache, do_sample=False,
                                          max_new_tokens=int(gen_kwargs.get("max_new_tokens", self.max_new_tokens)))
            answers[i] = self.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                                         skip_special_tokens=True).strip()
            ANSWERS[(task, doc_key(doc, doc_id))] = Answer(
                ",".join(str(e.kind) for e in cache.events) or "text",
                next((e.fallback for e in cache.events if e.fallback), None))
        return answers

    def generate_until_multi_round(self, requests) -> list[str]:
        return self.generate_until(requests)

    def loglikelihood(self, requests):
        raise NotImplementedError("the vismemo backend only generates")


def manifests():
    return [ModelManifest(model_id="vismemo", simple_class_path="vismemo_hf.eval.lmms.VisMemoLMM")]
