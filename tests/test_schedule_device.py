"""``schedule.on_device`` copies index sets to the accelerator; a set built with ``expand`` (one row's index
repeated) is a view whose elements share memory, and a copy into a tensor of that layout is refused on CUDA."""

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
