"""Layouts as tile lists: the one place where a layout becomes what the kernels walk (FlexAttention's
`kv_num_blocks` / `kv_indices` and `full_kv_*`, vLLM's column CSR).

A layout is any object of the protocol in reference/layouts.py; `None` is dense causal. For query
tiles of `rows` positions (tile t holds the absolute positions t * rows .. t * rows + rows - 1) and
key tiles of `block_n` positions, each (query tile, head) gets two ascending lists of key tiles:
    full     tiles every position of the query tile sees whole: the whole tile lies causally at or
             below the tile's first position, and every block pair the tiles span is allowed;
    partial  the other tiles that some position may see (the diagonal, blocks that the rows or keys
             straddle): the kernel masks them per element, by causality, the sequence end and the
             layout's block mask.
The lists depend on the layout, the heads and the tile sizes, never on the batch (positions are
absolute), so they are built once on the device and kept with the layout; a later, shorter call reads
a prefix of the grid. A key tile holding no allowed key is in neither list.
Lists built for two halves (`halves`: the Hopper prefill's two consumer groups, each taking half of a
query tile's rows) also say, in each partial entry's bits above TILE_BITS, what each half sees of that
tile: nothing (HALF_SKIP), all of it (HALF_WHOLE), what causality and the sequence end leave of it
(HALF_CAUSAL: the layout allows every block pair), or a layout-masked part (HALF_MASKED).
"""

import weakref
from dataclasses import dataclass

import torch

from reference.layouts import causal_block_mask, kept_block_mask, kept_with

# Heads reduced at once when building lists: bounds the int32 temporaries [heads, tiles, blocks].
BUILD_ELEMENTS = 2**24
# Grid (in blocks) of the dense layout's lists when no longer call has asked for more.
DENSE_MIN_BLOCKS = 64
# How a partial tile learns which of its elements the layout allows (the kernels' LAYOUT_MASK):
MASK_ELEMENTS = 0  # the block mask per element (a key tile spans several blocks)
MASK_ROWS = 1  # the block mask per row (a key tile lies in one block; the rows' blocks or heads differ)
MASK_BITS = 2  # per row from the entry's bit of each head of the group (decode, one key block a tile)
MASK_NONE = 3  # the layout allows every element of a listed tile (query and key tile in one block each)
# The most heads one list's bits can tell apart (int32 entries).
MAX_BITS = 32
# A partial entry of lists with halves: its key tile in the low TILE_BITS bits, then 2 bits a half.
TILE_BITS = 24
TILE_MASK = (1 << TILE_BITS) - 1
HALF_SKIP, HALF_WHOLE, HALF_CAUSAL, HALF_MASKED = 0, 1, 2, 3


@dataclass(frozen=True)
class TileLists:
    """Tile lists of one layout, head count and tiling, on one device.

    lists: int32 [2, num_tiles, list_heads, 1 + width]: [0] full, [1] partial; entry 0 of a row is
        its count, entries 1 .. count its key tiles, ascending (with halves, a partial entry's key
        tile is entry & TILE_MASK and half h's HALF_* mode (entry >> TILE_BITS + 2 * h) & 3).
        list_heads is 1 when every head (or every KV head's group, for decode) has the same lists
        (head stride 0 in the kernels).
    bits: int32 shaped like lists[1] (MASK_BITS), bit g of a partial entry set when head g of the
        list's group sees its tile; else None.
    mask: uint8 [1 or num_heads, num_blocks, num_blocks], the block mask the partial tiles read.
    counts: int32 [2, num_tiles, list_heads] on the CPU, the lists' counts (split sizes for decode).
    mask_mode: one of the MASK_* modes above.
    """

    lists: torch.Tensor
    bits: torch.Tensor | None
    mask: torch.Tensor
    counts: torch.Tensor
    block_size: int
    mask_mode: int

    def list_strides(self) -> tuple[int, int, int]:
        """(kind, tile, head) strides of `lists`; head 0 when the heads share their lists."""
        kind, tile, head, _ = self.lists.stride()
        return kind, tile, head if self.lists.shape[2] > 1 else 0

    def mask_head_stride(self) -> int:
        return self.mask.stride(0) if self.mask.shape[0] > 1 else 0


def mask_mode(block_size: int, rows: int, block_n: int, group: int, shared: bool) -> int:
    """The MASK_* mode of lists of these tiles: the cheapest that is exact."""
    if block_size % block_n:
        return MASK_ELEMENTS
    if block_size % rows == 0 and (group == 1 or shared):
        return MASK_NONE
    if 1 < group <= MAX_BITS and not shared and rows == block_size:
        return MASK_BITS
    return MASK_ROWS


def _block_counts(mask: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of `mask` (int) over the index ranges lo[i] .. hi[i] (inclusive) along `dim`."""
    sums = mask.cumsum(dim, dtype=torch.int32)
    sums = torch.cat([torch.zeros_like(sums.narrow(dim, 0, 1)), sums], dim)
    return sums.index_select(dim, hi + 1) - sums.index_select(dim, lo)


def _spans(num_tiles: int, tile: int, size: int, num_blocks: int, device) -> tuple[torch.Tensor, ...]:
    """First position, first block and last block of each tile of `tile` positions."""
    first = torch.arange(num_tiles, device=device) * tile
    return first, first // size, torch.clamp((first + tile - 1) // size, max=max(num_blocks - 1, 0))


def _compact(active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `active` (bool [..., n]), its count and its True indices, ascending, in front."""
    counts = active.sum(-1, dtype=torch.int32)
    slot = torch.where(active, active.cumsum(-1) - 1, active.shape[-1])  # the last column collects the rest
    index = torch.arange(active.shape[-1], device=active.device).expand_as(active)
    out = torch.zeros((*active.shape[:-1], active.shape[-1] + 1), dtype=torch.int64, device=active.device)
    return counts, out.scatter_(-1, slot, index)[..., :-1].to(torch.int32)


def _half_modes(heads, size, rows, block_n, num_tiles, k_first, kb_lo, kb_hi, num_blocks, half):
    """int32 [lists, num_tiles, num_keys]: the HALF_* mode of each key tile for half `half` of each
    query tile (its rows // 2 positions from t * rows + half * rows // 2), from the mask's int32
    heads [lists, NB, NB] (one head a list)."""
    last_block = max(num_blocks - 1, 0)
    h_first = torch.arange(num_tiles, device=heads.device) * rows + half * (rows // 2)
    hb_lo = torch.clamp(h_first // size, max=last_block)
    hb_hi = torch.clamp((h_first + rows // 2 - 1) // size, max=last_block)
    area = ((hb_hi - hb_lo + 1).view(-1, 1) * (kb_hi - kb_lo + 1).view(1, -1)).to(torch.int32)
    allowed = _block_counts(_block_counts(heads, hb_lo, hb_hi, 1), kb_lo, kb_hi, 2)
    after = k_first.view(1, -1) > (h_first + rows // 2 - 1).view(-1, 1)
    below = (k_first + block_n - 1).view(1, -1) <= h_first.view(-1, 1)
    every = allowed == area
    mode = torch.where(every, torch.where(below, HALF_WHOLE, HALF_CAUSAL), HALF_MASKED)
    return torch.where(after | (allowed == 0), HALF_SKIP, mode).to(torch.int32)


def build(
    mask: torch.Tensor, block_size: int, rows: int, block_n: int, group: int, halves: bool = False
) -> TileLists:
    """The tile lists of `mask` (bool [1 or num_heads, NB, NB], causal, on the device).

    `group` > 1 builds one list per group of `group` consecutive heads (decode: the query heads of a
    KV head), a key tile being full only when it is full for every head of the group. `halves`
    (group 1, even rows) adds each half's mode to the partial entries.
    """
    if halves and (group != 1 or rows % 2):
        raise ValueError(f"halves: expected group 1 and even rows, got group {group}, rows {rows}")
    num_blocks, device = mask.shape[1], mask.device
    num_tiles = -(-num_blocks * block_size // rows)
    num_keys = -(-num_blocks * block_size // block_n)
    if halves and num_keys > TILE_MASK + 1:
        raise ValueError(f"halves: at most {TILE_MASK + 1} key tiles fit an entry, got {num_keys}")
    shared = mask.shape[0] == 1
    depth = 1 if shared else group  # mask heads per list
    mode = mask_mode(block_size, rows, block_n, group, shared)
    q_first, qb_lo, qb_hi = _spans(num_tiles, rows, block_size, num_blocks, device)
    k_first, kb_lo, kb_hi = _spans(num_keys, block_n, block_size, num_blocks, device)
    area = ((qb_hi - qb_lo + 1).view(-1, 1) * (kb_hi - kb_lo + 1).view(1, -1) * depth).to(torch.int32)
    # [num_tiles, num_keys]: the token-level causal rule between the tiles' first and last positions
    below = (k_first + block_n - 1).view(1, -1) <= q_first.view(-1, 1)
    visible = k_first.view(1, -1) <= (q_first + rows - 1).view(-1, 1)
    shifts = torch.arange(depth, device=device).view(1, -1, 1, 1)
    step = max(1, BUILD_ELEMENTS // max(1, depth * num_tiles * max(num_blocks, num_keys)))
    # Per chunk of lists: counts [2, lists, num_tiles]; key tiles (and bits) [2 or 3, lists, num_tiles, w]
    chunks = []
    for h in range(0, mask.shape[0] // depth, step):
        heads = mask[h * depth : (h + step) * depth].to(torch.int32)
        per_row = _block_counts(heads, qb_lo, qb_hi, 1)
        each = _block_counts(per_row, kb_lo, kb_hi, 2).view(-1, depth, num_tiles, num_keys)
        counts = each.sum(1)  # [lists, num_tiles, num_keys]
        full = (counts == area) & below
        (n_full, i_full), (n_part, i_part) = _compact(full), _compact((counts > 0) & visible & ~full)
        n = torch.stack([n_full, n_part])
        width = max(int(n.max()) if n.numel() else 0, 1)  # a host sync per chunk, at build time only
        parts = [i_full[..., :width], i_part[..., :width]]
        if halves:
            keys = parts[1].long()
            for half in range(2):
                modes = _half_modes(heads, block_size, rows, block_n, num_tiles, k_first, kb_lo, kb_hi,
                                    num_blocks, half)  # fmt: skip
                parts[1] = parts[1] | torch.gather(modes, -1, keys) << TILE_BITS + 2 * half
        if mode == MASK_BITS:
            seen = ((each > 0).to(torch.int64) << shifts).sum(1).to(torch.int32)
            parts.append(torch.gather(seen, -1, i_part[..., :width].long()))
        chunks.append((n, torch.stack(parts)))
    width = max(c[1].shape[-1] for c in chunks)
    counts = torch.cat([n for n, _ in chunks], 1).transpose(1, 2)  # [2, num_tiles, lists]
    entries = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[-1])) for _, i in chunks], 1)
    entries = entries.transpose(1, 2)  # [2 or 3, num_tiles, lists, width]
    lists = torch.zeros((*counts.shape, 1 + width), dtype=torch.int32, device=device)
    lists[..., 0] = counts
    lists[..., 1:] = entries[:2]
    bits = None
    if mode == MASK_BITS:
        bits = torch.zeros_like(lists[1])
        bits[..., 1:] = entries[2]
    mask = mask.to(torch.uint8).contiguous()
    return TileLists(lists, bits, mask, counts.cpu(), block_size, mode)


# layout -> {(device, num_heads, rows, block_n, group): TileLists}; dense causal under `None`'s key.
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DENSE: dict = {}


def tile_lists(
    layout, num_heads: int, max_len: int, rows: int, block_n: int, group: int, device, halves: bool = False
) -> TileLists:
    """The kept tile lists of `layout` (None: dense causal) covering positions 0 .. max_len - 1.

    `rows`: query positions per tile (a prefill's BLOCK_M; decode passes the layout's block size);
    `group`: heads per list (1 for prefill, the GQA group for decode); `halves`: see `build`. The
    layout is validated (reference.layouts.kept_block_mask) before this is called.
    """
    if layout is None:
        # Any block size says dense causal; one that holds whole query and key tiles needs no mask.
        size, kept = max(rows, block_n), _DENSE
    else:
        size, kept = layout.block_size, kept_with(_KEPT, layout)
    key = (torch.device(device), num_heads, rows, block_n, group, halves)
    lists = kept.get(key)
    needed = -(-max_len // size)
    if lists is None or lists.mask.shape[1] < needed:
        if layout is None:
            blocks = max(DENSE_MIN_BLOCKS, 1 << max(needed - 1, 0).bit_length())
            mask = causal_block_mask(blocks)[None]
        else:
            mask = kept_block_mask(layout, num_heads, needed)
        lists = build(mask.to(device), size, rows, block_n, group, halves)
        kept[key] = lists
    return lists
