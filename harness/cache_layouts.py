"""Conversions between the suite's paged KV cache and the layouts kernels in the field use.

The suite's cache is token-major, `[num_pages, page_size, num_kv_heads, head_dim]` (contract §3); an
adapter converts it to its kernel's layout with these helpers and back. Every conversion returns a
fresh contiguous copy (never a view of its input), works on any device and dtype, and is exact: it
only moves elements. Bad input raises `ValueError` / `TypeError` naming the argument.
"""

import math

import torch

from reference.layouts import causal_block_mask, check_int, layout_block_mask

# vLLM's v0 key cache splits head_dim into chunks of 16 bytes, so that one chunk is one vector load.
VLLM_V0_CHUNK_BYTES = 16


def _tensor(name: str, t, rank: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    return t


def _integer(name: str, t, rank: int) -> torch.Tensor:
    _tensor(name, t, rank)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t


def _pair(k_name: str, k, v_name: str, v, rank: int) -> None:
    """k and v: tensors of one rank, shape, dtype and device."""
    _tensor(k_name, k, rank)
    _tensor(v_name, v, rank)
    if v.shape != k.shape:
        raise ValueError(f"{v_name} shape {tuple(v.shape)} differs from {k_name} {tuple(k.shape)}")
    if v.dtype != k.dtype:
        raise TypeError(f"{v_name} dtype {v.dtype} differs from {k_name} dtype {k.dtype}")
    if v.device != k.device:
        raise ValueError(f"{v_name} is on {v.device}, {k_name} on {k.device}")


def _suite_caches(k_cache, v_cache) -> None:
    _pair("k_cache", k_cache, "v_cache", v_cache, 4)
    if min(k_cache.shape[1:]) < 1:
        raise ValueError(
            f"k_cache must be [num_pages, page_size>=1, num_kv_heads>=1, head_dim>=1], "
            f"got {tuple(k_cache.shape)}"
        )


def _copy(t: torch.Tensor) -> torch.Tensor:
    # clone, not contiguous(): a permute that happens to be contiguous (a dim of size 1) would alias.
    return t.clone(memory_format=torch.contiguous_format)


def vllm_v0_chunk(dtype: torch.dtype) -> int:
    """x of vLLM's v0 key cache: elements per 16-byte chunk (8 for 16-bit dtypes, 4 for float32)."""
    size = dtype.itemsize
    if size > VLLM_V0_CHUNK_BYTES:
        raise ValueError(f"dtype {dtype} is wider than a {VLLM_V0_CHUNK_BYTES}-byte chunk")
    return VLLM_V0_CHUNK_BYTES // size


def to_vllm_v0(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The suite's caches in vLLM's v0 paged layout.

    Args:
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]; head_dim a multiple of x.
    Returns:
        key_cache [num_pages, num_kv_heads, head_dim // x, page_size, x] (x = 16 // element_size) and
        value_cache [num_pages, num_kv_heads, head_dim, page_size].
    """
    _suite_caches(k_cache, v_cache)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    x = vllm_v0_chunk(k_cache.dtype)
    if head_dim % x:
        raise ValueError(f"head_dim ({head_dim}) must be a multiple of x = {x} for dtype {k_cache.dtype}")
    key = k_cache.reshape(num_pages, page_size, num_kv_heads, head_dim // x, x).permute(0, 2, 3, 1, 4)
    return _copy(key), _copy(v_cache.permute(0, 2, 3, 1))


def from_vllm_v0(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's v0 paged caches in the suite's layout (the inverse of `to_vllm_v0`).

    Args:
        key_cache: [num_pages, num_kv_heads, head_dim // x, page_size, x], x = 16 // element_size.
        value_cache: [num_pages, num_kv_heads, head_dim, page_size], key_cache's dtype and device.
    Returns:
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim].
    """
    _tensor("key_cache", key_cache, 5)
    _tensor("value_cache", value_cache, 4)
    num_pages, num_kv_heads, chunks, page_size, x = key_cache.shape
    if x != vllm_v0_chunk(key_cache.dtype):
        want = vllm_v0_chunk(key_cache.dtype)
        raise ValueError(f"key_cache's last dim must be x = {want} for {key_cache.dtype}, got {x}")
    expected = (num_pages, num_kv_heads, chunks * x, page_size)
    if tuple(value_cache.shape) != expected:
        raise ValueError(f"value_cache must be {expected} to match key_cache, got {tuple(value_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(
            f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}"
        )
    if value_cache.device != key_cache.device:
        raise ValueError(f"value_cache is on {value_cache.device}, key_cache on {key_cache.device}")
    k = _copy(key_cache.permute(0, 3, 1, 2, 4)).view(num_pages, page_size, num_kv_heads, chunks * x)
    return k, _copy(value_cache.permute(0, 3, 1, 2))


def to_head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The suite's caches with heads outside tokens inside each page.

    Args:
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim].
    Returns:
        k, v: [num_pages, num_kv_heads, page_size, head_dim].
    """
    _suite_caches(k_cache, v_cache)
    return _copy(k_cache.transpose(1, 2)), _copy(v_cache.transpose(1, 2))


def from_head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-major caches in the suite's layout (the inverse of `to_head_major`).

    Args:
        k_cache, v_cache: [num_pages, num_kv_heads, page_size, head_dim].
    Returns:
        k, v: [num_pages, page_size, num_kv_heads, head_dim].
    """
    _pair("k_cache", k_cache, "v_cache", v_cache, 4)
    return _copy(k_cache.transpose(1, 2)), _copy(v_cache.transpose(1, 2))


def _slots(block_tables, lens_name: str, lens: torch.Tensor, page_size: int, num_pages: int):
    """(page, offset) of every key, sequence after sequence: int64 [total_keys] each.

    Only the block-table entries a sequence uses are read, so its padding may hold any value.
    """
    if block_tables.shape[0] != lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected {lens.shape[0]} sequences")
    longest = int(lens.max()) if lens.numel() else 0
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"{lens_name} must hold sequence lengths >= 0")
    if math.ceil(longest / page_size) > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns, a sequence needs "
            f"{math.ceil(longest / page_size)} pages"
        )
    lens = lens.to(device=block_tables.device, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seq.shape[0], device=lens.device) - starts[seq]
    pages = block_tables[seq, pos // page_size].long()
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"block_tables holds a used page id outside [0, {num_pages})")
    return pages, pos % page_size


def _same_device(anchor_name: str, anchor: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != anchor.device:
            raise ValueError(f"{name} is on {t.device}, {anchor_name} on {anchor.device}")


def gather_varlen(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's keys and values, read through its block table and packed one after another.

    Args:
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim].
        block_tables: int [num_seqs, max_pages_per_seq]; entries past a sequence's last page are unread.
        seq_lens: int [num_seqs].
    Returns:
        k, v: [total_keys, num_kv_heads, head_dim] (sequence b at cu_seqlens_k[b] .. cu_seqlens_k[b+1])
        and cu_seqlens_k: int32 [num_seqs + 1].
    """
    _suite_caches(k_cache, v_cache)
    _integer("block_tables", block_tables, 2)
    _integer("seq_lens", seq_lens, 1)
    _same_device("k_cache", k_cache, block_tables=block_tables, seq_lens=seq_lens)
    pages, offsets = _slots(block_tables, "seq_lens", seq_lens, k_cache.shape[1], k_cache.shape[0])
    cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=k_cache.device)
    cu_seqlens_k[1:] = torch.cumsum(seq_lens.to(k_cache.device), 0)
    return k_cache[pages, offsets], v_cache[pages, offsets], cu_seqlens_k


def scatter_varlen(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Writes packed keys and values into a paged cache through the block tables, in place (the
    inverse of `gather_varlen`); slots no sequence uses are left as they are.

    Args:
        k, v: [total_keys, num_kv_heads, head_dim], the caches' dtype.
        cu_seqlens_k: int [num_seqs + 1], 0 first, non-decreasing, total_keys last.
        block_tables: int [num_seqs, max_pages_per_seq]; entries past a sequence's last page are unread.
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]; views are written through.
    """
    _suite_caches(k_cache, v_cache)
    _pair("k", k, "v", v, 3)
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k is [.., {k.shape[1]}, {k.shape[2]}], k_cache holds [.., *{tuple(k_cache.shape[2:])}]"
        )
    if k.dtype != k_cache.dtype:
        raise TypeError(f"k dtype {k.dtype} differs from k_cache dtype {k_cache.dtype}")
    _integer("cu_seqlens_k", cu_seqlens_k, 1)
    _integer("block_tables", block_tables, 2)
    _same_device("k_cache", k_cache, k=k, cu_seqlens_k=cu_seqlens_k, block_tables=block_tables)
    if cu_seqlens_k.shape[0] < 1:
        raise ValueError("cu_seqlens_k must have num_seqs + 1 >= 1 entries")
    bounds = cu_seqlens_k.tolist()
    if bounds[0] != 0 or bounds[-1] != k.shape[0]:
        raise ValueError(
            f"cu_seqlens_k must run from 0 to total_keys ({k.shape[0]}), got {bounds[0]} .. {bounds[-1]}"
        )
    lens = torch.tensor(bounds, dtype=torch.int64).diff()
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError("cu_seqlens_k must be non-decreasing")
    lens = lens.to(block_tables.device)
    pages, offsets = _slots(block_tables, "cu_seqlens_k", lens, k_cache.shape[1], k_cache.shape[0])
    k_cache[pages, offsets] = k
    v_cache[pages, offsets] = v


def block_layout_to_csr(layout, num_heads: int, num_blocks: int, *, device="cpu"):
    """A block layout's visible (query block, key block) pairs as one CSR matrix per head.

    Args:
        layout: a layout (the protocol of reference/layouts.py), or None (dense causal).
        num_heads, num_blocks: the block grid is [num_heads, num_blocks, num_blocks].
        device: where the result lives. Default: the CPU.
    Returns:
        crow: int32 [num_heads, num_blocks + 1], row r of head h holds col[h, crow[h, r]:crow[h, r+1]];
        col: int32 [num_heads, nnz_max], ascending within a row, padded with -1 past crow[h, -1].
    """
    check_int("num_heads", num_heads, 1)
    check_int("num_blocks", num_blocks, 0)
    if layout is None:
        mask = causal_block_mask(num_blocks).expand(num_heads, -1, -1)
    else:
        mask = layout_block_mask(layout, num_heads, num_blocks).expand(num_heads, -1, -1)
    mask = mask.to(device)
    crow = torch.zeros(num_heads, num_blocks + 1, dtype=torch.int32, device=device)
    crow[:, 1:] = mask.sum(-1).cumsum(-1)
    nnz = crow[:, -1].long()
    heads, flat = mask.reshape(num_heads, -1).nonzero(as_tuple=True)
    # nonzero() walks head by head, row by row: an entry's slot is its rank inside its head.
    slot = torch.arange(heads.shape[0], device=device) - (nnz.cumsum(0) - nnz)[heads]
    col = torch.full((num_heads, int(nnz.max())), -1, dtype=torch.int32, device=device)
    col[heads, slot] = (flat % max(num_blocks, 1)).to(torch.int32)
    return crow, col


def csr_to_block_mask(crow: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """The dense block mask of per-head CSR matrices (the inverse of `block_layout_to_csr`).

    Args:
        crow: int [num_heads, num_blocks + 1], 0 first and non-decreasing along each head.
        col: int [num_heads, >= max nnz], key blocks in [0, num_blocks); entries past crow[h, -1] unread.
    Returns:
        bool [num_heads, num_blocks, num_blocks].
    """
    _integer("crow", crow, 2)
    _integer("col", col, 2)
    if col.shape[0] != crow.shape[0] or col.device != crow.device:
        raise ValueError(f"col must have crow's {crow.shape[0]} heads and device, got {tuple(col.shape)}")
    if crow.shape[1] < 1:
        raise ValueError("crow must have num_blocks + 1 >= 1 columns")
    num_heads, num_blocks = crow.shape[0], crow.shape[1] - 1
    crow = crow.long()
    if bool((crow[:, 0] != 0).any()) or bool((crow.diff(dim=1) < 0).any()):
        raise ValueError("crow must start at 0 and be non-decreasing along each head")
    if bool((crow[:, -1] > col.shape[1]).any()):
        raise ValueError(f"crow counts more entries than col's {col.shape[1]} columns")
    slot = torch.arange(col.shape[1], device=col.device).expand(num_heads, -1)
    used = slot < crow[:, -1:]
    # The row of entry j is the number of row ends at or before j.
    rows = torch.searchsorted(crow[:, 1:].contiguous(), slot.contiguous(), right=True)
    cols = col.long()
    if bool((used & ((cols < 0) | (cols >= num_blocks))).any()):
        raise ValueError(f"col holds a key block outside [0, {num_blocks})")
    mask = torch.zeros(num_heads, num_blocks, num_blocks, dtype=torch.bool, device=col.device)
    heads = torch.arange(num_heads, device=col.device)[:, None].expand_as(slot)
    mask[heads[used], rows[used], cols[used]] = True
    return mask
