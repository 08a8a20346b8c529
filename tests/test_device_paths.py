"""The code that moves tensors between the host and an accelerator, run here on the CPU through the same
functions: ``schedule.on_device`` (index sets to the accelerator; a set built with ``expand`` is a view whose
elements share memory, and a copy into a tensor of that layout is refused on CUDA) and ``writeback.to_host``
(an entry's K/V to the host through a bounded pinned buffer, a chunk at a time)."""

import pytest
import torch

from vismemo_hf.runtime.schedule import host_of, on_device


def test_an_expanded_index_set_moves_as_a_dense_tensor_and_keeps_its_host_copy():
    rows = torch.arange(1)[:, None].expand(1, 6).reshape(-1)  # stride 0: six elements, one memory location
    assert rows.stride() == (0,)
    moved = on_device(rows, "cpu")
    assert moved.is_contiguous() and moved.stride() == (1,)
    assert torch.equal(moved, torch.zeros(6, dtype=torch.long))
    assert torch.equal(host_of(moved), moved)
    moved.add_(1)  # a write into it is allowed (it is not a view of overlapping memory)


def test_a_staged_copy_moves_every_element_in_chunks_of_the_buffer():
    from vismemo_hf.runtime.writeback import staged_copy, to_host

    src = torch.randn(2, 3, 7, dtype=torch.bfloat16)
    for size in (1, 5, 42, 100):  # a buffer smaller than, dividing, equal to and larger than the tensor
        out = torch.empty_like(src)
        staged_copy(src.view(-1), out.view(-1), torch.empty(min(size, src.numel()), dtype=src.dtype))
        assert torch.equal(out, src)
    empty = torch.empty(0, 4)
    staged_copy(empty.view(-1), torch.empty(0), torch.empty(0))
    assert torch.equal(to_host(src), src) and to_host(src).device.type == "cpu"


def test_a_layer_copies_between_devices_of_another_type_or_index_and_reads_in_place_otherwise():
    """``StreamOps.brings``: K/V on another device type, or another index of the same type, are copied to the
    consumer's device; on its own device (a device named without its index is the current one) they are read where
    they are."""
    from vismemo_hf.runtime.stream import StreamOps

    brings = StreamOps().brings
    assert brings("cpu", "cuda:0") and brings("cuda:0", "cpu") and brings("cuda:0", "cuda:1")
    assert not brings("cpu", "cpu") and not brings("cuda:1", "cuda:1")
    assert not brings("cuda", "cuda:1") and not brings("cuda:0", "cuda")


def test_an_image_column_missing_from_a_layer_is_refused_not_read_from_another_slot():
    """``writeback._slots``: where the image's columns sit in a layer's slot layout (-1: an empty slot); a column
    the layer does not hold is an error, never the K/V of another slot (index -1 would read the last one)."""
    from vismemo_hf.runtime.writeback import _slots

    layout = torch.tensor([4, -1, 2, 3, 5])  # slot i holds column layout[i]
    assert torch.equal(_slots(layout, torch.tensor([2, 3, 4, 5])), torch.tensor([2, 3, 0, 4]))
    for missing in ([1], [2, 6], [0]):
        with pytest.raises(RuntimeError, match="not all in the layer"):
            _slots(layout, torch.tensor(missing))
