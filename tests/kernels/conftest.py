"""NaN poisoning (STYLE 15): outputs the kernels allocate start as NaN, so an unwritten one fails.

Only allocations made from a frame inside `kernels/` are poisoned; test-side inputs are untouched.
"""

import math
import pathlib
import sys

import pytest
import torch

import kernels

KERNELS_DIR = str(pathlib.Path(kernels.__file__).resolve().parent)


def _from_kernels() -> bool:
    # Frame 0 is _from_kernels, 1 the patched allocator, 2 its caller.
    return str(pathlib.Path(sys._getframe(2).f_code.co_filename).resolve()).startswith(KERNELS_DIR)


def _poisoned(alloc):
    def wrapper(*args, **kwargs):
        t = alloc(*args, **kwargs)
        if _from_kernels() and t.is_floating_point():
            t.fill_(math.nan)
        return t

    return wrapper


@pytest.fixture(autouse=True)
def nan_poisoning(monkeypatch):
    """Fills torch.empty / empty_like / Tensor.new_empty results with NaN for kernels/ callers."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
    yield
