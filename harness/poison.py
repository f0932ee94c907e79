"""NaN poisoning: tensors an implementation allocates start as NaN, so an output it forgets to write
fails the tolerance rule instead of passing by luck (STYLE 15).

Only allocations made from a frame inside the implementation's own code (`Implementation.sources`)
are poisoned; the caller's inputs are untouched.
"""

import contextlib
import math
import os
import pathlib
import sys

import torch


def _poisoning(alloc, folders: tuple[str, ...], files: frozenset):
    def wrapper(*args, **kwargs):
        t = alloc(*args, **kwargs)
        # Frame 0 is this wrapper, 1 its caller.
        caller = str(pathlib.Path(sys._getframe(1).f_code.co_filename).resolve())
        if t.is_floating_point() and (caller in files or caller.startswith(folders)):
            t.fill_(math.nan)
        return t

    return wrapper


@contextlib.contextmanager
def poison_allocations(sources):
    """Within the block, torch.empty / empty_like / Tensor.new_empty called from `sources` fill NaN."""
    paths = [pathlib.Path(s).resolve() for s in sources]
    folders = tuple(str(p) + os.sep for p in paths if p.is_dir())
    files = frozenset(str(p) for p in paths if not p.is_dir())
    if not folders and not files:
        yield
        return
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty, torch.empty_like, torch.Tensor.new_empty = (_poisoning(a, folders, files) for a in saved)
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved
