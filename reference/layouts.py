"""Block-sparse layouts (contract §2): which (query block, key block) pairs each head attends.

The layout protocol. A layout is any object with
    block_size: int >= 1
        S, tokens per sparse block (position p lies in block p // S);
    block_mask(num_heads, num_blocks) -> bool [num_heads, num_blocks, num_blocks]
        whether query block qb of head h may see key block kb, causality included (False above the
        diagonal). Positions are absolute, so a smaller grid is the corner of a larger one:
        block_mask(H, m) == block_mask(H, n)[:, :m, :m] for m <= n. An expanded view (head stride 0)
        says that every head has the same mask. It may raise ValueError for a grid it does not cover.
and, optionally,
    token_mask(num_heads, q_pos, k_pos) -> bool [num_heads, len(q_pos), len(k_pos)]
        the same rule per token, for a family that can say it without the block grid (the local-strided
        formula, exact for rows that straddle blocks at any length); it must equal `token_mask` below.

The token rule is always `allowed(h, pq, pk) = pk <= pq and block_allowed(h, pq // S, pk // S)`.
Everything that reads a layout (the oracle, validation, the kernels' tile lists) goes through
`layout_block_mask` and `token_mask` here, never through a layout's class. A layout must not change
after its first use: its validated block mask is kept (`layout_block_mask`).
"""

import weakref

import torch


def check_int(name: str, value, minimum: int) -> int:
    """`value` if it is an int (not a bool) >= `minimum`, else TypeError or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_positions(q_pos: torch.Tensor, k_pos: torch.Tensor) -> None:
    for name, pos in (("q_pos", q_pos), ("k_pos", k_pos)):
        if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.dtype.is_floating_point:
            raise TypeError(f"{name} must be a 1-D integer tensor")
        if pos.numel() and int(pos.min()) < 0:
            raise ValueError(f"{name} must hold positions >= 0")


class LocalStridedLayout:
    """Phi-3-small's local + vertical-stride layout (contract §2.1).

    With `step = 0 if homo_head else max(1, vert_stride // num_heads_total)` and the global head
    index `g = head_offset + h`, key block kb is visible from query block qb when
    `kb <= qb and ((qb - kb) < local_blocks or (kb + g * step + 1) % vert_stride == 0)`.

    Args:
        block_size (int):
            Tokens per sparse block, S >= 1.
        local_blocks (int):
            Blocks on and below the diagonal that every query block sees, >= 1.
        vert_stride (int):
            Period of the vertical key-block columns, >= 1 (1 is dense causal).
        homo_head (bool):
            Every head uses the same vertical columns. Default: `False`.
        num_heads_total (int | None):
            Heads before tensor parallelism. Default: `None`, the number of heads passed in.
        head_offset (int):
            Global index of this shard's first head. Default: `0`.
    """

    def __init__(
        self, block_size, local_blocks, vert_stride, homo_head=False, num_heads_total=None, head_offset=0
    ):
        self.block_size = check_int("block_size", block_size, 1)
        self.local_blocks = check_int("local_blocks", local_blocks, 1)
        self.vert_stride = check_int("vert_stride", vert_stride, 1)
        if not isinstance(homo_head, bool):
            raise TypeError(f"homo_head must be a bool, got {type(homo_head).__name__}")
        self.homo_head = homo_head
        self.num_heads_total = (
            None if num_heads_total is None else check_int("num_heads_total", num_heads_total, 1)
        )
        self.head_offset = check_int("head_offset", head_offset, 0)

    def __repr__(self) -> str:
        return (
            f"LocalStridedLayout(block_size={self.block_size}, local_blocks={self.local_blocks}, "
            f"vert_stride={self.vert_stride}, homo_head={self.homo_head}, "
            f"num_heads_total={self.num_heads_total}, head_offset={self.head_offset})"
        )

    def head_step(self, num_heads: int) -> int:
        """The per-head shift of the vertical columns, `step` of contract §2.1."""
        total = num_heads if self.num_heads_total is None else self.num_heads_total
        if self.head_offset + num_heads > total:
            raise ValueError(
                f"head_offset ({self.head_offset}) + num_heads ({num_heads}) exceeds "
                f"num_heads_total ({total})"
            )
        return 0 if self.homo_head else max(1, self.vert_stride // total)

    def _allowed(self, num_heads: int, qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
        # qb: [Q, 1], kb: [1, K] block indices (broadcast); returns [H, Q, K].
        step = self.head_step(num_heads)
        g = (self.head_offset + torch.arange(num_heads)).view(-1, 1, 1)
        local = (qb - kb) < self.local_blocks
        vertical = (kb + g * step + 1) % self.vert_stride == 0
        return (kb <= qb) & (local | vertical)

    def block_mask(self, num_heads: int, num_blocks: int) -> torch.Tensor:
        """Dense block mask. Returns: bool [num_heads, num_blocks, num_blocks]."""
        check_int("num_heads", num_heads, 1)
        check_int("num_blocks", num_blocks, 0)
        idx = torch.arange(num_blocks)
        return self._allowed(num_heads, idx.view(-1, 1), idx.view(1, -1))

    def token_mask(self, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Token mask, causal rule included. Returns: bool [num_heads, len(q_pos), len(k_pos)]."""
        check_int("num_heads", num_heads, 1)
        _check_positions(q_pos, k_pos)
        q_pos, k_pos = q_pos.cpu().long(), k_pos.cpu().long()
        causal = k_pos.view(1, -1) <= q_pos.view(-1, 1)
        qb = (q_pos // self.block_size).view(-1, 1)
        kb = (k_pos // self.block_size).view(1, -1)
        return causal & self._allowed(num_heads, qb, kb)


class BlockMaskLayout:
    """A general block layout from an explicit boolean mask (contract §2.2).

    The stored mask is combined with the causal rule: key block kb above the diagonal (kb > qb) is
    never visible, whatever the mask says. Rows may be empty.

    Args:
        block_mask (torch.Tensor):
            bool [num_heads, num_blocks, num_blocks], or [num_blocks, num_blocks] shared by all heads.
        block_size (int):
            Tokens per sparse block, S >= 1.
    """

    def __init__(self, block_mask, block_size):
        if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
            raise TypeError("block_mask must be a bool tensor")
        if block_mask.dim() == 2:
            block_mask = block_mask.unsqueeze(0)
        if block_mask.dim() != 3 or block_mask.shape[1] != block_mask.shape[2]:
            raise ValueError(f"block_mask must be [H, NB, NB] or [NB, NB], got {tuple(block_mask.shape)}")
        self.mask = block_mask.detach().cpu().clone()
        self.block_size = check_int("block_size", block_size, 1)

    def __repr__(self) -> str:
        heads, nb, _ = self.mask.shape
        return f"BlockMaskLayout(heads={heads}, num_blocks={nb}, block_size={self.block_size})"

    @property
    def num_blocks(self) -> int:
        return self.mask.shape[1]

    def block_mask(self, num_heads: int, num_blocks: int) -> torch.Tensor:
        """Dense block mask, causal rule included. Returns: bool [num_heads, num_blocks, num_blocks]
        (an expanded view when one mask serves every head)."""
        check_int("num_heads", num_heads, 1)
        check_int("num_blocks", num_blocks, 0)
        if num_blocks > self.num_blocks:
            raise ValueError(f"num_blocks ({num_blocks}) exceeds the layout's {self.num_blocks} blocks")
        mask = self.mask[:, :num_blocks, :num_blocks] & causal_block_mask(num_blocks)
        return self._per_head(mask, num_heads)

    @staticmethod
    def _per_head(mask: torch.Tensor, num_heads: int) -> torch.Tensor:
        if mask.shape[0] not in (1, num_heads):
            raise ValueError(f"layout has {mask.shape[0]} heads, expected 1 or {num_heads}")
        return mask.expand(num_heads, -1, -1)

    def token_mask(self, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Token mask, causal rule included. Returns: bool [num_heads, len(q_pos), len(k_pos)]."""
        check_int("num_heads", num_heads, 1)
        _check_positions(q_pos, k_pos)
        q_pos, k_pos = q_pos.cpu().long(), k_pos.cpu().long()
        top = max(int(q_pos.max()) if q_pos.numel() else 0, int(k_pos.max()) if k_pos.numel() else 0)
        if top // self.block_size >= self.num_blocks:
            raise ValueError(
                f"position {top} lies past the layout's {self.num_blocks} blocks of {self.block_size} tokens"
            )
        causal = k_pos.view(1, -1) <= q_pos.view(-1, 1)
        qb, kb = q_pos // self.block_size, k_pos // self.block_size
        mask = self._per_head(self.mask, num_heads)[:, qb][:, :, kb]
        return causal & mask


def causal_block_mask(num_blocks: int) -> torch.Tensor:
    """Dense causal blocks. Returns: bool [num_blocks, num_blocks]."""
    return torch.ones(num_blocks, num_blocks, dtype=torch.bool).tril()


def sliding_window_block_mask(num_blocks: int, window_blocks: int) -> torch.Tensor:
    """Each query block sees itself and the `window_blocks - 1` blocks before it.

    Returns: bool [num_blocks, num_blocks].
    """
    check_int("window_blocks", window_blocks, 1)
    idx = torch.arange(num_blocks)
    dist = idx.view(-1, 1) - idx.view(1, -1)
    return (dist >= 0) & (dist < window_blocks)


def random_block_mask(num_heads: int, num_blocks: int, density: float, seed: int) -> torch.Tensor:
    """Random causal block mask; rows may be empty (every block is kept with probability `density`).

    Returns: bool [num_heads, num_blocks, num_blocks].
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(num_heads, num_blocks, num_blocks, generator=gen) < density
    return keep & causal_block_mask(num_blocks)


def check_layout(layout) -> int:
    """The layout's block size; TypeError naming `layout` when it is not a layout (module docstring),
    ValueError when its block size is below 1."""
    size = getattr(layout, "block_size", None)
    if (
        not callable(getattr(layout, "block_mask", None))
        or isinstance(size, bool)
        or not isinstance(size, int)
    ):
        raise TypeError(
            "layout must be None or a layout: an object with an int block_size and a block_mask(num_heads, "
            f"num_blocks) method (reference/layouts.py), got {type(layout).__name__}"
        )
    if size < 1:
        raise ValueError(f"layout.block_size must be >= 1, got {size}")
    return size


def _checked_mask(layout, num_heads: int, num_blocks: int) -> torch.Tensor:
    mask = layout.block_mask(num_heads, num_blocks)
    shape = (num_heads, num_blocks, num_blocks)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"layout.block_mask({num_heads}, {num_blocks}) must be a bool tensor {list(shape)}, got {got}"
        )
    mask = mask.cpu()
    # One mask for every head (an expanded view, or equal rows) is kept once: [1, NB, NB].
    if num_heads > 1 and (mask.stride(0) == 0 or bool((mask == mask[:1]).all())):
        mask = mask[:1]
    # Causality is part of the protocol; a family that forgets it cannot open the upper triangle.
    return (mask & causal_block_mask(num_blocks)).contiguous()


def kept_with(store: "weakref.WeakKeyDictionary", layout) -> dict:
    """What `store` keeps for `layout` while the layout lives (a dict); a fresh one, kept nowhere, for a
    layout that cannot be weakly referenced."""
    try:
        return store.setdefault(layout, {})
    except TypeError:
        return {}


# layout -> {num_heads: validated mask [1 or num_heads, cap, cap]}, cap >= every grid asked so far.
_MASKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def kept_block_mask(layout, num_heads: int, num_blocks: int) -> torch.Tensor:
    """The layout's validated block mask on a grid of at least `num_blocks` blocks, on the CPU.
    Returns bool [1 or num_heads, NB', NB'] with NB' >= num_blocks: one row of heads when every head
    has the same mask.

    Raises TypeError when `layout` is not a layout and ValueError when its mask is malformed or does
    not cover `num_blocks` blocks. The mask is computed once per layout and number of heads, on a grid
    rounded up to a power of two (when the layout covers it); smaller grids are its corners.
    """
    check_layout(layout)
    check_int("num_heads", num_heads, 1)
    check_int("num_blocks", num_blocks, 0)
    kept = kept_with(_MASKS, layout)
    mask = kept.get(num_heads)
    if mask is None or mask.shape[1] < num_blocks:
        wanted = 1 << max(num_blocks - 1, 0).bit_length()
        try:
            mask = _checked_mask(layout, num_heads, wanted)
        except ValueError:
            mask = _checked_mask(layout, num_heads, num_blocks)
        kept[num_heads] = mask
    return mask


def layout_block_mask(layout, num_heads: int, num_blocks: int) -> torch.Tensor:
    """`kept_block_mask` cut to num_blocks: bool [1 or num_heads, num_blocks, num_blocks]."""
    return kept_block_mask(layout, num_heads, num_blocks)[:, :num_blocks, :num_blocks]


def token_mask(layout, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The token rule of contract §2 for any layout (None: dense causal), through the layout's own
    `token_mask` when it has one. Returns: bool [num_heads, len(q_pos), len(k_pos)]."""
    check_int("num_heads", num_heads, 1)
    _check_positions(q_pos, k_pos)
    q_pos, k_pos = q_pos.cpu().long(), k_pos.cpu().long()
    causal = k_pos.view(1, -1) <= q_pos.view(-1, 1)
    if layout is None:
        return causal.expand(num_heads, -1, -1)
    size = check_layout(layout)
    if callable(getattr(layout, "token_mask", None)):
        return layout.token_mask(num_heads, q_pos, k_pos)
    top = max([int(p.max()) for p in (q_pos, k_pos) if p.numel()], default=0)
    mask = layout_block_mask(layout, num_heads, top // size + 1)
    qb, kb = q_pos // size, k_pos // size
    return causal & mask[:, qb][:, :, kb].expand(num_heads, -1, -1)
