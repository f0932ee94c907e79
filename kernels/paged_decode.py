"""Paged decode in Triton: split-KV (flash-decoding) attention of one query per sequence.

spec: `reference.paged_decode.paged_decode`. The query of sequence b sits at position
seq_lens[b] - 1. A first kernel runs online softmax over one slice ("split") of the keys for a GQA
group of query heads; a second combines the splits. A split that sees no key leaves l = 0 and
weighs nothing; a row with no key at all gives out 0 and lse -inf.
"""

import torch
import triton
import triton.language as tl

from kernels._common import (
    FINITE_MIN,
    LAYOUT_DENSE,
    LN2,
    MIN_DOT,
    NEG_INF,
    LayoutArgs,
    attend_tile,
    cdiv,
    ceil_to,
    interpreted,
    layout_allowed,
    padded_head_dim,
    positive_scale,
    scores_in_float64,
    shared_launch_kwargs,
)
from reference.validation import validate_paged_decode

# (BLOCK_N, num_warps, num_stages) of the split kernel.
CONFIG_INTERPRETER = (32, 4, 1)
# Sweep winner on the H200 (docs/kernels-notes.md): 2 warps and 16 programs per SM beat 4 and 8.
CONFIG_GPU = (64, 2, 3)
# Splits: enough programs to fill the GPU, but no split shorter than MIN_SPLIT_KEYS keys.
PROGRAMS_PER_SM = 16
MIN_SPLIT_KEYS = 256
# Under the interpreter, a few splits even for short sequences, so that empty splits are exercised.
SPLITS_INTERPRETER = 3
REDUCE_WARPS = 4
# Runtime integers that would otherwise compile one variant per value class (1, multiple of 16).
NOT_SPECIALIZED = [
    "split_len",
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


def _num_splits(batch, block_n: int, device: torch.device) -> int:
    max_len = max(batch.seq_lens)
    if interpreted():
        return max(1, min(SPLITS_INTERPRETER, cdiv(max_len, block_n)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = cdiv(PROGRAMS_PER_SM * sms, batch.num_seqs * batch.num_kv_heads)
    return max(1, min(wanted, cdiv(max_len, MIN_SPLIT_KEYS)))


# Grid: (sequence, KV head, split). Rows of the tile are the GQA group of query heads sharing the KV
# head (padded to BLOCK_G >= 16 for tl.dot); split s covers keys [s * split_len, (s+1) * split_len).
# Sparse layouts test every tile's element mask first and skip tiles no row may see.
@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def paged_decode_split_kernel(
    q,
    part_m,
    part_l,
    part_acc,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    split_len,
    stride_qb,
    stride_qh,
    stride_qd,
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
    BLOCK_G: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    LAYOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCORES_F64: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1) * group
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens + i_b)
    # [BLOCK_G]
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < group
    o_h = tl.program_id(1) * group + o_g
    q_pos = tl.zeros([BLOCK_G], tl.int32) + (seq_len - 1)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < head_dim

    # [BLOCK_G, HEAD_DIM_PAD]
    p_q = q + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
    if SCORES_F64:
        b_q = b_q.to(tl.float64)
        b_m = tl.full([BLOCK_G], FINITE_MIN, tl.float64)
    else:
        b_m = tl.full([BLOCK_G], FINITE_MIN, tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], tl.float32)

    kv_off = i_kvh * stride_kvh
    p_k_base = k_cache + kv_off
    p_v_base = v_cache + kv_off
    p_bt = block_tables + i_b * stride_bt
    # [BLOCK_G, 1]: per-row global head (local-strided) and mask row (block mask)
    g = (head_offset + o_h)[:, None]
    # Padded rows read mask row 0: their results are never stored.
    head = tl.where(m_g, o_h, 0)[:, None]
    lo = tl.program_id(2) * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if LAYOUT == LAYOUT_DENSE:
        full_hi = tl.maximum(lo + (hi - lo) // BLOCK_N * BLOCK_N, lo)
        for n in range(lo, full_hi, BLOCK_N):
            b_m, b_l, b_acc = attend_tile(
                b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, head, mask_ptr,
                mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, False, EVEN_D, LAYOUT, DOT_PRECISION,
            )  # fmt: skip
        for n in range(full_hi, hi, BLOCK_N):
            b_m, b_l, b_acc = attend_tile(
                b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, head, mask_ptr,
                mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, True, EVEN_D, LAYOUT, DOT_PRECISION,
            )  # fmt: skip
    else:
        for n in range(lo, hi, BLOCK_N):
            o_n = n + tl.arange(0, BLOCK_N)
            # [BLOCK_G, BLOCK_N]
            m_see = layout_allowed(
                q_pos[:, None], o_n[None, :], g, mask_ptr, mask_head_stride, head, num_blocks,
                sparse_block, local_blocks, vert_stride, head_step, LAYOUT,
            ) & (o_n < seq_len)[None, :] & m_g[:, None]  # fmt: skip
            if tl.max(m_see.to(tl.int32)) > 0:
                b_m, b_l, b_acc = attend_tile(
                    b_q, b_m, b_l, b_acc, q_pos, n, seq_len, p_k_base, p_v_base, p_bt, page_size,
                    stride_page, stride_tok, stride_d, o_d, m_d, qk_scale, g, head, mask_ptr,
                    mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride, head_step,
                    BLOCK_N, PAGE_ALIGNED, PAGE_SIZE_C, True, EVEN_D, LAYOUT, DOT_PRECISION,
                )  # fmt: skip

    # part_*: [num_seqs, num_heads, num_splits(, HEAD_DIM_PAD)], float32
    o_part = (i_b * num_heads + o_h) * num_splits + i_s
    tl.store(part_m + o_part, b_m, mask=m_g)
    tl.store(part_l + o_part, b_l, mask=m_g)
    p_acc = part_acc + o_part[:, None] * HEAD_DIM_PAD + o_d[None, :]
    tl.store(p_acc, b_acc, mask=m_g[:, None])


# Grid: (sequence, query head). Combines the splits' (max, sum, accumulator) into out and lse.
@triton.jit(do_not_specialize=["num_splits", "head_dim"])
def paged_decode_reduce_kernel(
    part_m,
    part_l,
    part_acc,
    out,
    lse,
    num_splits,
    qk_scale,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    head_dim,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    # [SPLITS_PAD]
    o_s = tl.arange(0, SPLITS_PAD)
    m_s = o_s < num_splits
    o_d = tl.arange(0, HEAD_DIM_PAD)
    o_part = (i_b * num_heads + i_h) * num_splits + o_s
    b_m = tl.load(part_m + o_part, mask=m_s, other=FINITE_MIN)
    b_l = tl.load(part_l + o_part, mask=m_s, other=0.0)
    # [SPLITS_PAD, HEAD_DIM_PAD]
    b_acc = tl.load(part_acc + o_part[:, None] * HEAD_DIM_PAD + o_d[None, :], mask=m_s[:, None], other=0.0)
    # Every split's max is finite (FINITE_MIN when it saw no key), so the weights never hit NaN.
    # The maxima are raw q.k scores, combined before scaling like the splits' own weights.
    b_max = tl.max(b_m, 0)
    b_w = tl.exp2(((b_m - b_max) * qk_scale).to(tl.float32))
    l_total = tl.sum(b_l * b_w, 0)
    # [HEAD_DIM_PAD]
    b_num = tl.sum(b_acc * b_w[:, None], 0)
    l_safe = tl.where(l_total > 0, l_total, 1.0)
    b_out = tl.where(l_total > 0, b_num / l_safe, 0.0)
    b_lse = tl.where(l_total > 0, ((b_max * qk_scale + tl.log2(l_safe)) * LN2).to(tl.float32), NEG_INF)
    p_o = out + i_b * stride_ob + i_h * stride_oh + o_d * stride_od
    tl.store(p_o, b_out.to(out.dtype.element_ty), mask=o_d < head_dim)
    tl.store(lse + i_b * stride_lb + i_h * stride_lh, b_lse)


def _launch(batch, q, k_cache, v_cache, block_tables, seq_lens, layout):
    device = q.device
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
    if batch.num_seqs == 0:
        return out, lse
    if k_cache.stride() != v_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    head_dim_pad = padded_head_dim(batch.head_dim)
    block_n, num_warps, num_stages = CONFIG_INTERPRETER if interpreted() else CONFIG_GPU
    group = batch.num_heads // batch.num_kv_heads
    num_splits = _num_splits(batch, block_n, device)
    split_len = ceil_to(cdiv(max(batch.seq_lens), num_splits), block_n)
    part_shape = (batch.num_seqs, batch.num_heads, num_splits)
    # Raw-score maxima keep the split kernel's precision (float64 scores for float32 inputs).
    part_m = torch.empty(
        part_shape, dtype=torch.float64 if scores_in_float64(q.dtype) else torch.float32, device=device
    )
    part_l = torch.empty(part_shape, dtype=torch.float32, device=device)
    part_acc = torch.empty((*part_shape, head_dim_pad), dtype=torch.float32, device=device)
    args = LayoutArgs(layout, batch.num_heads, device)
    q_in, qk_scale = positive_scale(q, batch.scale)
    paged_decode_split_kernel[(batch.num_seqs, batch.num_kv_heads, num_splits)](
        q_in,
        part_m,
        part_l,
        part_acc,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        split_len,
        *q_in.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        qk_scale=qk_scale,
        **args.kernel_kwargs(),
        **shared_launch_kwargs(batch, q.dtype, block_n),
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    paged_decode_reduce_kernel[(batch.num_seqs, batch.num_heads)](
        part_m,
        part_l,
        part_acc,
        out,
        lse,
        num_splits,
        qk_scale,
        *out.stride(),
        *lse.stride(),
        head_dim=batch.head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=REDUCE_WARPS,
    )
    return out, lse


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    """Attention of each sequence's last token over its paged KV cache.

    spec: `reference.paged_decode.paged_decode`.

    Args:
        q (torch.Tensor):
            [num_seqs, num_heads, head_dim], float32, float16 or bfloat16.
        k_cache, v_cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim], q's dtype.
        block_tables (torch.Tensor):
            int32 [num_seqs, max_pages_per_seq]; entries past a sequence's last page are never read.
        seq_lens (torch.Tensor):
            int32 [num_seqs], >= 1, the new token included.
        scale (float | None):
            Score scale. Default: `None`, meaning 1/sqrt(head_dim).
        layout (LocalStridedLayout | BlockMaskLayout | None):
            Block-sparse layout. Default: `None`, dense causal.
        return_lse (bool):
            Also return the log-sum-exp. Default: `False`.
    Returns:
        out [num_seqs, num_heads, head_dim] in q's dtype; with `return_lse`, also
        lse [num_seqs, num_heads] float32 (natural log; -inf and out 0 for a row with no key).
    """
    batch = validate_paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )
    out, lse = _launch(batch, q, k_cache, v_cache, block_tables, seq_lens, layout)
    return (out, lse) if return_lse else out
