"""Shared pieces of the Triton kernels: math constants, layout codes, host conversions, jit helpers.

The kernels are the twins of the oracle in `reference/`; everything here is private to `kernels/`.
Three jit helpers carry the attention arithmetic of prefill and decode alike:
    `attend_tiles`  owns one loop of online softmax over key tiles (full tiles unmasked, partial ones
                    masked), the way the Triton tutorial's inner function does;
    `finalize`      turns the running state into out and lse (NaN rule, empty rows);
    `layout_allowed` is the layout's block rule, factored into a query side computed once per program
                    and a key side computed once per tile, so that a masked tile costs a few integer
                    ops per element instead of three runtime divisions.
Related values travel as tuples (`kv`, `lay`, `state`) rather than dozens of positional arguments.
"""

import os

import torch
import triton
import triton.language as tl

from reference.layouts import BlockMaskLayout, LocalStridedLayout

# Globals read inside @triton.jit code must be tl.constexpr; the host reads them through `.value`.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores scaled by scale * LOG2E make exp2 an exp
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns a base-2 log-sum-exp into a natural one
NEG_INF = tl.constexpr(float("-inf"))
# Initial running max: the most negative float32, so the max stays finite in rows with no key yet.
FINITE_MIN = tl.constexpr(-3.4028234663852886e38)
# tl.dot needs at least 16 rows, 16 columns and a reduction of 16.
MIN_DOT = 16
# Layout codes, passed to the kernels as the LAYOUT constexpr.
LAYOUT_DENSE = tl.constexpr(0)
LAYOUT_LOCAL_STRIDED = tl.constexpr(1)
LAYOUT_BLOCK_MASK = tl.constexpr(2)
# How `attend_tiles` enumerates its key tiles (the TILES constexpr).
TILES_SEGMENTS = tl.constexpr(0)  # count_a tiles of blocks a0, a0 + a_step, ...; then contiguous tiles
TILES_LIST = tl.constexpr(1)  # tile indices read from a host-built list
TILES_SCAN = tl.constexpr(2)  # every tile of a range, skipped by a scalar test when no block is allowed
TILES_RESIDUES = tl.constexpr(3)  # the blocks of some residues mod vert_stride, then contiguous tiles
# Placeholder parameters of a layout the kernel does not read.
NO_BLOCK_SIZE = 1


def interpreted() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, qk_scale) with qk_scale = |scale| * log2(e) >= 0, negating q when scale < 0.

    The kernels subtract the running max before scaling, which needs a non-negative scale.
    """
    if scale < 0:
        return -q, -scale * LOG2E.value
    return q, scale * LOG2E.value


def scores_in_float64(dtype: torch.dtype) -> bool:
    """float32 inputs get float64 scores q.k: float32 rounding of large scores would otherwise match
    the float32 oracle's own error, with no margin under contract §5's max gate."""
    return dtype == torch.float32


def padded_head_dim(head_dim: int) -> int:
    """Head dims that are not powers of two are padded (and masked) to the next power of two."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ceil_to(a: int, b: int) -> int:
    return cdiv(a, b) * b


def page_size_constexpr(page_size: int, block_n: int) -> int:
    """The PAGE_SIZE_C kernel argument: page_size when it is a power of two below block_n (a tile
    spans whole pages; at most log2(block_n) compiled variants), else 0 (runtime division)."""
    if page_size < block_n and page_size & (page_size - 1) == 0:
        return page_size
    return 0


_PLACEHOLDERS: dict = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element int32 tensor for pointer arguments a launch does not read (made once per device)."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _PLACEHOLDERS[device]


def compact_lists(active: torch.Tensor, trim: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `active` (bool [..., n]), the indices of its True entries, first ones first.

    Returns counts int32 [...] and indices int32 [..., width]: width is the largest count (at least
    1) when `trim`, which reads it on the host, else n (no host sync). Entries past a row's count are
    unspecified and never read.
    """
    counts = active.sum(-1, dtype=torch.int32)
    order = torch.sort((~active).to(torch.int8), dim=-1, stable=True).indices
    width = max(int(counts.max()) if counts.numel() else 0, 1) if trim else max(active.shape[-1], 1)
    return counts.contiguous(), order[..., :width].to(torch.int32).contiguous()


class LayoutArgs:
    """A layout as kernel arguments.

    `kind` is one of the LAYOUT_* codes. LocalStridedLayout is computed inside the kernel from its
    parameters (no table). BlockMaskLayout travels as the layout's own [heads, NB, NB] uint8 mask
    (`mask`, head stride 0 when shared by all heads), read per element of a visited tile.
    """

    def __init__(self, layout, num_heads: int, device: torch.device):
        self.block_size = NO_BLOCK_SIZE
        self.local_blocks = 1
        self.vert_stride = 1
        self.head_step = 0
        self.head_offset = 0
        self.mask = placeholder(device)
        self.mask_head_stride = 0
        self.num_blocks = 0
        if layout is None:
            self.kind = LAYOUT_DENSE.value
        elif isinstance(layout, LocalStridedLayout):
            self.kind = LAYOUT_LOCAL_STRIDED.value
            self.block_size = layout.block_size
            self.local_blocks = layout.local_blocks
            self.vert_stride = layout.vert_stride
            self.head_step = layout.head_step(num_heads)
            self.head_offset = layout.head_offset
        elif isinstance(layout, BlockMaskLayout):
            self.kind = LAYOUT_BLOCK_MASK.value
            self.block_size = layout.block_size
            self.num_blocks = layout.num_blocks
            # The causal rule is applied per element in the kernel; the mask is taken as stored.
            self.mask = layout.mask.to(device=device, dtype=torch.uint8).contiguous()
            self.mask_head_stride = 0 if self.mask.shape[0] == 1 else self.num_blocks * self.num_blocks
        else:  # validation has already rejected anything else
            raise TypeError(f"unsupported layout {type(layout).__name__}")

    def kernel_kwargs(self) -> dict:
        return dict(
            mask_ptr=self.mask,
            mask_head_stride=self.mask_head_stride,
            num_blocks=self.num_blocks,
            sparse_block=self.block_size,
            local_blocks=self.local_blocks,
            vert_stride=self.vert_stride,
            head_step=self.head_step,
            head_offset=self.head_offset,
            LAYOUT=self.kind,
        )


INT32_MAX = 2**31 - 1


def offsets_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every element offset of the cache (a non-negative-stride view) fits in int32."""
    return sum((n - 1) * s for n, s in zip(cache.shape, cache.stride(), strict=True)) <= INT32_MAX


def shared_launch_kwargs(batch, cache: torch.Tensor, block_n: int) -> dict:
    """Sizes and constexpr switches that the prefill and decode launchers pass alike."""
    head_dim_pad = padded_head_dim(batch.head_dim)
    return dict(
        page_size=batch.page_size,
        group=batch.num_heads // batch.num_kv_heads,
        head_dim=batch.head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        EVEN_D=batch.head_dim == head_dim_pad,
        PAGE_ALIGNED=batch.page_size % block_n == 0,
        PAGE_SIZE_C=page_size_constexpr(batch.page_size, block_n),
        SCORES_F64=scores_in_float64(cache.dtype),
        OFFSETS_I32=offsets_fit_int32(cache),
    )


@triton.jit
def cdiv_jit(a, b):
    return (a + b - 1) // b


@triton.jit
def vertical_target(g, head_step, vert_stride):
    """The key-block residue mod vert_stride of head g's vertical columns:
    (kb + g * step + 1) % vert_stride == 0  <=>  kb % vert_stride == vertical_target(g, ...)."""
    return (vert_stride - 1 - (g * head_step) % vert_stride) % vert_stride


@triton.jit
def layout_allowed(qb, target, head, kb, lay, LAYOUT: tl.constexpr):
    """block_allowed of contract §2 for query blocks `qb` and key blocks `kb` (causal rule excluded).

    Query-side values (`qb`, `target` of `vertical_target`, `head` = mask row) and key-side `kb`
    broadcast against each other, e.g. [BLOCK_M, 1] against [1, BLOCK_N].
    """
    mask_ptr, mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride = lay
    if LAYOUT == LAYOUT_LOCAL_STRIDED:
        return ((qb - kb) < local_blocks) | ((kb % vert_stride) == target)
    elif LAYOUT == LAYOUT_BLOCK_MASK:
        m_in = (qb < num_blocks) & (kb < num_blocks)
        p_mask = mask_ptr + head.to(tl.int64) * mask_head_stride + qb * num_blocks + kb
        return tl.load(p_mask, mask=m_in, other=0) != 0
    else:
        return (qb >= 0) & (kb >= 0)


@triton.jit
def kv_row_offsets(
    p_bt,
    n,
    o_n,
    m_k,
    page_size,
    stride_page,
    stride_tok,
    BLOCK_N,
    PAGE_ALIGNED,
    PAGE_SIZE_C,
    MASKED,
    OFFSETS_I32,
):
    """Cache offsets of key positions o_n = n + arange(BLOCK_N), read through a block-table row.

    PAGE_ALIGNED (page_size a multiple of BLOCK_N, n a multiple of BLOCK_N): one page per tile, one
    table entry. Otherwise every position looks up its own page; with MASKED, entries of positions
    outside m_k (past the sequence) are never read. PAGE_SIZE_C is page_size as a constexpr when it
    is a power of two below BLOCK_N (0 otherwise): a shift and a mask instead of a runtime division.
    OFFSETS_I32: the host proved every offset of the cache fits in int32 (half the address math);
    otherwise page ids are widened to int64 before the multiply.
    """
    if PAGE_ALIGNED:
        page = tl.load(p_bt + n // page_size)
        i_row = (n % page_size) + tl.arange(0, BLOCK_N)
    else:
        if PAGE_SIZE_C != 0:
            i_page = o_n // PAGE_SIZE_C
            i_row = o_n % PAGE_SIZE_C
        else:
            i_page = o_n // page_size
            i_row = o_n % page_size
        if MASKED:
            page = tl.load(p_bt + i_page, mask=m_k, other=0)
        else:
            page = tl.load(p_bt + i_page)
    if OFFSETS_I32:
        return page * stride_page + i_row * stride_tok
    else:
        return page.to(tl.int64) * stride_page + i_row * stride_tok


@triton.jit
def _dot(a, b):
    """a @ b with float32 (and float64) operands in IEEE precision: no tf32 in a float32 kernel
    (contract §5); 16-bit operands accumulate in float32 on the tensor cores."""
    if a.dtype == tl.float16 or a.dtype == tl.bfloat16:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attend_one(
    state,
    b_q,
    rows,
    kv,
    lay,
    n,
    qk_scale,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    EVEN_D: tl.constexpr,
    LAYOUT: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One key tile of online softmax, keys n .. n + BLOCK_N - 1 (see `attend_tiles`)."""
    b_m, b_l, b_acc, b_seen = state
    q_pos, target, head = rows
    p_k, p_v, p_bt, page_size, stride_page, stride_tok, stride_d, o_d, m_d, seq_len = kv
    _mask_ptr, _mask_head_stride, _num_blocks, sparse_block, _local_blocks, _vert_stride = lay
    # [BLOCK_N]
    o_n = n + tl.arange(0, BLOCK_N)
    m_k = o_n < seq_len
    o_row = kv_row_offsets(
        p_bt,
        n,
        o_n,
        m_k,
        page_size,
        stride_page,
        stride_tok,
        BLOCK_N,
        PAGE_ALIGNED,
        PAGE_SIZE_C,
        MASKED,
        OFFSETS_I32,
    )
    # [BLOCK_N, HEAD_DIM_PAD]: K is loaded like V (and transposed for the dot), so that both share
    # one set of offsets and one block-table gather.
    o_kv = o_row[:, None] + o_d[None, :] * stride_d
    p_kt = p_k + o_kv
    p_vt = p_v + o_kv
    # With EVEN_D the head-dim mask is left out: m_d compares against the runtime head_dim, so the
    # compiler cannot prove it constant along the contiguous dim and would split the loads into
    # scalar (2-byte) loads, which also defeats the asynchronous-copy pipeline.
    if MASKED and EVEN_D:
        b_k = tl.load(p_kt, mask=m_k[:, None], other=0.0)
        b_v = tl.load(p_vt, mask=m_k[:, None], other=0.0)
    elif MASKED:
        b_k = tl.load(p_kt, mask=m_k[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(p_vt, mask=m_k[:, None] & m_d[None, :], other=0.0)
    elif EVEN_D:
        b_k = tl.load(p_kt)
        b_v = tl.load(p_vt)
    else:
        b_k = tl.load(p_kt, mask=m_d[None, :], other=0.0)
        b_v = tl.load(p_vt, mask=m_d[None, :], other=0.0)
    # [R, BLOCK_N] raw scores q.k (float64 when b_q is: float32 kernels score in float64, so their
    # error stays below the float32 oracle's); the running max b_m is kept in these units.
    b_s = _dot(b_q, tl.trans(b_k.to(b_q.dtype)))
    # s + s * 0 is s when finite and NaN when +-Inf or NaN (one FMA per element).
    b_s = b_s + b_s * 0.0
    if MASKED:
        m_s = (o_n[None, :] <= q_pos) & m_k[None, :]
        if LAYOUT != LAYOUT_DENSE:
            qb = q_pos // sparse_block
            m_s = m_s & layout_allowed(qb, target, head, o_n[None, :] // sparse_block, lay, LAYOUT)
        # [BLOCK_N]: keys whose V holds NaN or Inf; zeroed, and seen as a NaN score instead.
        m_v_bad = tl.max(((b_v != b_v) | (tl.abs(b_v) == float("inf"))).to(tl.int32), 1) > 0
        b_v = tl.where(m_v_bad[:, None], 0.0, b_v)
        b_s = tl.where(m_v_bad[None, :], float("nan"), b_s)
        b_s = tl.where(m_s, b_s, NEG_INF)
        if LAYOUT == LAYOUT_BLOCK_MASK:
            b_seen = b_seen | (tl.max(m_s.to(tl.int32), 1) > 0)
    # b_m starts at FINITE_MIN and stays finite, so a row with no key yet gets alpha 1 and p 0.
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # Subtract the max before scaling (qk_scale >= 0): the difference is exact or small, so the
    # largest weight is exactly 1 and none carries the rounding of the full score * scale product.
    # (One FFMA, s * c - m * c, leaves the max's weight at 2^(rounding of m * c): at a saturating
    # scale that is ~2^-9 off 1, so its 16-bit P rounds away from l; the H200 measured it 566x over
    # contract §5's bound and no faster: docs/kernels-notes.md.)
    b_alpha = tl.exp2(((b_m - b_m_new) * qk_scale).to(tl.float32))
    b_p = tl.exp2(((b_s - b_m_new[:, None]) * qk_scale).to(tl.float32))
    if MASKED:
        # (-inf) * 0 is NaN when scale == 0: masked weights are set, not computed.
        b_p = tl.where(m_s, b_p, 0.0)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v)
    return b_m_new, b_l, b_acc, b_seen


@triton.jit
def _tile_start(
    i,
    tiles,
    sparse_block,
    vert_stride,
    BLOCK_N: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """First key position of the i-th tile of a TILES_LIST, TILES_SEGMENTS or TILES_RESIDUES
    enumeration (see `attend_tiles`)."""
    if TILES == TILES_LIST:
        (p_list,) = tiles
        return tl.load(p_list + i) * BLOCK_N
    elif TILES == TILES_RESIDUES:
        p_res, num_res, count_a, b0, first = tiles
        j = first + i
        # Period-major order of the blocks kb < band whose kb % vert_stride is one of the sorted
        # residues: (v // num_res) * vert_stride + res[v % num_res] increases with v.
        v = j // TILES_PER_BLOCK
        kb = (v // num_res) * vert_stride + tl.load(p_res + v % num_res)
        n_a = kb * sparse_block + (j % TILES_PER_BLOCK) * BLOCK_N
        return tl.where(j < count_a, n_a, b0 + (j - count_a) * BLOCK_N)
    else:
        a0, a_step, count_a, b0 = tiles
        n_a = (a0 + (i // TILES_PER_BLOCK) * a_step) * sparse_block + (i % TILES_PER_BLOCK) * BLOCK_N
        return tl.where(i < count_a, n_a, b0 + (i - count_a) * BLOCK_N)


@triton.jit
def attend_tiles(
    state,
    b_q,
    rows,
    kv,
    lay,
    tiles,
    count,
    qk_scale,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    EVEN_D: tl.constexpr,
    LAYOUT: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over `count` key tiles; returns the new state (b_m, b_l, b_acc, b_seen).

    state: b_m [R] running max in raw q.k units, b_l [R] running sum, b_acc [R, HEAD_DIM_PAD],
        b_seen [R] whether the row has had an allowed key (tracked for block masks only).
    rows: (q_pos, target, head), each [R, 1] or broadcastable to it: the row's position, vertical-
        column residue (`vertical_target`) and mask row.
    kv: (p_k, p_v, p_bt, page_size, stride_page, stride_tok, stride_d, o_d, m_d, seq_len).
    lay: (mask_ptr, mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride).
    tiles: the enumeration's parameters, by TILES:
        TILES_SEGMENTS (a0, a_step, count_a, b0): the first count_a tiles cover the blocks a0,
            a0 + a_step, ... (TILES_PER_BLOCK tiles each), the rest are contiguous from b0;
        TILES_LIST (p_list,): tile indices (in units of BLOCK_N) read from a list;
        TILES_RESIDUES (p_res, num_res, count_a, b0, first): tiles first, first + 1, ... of: the
            count_a tiles of the blocks whose residue mod vert_stride is one of the num_res sorted
            residues at p_res (TILES_PER_BLOCK tiles each), then contiguous tiles from b0;
        TILES_SCAN (lo, kb_lo, kb_vert, hi): the tiles from lo, skipped when no block of the
            local-strided layout is allowed in them (kb_lo: first local block, kb_vert: first column).
    Unmasked tiles are known on the host side of the loop to be fully visible to every row; MASKED
    tiles apply causality, the sequence end and the layout per element (scores -inf, never zero).
    NaN rule: a non-finite score (a NaN or Inf query or key) becomes NaN, so that it reaches exactly
    the rows that see it through their weights; in masked tiles a non-finite V is zeroed and its key's
    score made NaN instead, since 0 * NaN in the weighted sum would reach rows that do not see it.
    """
    _mask_ptr, _mask_head_stride, _num_blocks, sparse_block, _local_blocks, vert_stride = lay
    for i in range(0, count):
        if TILES == TILES_SCAN:
            lo, kb_lo, kb_vert, hi = tiles
            n = lo + i * BLOCK_N
            kb_a = n // sparse_block
            kb_b = (tl.minimum(n + BLOCK_N, hi) - 1) // sparse_block
            # The smallest vertical column >= kb_a, tested against the tile's last block.
            kb_v = kb_a + (kb_vert - kb_a % vert_stride + vert_stride) % vert_stride
            if (kb_b >= kb_lo) | (kb_v <= kb_b):
                state = _attend_one(
                    state, b_q, rows, kv, lay, n, qk_scale, BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, EVEN_D,
                    LAYOUT, OFFSETS_I32, MASKED,
                )  # fmt: skip
        else:
            n = _tile_start(i, tiles, sparse_block, vert_stride, BLOCK_N, TILES_PER_BLOCK, TILES)
            state = _attend_one(
                state, b_q, rows, kv, lay, n, qk_scale, BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, EVEN_D, LAYOUT,
                OFFSETS_I32, MASKED,
            )  # fmt: skip
    return state


@triton.jit
def finalize(state, qk_scale):
    """out = acc / l and the natural-log lse (b_m in raw score units), by contract §4's rules: a row
    that saw a non-finite value (NaN or Inf anywhere in its sum or accumulator) is NaN in out and lse;
    a row with no allowed key (b_seen False) gives out 0 and lse -inf."""
    b_m, b_l, b_acc, b_seen = state
    m_bad = (b_l != b_l) | (tl.sum(((b_acc != b_acc) | (tl.abs(b_acc) == float("inf"))).to(tl.int32), 1) > 0)
    b_l_safe = tl.where(b_seen, b_l, 1.0)
    b_out = tl.where(b_seen[:, None], b_acc / b_l_safe[:, None], 0.0)
    b_lse = tl.where(b_seen, ((b_m * qk_scale + tl.log2(b_l_safe)) * LN2).to(tl.float32), NEG_INF)
    b_out = tl.where(m_bad[:, None], float("nan"), b_out)
    b_lse = tl.where(m_bad, float("nan"), b_lse)
    return b_out, b_lse
