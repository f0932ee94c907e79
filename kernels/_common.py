"""Shared pieces of the Triton kernels: math constants, layout codes, jit helpers, host conversions.

The kernels are the twins of the oracle in `reference/`; everything here is private to `kernels/`.
"""

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
# Placeholder parameters of a layout the kernel does not read.
NO_BLOCK_SIZE = 1


def interpreted() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE for float32 (no tf32 in a float32 kernel, SPEC section 5); irrelevant for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, qk_scale) with qk_scale = |scale| * log2(e) >= 0, negating q when scale < 0.

    The kernels subtract the running max before scaling, which needs a non-negative scale.
    """
    if scale < 0:
        return -q, -scale * LOG2E.value
    return q, scale * LOG2E.value


def scores_in_float64(dtype: torch.dtype) -> bool:
    """float32 inputs get float64 scores q.k: float32 rounding of large scores would otherwise match
    the float32 oracle's own error, with no margin under SPEC section 5's max gate."""
    return dtype == torch.float32


def padded_head_dim(head_dim: int) -> int:
    """Head dims that are not powers of two are padded (and masked) to the next power of two."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


class LayoutArgs:
    """A layout as kernel arguments.

    `kind` is one of the LAYOUT_* codes. LocalStridedLayout is computed inside the kernel from its
    parameters (no table). BlockMaskLayout travels as the layout's own [heads, NB, NB] uint8 mask
    (`mask`, head stride 0 when shared by all heads), used for the element mask of a visited tile.
    """

    def __init__(self, layout, num_heads: int, device: torch.device):
        self.block_size = NO_BLOCK_SIZE
        self.local_blocks = 1
        self.vert_stride = 1
        self.head_step = 0
        self.head_offset = 0
        self.mask = torch.zeros(1, dtype=torch.uint8, device=device)
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


def shared_launch_kwargs(batch, dtype: torch.dtype, block_n: int) -> dict:
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
        DOT_PRECISION=dot_precision(dtype),
        SCORES_F64=scores_in_float64(dtype),
    )


@triton.jit
def layout_allowed(
    q_pos,
    k_pos,
    g,
    mask_ptr,
    mask_head_stride,
    head,
    num_blocks,
    sparse_block,
    local_blocks,
    vert_stride,
    head_step,
    LAYOUT: tl.constexpr,
):
    """block_allowed(head, q_pos // S, k_pos // S) of SPEC section 2, without the causal rule.

    q_pos, k_pos, g and head broadcast against each other; g is the global head index (local-strided)
    and head the row of the block mask (block-mask layout).
    """
    if LAYOUT == LAYOUT_LOCAL_STRIDED:
        qb = q_pos // sparse_block
        kb = k_pos // sparse_block
        return ((qb - kb) < local_blocks) | (((kb + g * head_step + 1) % vert_stride) == 0)
    elif LAYOUT == LAYOUT_BLOCK_MASK:
        qb = q_pos // sparse_block
        kb = k_pos // sparse_block
        m_in = (qb < num_blocks) & (kb < num_blocks)
        p_mask = mask_ptr + head.to(tl.int64) * mask_head_stride + qb * num_blocks + kb
        return tl.load(p_mask, mask=m_in, other=0) != 0
    else:
        return (q_pos >= 0) & (k_pos >= 0)


@triton.jit
def kv_row_offsets(
    p_bt,
    n_start,
    o_n,
    m_k,
    page_size,
    stride_page,
    stride_tok,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Cache offsets of key positions o_n = n_start + arange(BLOCK_N), read through a block-table row.

    PAGE_ALIGNED (page_size a multiple of BLOCK_N, n_start a multiple of BLOCK_N): one page per tile,
    one table entry. Otherwise every position looks up its own page; with MASKED, entries of
    positions outside m_k (past the sequence) are never read. PAGE_SIZE_C is page_size as a
    constexpr when it is a power of two below BLOCK_N (0 otherwise): the per-position page index and
    row become a shift and a mask instead of a runtime integer division and modulo.
    """
    if PAGE_ALIGNED:
        page = tl.load(p_bt + n_start // page_size).to(tl.int64)
        return page * stride_page + ((n_start % page_size) + tl.arange(0, BLOCK_N)) * stride_tok
    else:
        if PAGE_SIZE_C != 0:
            i_page = o_n // PAGE_SIZE_C
            i_row = o_n % PAGE_SIZE_C
        else:
            i_page = o_n // page_size
            i_row = o_n % page_size
        if MASKED:
            page = tl.load(p_bt + i_page, mask=m_k, other=0).to(tl.int64)
        else:
            page = tl.load(p_bt + i_page).to(tl.int64)
        return page * stride_page + i_row * stride_tok


@triton.jit
def attend_tile(
    b_q,
    b_m,
    b_l,
    b_acc,
    q_pos,
    n_start,
    seq_len,
    p_k_base,
    p_v_base,
    p_bt,
    page_size,
    stride_page,
    stride_tok,
    stride_d,
    o_d,
    m_d,
    qk_scale,
    g,
    head,
    mask_ptr,
    mask_head_stride,
    num_blocks,
    sparse_block,
    local_blocks,
    vert_stride,
    head_step,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    LAYOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of online softmax; returns the new (b_m, b_l, b_acc), b_m in raw q.k units.

    MASKED tiles apply causality, the sequence end and the layout per element (masked scores are
    -inf, never zero); unmasked tiles are known on the host side of the loop to be fully visible.
    """
    # [BLOCK_N]
    o_n = n_start + tl.arange(0, BLOCK_N)
    m_k = o_n < seq_len
    o_row = kv_row_offsets(
        p_bt,
        n_start,
        o_n,
        m_k,
        page_size,
        stride_page,
        stride_tok,
        BLOCK_N,
        PAGE_ALIGNED,
        PAGE_SIZE_C,
        MASKED,
    )
    # [HEAD_DIM_PAD, BLOCK_N]
    p_k = p_k_base + o_row[None, :] + o_d[:, None] * stride_d
    # [BLOCK_N, HEAD_DIM_PAD]
    p_v = p_v_base + o_row[:, None] + o_d[None, :] * stride_d
    # With EVEN_D the head-dim mask is left out: m_d compares against the runtime head_dim, so the
    # compiler cannot prove it constant along the contiguous dim and would split the loads into
    # scalar (2-byte) loads, which also defeats the asynchronous-copy pipeline.
    if MASKED and EVEN_D:
        b_k = tl.load(p_k, mask=m_k[None, :], other=0.0)
        b_v = tl.load(p_v, mask=m_k[:, None], other=0.0)
    elif MASKED:
        b_k = tl.load(p_k, mask=m_k[None, :] & m_d[:, None], other=0.0)
        b_v = tl.load(p_v, mask=m_k[:, None] & m_d[None, :], other=0.0)
    elif EVEN_D:
        b_k = tl.load(p_k)
        b_v = tl.load(p_v)
    else:
        b_k = tl.load(p_k, mask=m_d[:, None], other=0.0)
        b_v = tl.load(p_v, mask=m_d[None, :], other=0.0)
    # [BLOCK_M, BLOCK_N] raw scores q.k (float64 when b_q is: float32 kernels score in float64, so
    # their error stays below the float32 oracle's); the running max b_m is kept in these raw units.
    b_s = tl.dot(b_q, b_k.to(b_q.dtype), input_precision=DOT_PRECISION)
    if MASKED:
        m_s = (o_n[None, :] <= q_pos[:, None]) & m_k[None, :]
        if LAYOUT != LAYOUT_DENSE:
            m_s = m_s & layout_allowed(
                q_pos[:, None],
                o_n[None, :],
                g,
                mask_ptr,
                mask_head_stride,
                head,
                num_blocks,
                sparse_block,
                local_blocks,
                vert_stride,
                head_step,
                LAYOUT,
            )
        b_s = tl.where(m_s, b_s, NEG_INF)
    # b_m starts at FINITE_MIN and stays finite, so a row with no key yet gets alpha 1 and p 0.
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # Subtract the max before scaling (qk_scale > 0): the difference is exact or small, so the
    # largest weights carry no rounding of the full score * scale product (float32 accuracy).
    b_alpha = tl.exp2(((b_m - b_m_new) * qk_scale).to(tl.float32))
    b_p = tl.exp2(((b_s - b_m_new[:, None]) * qk_scale).to(tl.float32))
    if MASKED:
        # (-inf) * 0 is NaN when scale == 0: masked weights are set, not computed.
        b_p = tl.where(m_s, b_p, 0.0)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return b_m_new, b_l, b_acc


@triton.jit
def finalize_rows(b_m, b_l, b_acc, qk_scale):
    """out = acc / l and the natural-log lse (b_m in raw score units); rows with l == 0 give 0, -inf."""
    m_has = b_l > 0
    b_l_safe = tl.where(m_has, b_l, 1.0)
    b_out = tl.where(m_has[:, None], b_acc / b_l_safe[:, None], 0.0)
    b_lse = tl.where(m_has, ((b_m * qk_scale + tl.log2(b_l_safe)) * LN2).to(tl.float32), NEG_INF)
    return b_out, b_lse
