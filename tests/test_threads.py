"""The library's own threads (entry builders, disk and remote writers and readers, alias fetches) run their torch
operations on one thread each. A thread that ran a parallel torch operation keeps an OpenMP team while it lives; with
more OpenMP threads than cores every team sleeps between parallel regions, and the serving thread's small operations
wait for their wake-ups: plain transformers' decoding in the same process ran 3x slower while a store's idle writer
thread lived (``store.background.one_torch_thread``)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import vismemo_hf
from vismemo_hf.core.plan import HitKind
from vismemo_hf.runtime import alias
from vismemo_hf.store.background import background_pool, one_torch_thread

from conftest import build_inputs, generate, stored


def _threads_of(pool: ThreadPoolExecutor) -> int:
    """torch's thread count as a job of ``pool`` sees it (after a parallel operation there)."""

    def job():
        torch.randn(256, 256) @ torch.randn(256, 256)
        return torch.get_num_threads()

    return pool.submit(job).result()


def test_background_pools_run_torch_on_one_thread_and_leave_the_callers_alone():
    before = torch.get_num_threads()
    pool = background_pool("vismemo-test")
    try:
        assert _threads_of(pool) == 1 and _threads_of(alias._POOL) == 1
    finally:
        pool.shutdown(wait=True)
    assert torch.get_num_threads() == before
    seen = []
    worker = threading.Thread(target=lambda: (one_torch_thread(), seen.append(torch.get_num_threads())))
    worker.start()
    worker.join()
    assert seen == [1] and torch.get_num_threads() == before


def test_a_stores_threads_built_entries_on_one_thread_while_requests_kept_theirs(qwen2, pages, tmp_path):
    """A miss stored through the writer thread, a disk tier's writer and an exact hit's fetch: each of the
    library's threads that ran torch operations has one; the serving thread's count is what it was."""
    model, processor = qwen2
    before = torch.get_num_threads()
    store = vismemo_hf.VisMemoStore(disk_dir=tmp_path, disk_bytes=1 << 30)
    stored(model, processor, pages["base"], store=store)
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 2)
    store.flush()
    ours = [t for t in threading.enumerate() if t.name.startswith(("vismemo-put", "vismemo-disk", "vismemo-fetch"))]
    assert {t.name.split("_")[0] for t in ours} >= {"vismemo-put", "vismemo-disk"}
    assert _threads_of(store.writer.pool) == 1 and torch.get_num_threads() == before


def _requests(pages):
    """Misses, exact hits and approximate hits of the tiny page set (an edited and a shifted copy of a stored page)."""
    return [[pages["base"]], [pages["edit"]], [pages["noise"]], [pages["shift"]], [pages["base"]], [pages["edit"]]]


def test_threads_on_one_model_and_one_store_answer_as_one_thread_does(family, pages):
    """Three threads generate on one enabled model with one store (a web server's workers, transformers' streaming
    thread): no exception, every answer and every first-token score what the same request gives alone, the same kind
    of hit; afterwards the model still serves requests from one thread and its attention modules name the model's
    own implementation. Nothing new is stored meanwhile (``store_misses=False``), so each request's kind does not
    depend on the order the threads run in."""
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family, seed=5)
    vismemo_hf.enable(model)
    store = stored(model, processor, pages["base"])
    requests = [build_inputs(processor, images) for images in _requests(pages)]

    def run(inputs):
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
        tokens, scores = generate(model, inputs, cache, 3)
        return tokens, scores, [(e.kind, e.alias) for e in cache.events]

    alone = [run(inputs) for inputs in requests]
    kinds = {kind for _, _, events in alone for kind, _ in events}
    assert HitKind.EXACT in kinds and HitKind.MISS in kinds
    if vismemo_hf.families.FAMILIES[family].approximate:
        assert HitKind.APPROXIMATE in kinds
    errors, results = [], []

    def worker(offset):
        for _ in range(2):
            for k in range(len(requests)):
                i = (k + offset) % len(requests)
                try:
                    results.append((i, run(requests[i])))
                except Exception as error:  # noqa: BLE001 - the test reports every error a thread met
                    errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 3 * 2 * len(requests)
    for i, (tokens, scores, events) in results:
        assert events == alone[i][2]
        assert torch.equal(tokens, alone[i][0])
        assert (scores - alone[i][1]).abs().max() <= 1e-4
    tokens, _, events = run(requests[0])
    assert torch.equal(tokens, alone[0][0]) and events == alone[0][2]
    text_view = model.model.language_model.layers[0].self_attn.config
    assert text_view._attn_implementation == model.config.text_config._attn_implementation


def test_a_routed_forward_routes_only_its_own_thread(qwen2):
    """While one thread routes the text model's attention modules to VisMemo's function, another thread's modules
    name the model's own implementation (a switch written on the shared config would show it to every thread)."""
    from vismemo_hf.families import routing

    model, _ = qwen2
    view = model.model.language_model.layers[0].self_attn.config
    assert isinstance(view, routing.ConfigView)
    own = model.config.text_config._attn_implementation
    inside, seen = threading.Event(), []

    def other():
        inside.wait()
        seen.append(view._attn_implementation)

    thread = threading.Thread(target=other)
    thread.start()
    with routing.routed(view, "vismemo"):
        assert view._attn_implementation == "vismemo"
        assert model.config.text_config._attn_implementation == own
        inside.set()
        thread.join()
    assert seen == [own] and view._attn_implementation == own
