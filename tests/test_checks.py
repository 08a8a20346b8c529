"""``core.checks.all_finite``: one sum decides, and a non-finite value anywhere is never read as finite."""

import threading

import pytest
import torch

from vismemo_hf.core.checks import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_value_anywhere_is_found(dtype, bad):
    tensor = torch.randn(3, 5, 7).to(dtype)
    assert all_finite(tensor)
    for at in (0, 52, tensor.numel() - 1):
        damaged = tensor.clone()
        damaged.view(-1)[at] = bad
        assert not all_finite(damaged)
        assert not all_finite(damaged.transpose(0, 2))  # a strided view reads the same values


def test_opposite_infinities_and_overflow():
    assert not all_finite(torch.tensor([float("inf"), float("-inf"), 1.0]))
    # finite values whose float32 sum overflows read as non-finite: the safe side
    assert not all_finite(torch.tensor([1e308, 1e308], dtype=torch.float64))
    assert all_finite(torch.full((1000,), 65504.0, dtype=torch.float16))  # float16's largest value, summed in float32


def test_empty_integer_boolean_and_complex_tensors():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.arange(10)) and all_finite(torch.ones(3, dtype=torch.bool))
    assert all_finite(torch.randn(4, dtype=torch.complex64))
    assert not all_finite(torch.tensor([1 + 1j, complex(float("nan"), 0)]))


def test_a_remembered_tensor_is_read_again_only_when_it_changes(monkeypatch):
    """``remember=True``: the same tensor object at the same in-place version is not summed again; written in
    place, or another object with the same values, it is; a tensor found non-finite is never remembered."""
    reads = []
    real = torch.Tensor.sum
    here = threading.get_ident()  # a writer thread left by an earlier test may sum its own tensors meanwhile

    def counted(self, *a, **k):
        if threading.get_ident() == here:
            reads.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "sum", counted)
    tower = torch.randn(4, 8)
    assert all_finite(tower, remember=True) and all_finite(tower, remember=True) and len(reads) == 1
    tower[1, 2] = float("nan")  # in place: a new version
    assert not all_finite(tower, remember=True) and not all_finite(tower, remember=True) and len(reads) == 3
    tower[1, 2] = 0.0
    assert all_finite(tower, remember=True) and len(reads) == 4
    assert all_finite(tower.clone(), remember=True) and len(reads) == 5  # another object
    assert all_finite(tower) and len(reads) == 6  # without remember: always read
    view = tower[2:]
    assert all_finite(view, remember=True) and len(reads) == 7
    tower[3, 0] = float("inf")  # the base written: the view's version moves too
    assert not all_finite(view, remember=True)
