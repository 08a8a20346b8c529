"""The collaborators of the prefill and the store on plain tensors, without a model: the schedule's layouts, the
eviction policy, the catalog and the blob reader over a byte source."""

from collections import OrderedDict

import pytest
import torch

from vismemo_hf.core.plan import HitKind, ImagePlan
from vismemo_hf.runtime.schedule import ActiveStates, ImageSpan, Schedule, positions_of, query_blocks, slot_mask
from vismemo_hf.store import blob
from vismemo_hf.store.catalog import Catalog
from vismemo_hf.store.eviction import ExactPriorityLRU
from vismemo_hf.store.ranges import BlobReader

from test_store import _entry


def _plan(n, recompute, reuse, mask, warmup=1):
    return ImagePlan(HitKind.APPROXIMATE, n, warmup, recompute, reuse, mask, "alias")


def test_active_columns_follow_each_images_plan_and_pad_short_rows():
    schedule = Schedule(batch=2, length=10, valid=None, device="cpu")
    images = [ImageSpan(0, 2, 4, _plan(4, [1], [0, 2], [3])), ImageSpan(1, 5, 3, None)]
    assert torch.equal(schedule.active(0, images), torch.arange(10).expand(2, -1))  # warmup: every token
    late = schedule.active(1, images)
    assert late[0].tolist() == [0, 1, 3, 6, 7, 8, 9, -1, -1, -1][: late.shape[1]]
    assert late[1].tolist() == list(range(10))[: late.shape[1]]  # undecided: every token of row 1
    assert schedule.active(2, images) is late  # unchanged plans: the same layout object


def test_a_slot_layout_holds_columns_in_order_and_masks_the_future_padding_and_unwritten_slots():
    valid = torch.tensor([[False, True, True, True, True, True]])
    schedule = Schedule(batch=1, length=6, valid=valid, device="cpu")
    active = torch.tensor([[0, 1, 5]])
    reused = torch.tensor([[3, 2]])
    kept = torch.tensor([[4]])  # a masked token given back for decoding after the prefill
    writer, layout = schedule.layout(active, reused, kept)
    assert writer.columns.tolist() == [[0, 1, 2, 3, 4, 5]]
    # query column 1 sees column 1 (not 0: padding); column 5 sees 1, 2, 3 and itself, not the unwritten slot 4
    assert layout.mask[0, 0].tolist() == [[False] * 6, [False, True, False, False, False, False],
                                          [False, True, True, True, False, True]]
    assert schedule.layout(active, reused, kept)[1] is layout  # the same layout: the same mask
    assert schedule.is_plain(torch.arange(6)[None], None) and not schedule.is_plain(active, None)


def test_a_layer_opened_with_a_layout_is_written_in_place_and_settles_to_the_plain_layout():
    from vismemo_hf.runtime.cache import VisMemoLayer

    layer = VisMemoLayer()
    layer.open(torch.tensor([[0, 1, 2, 3]]), 4)
    k = torch.arange(4, dtype=torch.float32).view(1, 1, 4, 1).expand(1, 2, 4, 3).contiguous()
    layer.preload(k[:, :, [2, 3]], k[:, :, [2, 3]] + 10, torch.tensor([[2, 3]]))
    keys, values = layer.update(k[:, :, [0, 1]], k[:, :, [0, 1]] + 10, columns=torch.tensor([[0, 1]]), contiguous=False)
    assert torch.equal(keys, k) and torch.equal(values, k + 10)
    layer.settle(4)
    assert not layer.mapped  # every column in order: a DynamicCache layer again
    holes = VisMemoLayer()
    holes.open(torch.tensor([[0, 1, 2]]), 3)
    holes.update(k[:, :, [0, 2]], k[:, :, [0, 2]], columns=torch.tensor([[0, 2]]), contiguous=False)
    holes.settle(3)
    assert holes.columns.tolist() == [[0, -1, 2]]  # the unwritten slot is empty, nothing moved


def test_layers_with_one_layout_share_its_write_plans_and_settle_alike():
    from vismemo_hf.runtime.cache import VisMemoLayer
    from vismemo_hf.runtime.schedule import SlotWriter

    writer = SlotWriter(torch.tensor([[0, 2, 3, 5]]), 6)
    computed, reused = torch.tensor([[0, 5]]), torch.tensor([[2, 3]])
    k = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1).expand(1, 2, 6, 3).contiguous()
    layers = [VisMemoLayer() for _ in range(3)]
    for layer in layers:
        layer.open(writer)
        layer.preload(k[:, :, [2, 3]], k[:, :, [2, 3]], reused)
        keys, _ = layer.update(k[:, :, [0, 5]], k[:, :, [0, 5]], columns=computed, contiguous=False)
        assert torch.equal(keys, k[:, :, [0, 2, 3, 5]])
    assert writer.plan(reused) is writer.plan(reused) and writer.plan(reused)[0] == "run"
    assert writer.plan(computed)[0] == "scatter"
    for layer in layers:
        layer.settle(6)
    assert layers[0].columns.tolist() == [[0, 2, 3, 5]] and all(x.columns is layers[0].columns for x in layers)
    with pytest.raises(RuntimeError, match="does not hold"):
        writer.plan(torch.tensor([[1]]))


def test_scattered_writes_land_where_their_columns_go_in_one_row_and_in_padded_rows():
    """One row writes by copies along the slot axis, several rows by an indexed put: both put each column's K/V
    in its slot and nothing elsewhere (pads of -1 write nothing)."""
    from vismemo_hf.runtime.cache import VisMemoLayer

    def written(layout, columns, batch):
        layer = VisMemoLayer()
        layer.open(torch.tensor(layout), 8)
        k = torch.arange(batch * 8, dtype=torch.float32).view(batch, 1, 8, 1).expand(batch, 2, 8, 3).contiguous()
        cols = torch.tensor(columns)
        keys = torch.stack([k[b, :, cols[b].clamp(min=0)] for b in range(batch)])
        out, values = layer.update(keys, keys + 100, columns=cols, contiguous=False)
        want_keys, want_values = torch.zeros_like(out), torch.zeros_like(out)
        for b in range(batch):
            for slot, column in enumerate(layout[b]):
                if column >= 0 and column in columns[b]:
                    want_keys[b, :, slot], want_values[b, :, slot] = k[b, :, column], k[b, :, column] + 100
        assert torch.equal(out, want_keys) and torch.equal(values, want_values)

    written([[0, 1, 3, 4, 6, 7]], [[1, 4, 7]], 1)  # one row, gaps between its slots: the copy path
    written([[0, 1, 3, 4, 6, 7], [0, 2, 3, 5, 6, -1]], [[1, 4, 7], [2, 6, -1]], 2)  # two rows, a pad


def test_query_blocks_see_only_the_keys_their_rows_can():
    q = torch.arange(128)[None]
    mask = slot_mask(torch.arange(128)[None], q, None)
    blocks = query_blocks(mask)
    assert len(blocks) == 4 and [b[2] for b in blocks] == [32, 64, 96, 128]


def test_active_states_narrow_and_park_hidden_states_by_column():
    hidden = torch.arange(10, dtype=torch.float32).view(1, 5, 2)
    cos = sin = torch.ones(1, 5, 3)
    states = ActiveStates(torch.arange(5)[None], hidden.clone(), cos, sin)
    states.narrow(torch.tensor([[1, 3]]))
    assert torch.equal(states.hidden, hidden[:, [1, 3]])
    states.hidden = states.hidden + 100
    out = states.result()
    assert torch.equal(out[0, [1, 3]], hidden[0, [1, 3]] + 100) and torch.equal(out[0, [0, 2, 4]], hidden[0, [0, 2, 4]])
    with pytest.raises(RuntimeError, match="not computed"):
        states.narrow(torch.tensor([[1, 2]]))


def test_positions_of_inverts_a_padded_layout():
    cols = torch.tensor([[3, 0, -1], [1, 2, 4]])
    where = positions_of(cols, 5)
    assert where.tolist() == [[1, -1, -1, 0, -1], [-1, 0, 1, -1, 2]]


def test_exact_priority_lru_gives_protected_entries_second_chances():
    policy = ExactPriorityLRU(protect=2)
    lru = OrderedDict.fromkeys(["a", "b", "c"])
    policy.exact_hit("a")
    assert policy.victim(lru) == "b" and list(lru) == ["b", "c", "a"]
    lru.pop("b")
    assert policy.victim(lru) == "c"
    lru.pop("c")
    assert policy.victim(lru) == "a"  # both chances spent


def test_the_catalog_indexes_per_model_and_forgets():
    catalog = Catalog()
    e = _entry("k")
    catalog.add("k", "fp", e.grid, e.descriptors)
    from vismemo_hf.core.thresholds import ModelReference

    catalog.set_reference("fp", ModelReference(torch.zeros(8), torch.zeros(8), 0.0))
    assert [k for k, _ in catalog.candidates("fp", e.grid, e.descriptors, 0.5, 5)] == ["k"]
    assert catalog.candidates("other", e.grid, e.descriptors, 0.5, 5) == []
    catalog.remove("k")
    assert "k" not in catalog and catalog.candidates("fp", e.grid, e.descriptors, 0.5, 5) == []


class _Bytes:
    """A byte source over one blob in memory (what a disk file or a Redis value offers)."""

    def __init__(self, key, data):
        self.key, self.data, self.calls = key, data, 0

    def ranges(self, key, spans):
        self.calls += 1
        if key != self.key:
            raise KeyError(key)
        return [self.data[s : s + n] for s, n in spans]

    def read_into(self, key, view):
        view[:] = self.data

    def check(self, key, header):
        if header.total_bytes != len(self.data):
            raise blob.BlobError("size")


def test_the_blob_reader_checks_every_part_it_reads():
    entry = _entry("k", n=5, layers=4)
    source = _Bytes("k", blob.encode(entry))
    reader = BlobReader(source)
    assert torch.equal(reader.full("k").kv, entry.kv)
    kv, nbytes = reader.tokens("k", torch.tensor([4, 1]), 2)
    assert torch.equal(kv, entry.kv[[4, 1]][:, 2:]) and source.calls >= 2
    assert torch.equal(reader.meta("k").embeds, entry.embeds)
    with pytest.raises(blob.BlobError, match="another key"):
        BlobReader(_Bytes("other", source.data)).header("other")
    flipped = bytearray(source.data)
    flipped[blob.HEADER_SIZE + 20] ^= 1  # a byte of token 0's first layer
    with pytest.raises(blob.BlobError):
        BlobReader(_Bytes("k", bytes(flipped))).tokens("k", torch.tensor([0]), 0)


def test_a_layout_of_other_columns_with_the_same_shape_is_built_anew():
    """``Schedule.layout`` keeps a layout while its column sets are the same (the same tensors or equal values); a
    set of the same size with other columns (another image's reuse, a row's other tokens) gets its own slots and
    mask, never the last layout's."""
    schedule = Schedule(batch=1, length=6, valid=None, device="cpu")
    active = torch.tensor([[0, 1, 5]])
    writer, layout = schedule.layout(active, torch.tensor([[2, 3]]))
    assert schedule.layout(active.clone(), torch.tensor([[2, 3]]))[1] is layout  # equal values: kept
    other_writer, other = schedule.layout(active, torch.tensor([[3, 4]]))
    assert other is not layout and other_writer.columns.tolist() == [[0, 1, 3, 4, 5]]
    assert other.mask[0, 0, 2].tolist() == [True] * 5  # column 5 sees 0, 1, 3, 4 and itself


def test_a_padded_row_is_never_the_plain_layout():
    """``Schedule.is_plain``: a batch whose first row computes every column and whose second lacks one (padded with
    -1 to the same width) is not the plain layout, though its shape is."""
    schedule = Schedule(batch=2, length=4, valid=None, device="cpu")
    full = torch.arange(4)
    assert schedule.is_plain(torch.stack([full, full]), None)
    assert not schedule.is_plain(torch.stack([full, torch.tensor([0, 1, 3, -1])]), None)
    assert not schedule.is_plain(torch.stack([full, full]), torch.tensor([[2], [2]]))


@pytest.mark.parametrize("seed", range(6))
def test_layout_blocks_from_the_index_sets_equal_the_blocks_of_the_layout_mask(seed, monkeypatch):
    """``layout_blocks`` works the query blocks out from host index sets; they equal ``query_blocks`` of the mask
    they stand for (slots not after the query, visible, not padding) for any padding (left or right), visibility and
    -1 padded rows."""
    from vismemo_hf.runtime import schedule as sched

    monkeypatch.setattr(sched, "MIN_BLOCK_ROWS", 2)
    g = torch.Generator().manual_seed(seed)
    batch, length = 2, 40
    kept = torch.rand(batch, length, generator=g) < 0.8
    slots = sched._held(kept)
    visible = kept & (torch.rand(batch, length, generator=g) < 0.8)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[0, :3] = False  # left padding
    valid[1, -4:] = False  # right padding
    rows = [torch.nonzero(visible[b]).flatten() for b in range(batch)]
    queries = sched.pad_rows([r[torch.rand(r.numel(), generator=g) < 0.7] for r in rows], -1, "cpu")
    for v in (None, valid):
        mask = slot_mask(slots, queries, v) & visible.gather(1, slots.clamp(min=0))[:, None, None, :]
        assert sched.layout_blocks(slots, queries, v, visible) == query_blocks(mask)


def test_narrowing_to_the_same_columns_keeps_the_states_as_they_are():
    """``ActiveStates.narrow`` to columns equal to the current ones (another tensor of a layer whose plan did not
    change) neither parks nor gathers: the hidden states stay the same tensor."""
    hidden = torch.arange(10, dtype=torch.float32).view(1, 5, 2)
    states = ActiveStates(torch.arange(5)[None], hidden.clone(), torch.ones(1, 5, 3), torch.ones(1, 5, 3))
    states.narrow(torch.tensor([[1, 3]]))
    kept = states.hidden
    states.narrow(torch.tensor([[1, 3]]))
    assert states.hidden is kept


def _mapped_layer(rows):
    """A ``VisMemoLayer`` after a prefill that left columns out: ``rows`` (B, S) the columns each row holds, its
    keys (1 head, dim 1) equal to 10 * row + column and its values their negatives."""
    from vismemo_hf.runtime.cache import VisMemoLayer

    columns = torch.tensor(rows)
    length = int(columns.max()) + 1
    layer = VisMemoLayer()
    layer.open(columns, length)
    keys = (10 * torch.arange(len(rows))[:, None] + columns).float()[:, None, :, None]
    layer.update(keys, -keys, columns=columns, contiguous=False)
    layer.settle(length)
    assert layer.mapped
    return layer


def _slots_held(layer):
    """Each row's (column, key) pairs of its non-empty slots (a column for every slot)."""
    assert layer.columns.shape == layer.keys.shape[:1] + layer.keys.shape[2:3]
    return [[(int(c), float(k)) for c, k in zip(cols, keys[0, :, 0]) if c >= 0]
            for cols, keys in zip(layer.columns, layer.keys)]


def test_a_mapped_layer_keeps_each_slots_column_with_its_kv_through_every_cache_operation():
    """Cropping, reordering beams, repeating and selecting rows act on a layer's slot columns as on its K/V: every
    slot keeps its own column (the mask of later steps is built from them)."""
    layer = _mapped_layer([[0, 1, 3], [0, 2, 3]])
    expected = [[(0, 0.0), (1, 1.0), (3, 3.0)], [(0, 10.0), (2, 12.0), (3, 13.0)]]
    assert _slots_held(layer) == expected
    step = torch.tensor([[[[4.0]]], [[[14.0]]]])
    layer.update(step, -step, columns=torch.tensor([[4], [4]]), contiguous=True)  # a decoding step
    assert _slots_held(layer) == [expected[0] + [(4, 4.0)], expected[1] + [(4, 14.0)]]
    layer.crop(-1)
    assert _slots_held(layer) == expected and torch.equal(layer.values, -layer.keys)
    layer.reorder_cache(torch.tensor([1, 0]))
    assert _slots_held(layer) == expected[::-1]
    layer.batch_repeat_interleave(2)
    assert _slots_held(layer) == [expected[1], expected[1], expected[0], expected[0]]
    layer.batch_select_indices(torch.tensor([2]))
    assert _slots_held(layer) == [expected[0]]


def test_keeping_slots_drops_the_others_and_never_keeps_an_empty_slot():
    """``keep_slots``: the slots ``keep`` marks stay, in order; an empty slot (column -1) goes even when marked."""
    from vismemo_hf.runtime.cache import VisMemoLayer

    layer = VisMemoLayer()
    layer.open(torch.tensor([[0, 1, 2, 3]]), 4)
    k = torch.arange(4, dtype=torch.float32).view(1, 1, 4, 1)
    layer.update(k[:, :, [0, 2, 3]], k[:, :, [0, 2, 3]], columns=torch.tensor([[0, 2, 3]]), contiguous=False)
    layer.settle(4)
    assert layer.columns.tolist() == [[0, -1, 2, 3]]
    layer.keep_slots(torch.tensor([[True, True, False, True]]))
    assert layer.columns.tolist() == [[0, 3]] and layer.keys[0, 0, :, 0].tolist() == [0.0, 3.0]


def test_a_layer_holding_every_column_in_order_settles_to_the_plain_layout_and_slot_of_refuses_absent_ones():
    """``settle`` of a layer that was given columns outside a prefill's layout (they map it) and holds every
    column in order: the plain layout again, whose slots are its columns; ``slot_of`` finds a mapped layer's columns
    and refuses one it does not hold."""
    from vismemo_hf.runtime.cache import VisMemoLayer

    k = torch.arange(3, dtype=torch.float32).view(1, 1, 3, 1)
    appended = VisMemoLayer()  # a plain layer given its next column as a non-contiguous write
    appended.update(k[:, :, :2], k[:, :, :2], columns=torch.tensor([[0, 1]]), contiguous=True)
    appended.update(k[:, :, 2:], k[:, :, 2:], columns=torch.tensor([[2]]), contiguous=False)
    assert appended.mapped
    appended.settle(3)
    assert not appended.mapped and torch.equal(appended.slot_of(torch.tensor([2, 0]), 0), torch.tensor([2, 0]))
    gap = _mapped_layer([[0, 1, 3]])
    assert torch.equal(gap.slot_of(torch.tensor([3, 0]), 0), torch.tensor([2, 0]))
    with pytest.raises(RuntimeError, match="not stored"):
        gap.slot_of(torch.tensor([2]), 0)


def test_a_decoding_mask_after_a_step_of_several_tokens_covers_every_slot():
    """``attention_mask`` of a one-query step extends the last one-query step's mask by a slot; after a step that
    appended several tokens (assisted decoding's candidates) it is built again, as wide as the layer."""
    layer = _mapped_layer([[0, 1, 3]])
    one = torch.ones(1, 1, 1, 1)
    layer.update(one, one, columns=torch.tensor([[4]]), contiguous=True)
    assert layer.attention_mask(1, None)[0, 0, 0].tolist() == [True] * 4
    three = torch.ones(1, 1, 3, 1)
    layer.update(three, three, columns=torch.tensor([[5, 6, 7]]), contiguous=True)
    layer.attention_mask(3, None)
    layer.update(one, one, columns=torch.tensor([[8]]), contiguous=True)
    assert layer.attention_mask(1, None)[0, 0, 0].tolist() == [True] * 8
