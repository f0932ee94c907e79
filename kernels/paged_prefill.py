"""Block-sparse prefill over a paged KV cache, in Triton (flash attention with online softmax).

spec: `reference.paged_prefill.paged_prefill`. Every key is read through the block table (the new
tokens' K/V are already in the cache), at absolute positions: a sequence of length L with Q queries
has its queries at positions L-Q .. L-1 (bottom-right causal alignment). Page size P and sparse
block size S are independent; every (P, S) pair is supported. Masked scores are -inf, never zero.

Planned path: `plan_prefill(...)` validates the call once and keeps what the launch needs (tile
tables, layout arguments, the grid); `plan.run(q, k_cache, v_cache)` launches it for any q and caches
of the planned shapes (every layer of a model step). `paged_prefill` is plan + run.
"""

import torch
import triton
import triton.language as tl

from kernels._common import (
    FINITE_MIN,
    LAYOUT_BLOCK_MASK,
    LAYOUT_DENSE,
    LAYOUT_LOCAL_STRIDED,
    TILES_LIST,
    TILES_SCAN,
    TILES_SEGMENTS,
    LayoutArgs,
    attend_tiles,
    cdiv,
    cdiv_jit,
    compact_lists,
    finalize,
    interpreted,
    padded_head_dim,
    placeholder,
    positive_scale,
    shared_launch_kwargs,
    vertical_target,
)
from reference.validation import PlanGuard, validate_paged_prefill

# (BLOCK_M, BLOCK_N, num_warps, num_stages). The interpreter's cost is per loop iteration: big tiles.
CONFIG_INTERPRETER = (64, 64, 4, 1)
CONFIG_FP32 = (32, 32, 4, 2)  # float64 scores (FMA units, float64 registers): small tiles
# 16-bit inputs on the GPU, by layout kind and whether the padded head dim exceeds LARGE_D. Chosen
# from the same-process sweep of reports/kernel_probe.py on the H200 (docs/kernels-notes.md).
CONFIGS_GPU = {
    ("dense", False): (128, 64, 4, 3),
    ("dense", True): (128, 128, 8, 3),
    ("local_strided", False): (64, 64, 4, 2),
    ("local_strided", True): (64, 64, 4, 2),
    ("block_mask", False): (64, 64, 4, 2),
    ("block_mask", True): (64, 64, 4, 2),
}
LARGE_D = 64
# A register cap for the launch (Triton's `maxnreg`); None leaves the choice to the compiler.
MAX_REGISTERS = None
KINDS = {
    LAYOUT_DENSE.value: "dense",
    LAYOUT_LOCAL_STRIDED.value: "local_strided",
    LAYOUT_BLOCK_MASK.value: "block_mask",
}
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


def _config(dtype: torch.dtype, head_dim_pad: int, kind: int) -> tuple[int, int, int, int]:
    if interpreted():
        return CONFIG_INTERPRETER
    if dtype == torch.float32:
        return CONFIG_FP32
    return CONFIGS_GPU[(KINDS[kind], head_dim_pad > LARGE_D)]


# Grid: (query tile, query head), tiles taken last-first. Query tile t covers queries
# tiles[t, 1] .. + BLOCK_M - 1 of sequence tiles[t, 0] (indices within the sequence's queries);
# every program runs online softmax over the key tiles its layout allows (`attend_tiles`):
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
    tiles,
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
    SCORES_F64: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr,
):
    # Reversed: a sequence's last query tiles see the most keys; they start first.
    i_t = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    # Loaded rather than searched for: computing the tile's sequence in the kernel cost ~30
    # registers (and spills) in the whole program (reports/kernel_inspect.py).
    i_b = tl.load(tiles + 2 * i_t).to(tl.int64)
    m_start = tl.load(tiles + 2 * i_t + 1)
    q_begin = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_begin
    seq_len = tl.load(seq_lens + i_b)
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
    # Row mask of Q and out; the head-dim mask only when D is padded (vectorized access, _attend_one).
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
    # Dense and local-strided rows always see their own key; block-mask rows may be empty.
    b_seen = tl.full([BLOCK_M], LAYOUT != LAYOUT_BLOCK_MASK, tl.int1)
    state = (b_m, tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32), b_seen)

    kv_off = (i_h // group) * stride_kvh
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
    lay = (mask_ptr, mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride)
    g = head_offset + tl.program_id(1)
    kb_vert = vertical_target(g, head_step, vert_stride)
    rows = (q_pos[:, None], kb_vert, i_h)
    # Key tiles ending at or before q_first + 1 are causally visible to every row of the tile.
    full_hi = (q_first + 1) // BLOCK_N * BLOCK_N

    if LAYOUT == LAYOUT_DENSE:
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            (0, 1, 0, 0),
            full_hi // BLOCK_N,
            qk_scale,
            BLOCK_N,
            PAGE_ALIGNED,
            PAGE_SIZE_C,
            EVEN_D,
            LAYOUT,
            OFFSETS_I32,
            TILES_PER_BLOCK,
            TILES_SEGMENTS,
            False,
        )
        # Diagonal tiles: causality and the sequence end cut them.
        num_diag = cdiv_jit(hi - full_hi, BLOCK_N)
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            (0, 1, 0, full_hi),
            num_diag,
            qk_scale,
            BLOCK_N,
            PAGE_ALIGNED,
            PAGE_SIZE_C,
            EVEN_D,
            LAYOUT,
            OFFSETS_I32,
            TILES_PER_BLOCK,
            TILES_SEGMENTS,
            True,
        )
    elif LAYOUT == LAYOUT_LOCAL_STRIDED:
        qb_lo = q_first // sparse_block
        qb_hi = q_last // sparse_block
        kb_lo = tl.maximum(qb_lo - local_blocks + 1, 0)
        if SPARSE_ALIGNED:
            # Vertical columns kb_vert, kb_vert + V, ... left of the band (below every row's diagonal).
            num_vert = tl.maximum(kb_lo - kb_vert + vert_stride - 1, 0) // vert_stride * TILES_PER_BLOCK
            # Band blocks kb >= qb_hi - local_blocks + 1 are local to every row of the tile.
            band_full = tl.maximum(kb_lo, qb_hi - local_blocks + 1) * sparse_block
            num_band = tl.maximum(full_hi - band_full, 0) // BLOCK_N
            vertical = (kb_vert, vert_stride, num_vert, band_full)
            state = attend_tiles(
                state,
                b_q,
                rows,
                kv,
                lay,
                vertical,
                num_vert + num_band,
                qk_scale,
                BLOCK_N,
                PAGE_ALIGNED,
                PAGE_SIZE_C,
                EVEN_D,
                LAYOUT,
                OFFSETS_I32,
                TILES_PER_BLOCK,
                TILES_SEGMENTS,
                False,
            )
            # The band's partial start (blocks from kb_lo), then the diagonal tiles.
            num_partial = (band_full - kb_lo * sparse_block) // BLOCK_N
            lo_diag = tl.maximum(band_full, full_hi)
            partial = (kb_lo, 1, num_partial, lo_diag)
            num_masked = num_partial + cdiv_jit(hi - lo_diag, BLOCK_N)
            state = attend_tiles(
                state,
                b_q,
                rows,
                kv,
                lay,
                partial,
                num_masked,
                qk_scale,
                BLOCK_N,
                PAGE_ALIGNED,
                PAGE_SIZE_C,
                EVEN_D,
                LAYOUT,
                OFFSETS_I32,
                TILES_PER_BLOCK,
                TILES_SEGMENTS,
                True,
            )
        else:
            scan = (0, kb_lo, kb_vert, hi)
            state = attend_tiles(
                state,
                b_q,
                rows,
                kv,
                lay,
                scan,
                cdiv_jit(hi, BLOCK_N),
                qk_scale,
                BLOCK_N,
                PAGE_ALIGNED,
                PAGE_SIZE_C,
                EVEN_D,
                LAYOUT,
                OFFSETS_I32,
                TILES_PER_BLOCK,
                TILES_SCAN,
                True,
            )
    else:
        o_list = i_t * tl.num_programs(1) + i_h
        listed = (tile_blocks + o_list * max_tile_blocks,)
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            listed,
            tl.load(tile_counts + o_list),
            qk_scale,
            BLOCK_N,
            PAGE_ALIGNED,
            PAGE_SIZE_C,
            EVEN_D,
            LAYOUT,
            OFFSETS_I32,
            TILES_PER_BLOCK,
            TILES_LIST,
            True,
        )

    b_out, b_lse = finalize(state, qk_scale)
    p_o = out + o_tok[:, None] * stride_ot + i_h * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, b_out.to(out.dtype.element_ty), mask=m_md)
    tl.store(lse + o_tok * stride_lt + i_h * stride_lh, b_lse, mask=m_m)


def _query_tiles(batch, block_m: int) -> list[tuple[int, int]]:
    """(sequence, first query index) of every query tile, sequences without queries skipped."""
    return [(b, m) for b in range(batch.num_seqs) for m in range(0, batch.query_len(b), block_m)]


def _block_mask_tiles(layout, batch, tiles, block_m, block_n, device):
    """Compact per-(query tile, head) lists of the key tiles (BLOCK_N grid) holding an allowed block.

    Returns counts int32 [num_tiles, num_heads] and indices int32 [num_tiles, num_heads, max_count].
    Built from absolute positions: a tile may span several query blocks (rows OR-ed) and a key tile
    several key blocks. The kernel still applies the element mask inside each listed tile.
    """
    size = layout.block_size
    mask = layout.mask.to(device)  # [Hm, NB, NB]
    heads, nb = mask.shape[0], mask.shape[1]
    seqs, starts = (list(column) for column in zip(*tiles, strict=True))
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
    return compact_lists(active.expand(batch.num_heads, -1, -1).transpose(0, 1))


class PrefillPlan:
    """One validated `paged_prefill` call, ready to launch for any q and caches of the planned shapes.

    Built by `plan_prefill` (the arguments of `paged_prefill`). `run(q, k_cache, v_cache)` refuses
    with ValueError tensors that do not match the plan, and a plan whose metadata tensors were
    modified in place since it was built (a stale plan).
    """

    def __init__(
        self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale, layout, return_lse
    ):
        self.batch = batch = validate_paged_prefill(
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
        self.guard = PlanGuard(
            dict(q=q, k_cache=k_cache, v_cache=v_cache),
            dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc),
        )
        self.return_lse = return_lse
        device = q.device
        # Integer metadata is read as contiguous memory by the kernel (a no-op when it already is).
        self.block_tables, self.seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        self.query_start_loc = query_start_loc.contiguous()
        self.args = LayoutArgs(layout, batch.num_heads, device)
        self.block_m, self.block_n, self.num_warps, self.num_stages = _config(
            q.dtype, padded_head_dim(batch.head_dim), self.args.kind
        )
        tiles = _query_tiles(batch, self.block_m)
        self.grid = (len(tiles), batch.num_heads)
        if not tiles:
            return
        # [num_tiles, 2]: (sequence, first query index) of each tile, in one host-to-device copy.
        self.tiles = torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True)
        if self.args.kind == LAYOUT_BLOCK_MASK.value:
            self.counts, self.blocks = _block_mask_tiles(
                layout, batch, tiles, self.block_m, self.block_n, device
            )
        else:
            self.counts = self.blocks = placeholder(device)
        self.constants = self.args.kernel_kwargs() | dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            SPARSE_ALIGNED=self.args.block_size % self.block_n == 0,
            TILES_PER_BLOCK=max(self.args.block_size // self.block_n, 1),
        )

    def run(self, q, k_cache, v_cache):
        """out [num_tokens, num_heads, head_dim] in q's dtype; with return_lse also lse float32."""
        self.guard.check(q=q, k_cache=k_cache, v_cache=v_cache)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if hasattr(self, "constants"):
            self._launch(q, k_cache, v_cache, out, lse)
        return (out, lse) if self.return_lse else out

    def _launch(self, q, k_cache, v_cache, out, lse):
        if k_cache.stride() != v_cache.stride():
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        q_in, qk_scale = positive_scale(q, self.batch.scale)
        paged_prefill_kernel[self.grid](
            q_in,
            out,
            lse,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.tiles,
            self.counts,
            self.blocks,
            self.blocks.shape[-1],
            *q_in.stride(),
            *out.stride(),
            *lse.stride(),
            *k_cache.stride(),
            self.block_tables.stride(0),
            qk_scale=qk_scale,
            **self.constants,
            **shared_launch_kwargs(self.batch, k_cache, self.block_n),
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            **({} if MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}),
        )


def plan_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Validates a `paged_prefill` call once; returns a plan whose `run(q, k_cache, v_cache)` launches it.

    spec: `reference.paged_prefill.plan_prefill`. Arguments as `paged_prefill`; only the shapes,
    strides, dtypes and devices of q, k_cache and v_cache are planned, so one plan serves every layer.
    """
    return PrefillPlan(
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
        lse [num_tokens, num_heads] float32 (natural log; -inf and out 0 for a row with no key, NaN
        for a row that sees a non-finite value).
    """
    plan = plan_prefill(
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
    return plan.run(q, k_cache, v_cache)
