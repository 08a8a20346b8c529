"""pytest plugin for running transformers' own tests of the supported families with VisMemo in the loop.

``VISMEMO_COMPAT_MODE=enable``: every model of a supported family a test builds is ``vismemo_hf.enable``d when it is built.
``VISMEMO_COMPAT_MODE=cache``: also, every ``generate`` that brings no cache of its own gets a ``VisMemoCache``
on a store that lives for the test (so a test's repeated requests are exact hits). Loaded by transformers' test
tree through ``PYTEST_EXTRA_PLUGIN=vismemo_compat`` (``make compat TESTS=DIR``).
"""

from __future__ import annotations

import os

import pytest

MODE = os.environ.get("VISMEMO_COMPAT_MODE", "enable")
_STATE = {"store": None}


def _family_model(model) -> bool:
    from vismemo_hf.families import FAMILIES

    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in FAMILIES and hasattr(config, "vision_config")


def _install() -> None:
    from transformers import GenerationMixin
    from transformers.modeling_utils import PreTrainedModel

    import vismemo_hf

    post_init = PreTrainedModel.post_init

    def enabling_post_init(self, *args, **kwargs):
        out = post_init(self, *args, **kwargs)
        if _family_model(self):
            inner = getattr(self, "model", None)
            if inner is not None and getattr(inner, "_vismemo_installation", None) is not None:
                vismemo_hf.disable(inner)  # built as a part of this model: the outer model is the one to enable
            vismemo_hf.enable(self)
        return out

    PreTrainedModel.post_init = enabling_post_init
    if MODE != "cache":
        return
    generate = GenerationMixin.generate

    def generate_with_vismemo(self, *args, **kwargs):
        brings_cache = kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
        config = kwargs.get("generation_config")
        wants_no_cache = kwargs.get("use_cache") is False or (config is not None and config.use_cache is False)
        picks_cache = kwargs.get("cache_implementation") is not None or any(
            getattr(c, "cache_implementation", None) is not None for c in (config, getattr(self, "generation_config", None)))
        if _family_model(self) and getattr(self, "_vismemo", None) is not None and not (
                brings_cache or wants_no_cache or picks_cache):
            if _STATE["store"] is None:
                _STATE["store"] = vismemo_hf.VisMemoStore()
            kwargs["past_key_values"] = vismemo_hf.VisMemoCache(store=_STATE["store"])
        return generate(self, *args, **kwargs)

    GenerationMixin.generate = generate_with_vismemo


_install()


@pytest.fixture(autouse=True)
def _vismemo_store_per_test():
    _STATE["store"] = None
    yield
    _STATE["store"] = None


def pytest_report_header(config):
    return f"vismemo compat mode: {MODE}"
