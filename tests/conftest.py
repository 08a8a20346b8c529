import functools
import os
import shutil
import socket
import subprocess
import time

os.environ.setdefault("VISMEMO_STORE", "memory")  # the process-wide default store never writes to disk in tests
# every request looks for approximate hits: what a test of a policy checks does not depend on the gate's timing
# evidence (runtime.gate; tests/test_gate.py checks the gate with approximate="auto")
os.environ.setdefault("VISMEMO_APPROXIMATE", "always")
# a bug met at the store's boundary fails the test instead of degrading to a miss (store/faults.py)
os.environ.setdefault("VISMEMO_STRICT", "1")

import numpy as np
import pytest
import torch
from PIL import Image

import vismemo_hf
import vismemo_hf.families
from vismemo_hf.bench.soak import Cluster
from vismemo_hf.eval import synthetic
from vismemo_hf.testing import tiny_model

#: the families every family-parametrised test runs: all registered ones but GLM-4.6V, whose language model and
#: vision tower are GLM-4.1V's own classes (it runs in tests/test_families.py and in transformers' suite, make compat)
FAMILIES = [f for f in vismemo_hf.families.FAMILIES if f != "glm46v"]
REDIS_SERVER = shutil.which("redis-server")


@functools.cache
def _enabled_tiny(family: str, seed: int = 0):
    model, processor = tiny_model(family, seed=seed)
    vismemo_hf.enable(model)
    return model, processor


@functools.cache
def docqa_reader():
    """The packaged reading model, enabled, loaded once per test session."""
    from vismemo_hf.testing import docqa_model

    model, processor = docqa_model()
    vismemo_hf.enable(model)
    return model, processor


@pytest.fixture(autouse=True)
def policy_registry():
    """Policies a test registers are gone after it (the registry is global)."""
    from vismemo_hf.policies.base import _REGISTRY

    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)


def forget_bugs():
    """The bugs a test caused on purpose (outside strict mode) are not the suite's (``no_library_bug``)."""
    from vismemo_hf.store import faults

    with faults._COUNTS_LOCK:
        for key in [k for k in faults._COUNTS if k[1] == "bug"]:
            del faults._COUNTS[key]


@pytest.fixture(autouse=True)
def no_library_bug():
    """No store call of the test met a bug of the library (an exception that is no store or I/O fault), on the
    request's thread or the store's writer threads (where strict mode cannot fail the test by raising)."""
    from vismemo_hf.store.faults import fault_counts

    before = fault_counts().get("bug", 0)
    yield
    after = fault_counts()
    assert after.get("bug", 0) == before, {k: v for k, v in after.items() if k.endswith("/bug")}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def approximate_families(request):
    """``@pytest.mark.approximate``: the test needs approximate hits, which a family whose visual tokens form no
    grid of patch groups (LLaVA-OneVision's tiles) does not have: skipped there, saying why."""
    family = getattr(getattr(request.node, "callspec", None), "params", {}).get("family")
    if request.node.get_closest_marker("approximate") and family is not None and \
            not vismemo_hf.families.FAMILIES[family].approximate:
        pytest.skip(f"{family} images are misses and exact hits only (no token grid for an approximate lookup)")


@pytest.fixture
def tiny(family):
    return _enabled_tiny(family)


@pytest.fixture
def qwen2():
    return _enabled_tiny("qwen2_vl")


def build_inputs(processor, images, question="What is the value of row 1?", prefix="", batch=None):
    """Processor inputs for one request (``images`` then ``question``), or a batch of (images, question, prefix)."""
    requests = batch or [(images, question, prefix)]
    texts, all_images = [], []
    for imgs, q, pre in requests:
        content = ([{"type": "text", "text": pre}] if pre else []) + [{"type": "image"} for _ in imgs]
        content.append({"type": "text", "text": q})
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
        all_images.extend(imgs)
    processor.tokenizer.padding_side = "left"
    return processor(text=texts, images=all_images or None, return_tensors="pt", padding=True)


def noise_image(seed=0, size=(224, 168)):
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def generate(model, inputs, cache, new_tokens=3):
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.scores, 1)


def stored(model, processor, *images, store=None, **opts):
    """A store holding the entries of ``images`` (each run alone as a request, ``opts`` for its cache)."""
    store = store if store is not None else vismemo_hf.VisMemoStore()
    for image in images:
        generate(model, build_inputs(processor, [image]), vismemo_hf.VisMemoCache(store=store, **opts), 1)
    store.flush()  # the entries are written after the first token: wait for them before reading tiers directly
    return store


def page_set():
    return {
        "base": synthetic.page(1),
        "edit": synthetic.edited(1, row=2, value="9999"),
        "shift": synthetic.shifted(synthetic.page(1), 2),
        "noise": noise_image(0),
    }


@pytest.fixture
def pages():
    return page_set()


class RedisServer:
    """A throwaway server on a free loopback port; ``kill`` and ``start`` keep the port."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def client(self):
        import redis

        return redis.Redis(port=self.port)


@pytest.fixture
def cluster(tmp_path_factory):
    """A 3-master Redis Cluster of the test's own (skips without redis-server, redis-cli or the redis client)."""
    pytest.importorskip("redis", reason="the redis client is not installed (pip install -e '.[test]')")
    if REDIS_SERVER is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not installed (apt-get install redis-server)")
    nodes = Cluster(tmp_path_factory.mktemp("cluster"))
    yield nodes
    nodes.close()


@pytest.fixture
def server():
    """A redis-server of the test's own (skips without redis-server or the redis client)."""
    pytest.importorskip("redis", reason="the redis client is not installed (pip install -e '.[test]')")
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    srv = RedisServer()
    yield srv
    srv.kill()


@pytest.fixture(autouse=True)
def _progress_switch_reset():
    """``main(["--quiet", ...])`` turns progress bars off process-wide (as the CLI should); every test starts from
    the default again (bars on unless VISMEMO_QUIET, other libraries' bars back on)."""
    yield
    from vismemo_hf import progress

    progress.set_enabled(None)
    progress._other_bars(False)
