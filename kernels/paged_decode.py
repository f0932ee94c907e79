"""Paged decode in Triton: split-KV (flash-decoding) attention of one query per sequence.

spec: `reference.paged_decode.paged_decode`. The query of sequence b sits at position
seq_lens[b] - 1. A first kernel runs online softmax over one slice ("split") of the keys for a GQA
group of query heads; a second combines the splits. A split that sees no key leaves l = 0 and
weighs nothing; a row with no key at all gives out 0 and lse -inf; a row that sees a non-finite
value is NaN.

Planned path: `plan_decode(...)` validates once; `plan.run(q, k_cache, v_cache)` launches for any q
and caches of the planned shapes. `paged_decode` is plan + run.
"""

import torch
import triton
import triton.language as tl

from kernels import tile_lists
from kernels._common import (
    FINITE_MIN,
    MIN_DOT,
    BoundLaunch,
    LastPlan,
    RunInputs,
    attend,
    cdiv,
    contiguous_strides,
    finalize,
    interpreted,
    list_kwargs,
    padded_head_dim,
    scores_in_float64,
    shared_launch_kwargs,
)
from reference.validation import PlanGuard, validate_paged_decode

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
    "group",
    "head_dim",
    "stride_list_head",
]


def _num_splits(batch, num_keys: int, block_n: int, device: torch.device) -> int:
    """Splits of at most `num_keys` keys: enough programs to fill the GPU, none under MIN_SPLIT_KEYS."""
    if interpreted():
        return max(1, min(SPLITS_INTERPRETER, cdiv(num_keys, block_n)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = cdiv(PROGRAMS_PER_SM * sms, batch.num_seqs * batch.num_kv_heads)
    return max(1, min(wanted, cdiv(num_keys, MIN_SPLIT_KEYS)))


# Grid: (sequence, KV head, split). Rows of the tile are the GQA group of query heads sharing the KV
# head (padded to BLOCK_G >= 16 for tl.dot). The lists of kernels/tile_lists.py, per (query block,
# KV head), hold the key tiles some head of the group may see: full ones (every head sees them whole)
# and partial ones. Splits 0 .. full_splits - 1 cover entries [s * split_len, (s+1) * split_len) of
# the full list, unmasked; the others the same spans of the partial list, masked (per head by the
# entries' bits when the lists have them).
@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def paged_decode_split_kernel(
    q,
    k_cache,
    v_cache,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_page,
    stride_tok,
    stride_kvh,
    stride_d,
    qk_scale,
    part_m,
    part_l,
    part_acc,
    part_seen,
    block_tables,
    seq_lens,
    split_len,
    full_splits,
    tile_lists,
    tile_bits,
    block_mask,
    stride_bt,
    stride_list_kind,
    stride_list_tile,
    stride_list_head,
    stride_mask_head,
    num_blocks,
    sparse_block,
    page_size,
    group,
    head_dim,
    BLOCK_G: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    SCORES_F64: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    LAYOUT_MASK: tl.constexpr,
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
    q_pos = seq_len - 1
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < head_dim

    # [BLOCK_G, HEAD_DIM_PAD]
    p_q = q + i_b * stride_qt + o_h[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
    if SCORES_F64:
        b_q = b_q.to(tl.float64)
        b_m = tl.full([BLOCK_G], FINITE_MIN, tl.float64)
    else:
        b_m = tl.full([BLOCK_G], FINITE_MIN, tl.float32)
    b_seen = tl.zeros([BLOCK_G], tl.int1)
    state = (b_m, tl.zeros([BLOCK_G], tl.float32), tl.zeros([BLOCK_G, HEAD_DIM_PAD], tl.float32), b_seen)

    kv_off = i_kvh * stride_kvh
    kv = (
        k_cache + kv_off,
        v_cache + kv_off,
        block_tables + i_b * stride_bt,
        page_size,
        stride_page,
        stride_tok,
        stride_d,
        o_d,
        m_d,
        seq_len,
    )
    qb = q_pos // sparse_block
    # [BLOCK_G, 1]: each head's block-mask row at the query's block (padded rows are never read)
    p_mask_row = block_mask + (tl.where(m_g, o_h, 0) * stride_mask_head + qb * num_blocks)[:, None]
    rows = (q_pos, m_g[:, None], p_mask_row, sparse_block)
    p_full = tile_lists + qb * stride_list_tile + i_kvh * stride_list_head
    p_partial = p_full + stride_list_kind
    # Splits [0, full_splits) walk the full list, the others the partial one: one loop a program
    # (two short loops a program cost a second pipeline start: reports/gpu/kernel-ab.md).
    if i_s < full_splits:
        lo = i_s * split_len
        num = tl.minimum(tl.load(p_full) - lo, split_len)
        state = attend(
            state, b_q, rows, kv, p_full + 1 + lo, num, qk_scale, BLOCK_N, PAGE_SIZE_C, EVEN_D, OFFSETS_I32,
            LAYOUT_MASK, False,
        )  # fmt: skip
    else:
        lo = (i_s - full_splits) * split_len
        num = tl.minimum(tl.load(p_partial) - lo, split_len)
        if LAYOUT_MASK == 2:  # MASK_BITS: each entry's bit g says whether head g of the group sees it
            p_bits = tile_bits + qb * stride_list_tile + i_kvh * stride_list_head + 1 + lo
            # A tuple of its own: a branch may not give `rows` other types (Triton's typed if).
            bit_rows = (q_pos, m_g[:, None], p_bits, o_g[:, None])
            state = attend(
                state, b_q, bit_rows, kv, p_partial + 1 + lo, num, qk_scale, BLOCK_N, PAGE_SIZE_C, EVEN_D,
                OFFSETS_I32, LAYOUT_MASK, True,
            )  # fmt: skip
        else:
            state = attend(
                state, b_q, rows, kv, p_partial + 1 + lo, num, qk_scale, BLOCK_N, PAGE_SIZE_C, EVEN_D,
                OFFSETS_I32, LAYOUT_MASK, True,
            )  # fmt: skip

    # part_*: [num_seqs, num_heads, num_splits(, HEAD_DIM_PAD)]
    b_m, b_l, b_acc, b_seen = state
    o_part = (i_b * num_heads + o_h) * num_splits + i_s
    tl.store(part_m + o_part, b_m, mask=m_g)
    tl.store(part_l + o_part, b_l, mask=m_g)
    tl.store(part_seen + o_part, b_seen.to(tl.int8), mask=m_g)
    p_acc = part_acc + o_part[:, None] * HEAD_DIM_PAD + o_d[None, :]
    tl.store(p_acc, b_acc, mask=m_g[:, None])


# Grid: (sequence, query head). Combines the splits' (max, sum, accumulator) into out and lse.
@triton.jit(do_not_specialize=["num_splits", "head_dim"])
def paged_decode_reduce_kernel(
    out,
    lse,
    qk_scale,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    part_m,
    part_l,
    part_acc,
    part_seen,
    num_splits,
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
    b_seen = tl.load(part_seen + o_part, mask=m_s, other=0)
    # [SPLITS_PAD, HEAD_DIM_PAD]
    b_acc = tl.load(part_acc + o_part[:, None] * HEAD_DIM_PAD + o_d[None, :], mask=m_s[:, None], other=0.0)
    # Every split's max is finite (FINITE_MIN when it saw no key), so the weights never hit NaN; a
    # NaN sum or accumulator of a split (a non-finite value it saw) carries over into the row.
    # The maxima are raw q.k scores, combined before scaling like the splits' own weights.
    b_max = tl.max(b_m, 0, keep_dims=True)
    b_w = tl.exp2(((b_m - b_max) * qk_scale).to(tl.float32))
    # [1]-shaped state of one row, finalized like a prefill row.
    state = (
        b_max,
        tl.sum(b_l * b_w, 0, keep_dims=True),
        tl.sum(b_acc * b_w[:, None], 0, keep_dims=True),
        tl.max(b_seen, 0, keep_dims=True) > 0,
    )
    b_out, b_lse = finalize(state, qk_scale)
    p_o = out + i_b * stride_ob + i_h * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, b_out.to(out.dtype.element_ty), mask=(o_d < head_dim)[None, :])
    tl.store(lse + i_b * stride_lb + i_h * stride_lh + tl.arange(0, 1), b_lse)


class DecodePlan:
    """One validated `paged_decode` call, ready to launch for any q and caches of the planned shapes.

    Built by `plan_decode` (the arguments of `paged_decode`); `run` refuses with ValueError tensors
    that do not match the plan and metadata modified in place since it was built (a stale plan).
    """

    def __init__(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale, layout, return_lse):
        self.batch = batch = validate_paged_decode(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
        )
        self.guard = PlanGuard(
            dict(q=q, k_cache=k_cache, v_cache=v_cache), dict(block_tables=block_tables, seq_lens=seq_lens)
        )
        self.return_lse = return_lse
        self.inputs = RunInputs(q, k_cache, v_cache, batch.scale, return_lse)
        if batch.num_seqs == 0:
            return
        device = q.device
        head_dim_pad = padded_head_dim(batch.head_dim)
        block_n, num_warps, num_stages = CONFIG_INTERPRETER if interpreted() else CONFIG_GPU
        group = batch.num_heads // batch.num_kv_heads
        # Query "tiles" of one block: a sequence's lists are its query block's.
        rows = block_n if layout is None else layout.block_size
        lists = tile_lists.tile_lists(
            layout, batch.num_heads, max(batch.seq_lens), rows, block_n, group, device
        )
        # The longest lists of any query block up to the last one planned, from the lists' host-side
        # counts (no device read), full and partial: so the splits cover any sequence no longer than
        # the longest planned, should the metadata be rewritten in place (the engine's CUDA graphs).
        last_block = (max(batch.seq_lens) - 1) // lists.block_size
        longest = lists.counts[:, : last_block + 1].amax(dim=(1, 2)).tolist()
        num_tiles = max(sum(longest), 1)
        wanted = _num_splits(batch, num_tiles * block_n, block_n, device)
        split_len = cdiv(num_tiles, wanted)
        full_splits = cdiv(longest[0], split_len)
        self.num_splits = full_splits + max(cdiv(longest[1], split_len), 1)
        block_g = max(MIN_DOT, triton.next_power_of_2(group))
        # The split kernel's scratch, [num_seqs, num_heads, num_splits(, HEAD_DIM_PAD)], written whole by
        # every run. Raw-score maxima keep its precision (float64 scores for float32 inputs).
        part_shape = (batch.num_seqs, batch.num_heads, self.num_splits)
        max_dtype = torch.float64 if scores_in_float64(q.dtype) else torch.float32
        parts = dict(
            part_m=torch.empty(part_shape, dtype=max_dtype, device=device),
            part_l=torch.empty(part_shape, dtype=torch.float32, device=device),
            part_acc=torch.empty((*part_shape, head_dim_pad), dtype=torch.float32, device=device),
            part_seen=torch.empty(part_shape, dtype=torch.int8, device=device),
        )
        # The kernel reads the block table as contiguous rows (a no-op when it already is).
        table = block_tables.contiguous()
        self.grid = (batch.num_seqs, batch.num_kv_heads, self.num_splits)
        self.launch = BoundLaunch(
            paged_decode_split_kernel,
            self.grid,
            device,
            **self.inputs.kwargs,
            **parts,
            block_tables=table,
            seq_lens=seq_lens.contiguous(),
            split_len=split_len,
            full_splits=full_splits,
            stride_bt=table.stride(0),
            **list_kwargs(lists),
            **shared_launch_kwargs(batch, k_cache, block_n),
            BLOCK_G=block_g,
            BLOCK_N=block_n,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        self.reduce = BoundLaunch(
            paged_decode_reduce_kernel,
            (batch.num_seqs, batch.num_heads),
            device,
            qk_scale=self.inputs.qk_scale,
            **dict(zip(("stride_ob", "stride_oh", "stride_od"), contiguous_strides(q.shape), strict=True)),
            **dict(zip(("stride_lb", "stride_lh"), contiguous_strides(q.shape[:2]), strict=True)),
            **parts,
            num_splits=self.num_splits,
            head_dim=batch.head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(self.num_splits),
            num_warps=REDUCE_WARPS,
        )

    def run(self, q, k_cache, v_cache):
        """out [num_seqs, num_heads, head_dim] in q's dtype; with return_lse also lse float32."""
        self.guard.check(q=q, k_cache=k_cache, v_cache=v_cache)
        out, lse = self.inputs.outputs()
        if self.batch.num_seqs:
            self.launch(*self.inputs(q, k_cache, v_cache))
            self.reduce(out, lse)
        return (out, lse) if self.return_lse else out


def plan_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    """Validates a `paged_decode` call once; returns a plan whose `run(q, k_cache, v_cache)` launches it.

    spec: `reference.paged_decode.plan_decode`. Arguments as `paged_decode`; only the shapes, strides,
    dtypes and devices of q, k_cache and v_cache are planned, so one plan serves every layer.
    """
    return DecodePlan(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    """Attention of each sequence's last token over its paged KV cache.

    spec: `reference.paged_decode.paged_decode`. Repeated calls reuse the last plan as
    `kernels.paged_prefill.paged_prefill` does (`kernels._common.LastPlan`).

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
        layout (a layout | None):
            Block-sparse layout (the protocol of reference/layouts.py). Default: `None`, dense causal.
        return_lse (bool):
            Also return the log-sum-exp. Default: `False`.
    Returns:
        out [num_seqs, num_heads, head_dim] in q's dtype; with `return_lse`, also
        lse [num_seqs, num_heads] float32 (natural log; -inf and out 0 for a row with no key, NaN
        for a row that sees a non-finite value).
    """
    return _LAST_PLAN(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )


_LAST_PLAN = LastPlan(plan_decode)
