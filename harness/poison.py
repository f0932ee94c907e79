"""Poisoning of fresh allocations: an output an implementation forgets to write fails, never passes by
luck (STYLE 15, contract §5).

While an implementation runs, every empty-family allocation (`torch.empty`, `empty_like`,
`empty_strided`, `Tensor.new_empty`, `Tensor.new_empty_strided`) is filled, whoever makes it: the
adapter, a kernel package it calls, torch itself through Python. A `TorchFunctionMode` sees them all.
Floating and complex tensors are filled with NaN; integer tensors with their dtype's largest value
(as a page id or an index it lies far out of range); bool tensors are left alone.
"""

import math

import torch
from torch.overrides import TorchFunctionMode

EMPTY_FAMILY = frozenset(
    {
        torch.empty,
        torch.empty_like,
        torch.empty_strided,
        torch.Tensor.new_empty,
        torch.Tensor.new_empty_strided,
    }
)


def poison(t: torch.Tensor) -> None:
    """Fills a fresh tensor in place with its poison value (NaN, or the integer dtype's maximum)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(math.nan)
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


class poison_allocations(TorchFunctionMode):
    """`with poison_allocations(): impl.paged_prefill(...)`: every empty-family allocation made inside
    the block starts poisoned (the inputs, made before, are untouched)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in EMPTY_FAMILY and isinstance(result, torch.Tensor) and result.device.type != "meta":
            poison(result)
        return result
