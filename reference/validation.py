"""Input validation shared by the oracle and the kernels (one function per operator).

Each function raises `TypeError` (wrong type, rank or dtype) or `ValueError` (wrong value or size)
naming the argument, before any kernel launch, and returns the host-side facts the callers need.
"""

import math
from dataclasses import dataclass

import torch

from reference.layouts import check_layout, layout_block_mask

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PagedBatch:
    """Host-side view of a validated paged-attention call."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    scale: float
    seq_lens: list[int]  # context + new tokens, per sequence
    query_starts: list[int]  # query_start_loc as a list, length num_seqs + 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, b: int) -> int:
        return self.query_starts[b + 1] - self.query_starts[b]


def _tensor(name: str, x, rank: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")
    return x


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _check_cache(q, k_cache, v_cache) -> tuple[int, int, int]:
    """Checks q against the caches; returns (num_kv_heads, page_size, num_pages)."""
    _tensor("q", q, 3, SUPPORTED_DTYPES)
    _tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES)
    _tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if page_size < 1 or num_kv_heads < 1:
        raise ValueError(
            f"k_cache must be [num_pages, page_size>=1, num_kv_heads>=1, head_dim], "
            f"got {tuple(k_cache.shape)}"
        )
    if q.shape[2] != head_dim or head_dim < 1:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k_cache head_dim {head_dim}")
    if q.shape[1] < 1 or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q num_heads ({q.shape[1]}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_kv_heads, page_size, num_pages


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_layout(layout, num_heads: int, seq_lens: list[int]) -> None:
    """The layout protocol (reference/layouts.py) over the blocks the longest sequence needs; the mask
    is computed once per layout and kept, so a repeated call costs a lookup."""
    if layout is None:
        return
    needed = math.ceil(max(seq_lens, default=0) / check_layout(layout))
    layout_block_mask(layout, num_heads, needed)


# The last `_on_host` transfer: (the tensors themselves, their versions, their host copies). Held, so
# that no other tensor can take their ids; the engine's plans of one step (one per layout) share one.
_last_on_host: list = [(), (), []]


def _on_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The int32 metadata tensors on the CPU, moved there together: one transfer, one host sync. The
    same tensor objects, unmodified since (their version counters), as the last call's, cost none."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    held, versions, host = _last_on_host
    same = len(held) == len(tensors) and all(a is b for a, b in zip(held, tensors, strict=True))
    if same and versions == tuple(t._version for t in tensors):
        return host
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    host = [
        part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
    ]
    _last_on_host[:] = [tensors, tuple(t._version for t in tensors), host]
    return host


def _check_block_tables(table: torch.Tensor, seq_lens: list[int], page_size: int, num_pages: int) -> None:
    """`table`: the block tables on the CPU."""
    if table.shape[0] != len(seq_lens):
        raise ValueError(f"block_tables has {table.shape[0]} rows, expected {len(seq_lens)}")
    pages_needed = [math.ceil(n / page_size) for n in seq_lens]
    if max(pages_needed, default=0) > table.shape[1]:
        raise ValueError(
            f"block_tables has {table.shape[1]} columns, a sequence needs {max(pages_needed)} pages"
        )
    # Every used entry lies in [0, num_pages): checked on the columns some sequence uses, and entry
    # by entry only when an out-of-range id shows up there (it may be another sequence's padding).
    columns = table[:, : max(pages_needed, default=0)]
    if not columns.numel() or (int(columns.min()) >= 0 and int(columns.max()) < num_pages):
        return
    needed = torch.tensor(pages_needed, dtype=torch.int64).view(-1, 1)
    bad = (torch.arange(columns.shape[1]).view(1, -1) < needed) & ((columns < 0) | (columns >= num_pages))
    if bool(bad.any()):
        b = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(f"block_tables[{b}] holds a page id outside [0, {num_pages})")


def _check_metadata(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout, return_lse):
    """The checks both attention operators share; `query_start_loc` None means one query per sequence."""
    num_kv_heads, page_size, num_pages = _check_cache(q, k_cache, v_cache)
    _tensor("block_tables", block_tables, 2, (torch.int32,))
    _tensor("seq_lens", seq_lens, 1, (torch.int32,))
    metadata = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    if query_start_loc is not None:
        _tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
        metadata["query_start_loc"] = query_start_loc
    _same_device(**metadata)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if query_start_loc is None:
        table, lens = _on_host(block_tables, seq_lens)
        lens, starts = lens.tolist(), list(range(len(lens) + 1))
    else:
        table, lens, starts = _on_host(block_tables, seq_lens, query_start_loc)
        lens, starts = lens.tolist(), starts.tolist()
    if len(starts) != len(lens) + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {len(lens) + 1} entries, got {len(starts)}"
        )
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens ({q.shape[0]}), "
            f"got {starts[0]} .. {starts[-1]}"
        )
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    for b, q_len in enumerate(q_lens):
        if q_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, it falls at index {b + 1}")
    for b, q_len in enumerate(q_lens):
        if lens[b] < q_len:
            raise ValueError(f"seq_lens[{b}] ({lens[b]}) is smaller than its query count ({q_len})")
    _check_block_tables(table, lens, page_size, num_pages)
    _check_layout(layout, q.shape[1], lens)
    return PagedBatch(
        num_heads=q.shape[1],
        num_kv_heads=num_kv_heads,
        head_dim=q.shape[2],
        page_size=page_size,
        num_pages=num_pages,
        scale=_check_scale(scale, q.shape[2]),
        seq_lens=lens,
        query_starts=starts,
    )


def validate_paged_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
) -> PagedBatch:
    """Validates the arguments of `paged_prefill` (contract §4), with one device-to-host transfer."""
    if not isinstance(query_start_loc, torch.Tensor):
        raise TypeError(f"query_start_loc must be a torch.Tensor, got {type(query_start_loc).__name__}")
    return _check_metadata(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout, return_lse
    )


def validate_paged_decode(
    q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False
) -> PagedBatch:
    """Validates the arguments of `paged_decode`: one query per sequence, seq_lens >= 1."""
    _tensor("q", q, 3, SUPPORTED_DTYPES)
    _tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, q has {q.shape[0]} sequences")
    return _check_metadata(q, k_cache, v_cache, block_tables, seq_lens, None, scale, layout, return_lse)


def _check_no_overlap(name: str, t: torch.Tensor) -> None:
    """ValueError when two elements of `t` share memory (an expanded view): it cannot be written."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    reach = 0  # the largest offset spanned by the dims of smaller stride
    for stride, size in dims:
        if stride <= reach:
            raise ValueError(f"{name} has overlapping elements (strides {t.stride()}); it cannot be written")
        reach += stride * (size - 1)


def validate_write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Validates the arguments of `write_kv`: shapes, dtypes, slots in [-1, num_pages * page_size),
    caches that can be written (no two elements in one memory location)."""
    _tensor("k", k, 3, SUPPORTED_DTYPES)
    _tensor("v", v, 3, SUPPORTED_DTYPES)
    _tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES)
    _tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES)
    _tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    _same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != k.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from k dtype {k.dtype}")
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k is [num_tokens, {k.shape[1]}, {k.shape[2]}], the cache holds "
            f"[.., {k_cache.shape[2]}, {k_cache.shape[3]}]"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, k has {k.shape[0]} tokens")
    _check_no_overlap("k_cache", k_cache)
    _check_no_overlap("v_cache", v_cache)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots = slot_mapping.cpu()
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
        raise ValueError(f"slot_mapping entries must lie in [-1, {num_slots})")
    written = slots[slots >= 0]
    if written.unique().numel() != written.numel():
        raise ValueError("slot_mapping writes one slot twice")


class PlanGuard:
    """What a plan was built for, so that running it on anything else is refused (a stale plan).

    A plan covers the per-call tensors (`planned`: q and the caches, or K/V and the caches) of the
    planned shapes, strides, dtypes and devices (their values are free: one plan serves every layer of a
    step) and the metadata tensors as they were when it was validated: `check` raises ValueError
    when a tensor does not match, or when a metadata tensor was modified in place since (its version
    counter moved). Writes that bypass torch's version counter (a custom kernel writing through a
    raw pointer) cannot be seen: plan again after changing metadata.
    """

    def __init__(self, planned: dict, metadata: dict):
        self.signatures = {name: _signature(t) for name, t in planned.items()}
        self.metadata = {name: (t, t._version) for name, t in metadata.items()}

    def check(self, **tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            shape, stride, dtype, device = self.signatures[name]
            # Field by field rather than `_signature(t) != ...`: this runs on every planned launch.
            if t.shape != shape or t.stride() != stride or t.dtype != dtype or t.device != device:
                planned = _describe(self.signatures[name])
                raise ValueError(f"{name} {_describe(_signature(t))} does not match the plan's {planned}")
        for name, (t, version) in self.metadata.items():
            if t._version != version:
                raise ValueError(f"stale plan: {name} was modified after planning; plan again")

    def rebase(self) -> None:
        """Takes the metadata as it is now for what was planned: for a caller that rewrites it in place
        within what the plan was made for (the engine's CUDA graphs replay a plan over new metadata;
        a backend declaring the `graphs` capability promises its plans stay right then)."""
        self.metadata = {name: (t, t._version) for name, (t, _) in self.metadata.items()}

    def matches(self, **tensors: torch.Tensor) -> bool:
        """Whether `check` would pass."""
        try:
            self.check(**tensors)
        except (TypeError, ValueError):
            return False
        return True


def _signature(t: torch.Tensor) -> tuple:
    # Strides too: a plan's int32-offset choice and layout tables assume the planned memory layout.
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _describe(signature: tuple) -> str:
    shape, stride, dtype, device = signature
    return f"{list(shape)} (strides {list(stride)}) {dtype} on {device}"
