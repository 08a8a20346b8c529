"""Host syncs of the hit path: the counter itself, and every kind's count against depth (issue S)."""

from types import SimpleNamespace

import pytest
import torch

from vismemo_hf.bench import overhead
from vismemo_hf.bench.syncs import SyncCounter


def test_the_counter_sees_value_reads_and_value_sized_outputs_only():
    x, m = torch.arange(6.0), torch.tensor([True, False, True, False, True, False])
    with SyncCounter(sites=True) as c:
        bool(m.any())
        x.tolist()
        x[m]
        torch.where(m)
        x[m] = 0.0
        torch.where(m, x, -x)  # three arguments: the output size is known
        y = x * 2 + 1  # arithmetic reads nothing
        int(y[0])
    assert c.counts == {"__bool__": 1, "tolist": 1, "bool index": 2, "where": 1, "__int__": 1}
    assert c.total == 6 and any("test_overhead.py" in site for site in c.sites)
    x.tolist()  # outside: not counted
    assert c.total == 6


def _counts(family: str, layers: int, policies: list[str]) -> dict:
    args = SimpleNamespace(preset="tiny", family=family, dtype="float32", device="cpu")
    plain, model, processor = overhead._models(args, layers)
    base_img, edited_img = overhead.page_pair(64, model.config.vision_config.patch_size)
    base, edited = (overhead.request_inputs(processor, im) for im in (base_img, edited_img))
    seeded = overhead.VisMemoStore()
    with torch.no_grad():
        model(**base, cache=overhead.VisMemoCache(store=seeded), use_cache=True)
    seeded.flush()
    out = {}
    for label, case in overhead._kinds(plain, model, base, edited, seeded, policies).items():
        counter, event = overhead._syncs(case, label)
        assert event is None or str(event.kind) == case[3], label  # every case hits as it should
        out[label] = counter.total
    return out


@pytest.mark.parametrize("family, policies", [("qwen2_vl", ["attend-deviate", "cacheblend", "vlcache"]),
                                              ("qwen3_vl", ["attend-deviate"])])
def test_no_kind_reads_more_values_on_a_deeper_model(family, policies):
    shallow, deep = _counts(family, 2, policies), _counts(family, 7, policies)
    assert shallow == deep, {k: (shallow[k], deep[k]) for k in shallow if shallow[k] != deep[k]}
    assert deep["plain"] < deep["miss"] <= deep["plain"] + 20  # the lookup reads the ids and the image once
