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

from kernels._common import (
    FINITE_MIN,
    LAYOUT_BLOCK_MASK,
    LAYOUT_DENSE,
    LAYOUT_LOCAL_STRIDED,
    MIN_DOT,
    TILES_LIST,
    TILES_RESIDUES,
    TILES_SEGMENTS,
    LayoutArgs,
    attend_tiles,
    cdiv,
    cdiv_jit,
    ceil_to,
    compact_lists,
    finalize,
    interpreted,
    padded_head_dim,
    placeholder,
    positive_scale,
    scores_in_float64,
    shared_launch_kwargs,
    vertical_target,
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
    "list_width",
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


def _num_splits(batch, num_keys: int, block_n: int, device: torch.device) -> int:
    """Splits of at most `num_keys` keys: enough programs to fill the GPU, none under MIN_SPLIT_KEYS."""
    if interpreted():
        return max(1, min(SPLITS_INTERPRETER, cdiv(num_keys, block_n)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = cdiv(PROGRAMS_PER_SM * sms, batch.num_seqs * batch.num_kv_heads)
    return max(1, min(wanted, cdiv(num_keys, MIN_SPLIT_KEYS)))


_RESIDUES: dict = {}


def _group_residues(args, batch, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per KV head, the sorted distinct residues mod vert_stride of its query heads' vertical columns.

    Returns counts int32 [num_kv_heads], residues int32 [num_kv_heads, group] (rows padded with their
    last residue) and the largest count, kept per device and layout so that a plan uploads them once.
    """
    group = batch.num_heads // batch.num_kv_heads
    key = (args.vert_stride, args.head_step, args.head_offset, batch.num_heads, batch.num_kv_heads, device)
    if key not in _RESIDUES:
        v = args.vert_stride
        rows = [
            sorted(
                {
                    (v - 1 - ((args.head_offset + h) * args.head_step) % v) % v
                    for h in range(k * group, (k + 1) * group)
                }
            )
            for k in range(batch.num_kv_heads)
        ]
        counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
        table = torch.tensor([r + r[-1:] * (group - len(r)) for r in rows], dtype=torch.int32)
        _RESIDUES[key] = counts.to(device), table.to(device), max(len(r) for r in rows)
    return _RESIDUES[key]


def _residue_tiles_bound(args, batch, block_n: int, num_res: int) -> int:
    """The most key tiles the residue enumeration gives a (sequence, KV head): the longest sequence's
    vertical columns (num_res residues) below its band, and the band."""
    size = args.block_size
    qb = (max(batch.seq_lens) - 1) // size
    band_lo = max(qb - args.local_blocks + 1, 0)
    columns = num_res * cdiv(band_lo, args.vert_stride)
    return columns * (size // block_n) + cdiv(max(batch.seq_lens) - band_lo * size, block_n)


def _visible_tiles(layout, args, batch, seq_lens: torch.Tensor, block_n: int):
    """Per (sequence, KV head), the key tiles (BLOCK_N grid) that some query head of the group may see.

    Computed on the device from the layout's rule for each sequence's one query block. Returns counts
    int32 [num_seqs, num_kv_heads] and tile indices int32 [num_seqs, num_kv_heads, width].
    """
    device, size = seq_lens.device, layout.block_size
    num_blocks = cdiv(max(batch.seq_lens), size)
    lens = seq_lens.long()
    qb = ((lens - 1) // size).view(-1, 1, 1)
    kb = torch.arange(num_blocks, device=device).view(1, 1, -1)
    heads = torch.arange(batch.num_heads, device=device).view(1, -1, 1)
    if args.kind == LAYOUT_BLOCK_MASK.value:
        mask = args.mask.bool()  # [1 or num_heads, NB, NB]
        mask_rows = heads.view(1, -1) if mask.shape[0] > 1 else torch.zeros_like(heads.view(1, -1))
        # [num_seqs, num_heads, num_blocks]: each head's mask row at the sequence's query block
        allowed = mask[mask_rows, qb.view(-1, 1)][..., :num_blocks]
    else:
        target = (
            args.vert_stride - 1 - ((args.head_offset + heads) * args.head_step) % args.vert_stride
        ) % args.vert_stride
        allowed = ((qb - kb) < args.local_blocks) | ((kb % args.vert_stride) == target)
    # [num_seqs, num_kv_heads, num_blocks]
    blocks = (allowed & (kb <= qb)).view(batch.num_seqs, batch.num_kv_heads, -1, num_blocks).any(2)
    first = torch.arange(cdiv(max(batch.seq_lens), block_n), device=device) * block_n
    cols = torch.cat(
        [torch.zeros_like(blocks[..., :1], dtype=torch.int32), blocks.cumsum(-1, dtype=torch.int32)], -1
    )
    kb_a, kb_b = first // size, torch.clamp((first + block_n - 1) // size, max=num_blocks - 1)
    active = ((cols[..., kb_b + 1] - cols[..., kb_a]) > 0) & (first.view(1, 1, -1) < lens.view(-1, 1, 1))
    return compact_lists(active)


# Grid: (sequence, KV head, split). Rows of the tile are the GQA group of query heads sharing the KV
# head (padded to BLOCK_G >= 16 for tl.dot). Dense: split s covers keys [s * split_len, (s+1) *
# split_len). Sparse layouts enumerate the key tiles some head of the group may see (RESIDUES:
# arithmetically, for local-strided with S % BLOCK_N == 0; otherwise from a list the plan builds), and
# split s covers tiles [s * split_len, (s+1) * split_len) of it, masked per element (the heads of a
# group see different vertical columns).
@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def paged_decode_split_kernel(
    q,
    part_m,
    part_l,
    part_acc,
    part_seen,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    split_len,
    tile_counts,
    tile_lists,
    list_width,
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
    SCORES_F64: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr,
    RESIDUES: tl.constexpr,
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
    p_q = q + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
    if SCORES_F64:
        b_q = b_q.to(tl.float64)
        b_m = tl.full([BLOCK_G], FINITE_MIN, tl.float64)
    else:
        b_m = tl.full([BLOCK_G], FINITE_MIN, tl.float32)
    # Dense and local-strided rows always see their own key; block-mask rows may be empty.
    b_seen = tl.full([BLOCK_G], LAYOUT != LAYOUT_BLOCK_MASK, tl.int1)
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
    lay = (mask_ptr, mask_head_stride, num_blocks, sparse_block, local_blocks, vert_stride)
    # [BLOCK_G, 1]: per-row vertical-column residue (local-strided) and mask row (block mask); padded
    # rows read mask row 0 and are never stored.
    target = vertical_target(head_offset + o_h, head_step, vert_stride)[:, None]
    head = tl.where(m_g, o_h, 0)[:, None]
    rows = (q_pos, target, head)
    if LAYOUT == LAYOUT_DENSE:
        lo = tl.program_id(2) * split_len
        hi = tl.minimum(lo + split_len, seq_len)
        num_full = tl.maximum(hi - lo, 0) // BLOCK_N
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            (0, 1, 0, lo),
            num_full,
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
        last = (0, 1, 0, lo + num_full * BLOCK_N)
        num_last = cdiv_jit(tl.maximum(hi - lo, 0), BLOCK_N) - num_full
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            last,
            num_last,
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
    elif RESIDUES:
        # Local-strided, S a multiple of BLOCK_N: the group's vertical columns left of the local
        # band (sorted residues mod vert_stride of its heads, tile_lists[kv head]), then the band.
        qb = (seq_len - 1) // sparse_block
        band_lo = tl.maximum(qb - local_blocks + 1, 0)
        num_res = tl.load(tile_counts + i_kvh)
        p_res = tile_lists + i_kvh * list_width
        o_r = tl.arange(0, BLOCK_G)
        b_res = tl.load(p_res + o_r, mask=o_r < num_res, other=0)
        # [BLOCK_G]: columns of each residue below band_lo (the numerator is >= 0: residue < stride)
        b_cnt = tl.where(o_r < num_res, (band_lo - b_res + vert_stride - 1) // vert_stride, 0)
        count_a = tl.sum(b_cnt, 0) * TILES_PER_BLOCK
        total = count_a + cdiv_jit(seq_len - band_lo * sparse_block, BLOCK_N)
        first = tl.program_id(2) * split_len
        num = tl.minimum(tl.maximum(total - first, 0), split_len)
        columns = (p_res, num_res, count_a, band_lo * sparse_block, first)
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            columns,
            num,
            qk_scale,
            BLOCK_N,
            PAGE_ALIGNED,
            PAGE_SIZE_C,
            EVEN_D,
            LAYOUT,
            OFFSETS_I32,
            TILES_PER_BLOCK,
            TILES_RESIDUES,
            True,
        )
    else:
        o_list = i_b * tl.num_programs(1) + i_kvh
        first = tl.program_id(2) * split_len
        num = tl.minimum(tl.maximum(tl.load(tile_counts + o_list) - first, 0), split_len)
        listed = (tile_lists + o_list * list_width + first,)
        state = attend_tiles(
            state,
            b_q,
            rows,
            kv,
            lay,
            listed,
            num,
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
    part_m,
    part_l,
    part_acc,
    part_seen,
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
        # Integer metadata is read as contiguous memory by the kernel (a no-op when it already is).
        self.block_tables, self.seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        if batch.num_seqs == 0:
            return
        device = q.device
        self.head_dim_pad = padded_head_dim(batch.head_dim)
        self.block_n, self.num_warps, self.num_stages = CONFIG_INTERPRETER if interpreted() else CONFIG_GPU
        args = LayoutArgs(layout, batch.num_heads, device)
        residues = args.kind == LAYOUT_LOCAL_STRIDED.value and args.block_size % self.block_n == 0
        if args.kind == LAYOUT_DENSE.value:
            self.counts = self.lists = placeholder(device)
            self.num_splits = _num_splits(batch, max(batch.seq_lens), self.block_n, device)
            self.split_len = ceil_to(cdiv(max(batch.seq_lens), self.num_splits), self.block_n)
        else:
            if residues:
                self.counts, self.lists, num_res = _group_residues(args, batch, device)
                num_tiles = _residue_tiles_bound(args, batch, self.block_n, num_res)
            else:
                self.counts, self.lists = _visible_tiles(layout, args, batch, self.seq_lens, self.block_n)
                num_tiles = self.lists.shape[-1]
            self.num_splits = _num_splits(batch, num_tiles * self.block_n, self.block_n, device)
            self.split_len = cdiv(num_tiles, self.num_splits)
        self.constants = args.kernel_kwargs() | dict(
            TILES_PER_BLOCK=max(args.block_size // self.block_n, 1), RESIDUES=residues
        )
        self.block_g = max(MIN_DOT, triton.next_power_of_2(batch.num_heads // batch.num_kv_heads))
        # The split kernel's scratch, [num_seqs, num_heads, num_splits(, HEAD_DIM_PAD)], written whole by
        # every run. Raw-score maxima keep its precision (float64 scores for float32 inputs).
        part_shape = (batch.num_seqs, batch.num_heads, self.num_splits)
        max_dtype = torch.float64 if scores_in_float64(q.dtype) else torch.float32
        self.parts = (
            torch.empty(part_shape, dtype=max_dtype, device=device),
            torch.empty(part_shape, dtype=torch.float32, device=device),
            torch.empty((*part_shape, self.head_dim_pad), dtype=torch.float32, device=device),
            torch.empty(part_shape, dtype=torch.int8, device=device),
        )

    def run(self, q, k_cache, v_cache):
        """out [num_seqs, num_heads, head_dim] in q's dtype; with return_lse also lse float32."""
        self.guard.check(q=q, k_cache=k_cache, v_cache=v_cache)
        batch = self.batch
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if batch.num_seqs:
            self._launch(q, k_cache, v_cache, out, lse)
        return (out, lse) if self.return_lse else out

    def _launch(self, q, k_cache, v_cache, out, lse):
        batch = self.batch
        if k_cache.stride() != v_cache.stride():
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        part_m, part_l, part_acc, part_seen = self.parts
        q_in, qk_scale = positive_scale(q, batch.scale)
        paged_decode_split_kernel[(batch.num_seqs, batch.num_kv_heads, self.num_splits)](
            q_in,
            part_m,
            part_l,
            part_acc,
            part_seen,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            self.split_len,
            self.counts,
            self.lists,
            self.lists.shape[-1],
            *q_in.stride(),
            *k_cache.stride(),
            self.block_tables.stride(0),
            qk_scale=qk_scale,
            **self.constants,
            **shared_launch_kwargs(batch, k_cache, self.block_n),
            BLOCK_G=self.block_g,
            BLOCK_N=self.block_n,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        paged_decode_reduce_kernel[(batch.num_seqs, batch.num_heads)](
            part_m,
            part_l,
            part_acc,
            part_seen,
            out,
            lse,
            self.num_splits,
            qk_scale,
            *out.stride(),
            *lse.stride(),
            head_dim=batch.head_dim,
            HEAD_DIM_PAD=self.head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(self.num_splits),
            num_warps=REDUCE_WARPS,
        )


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
        lse [num_seqs, num_heads] float32 (natural log; -inf and out 0 for a row with no key, NaN
        for a row that sees a non-finite value).
    """
    plan = plan_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )
    return plan.run(q, k_cache, v_cache)
