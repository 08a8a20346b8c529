"""The code that moves tensors between the host and an accelerator, run here on the CPU through the same
functions: ``schedule.on_device`` (index sets to the accelerator; a set built with ``expand`` is a view whose
elements share memory, and a copy into a tensor of that layout is refused on CUDA) and ``writeback.to_host``
(an entry's K/V to the host through a bounded pinned buffer, a chunk at a time)."""

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
