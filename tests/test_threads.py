"""The library's own threads (entry builders, disk and remote writers and readers, alias fetches) run their torch
operations on one thread each. A thread that ran a parallel torch operation keeps an OpenMP team while it lives; with
more OpenMP threads than cores every team sleeps between parallel regions, and the serving thread's small operations
wait for their wake-ups: plain transformers' decoding in the same process ran 3x slower while a store's idle writer
thread lived (``store.background.one_torch_thread``)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import vismemo_hf
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
    assert _threads_of(store._builder) == 1 and torch.get_num_threads() == before
