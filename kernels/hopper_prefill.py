"""The planned prefill's Hopper path (sm_90, 16-bit inputs), in Gluon: the same tile lists and math as
`paged_prefill_kernel`, with the kernel structure Triton does not produce there.

spec: `reference.paged_prefill.paged_prefill`, through `kernels.paged_prefill.PrefillPlan`, which
takes this path when `ENABLED` is set and `supports(...)` holds, and falls back to the Triton kernel
otherwise (and for a run whose caches are not 16-byte aligned, which the tensor-memory copies need).
What differs from the Triton kernel, and why (reports/gpu/kernel-ab.md §9):
- K and V tiles arrive by TMA, page by page (`PAGE_ROWS` rows a copy), into a ring of `STAGES`
  shared-memory slots, issued two tiles ahead: no per-thread address arithmetic and no address
  registers, and a load's latency is hidden behind a whole tile of work.
- The scores of the next tile are computed while the softmax of this one runs (the tensor cores and
  the other units overlap within the warp group, as FlashAttention-3 does); Triton waits for each
  score product before its softmax.
- The full and the partial tiles are one pipelined loop (a runtime branch masks the partial ones), so
  the pipeline does not drain and refill between the two lists.
Not on this path: float32 (scores in float64), head dims other than 64 and 128, pages of fewer than
8 rows or of sizes that neither divide nor are multiples of `BLOCK_N`, and caches whose rows are not
contiguous (a TMA descriptor needs `[num_pages * page_size, num_kv_heads * head_dim]` rows).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels._common import BoundLaunch, interpreted

# Off: on the H200 this path is still slower than the Triton kernel with pages of 16 (Phi-3 8k prefill
# 0.676 against 0.595 ms) and 1-3% faster with pages of 64 (reports/gpu/kernel-ab.md §9).
# reports/hopper_ab.py and tests/kernels/test_hopper_prefill.py turn it on.
ENABLED = False
BLOCK_M, BLOCK_N, NUM_WARPS, STAGES = 64, 64, 4, 3
Q_IN_REGS = False  # Q as wgmma's register operand instead of shared memory (16 KB less a program)
HEAD_DIMS = (64, 128)
MIN_PAGE_ROWS = 8  # the 128-byte swizzle's atom: a TMA copy into a slot starts on one
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
NOT_SPECIALIZED = ["page_size", "num_blocks", "sparse_block", "group", "stride_list_head", "cache_rows"]

# The twins of kernels/_common.py's constants (a Gluon function reads only Gluon constexprs).
FINITE_MIN = gl.constexpr(-3.4028234663852886e38)
NEG_INF = gl.constexpr(float("-inf"))
LN2 = gl.constexpr(0.6931471805599453)


def on_hopper(device: torch.device) -> bool:
    """Whether the device is an sm_90 GPU, the one target of this path (and not the interpreter)."""
    return device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device) == (9, 0)


def supports(batch, q: torch.Tensor, cache_contiguous: bool) -> bool:
    """Whether a validated prefill call takes this path (a run's caches must also be `aligned`)."""
    page = batch.page_size
    return (
        ENABLED
        and on_hopper(q.device)
        and q.dtype in GL_DTYPES
        and batch.head_dim in HEAD_DIMS
        and page >= MIN_PAGE_ROWS
        and (page % BLOCK_N == 0 or BLOCK_N % page == 0)
        and cache_contiguous
        and batch.num_pages * page < 2**31
    )


def aligned(*tensors: torch.Tensor) -> bool:
    """TMA reads from 16-byte aligned bases only."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def launch(grid, device: torch.device, planned: dict, descriptors: "CacheDescriptors") -> BoundLaunch:
    """The bound launch of `hopper_prefill_kernel`, from the Triton kernel's planned arguments."""
    names = set(hopper_prefill_kernel.arg_names)
    return BoundLaunch(
        hopper_prefill_kernel,
        grid,
        device,
        **{name: value for name, value in planned.items() if name in names},
        cache_rows=descriptors.shape[0],
        HEAD_DIM=descriptors.block[1],
        PAGE_ROWS=descriptors.block[0],
        STAGES=STAGES,
        Q_IN_REGS=Q_IN_REGS,
        num_warps=NUM_WARPS,
    )


class CacheDescriptors:
    """Builds the per-run TMA descriptors of the K and V caches (their base pointers change per layer)."""

    def __init__(self, k_cache: torch.Tensor):
        num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
        self.shape = [num_pages * page_size, num_kv_heads * head_dim]
        self.strides = [num_kv_heads * head_dim, 1]
        self.block = [min(page_size, BLOCK_N), head_dim]
        self.layout = gl.NVMMASharedLayout.get_default_for(self.block, GL_DTYPES[k_cache.dtype])

    def __call__(self, cache: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor(cache, self.shape, self.strides, self.block, self.layout)


@gluon.constexpr_function
def _io_layout(head_dim, num_warps):
    # 16-byte vectors along the head dim, a row per 16 (or 8) threads: coalesced rows of Q and out.
    lanes_d = head_dim // 8
    return gl.BlockedLayout([1, 8], [32 // lanes_d, lanes_d], [num_warps, 1], [1, 0])


@gluon.jit
def _page_rows(n, p_bt, seq_len, page_size, cache_rows, pred, o_box, PAGE_ROWS: gl.constexpr):
    """[BOXES]: the cache row where each `PAGE_ROWS`-row box of the key tile at position n starts.
    Pages at or past the sequence end are never looked up: their boxes start past the cache's last
    row, which TMA reads as zeros (and counts, so a tile's byte count is always the same)."""
    pos = n + o_box * PAGE_ROWS
    valid = pred & (pos < seq_len)
    page = gl.load(p_bt + pos // page_size, mask=valid, other=0)
    return gl.where(valid, page * page_size + pos % page_size, cache_rows)


@gluon.jit
def _issue_tile(
    k_desc,
    v_desc,
    k_buf,
    v_buf,
    bar,
    rows,
    kv_col,
    pred,
    o_box,
    BLOCK_N: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
):
    """TMA copies of one key tile (K and V, box by box from `rows`) into one slot, completing on bar."""
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes * (BLOCK_N // PAGE_ROWS), pred=pred)
    for j in gl.static_range(BLOCK_N // PAGE_ROWS):
        row = gl.sum(gl.where(o_box == j, rows, 0), 0)
        tma.async_copy_global_to_shared(
            k_desc, [row, kv_col], bar, k_buf.slice(j * PAGE_ROWS, PAGE_ROWS), pred=pred
        )
        tma.async_copy_global_to_shared(
            v_desc, [row, kv_col], bar, v_buf.slice(j * PAGE_ROWS, PAGE_ROWS), pred=pred
        )


@gluon.jit
def _tile_ptr(p_full, p_partial, t, n_full):
    """Where the t-th tile of the walk is listed: the full list, then the partial one."""
    return gl.where(t < n_full, p_full + 1 + t, p_partial + 1 + (t - n_full))


# Grid and tiles as `paged_prefill_kernel`: (query tile, query head), tiles taken last-first.
@gluon.jit(do_not_specialize=NOT_SPECIALIZED)
def hopper_prefill_kernel(
    q,
    out,
    lse,
    k_desc,
    v_desc,
    stride_qt,
    stride_qh,
    stride_qd,
    qk_scale,
    block_tables,
    seq_lens,
    query_start_loc,
    tiles,
    tile_lists,
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
    cache_rows,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    LAYOUT_MASK: gl.constexpr,
    Q_IN_REGS: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = k_desc.dtype
    # One warp group: wgmma's M is 64 rows; scores [BLOCK_M, BLOCK_N], accumulator [BLOCK_M, HEAD_DIM].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_io: gl.constexpr = gl.SliceLayout(1, io_layout)
    col_io: gl.constexpr = gl.SliceLayout(0, io_layout)

    i_t = (gl.num_programs(0) - 1 - gl.program_id(0)).to(gl.int64)
    i_h = gl.program_id(1).to(gl.int64)
    num_heads = gl.num_programs(1)
    i_b = gl.load(tiles + 2 * i_t).to(gl.int64)
    i_qt = gl.load(tiles + 2 * i_t + 1)
    q_begin = gl.load(query_start_loc + i_b)
    q_len = gl.load(query_start_loc + i_b + 1) - q_begin
    seq_len = gl.load(seq_lens + i_b)
    context = seq_len - q_len

    # Q [BLOCK_M, HEAD_DIM] into shared memory (wgmma's A operand), rows outside the queries zero.
    o_m_io = i_qt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_io)
    m_m_io = (o_m_io >= context) & (o_m_io < seq_len)
    o_tok_io = (q_begin + o_m_io - context).to(gl.int64)
    o_d_io = gl.arange(0, HEAD_DIM, layout=col_io)
    m_md_io = m_m_io[:, None] & (o_d_io[None, :] < HEAD_DIM)
    b_q = gl.load(
        q + o_tok_io[:, None] * stride_qt + i_h * stride_qh + o_d_io[None, :] * stride_qd,
        mask=m_md_io,
        other=0.0,
    )
    if Q_IN_REGS:
        q_smem = gl.convert_layout(b_q, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_M, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype), b_q
        )

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    # Q's generic-proxy stores and the barriers' initialization, before wgmma and TMA read them.
    fence_async_shared()
    gl.thread_barrier()

    kv_col = ((i_h // group) * HEAD_DIM).to(gl.int32)
    p_bt = block_tables + i_b * stride_bt
    p_full = tile_lists + i_qt.to(gl.int64) * stride_list_tile + i_h * stride_list_head
    p_partial = p_full + stride_list_kind
    n_full = gl.load(p_full)
    count = n_full + gl.load(p_partial)
    box_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    o_box = gl.arange(0, BLOCK_N // PAGE_ROWS, layout=box_layout)
    for i in gl.static_range(STAGES):
        n_i = gl.load(_tile_ptr(p_full, p_partial, i, n_full), mask=i < count, other=0) * BLOCK_N
        rows = _page_rows(n_i, p_bt, seq_len, page_size, cache_rows, i < count, o_box, PAGE_ROWS)
        if i < STAGES - 1:
            _issue_tile(
                k_desc,
                v_desc,
                k_smem.index(i),
                v_smem.index(i),
                bars.index(i),
                rows,
                kv_col,
                i < count,
                o_box,
                BLOCK_N,
                PAGE_ROWS,
            )
    # rows: the boxes of the tile STAGES - 1, issued in the loop's first iteration.

    # Each row's position and whether it is a real row, in the scores' layout.
    o_m = i_qt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    m_m = (o_m >= context) & (o_m < seq_len)
    qb = gl.minimum(o_m // sparse_block, num_blocks - 1)
    p_mask_row = block_mask + i_h * stride_mask_head + qb * num_blocks
    b_m = gl.full([BLOCK_M], FINITE_MIN, gl.float32, row_s)
    b_l = gl.zeros([BLOCK_M], gl.float32, row_s)
    b_seen = gl.zeros([BLOCK_M], gl.int32, row_s)
    b_acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # The first tile's scores (a walk with no tile computes them on an unfilled slot, unused).
    mbarrier.wait(bars.index(0), 0, pred=count > 0)
    b_s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
    for t in range(count):
        slot = t % STAGES
        # The start of the tile STAGES ahead, loaded now and read at this iteration's end: the table
        # lookups behind the next TMA copies wait for no load of their own iteration.
        n_far = (
            gl.load(_tile_ptr(p_full, p_partial, t + STAGES, n_full), mask=t + STAGES < count, other=0)
            * BLOCK_N
        )
        # The next tile's scores run on the tensor cores during this tile's softmax (on the last tile
        # they are computed on a slot nothing refills, and dropped).
        nxt = t + 1
        mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < count)
        s_next = warpgroup_mma(
            q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True
        )

        # The NaN rule and the masks, as `attend` (kernels/_common.py).
        b_s = b_s + b_s * 0.0
        partial = t >= n_full
        if partial:
            n = gl.load(_tile_ptr(p_full, p_partial, t, n_full)) * BLOCK_N
            o_n = n + gl.arange(0, BLOCK_N, layout=col_s)
            m_s = (o_n[None, :] <= o_m[:, None]) & (o_n[None, :] < seq_len) & m_m[:, None]
            if LAYOUT_MASK == 0:  # MASK_ELEMENTS
                m_s = m_s & (
                    gl.load(p_mask_row[:, None] + o_n[None, :] // sparse_block, mask=m_s, other=0) != 0
                )
            elif LAYOUT_MASK == 1:  # MASK_ROWS
                m_s = m_s & (gl.load(p_mask_row + n // sparse_block, mask=m_m, other=0) != 0)[:, None]
            # Keys whose V holds NaN or Inf: zeroed in the slot and seen as a NaN score instead; keys
            # past the sequence end (rows of its last page that hold anything) zeroed too.
            v_buf = v_smem.index(slot)
            b_v = v_buf.load(io_layout)
            o_n_io = n + gl.arange(0, BLOCK_N, layout=row_io)
            m_v_bad = gl.max(((b_v != b_v) | (gl.abs(b_v) == float("inf"))).to(gl.int32), 1) > 0
            b_v = gl.where((m_v_bad | (o_n_io >= seq_len))[:, None], gl.zeros_like(b_v), b_v)
            v_buf.store(b_v)
            fence_async_shared()
            gl.thread_barrier()
            b_s = gl.where(gl.convert_layout(m_v_bad, col_s)[None, :], float("nan"), b_s)
            b_s = gl.where(m_s, b_s, NEG_INF)
            b_seen = gl.maximum(b_seen, gl.max(m_s.to(gl.int32), 1))
        else:
            b_seen = gl.full([BLOCK_M], 1, gl.int32, row_s)
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_alpha = gl.exp2((b_m - b_m_new) * qk_scale)
        b_p = gl.exp2((b_s - b_m_new[:, None]) * qk_scale)
        if partial:
            # (-inf) * 0 is NaN when scale == 0: masked weights are set, not computed.
            b_p = gl.where(b_s != NEG_INF, b_p, 0.0)
        b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new

        b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None]
        b_acc = warpgroup_mma(
            gl.convert_layout(b_p.to(dtype), p_layout), v_smem.index(slot), b_acc, is_async=True
        )
        # The previous tile's slot is free (in every warp group: wgmma waits are per warp group, so
        # with two, a barrier): refill it STAGES - 1 tiles ahead, while this tile's P.V runs.
        if NUM_WARPS > 4:
            gl.thread_barrier()
        ahead = t + STAGES - 1
        slot_ahead = ahead % STAGES
        _issue_tile(
            k_desc, v_desc, k_smem.index(slot_ahead), v_smem.index(slot_ahead), bars.index(slot_ahead), rows,
            kv_col, ahead < count, o_box, BLOCK_N, PAGE_ROWS,
        )  # fmt: skip
        rows = _page_rows(n_far, p_bt, seq_len, page_size, cache_rows, t + STAGES < count, o_box, PAGE_ROWS)
        # Both products done within the iteration: an accumulator still in flight at the loop's back
        # edge makes ptxas serialize every wgmma of the kernel (warning C7514).
        b_s, b_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, b_acc))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # finalize (kernels/_common.py): the NaN rule, rows with no key.
    b_l = gl.convert_layout(b_l, row_o)
    b_m = gl.convert_layout(b_m, row_o)
    seen = gl.convert_layout(b_seen, row_o) != 0
    m_bad = (b_l != b_l) | (gl.sum(((b_acc != b_acc) | (gl.abs(b_acc) == float("inf"))).to(gl.int32), 1) > 0)
    b_l_safe = gl.where(seen, b_l, 1.0)
    b_out = gl.where(seen[:, None], b_acc / b_l_safe[:, None], 0.0)
    b_lse = gl.where(seen, (b_m * qk_scale + gl.log2(b_l_safe)) * LN2, NEG_INF)
    b_out = gl.where(m_bad[:, None], float("nan"), b_out)
    b_lse = gl.where(m_bad, float("nan"), b_lse)

    b_out = gl.convert_layout(b_out.to(dtype), io_layout)
    o_out = o_tok_io[:, None] * num_heads + i_h
    gl.store(out + o_out * HEAD_DIM + o_d_io[None, :], b_out, mask=m_md_io)
    gl.store(lse + o_tok_io * num_heads + i_h, gl.convert_layout(b_lse, row_io), mask=m_m_io)
