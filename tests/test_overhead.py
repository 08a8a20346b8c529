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
    base_img, edited_img = overhead.page_pair(64, model)
    base, edited = (overhead.request_inputs(processor, im) for im in (base_img, edited_img))
    seeded = overhead.VisMemoStore()
    with torch.no_grad():
        model(**base, cache=overhead.VisMemoCache(store=seeded), use_cache=True)
    seeded.flush()
    out = {}
    for label, case in overhead._kinds(plain, model, base, edited, seeded, policies).items():
        counter, event = overhead._syncs(case, label)
        assert event is None or str(event.kind) == case[3], label  # every case hits as it should
        out[label] = (counter.total, counter.device_total)
    return out


@pytest.mark.parametrize("family, policies", [("qwen2_vl", ["attend-deviate", "cacheblend", "vlcache"]),
                                              ("qwen3_vl", ["attend-deviate"]), ("glm4v", ["attend-deviate"]),
                                              ("llava_onevision", ["attend-deviate"])])
def test_no_kind_reads_more_values_on_a_deeper_model(family, policies):
    shallow, deep = _counts(family, 2, policies), _counts(family, 7, policies)
    assert shallow == deep, {k: (shallow[k], deep[k]) for k in shallow if shallow[k] != deep[k]}
    plain = deep["plain"][1]
    # reads of device tensors (syncs on an accelerator): every kind within plain transformers' + 8 per request
    assert all(device <= plain + 8 for _, device in deep.values()), deep
    assert deep["plain"][0] < deep["miss"][0]  # the lookup's own reads are of host copies


def test_the_counter_tells_reads_of_device_tensors_from_reads_of_host_copies():
    from vismemo_hf.runtime.schedule import host_of, on_device

    layer, x = torch.nn.Linear(3, 3), torch.ones(2, 3)
    with SyncCounter(resident=[layer, {"x": x}]) as c:
        y = layer(x)  # made from device tensors: on the device
        y.sum().item()  # a sync
        host = torch.tensor([1, 2, 3])
        host.tolist()  # a host tensor: no sync
        copy = y.cpu()  # a sync, then a host copy
        copy.tolist()
        moved = on_device(host, x.device)
        moved.tolist()  # its device copy: a sync
        host_of(moved).tolist()  # the host copy kept for it: none
        torch.arange(3, device=x.device).tolist()  # made on the device: a sync
        torch.zeros(2, device="cpu").tolist()  # made on the host by name: none
    assert c.device_counts == {"item": 1, "cpu": 1, "tolist": 2} and c.device_total == 4
    assert c.total == 8
