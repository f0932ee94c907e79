"""Block-sparse prefill over a paged KV cache, in Triton (flash attention with online softmax).

spec: `reference.paged_prefill.paged_prefill`. Every key is read through the block table (the new
tokens' K/V are already in the cache), at absolute positions: a sequence of length L with Q queries
has its queries at positions L-Q .. L-1 (bottom-right causal alignment). Page size P and sparse
block size S are independent; every (P, S) pair is supported. Masked scores are -inf, never zero.
"""

import torch
import triton
import triton.language as tl

from kernels._common import (
    FINITE_MIN,
    LAYOUT_BLOCK_MASK,
    LAYOUT_DENSE,
    LAYOUT_LOCAL_STRIDED,
    LayoutArgs,
    attend_tile,
    cdiv,
    finalize_rows,
    interpreted,
    padded_head_dim,
    positive_scale,
    shared_launch_kwargs,
)
from reference.validation import validate_paged_prefill

# (BLOCK_M, BLOCK_N, num_warps, num_stages). The interpreter's cost is per loop iteration: big tiles.
CONFIG_INTERPRETER = (64, 64, 4, 1)
CONFIG_FP32 = (32, 32, 4, 2)  # float64 scores (FMA units, float64 registers): small tiles
CONFIG_SMALL_D = (128, 64, 4, 3)  # head_dim (padded) <= 64
CONFIG_LARGE_D = (128, 64, 8, 3)
LARGE_D = 64
# Runtime integers that would otherwise compile one variant per value class (1, multiple of 16).
NOT_SPECIALIZED = [
    "max_tile_blocks",
    "page_size",
    "num_blocks",
    "sparse_block",
    "local_blocks",
    "vert_stride",
    "head_step",
    "head_offset",
    "group",
    "head_dim",
]


def _config(dtype: torch.dtype, head_dim_pad: int) -> tuple[int, int, int, int]:
    if interpreted():
        return CONFIG_INTERPRETER
    if dtype == torch.float32:
        return CONFIG_FP32
    return CONFIG_LARGE_D if head_dim_pad > LARGE_D else CONFIG_SMALL_D


# Grid: (query tile, query head), tiles taken last-first. Query tile t covers queries
# tile_start[t] .. + BLOCK_M - 1 of sequence tile_seq[t] (indices within the sequence's queries);
# every program runs online softmax over the key tiles its layout allows:
#   dense          tiles fully below the diagonal unmasked, then the diagonal tiles masked;
#   local-strided  with S % BLOCK_N == 0: one unmasked loop (the vertical blocks left of the local
#                  band, then the band tiles every row sees) and one masked loop (the band's partial
#                  start, then the diagonal); otherwise every tile, skipping by a scalar test the
#                  tiles with no allowed block, masked;
#   block mask     the key tiles of the host-built per-(tile, head) index list, masked.
@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def paged_prefill_kernel(
    q,
    out,
    lse,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    tile_seq,
    tile_start,
    tile_counts,
    tile_blocks,
    max_tile_blocks,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    stride_page,
    stride_tok,
    stride_kvh,
    stride_d,
    stride_bt,
    qk_scale,
    page_size,
    mask_ptr,
    mask_head_stride,
    num_blocks,
    sparse_block,
    local_blocks,
    vert_stride,
    head_step,
    head_offset,
    group,
    head_dim,
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    SPARSE_ALIGNED: tl.constexpr,
    LAYOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCORES_F64: tl.constexpr,
):
    # Reversed: a sequence's last query tiles see the most keys; they start first.
    i_t = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.load(tile_seq + i_t).to(tl.int64)
    m_start = tl.load(tile_start + i_t)
    seq_len = tl.load(seq_lens + i_b)
    q_begin = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_begin
    context = seq_len - q_len
    # [BLOCK_M]
    o_m = m_start + tl.arange(0, BLOCK_M)
    m_m = o_m < q_len
    q_pos = context + o_m
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < head_dim
    q_first = context + m_start
    hi = tl.minimum(q_first + BLOCK_M, seq_len)
    q_last = hi - 1

    o_tok = (q_begin + o_m).to(tl.int64)
    # Row mask of Q and out; the head-dim mask only when D is padded (vectorized access, attend_tile).
    if EVEN_D:
        m_md = m_m[:, None]
    else:
        m_md = m_m[:, None] & m_d[None, :]
    # [BLOCK_M, HEAD_DIM_PAD]
    p_q = q + o_tok[:, None] * stride_qt + i_h * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_md, other=0.0)
    if SCORES_F64:
        b_q = b_q.to(tl.float64)
        b_m = tl.full([BLOCK_M], FINITE_MIN, tl.float64)
    else:
        b_m = tl.full([BLOCK_M], FINITE_MIN, tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    kv_off = (i_h // group) * stride_kvh
    p_k_base = k_cache + kv_off
    p_v_base = v_cache + kv_off
    p_bt = block_tables + i_b * stride_bt
    g = head_offset + tl.program_id(1)
    # Key tiles ending at or before q_first + 1 are causally visible to every row of the tile.
    full_hi = (q_first + 1) // BLOCK_N * BLOCK_N

    if LAYOUT == LAYOUT_DENSE:
        for n in range(0, full_hi, BLOCK_N):
            b_m, b_l, b_acc = attend_tile(
                b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, i_h, mask_ptr,
                mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, False, EVEN_D, LAYOUT, DOT_PRECISION,
            )  # fmt: skip
        # Diagonal tiles: causality and the sequence end cut them.
        for n in range(full_hi, hi, BLOCK_N):
            b_m, b_l, b_acc = attend_tile(
                b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, i_h, mask_ptr,
                mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, True, EVEN_D, LAYOUT, DOT_PRECISION,
            )  # fmt: skip
    elif LAYOUT == LAYOUT_LOCAL_STRIDED:
        qb_lo = q_first // sparse_block
        qb_hi = q_last // sparse_block
        kb_lo = tl.maximum(qb_lo - local_blocks + 1, 0)
        # First key block of this head's vertical columns: (kb + g * step + 1) % vert_stride == 0.
        kb_vert = (vert_stride - 1 - (g * head_step) % vert_stride) % vert_stride
        if SPARSE_ALIGNED:
            tiles_per_block = sparse_block // BLOCK_N
            num_vert = tl.maximum(kb_lo - kb_vert + vert_stride - 1, 0) // vert_stride * tiles_per_block
            # Band blocks kb >= qb_hi - local_blocks + 1 are local to every row of the tile.
            band_full = tl.maximum(kb_lo, qb_hi - local_blocks + 1) * sparse_block
            num_band = tl.maximum(full_hi - band_full, 0) // BLOCK_N
            # One loop, no mask: the vertical blocks left of the band (below every row's diagonal),
            # then the band tiles that every row sees.
            for i in range(0, num_vert + num_band):
                n_vert = (kb_vert + (i // tiles_per_block) * vert_stride) * sparse_block
                n_vert += (i % tiles_per_block) * BLOCK_N
                n = tl.where(i < num_vert, n_vert, band_full + (i - num_vert) * BLOCK_N)
                b_m, b_l, b_acc = attend_tile(
                    b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                    stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, i_h, mask_ptr,
                    mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                    BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, False, EVEN_D, LAYOUT, DOT_PRECISION,
                )  # fmt: skip
            # One masked loop: the band's partial start, then the diagonal tiles.
            num_partial = (band_full - kb_lo * sparse_block) // BLOCK_N
            lo_diag = tl.maximum(band_full, full_hi)
            num_diag = (hi - lo_diag + BLOCK_N - 1) // BLOCK_N
            for j in range(0, num_partial + num_diag):
                n = tl.where(
                    j < num_partial, kb_lo * sparse_block + j * BLOCK_N, lo_diag + (j - num_partial) * BLOCK_N
                )
                b_m, b_l, b_acc = attend_tile(
                    b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                    stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, i_h, mask_ptr,
                    mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                    BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, True, EVEN_D, LAYOUT, DOT_PRECISION,
                )  # fmt: skip
        else:
            for n in range(0, hi, BLOCK_N):
                kb_a = n // sparse_block
                kb_b = (tl.minimum(n + BLOCK_N, hi) - 1) // sparse_block
                # The smallest vertical column >= kb_a, tested against the tile's last block.
                kb_v = kb_a + (kb_vert - kb_a % vert_stride + vert_stride) % vert_stride
                if (kb_b >= kb_lo) | (kb_v <= kb_b):
                    b_m, b_l, b_acc = attend_tile(
                        b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                        stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, i_h, mask_ptr,
                        mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                        BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, True, EVEN_D, LAYOUT, DOT_PRECISION,
                    )  # fmt: skip
    else:
        o_list = i_t * tl.num_programs(1) + i_h
        count = tl.load(tile_counts + o_list)
        for j in range(0, count):
            n = tl.load(tile_blocks + o_list * max_tile_blocks + j) * BLOCK_N
            b_m, b_l, b_acc = attend_tile(
                b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, i_h, mask_ptr,
                mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, True, EVEN_D, LAYOUT, DOT_PRECISION,
            )  # fmt: skip

    b_out, b_lse = finalize_rows(b_m, b_l, b_acc, qk_scale)
    p_o = out + o_tok[:, None] * stride_ot + i_h * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, b_out.to(out.dtype.element_ty), mask=m_md)
    tl.store(lse + o_tok * stride_lt + i_h * stride_lh, b_lse, mask=m_m)


def _query_tiles(batch, block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first query index) of every query tile, sequences without queries skipped."""
    seqs, starts = [], []
    for b in range(batch.num_seqs):
        for m in range(0, batch.query_len(b), block_m):
            seqs.append(b)
            starts.append(m)
    return seqs, starts


def _block_mask_tiles(layout, batch, seqs, starts, block_m, block_n, device):
    """Compact per-(query tile, head) lists of the key tiles (BLOCK_N grid) holding an allowed block.

    Returns counts int32 [num_tiles, num_heads] and indices int32 [num_tiles, num_heads, max_count].
    Built from absolute positions: a tile may span several query blocks (rows OR-ed) and a key tile
    several key blocks. The kernel still applies the element mask inside each listed tile.
    """
    size = layout.block_size
    mask = layout.mask.to(device)  # [Hm, NB, NB]
    heads, nb = mask.shape[0], mask.shape[1]
    context = torch.tensor([batch.seq_lens[b] - batch.query_len(b) for b in seqs], device=device)
    lens = torch.tensor([batch.seq_lens[b] for b in seqs], device=device)
    q_first = context + torch.tensor(starts, device=device)
    hi = torch.minimum(q_first + block_m, lens)
    qb_lo, qb_hi = q_first // size, (hi - 1) // size
    zeros = torch.zeros(heads, 1, nb, dtype=torch.int32, device=device)
    rows = torch.cat([zeros, mask.to(torch.int32).cumsum(1, dtype=torch.int32)], 1)
    # [Hm, num_tiles, NB]: key blocks some row of the tile may see
    any_row = (rows[:, qb_hi + 1, :] - rows[:, qb_lo, :]) > 0
    num_key_tiles = cdiv(max(batch.seq_lens), block_n)
    first = torch.arange(num_key_tiles, device=device) * block_n
    kb_a = first // size
    kb_b = torch.clamp((first + block_n - 1) // size, max=nb - 1)
    zeros = torch.zeros(heads, len(seqs), 1, dtype=torch.int32, device=device)
    cols = torch.cat([zeros, any_row.to(torch.int32).cumsum(2, dtype=torch.int32)], 2)
    # [Hm, num_tiles, num_key_tiles]
    active = ((cols[:, :, kb_b + 1] - cols[:, :, kb_a]) > 0) & (first.view(1, 1, -1) < hi.view(1, -1, 1))
    active = active.expand(batch.num_heads, -1, -1).transpose(0, 1)
    counts = active.sum(-1, dtype=torch.int32)
    order = torch.sort((~active).to(torch.int8), dim=-1, stable=True).indices
    width = max(int(counts.max()), 1)
    return counts.contiguous(), order[:, :, :width].to(torch.int32).contiguous()


def _launch(batch, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, layout):
    device = q.device
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
    head_dim_pad = padded_head_dim(batch.head_dim)
    block_m, block_n, num_warps, num_stages = _config(q.dtype, head_dim_pad)
    seqs, starts = _query_tiles(batch, block_m)
    if not seqs:
        return out, lse
    if k_cache.stride() != v_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    args = LayoutArgs(layout, batch.num_heads, device)
    tile_seq = torch.tensor(seqs, dtype=torch.int32, device=device)
    tile_start = torch.tensor(starts, dtype=torch.int32, device=device)
    if args.kind == LAYOUT_BLOCK_MASK.value:
        counts, blocks = _block_mask_tiles(layout, batch, seqs, starts, block_m, block_n, device)
    else:
        counts = blocks = torch.zeros(1, dtype=torch.int32, device=device)
    grid = (len(seqs), batch.num_heads)
    q_in, qk_scale = positive_scale(q, batch.scale)
    paged_prefill_kernel[grid](
        q_in,
        out,
        lse,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_seq,
        tile_start,
        counts,
        blocks,
        blocks.shape[-1],
        *q_in.stride(),
        *out.stride(),
        *lse.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        qk_scale=qk_scale,
        **args.kernel_kwargs(),
        **shared_launch_kwargs(batch, q.dtype, block_n),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPARSE_ALIGNED=args.block_size % block_n == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, lse


def paged_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Block-sparse attention of new tokens over a paged KV cache that already holds them.

    spec: `reference.paged_prefill.paged_prefill`.

    Args:
        q (torch.Tensor):
            [num_tokens, num_heads, head_dim], float32, float16 or bfloat16.
        k_cache, v_cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim], q's dtype.
        block_tables (torch.Tensor):
            int32 [num_seqs, max_pages_per_seq]; entries past a sequence's last page are never read.
        seq_lens (torch.Tensor):
            int32 [num_seqs], context plus new tokens.
        query_start_loc (torch.Tensor):
            int32 [num_seqs + 1], cumulative query counts.
        scale (float | None):
            Score scale. Default: `None`, meaning 1/sqrt(head_dim).
        layout (LocalStridedLayout | BlockMaskLayout | None):
            Block-sparse layout. Default: `None`, dense causal.
        return_lse (bool):
            Also return the log-sum-exp. Default: `False`.
    Returns:
        out [num_tokens, num_heads, head_dim] in q's dtype; with `return_lse`, also
        lse [num_tokens, num_heads] float32 (natural log; -inf and out 0 for a row with no key).
    """
    batch = validate_paged_prefill(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        layout=layout,
        return_lse=return_lse,
    )
    out, lse = _launch(batch, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, layout)
    return (out, lse) if return_lse else out
