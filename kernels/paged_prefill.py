"""Block-sparse prefill over a paged KV cache, in Triton (flash attention with online softmax).

spec: `reference.paged_prefill.paged_prefill`. Every key is read through the block table (the new
tokens' K/V are already in the cache), at absolute positions: a sequence of length L with Q queries
has its queries at positions L-Q .. L-1 (bottom-right causal alignment). Page size P and sparse
block size S are independent; every (P, S) pair is supported. Masked scores are -inf, never zero.

Planned path: `plan_prefill(...)` validates the call once and keeps what the launch needs (tile
tables, layout arguments, the grid); `plan.run(q, k_cache, v_cache)` launches it for any q and caches
of the planned shapes (every layer of a model step). `paged_prefill` is plan + run.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import device_walk, hopper_prefill, tile_lists
from kernels._common import (
    FINITE_MIN,
    BoundLaunch,
    LastPlan,
    RunInputs,
    attend,
    finalize,
    interpreted,
    list_kwargs,
    padded_head_dim,
    shared_launch_kwargs,
)
from reference.validation import PlanGuard, validate_paged_prefill

# (BLOCK_M, BLOCK_N, num_warps, num_stages). The interpreter's cost is per loop iteration: big tiles.
CONFIG_INTERPRETER = (64, 64, 4, 1)
CONFIG_FP32 = (32, 32, 4, 2)  # float64 scores (FMA units, float64 registers): small tiles
# 16-bit inputs on the GPU, dense causal or not, by whether the padded head dim exceeds LARGE_D.
# Chosen from the same-process sweep of reports/kernel_probe.py on the H200 (docs/kernels-notes.md;
# with tile lists, dense D 128 at 8k: 64x64x4x2 1.59 ms, 128x128x8x3 1.94).
CONFIGS_GPU = {
    (True, False): (128, 64, 4, 3),
    (True, True): (64, 64, 4, 2),
    (False, False): (64, 64, 4, 2),
    (False, True): (64, 64, 4, 2),
}
LARGE_D = 64
# A register cap for the launch (Triton's `maxnreg`); None leaves the choice to the compiler.
MAX_REGISTERS = None
# Runtime integers that would otherwise compile one variant per value class (1, multiple of 16).
NOT_SPECIALIZED = ["page_size", "num_blocks", "sparse_block", "group", "head_dim", "stride_list_head"]


def _config(dtype: torch.dtype, head_dim_pad: int, dense: bool) -> tuple[int, int, int, int]:
    if interpreted():
        return CONFIG_INTERPRETER
    if dtype == torch.float32:
        return CONFIG_FP32
    return CONFIGS_GPU[(dense, head_dim_pad > LARGE_D)]


# Grid: (query tile, query head), tiles taken last-first. Query tile i covers the absolute positions
# tiles[i, 1] * BLOCK_M .. + BLOCK_M - 1 of sequence tiles[i, 0] (its rows outside the sequence's
# queries are masked), and reads that tile's two lists of key tiles (kernels/tile_lists.py): the full
# tiles unmasked, then the partial ones masked.
@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def paged_prefill_kernel(
    q,
    out,
    lse,
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
    block_tables,
    seq_lens,
    query_start_loc,
    tiles,
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
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    SCORES_F64: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    LAYOUT_MASK: tl.constexpr,
):
    # Reversed: a sequence's last query tiles see the most keys; they start first.
    i_t = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    # Loaded rather than searched for: computing the tile's sequence in the kernel cost ~30
    # registers (and spills) in the whole program (reports/kernel_inspect.py).
    i_b = tl.load(tiles + 2 * i_t).to(tl.int64)
    i_qt = tl.load(tiles + 2 * i_t + 1)
    q_begin = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_begin
    seq_len = tl.load(seq_lens + i_b)
    context = seq_len - q_len
    # [BLOCK_M] absolute positions of the tile's rows, int32 like every key position (cheaper masks);
    # out and lse are [num_tokens, num_heads(, D)]
    o_m = i_qt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = (o_m >= context) & (o_m < seq_len)
    o_tok = (q_begin + o_m - context).to(tl.int64)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < head_dim
    # Row mask of Q and out; the head-dim mask only when D is padded (vectorized access, `attend`).
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
    b_seen = tl.zeros([BLOCK_M], tl.int1)
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
    p_full = tile_lists + i_qt.to(tl.int64) * stride_list_tile + i_h * stride_list_head
    p_partial = p_full + stride_list_kind
    # Unmasked tiles read no row mask (block_mask stands in for the mask rows, unread).
    rows = (o_m[:, None], m_m[:, None], block_mask, sparse_block)
    state = attend(
        state, b_q, rows, kv, p_full + 1, tl.load(p_full), qk_scale, BLOCK_N, PAGE_SIZE_C, EVEN_D,
        OFFSETS_I32, LAYOUT_MASK, False,
    )  # fmt: skip
    # [BLOCK_M, 1]: each row's block-mask row, made only now (fewer registers live in the first loop);
    # rows outside the sequence are never read.
    qb = tl.minimum(o_m // sparse_block, num_blocks - 1)
    p_mask_row = block_mask + i_h * stride_mask_head + qb[:, None] * num_blocks
    rows = (o_m[:, None], m_m[:, None], p_mask_row, sparse_block)
    state = attend(
        state, b_q, rows, kv, p_partial + 1, tl.load(p_partial), qk_scale, BLOCK_N, PAGE_SIZE_C, EVEN_D,
        OFFSETS_I32, LAYOUT_MASK, True,
    )  # fmt: skip

    b_out, b_lse = finalize(state, qk_scale)
    o_out = o_tok[:, None] * num_heads + i_h
    tl.store(out + o_out * head_dim + o_d[None, :], b_out.to(out.dtype.element_ty), mask=m_md)
    tl.store(lse + o_tok * num_heads + i_h, b_lse, mask=m_m)


def _query_tiles(seq_lens: list[int], query_starts: list[int], block_m: int) -> list[tuple[int, int]]:
    """(sequence, absolute query tile) of every query tile, sequences without queries skipped."""
    tiles = []
    for b, seq_len in enumerate(seq_lens):
        context = seq_len - (query_starts[b + 1] - query_starts[b])
        if context < seq_len:
            tiles += [(b, t) for t in range(context // block_m, (seq_len - 1) // block_m + 1)]
    return tiles


def max_query_tiles(num_seqs: int, num_tokens: int, block_m: int) -> int:
    """The most query tiles of `block_m` positions that num_tokens queries over num_seqs sequences can
    touch: a sequence's q >= 1 queries span at most 1 + ceil((q - 1) / block_m) tiles, so K sequences
    with queries span fewer than 2K + num_tokens / block_m; and no tile is without a query."""
    return min(num_tokens, 2 * min(num_seqs, num_tokens) + num_tokens // block_m + 1)


class PrefillPlan:
    """One validated `paged_prefill` call, ready to launch for any q and caches of the planned shapes.

    Built by `plan_prefill` (the arguments of `paged_prefill`). `run(q, k_cache, v_cache)` refuses
    with ValueError tensors that do not match the plan, and a plan whose metadata tensors were
    modified in place since it was built (a stale plan). `replan` takes new metadata written in place
    within the plan's bounds (as many sequences, q's tokens, the block table's width); on the Hopper
    path it keeps every launch argument (`fixed_launch`), so a run captured in a CUDA graph replays
    the new batch.
    """

    def __init__(
        self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale, layout, return_lse
    ):
        self.batch = batch = validate_paged_prefill(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout,
            return_lse=return_lse,
        )  # fmt: skip
        self.guard = PlanGuard(
            dict(q=q, k_cache=k_cache, v_cache=v_cache),
            dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc),
        )
        self.return_lse = return_lse
        self.inputs = RunInputs(q, k_cache, v_cache, batch.scale, return_lse)
        device = q.device
        dense = layout is None
        block_m, block_n, num_warps, num_stages = _config(q.dtype, padded_head_dim(batch.head_dim), dense)
        cache_contiguous = self.inputs.copy_caches or k_cache.is_contiguous()
        hopper = hopper_prefill.supports(batch, q, cache_contiguous)
        if hopper:  # the Triton fallback (misaligned run tensors) walks the Hopper path's tiles
            block_m, block_n = hopper_prefill.BLOCK_M, hopper_prefill.BLOCK_N
            num_warps, num_stages = hopper_prefill.FALLBACK_WARPS, 2
        self.block_m = block_m
        tiles = _query_tiles(batch.seq_lens, batch.query_starts, block_m)
        self.grid = (len(tiles), batch.num_heads)
        self.hopper = self.walk = self.device_walk = None
        if not tiles:
            return
        self.lists = tile_lists.tile_lists(
            layout, batch.num_heads, max(batch.seq_lens), block_m, block_n, 1, device, halves=hopper
        )
        # What `replan` covers: as many sequences and tokens, sequences as long as the table and the
        # lists reach; the tiles buffer holds the most query tiles of such a batch.
        max_len = min(
            block_tables.shape[1] * batch.page_size, self.lists.mask.shape[1] * self.lists.block_size
        )
        self.bounds = (batch.num_seqs, q.shape[0], max_len)
        self.max_tiles = max_query_tiles(batch.num_seqs, q.shape[0], block_m)
        self.programs = (
            hopper_prefill.num_programs((self.max_tiles, batch.num_heads), device) if hopper else 0
        )
        # The split states the launch holds for its replans' walks (`hopper_prefill.split_slots`).
        self.split_slots = hopper_prefill.split_slots(q.shape[0], batch.num_heads, self.programs)
        size = 2 * self.max_tiles
        if hopper:
            # The walk of any batch in bounds: a unit an item (or a stand-in), or a part an item's
            # program (`split_one_round`), after the offsets; or this call's, split.
            units = max(self.max_tiles * batch.num_heads, self.programs)
            size += self.programs + 1 + units * hopper_prefill.ROW_FIELDS
        host = torch.from_numpy(self._fill(tiles, batch.seq_lens, batch.query_starts))
        buffer = torch.empty(max(size, host.shape[0]), dtype=torch.int32, device=device)
        buffer[: host.shape[0]].copy_(host.pin_memory() if device.type == "cuda" else host, non_blocking=True)
        # replan's pinned staging buffer and its copy's event, made at its first call
        self.staging = self.copied = None
        # The kernel reads the block table as contiguous rows (a no-op when it already is).
        table = block_tables.contiguous()
        # Everything but q, out, lse and the caches, fixed at planning.
        self.planned = dict(
            **self.inputs.kwargs,
            block_tables=table,
            seq_lens=seq_lens.contiguous(),
            query_start_loc=query_start_loc.contiguous(),
            tiles=buffer,
            stride_bt=table.stride(0),
            **list_kwargs(self.lists),
            **shared_launch_kwargs(batch, k_cache, block_n),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
        self.launch_options = dict(
            num_warps=num_warps,
            num_stages=num_stages,
            **({} if MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}),
        )
        self.launch = None  # the Triton launch, bound when a run first needs it (`triton_launch`)
        if hopper:  # the Triton launch then serves only caches that are not 16-byte aligned
            self.split_slots = max(self.split_slots, self.walk.num_slots)
            self.descriptors = hopper_prefill.CacheDescriptors(k_cache)
            self.hopper = hopper_prefill.launch(
                (self.max_tiles, batch.num_heads), device, self.planned, self.descriptors, self.walk,
                self.split_slots,
            )  # fmt: skip

    def _fill(self, tiles: list, seq_lens: list[int], query_starts: list[int], out=None) -> np.ndarray:
        """What the `tiles` buffer starts with (int32, written into the front of `out` when given): the
        (sequence, absolute query tile) pair of each Triton program, then on the Hopper path, after
        max_tiles pairs, the walk (`hopper_prefill.Walk`, made here: `self.walk`) over the plan's
        programs."""
        pairs = np.array(tiles, dtype=np.int32).reshape(-1)
        size = pairs.shape[0]
        if self.programs:
            fits = None  # at planning: the launch is made for the walk
            if self.hopper is not None:  # a replan's walk fits the launch and the buffer
                room = self.planned["tiles"].shape[0] - 2 * self.max_tiles - self.programs - 1
                fits = (self.split_slots, room // hopper_prefill.ROW_FIELDS)
            self.walk = hopper_prefill.settled_walk(
                self.lists.counts, tiles, self.grid[1], self.programs, fits
            )
            size = 2 * self.max_tiles + self.walk.size
        out = np.empty(size, dtype=np.int32) if out is None else out[:size]
        out[: pairs.shape[0]] = pairs
        if self.programs:
            self.walk.flat(self.lists.counts, tiles, seq_lens, query_starts, out=out[2 * self.max_tiles :])
        return out

    def replan(self, seq_lens: list[int], query_start_loc: list[int]) -> None:
        """Re-plans, in place, for new values that the caller has written into the planned metadata
        tensors: the rows of `seq_lens`, then rows never read; block tables of the planned width whose
        entries the caller vouches for (they are not read on the host). Costs no device sync. On the
        Hopper path a batch of at most a round of items has its walk written by the GPU
        (kernels/device_walk.py: one launch), any other by the host and copied in.

        Args:
            seq_lens (list[int]): context plus new tokens, at most as many sequences as planned, each
                at most as long as the planned block table (and layout) reaches.
            query_start_loc (list[int]): len(seq_lens) + 1 cumulative query counts, at most q's tokens.
        Raises:
            ValueError: a batch outside those bounds, or not a batch (queries negative or more than
                their sequence's length).
        """
        if not self.grid[0]:
            raise ValueError("replan: this plan was made for a call without queries")
        num_seqs, num_tokens, max_len = self.bounds
        if len(seq_lens) > num_seqs or len(query_start_loc) != len(seq_lens) + 1:
            raise ValueError(
                f"replan: expected at most {num_seqs} seq_lens and one more query_start_loc, "
                f"got {len(seq_lens)} and {len(query_start_loc)}"
            )
        if query_start_loc[0] != 0 or query_start_loc[-1] > num_tokens:
            raise ValueError(f"replan: query_start_loc must run from 0 to at most {num_tokens}")
        for b, seq_len in enumerate(seq_lens):
            if not 0 <= query_start_loc[b + 1] - query_start_loc[b] <= seq_len <= max_len:
                raise ValueError(f"replan: sequence {b} is not 0 <= queries <= length <= {max_len}")
        tiles = _query_tiles(seq_lens, query_start_loc, self.block_m)
        if self.hopper is not None and device_walk.lone_round(len(tiles), self.grid[1], self.programs):
            self.walk_launch()()  # the walk written on the device, no copy
            self.walk = None  # a host walk no longer describes the buffer
        else:
            self._host_replan(tiles, seq_lens, query_start_loc)
        self.grid = (len(tiles), self.grid[1])
        self.launch = None
        self.guard.rebase()

    def _host_replan(self, tiles: list, seq_lens: list[int], query_start_loc: list[int]) -> None:
        """The tiles buffer's new entries (`_fill`) written on the host and copied in, stream-ordered."""
        buffer = self.planned["tiles"]
        if self.staging is None:
            self.staging = torch.empty_like(buffer, device="cpu", pin_memory=buffer.is_cuda)
            self.copied = torch.cuda.Event() if buffer.is_cuda else None
        elif self.copied is not None:
            self.copied.synchronize()  # the last replan's copy has left the staging buffer
        used = self._fill(tiles, seq_lens, query_start_loc, out=self.staging.numpy()).shape[0]
        buffer[:used].copy_(self.staging[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def walk_launch(self) -> BoundLaunch | None:
        """On the Hopper path with `device_walk.ENABLED` (and SPLIT_LAST off), the launch that writes, on
        the device, the walk of the batch whose metadata the plan's tensors hold where it is a lone round
        (`device_walk.lone_round`), and nothing otherwise: a CUDA graph may hold it (bound at the first
        call: most plans never replan). None elsewhere."""
        if self.hopper is None or not device_walk.active():
            return None
        if self.device_walk is None:
            self.device_walk = device_walk.bind(
                self.planned, self.bounds[0], self.grid[1], self.programs, self.max_tiles, self.split_slots
            )
        return self.device_walk

    def lone_round(self, seq_lens: list[int], query_start_loc: list[int]) -> bool:
        """Whether `walk_launch` writes the walk of this batch (`replan`'s arguments): a lone round, with
        the launch bound."""
        tiles = device_walk.num_query_tiles(seq_lens, query_start_loc, self.block_m)
        return self.device_walk is not None and device_walk.lone_round(tiles, self.grid[1], self.programs)

    @property
    def fixed_launch(self) -> bool:
        """Whether `replan` keeps every launch argument (the Hopper path's persistent grid): a run
        captured in a CUDA graph then replays the replanned batch."""
        return self.hopper is not None

    def triton_launch(self) -> BoundLaunch:
        """The Triton kernel's launch over the current grid, bound on first use."""
        if self.launch is None:
            self.launch = BoundLaunch(
                paged_prefill_kernel,
                self.grid,
                self.planned["tiles"].device,
                **self.planned,
                **self.launch_options,
            )
        return self.launch

    def run(self, q, k_cache, v_cache):
        """out [num_tokens, num_heads, head_dim] in q's dtype; with return_lse also lse float32."""
        self.guard.check(q=q, k_cache=k_cache, v_cache=v_cache)
        out, lse = self.inputs.outputs()
        if self.grid[0]:
            q_in, k_in, v_in = self.inputs(q, k_cache, v_cache)
            if self.hopper is not None and hopper_prefill.aligned(k_in, v_in):
                self.hopper(q_in, out, lse, self.descriptors(k_in), self.descriptors(v_in))
            else:
                self.triton_launch()(q_in, out, lse, k_in, v_in)
        return (out, lse) if self.return_lse else out


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

    spec: `reference.paged_prefill.paged_prefill`. A call with the metadata tensors of the previous
    call (the same objects, unmodified: torch's version counters) and q and caches of its shapes
    reuses that call's plan (`kernels._common.LastPlan`); metadata written through a raw pointer is
    invisible to torch, so after such a write call `plan_prefill` yourself.

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
        layout (a layout | None):
            Block-sparse layout (the protocol of reference/layouts.py). Default: `None`, dense causal.
        return_lse (bool):
            Also return the log-sum-exp. Default: `False`.
    Returns:
        out [num_tokens, num_heads, head_dim] in q's dtype; with `return_lse`, also
        lse [num_tokens, num_heads] float32 (natural log; -inf and out 0 for a row with no key, NaN
        for a row that sees a non-finite value).
    """
    return _LAST_PLAN(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout,
        return_lse=return_lse,
    )  # fmt: skip


_LAST_PLAN = LastPlan(plan_prefill)
