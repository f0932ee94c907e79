"""Shared pieces of the Triton kernels: math constants, host conversions, jit helpers.

The kernels are the twins of the oracle in `reference/`; everything here is private to `kernels/`.
Two jit helpers carry the attention arithmetic of prefill and decode alike:
    `attend`    owns one loop of online softmax over a list of key tiles (kernels/tile_lists.py), the
                way the Triton tutorial's inner function does; every kernel calls it twice, for the
                full tiles unmasked and for the partial tiles masked;
    `finalize`  turns the running state into out and lse (NaN rule, empty rows).
No layout family reaches a kernel: a layout arrives as tile lists and, for the partial tiles, its
block mask. Related values travel as tuples (`rows`, `kv`, `state`).
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from kernels import tile_lists

# Globals read inside @triton.jit code must be tl.constexpr; the host reads them through `.value`.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores scaled by scale * LOG2E make exp2 an exp
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns a base-2 log-sum-exp into a natural one
NEG_INF = tl.constexpr(float("-inf"))
# Initial running max: the most negative float32, so the max stays finite in rows with no key yet.
FINITE_MIN = tl.constexpr(-3.4028234663852886e38)
# tl.dot needs at least 16 rows, 16 columns and a reduction of 16.
MIN_DOT = 16
TILE_MASK = tl.constexpr(tile_lists.TILE_MASK)  # a list entry's key tile


def interpreted() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Hopper's programmatic dependent launch for the small kernels between a layer's products (rotary, the
# K/V write, the norms): such a kernel may be launched while the one before it drains, and waits for
# it (`griddepcontrol.wait`, WAIT_PRIOR) before its first memory access, so a graph's gap between the
# two shrinks. A module setting, read when a launch is made or planned, so that an A/B
# (reports/host_ab.py's "dependent launch") turns it on. Off until it has run on a GPU
# (`bash reports/gpu_check.sh OUT dependent`).
DEPENDENT_LAUNCH = False


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def dependent_launch(device: torch.device) -> bool:
    """Whether a kernel on `device` launches as a programmatic dependent of the kernel before it: on a
    GPU of compute capability 9.0 or more, never under the interpreter, with DEPENDENT_LAUNCH on."""
    if not DEPENDENT_LAUNCH or device.type != "cuda" or interpreted():
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index)[0] >= 9


def dependent_launch_options(device: torch.device) -> dict[str, bool]:
    """A waiting kernel's launch options on `device`: WAIT_PRIOR (its constexpr) and launch_pdl, always
    together, since a kernel launched as a dependent that reads before its wait would race."""
    dependent = dependent_launch(device)
    return {"WAIT_PRIOR": dependent, "launch_pdl": dependent}


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class RunInputs:
    """How a plan hands q and the caches to its kernel, fixed at planning (the plan guards their
    shapes and strides): q negated when scale < 0, the caches copied to contiguous ones when k's and
    v's strides differ (the kernel takes one set). `kwargs` holds the kernel's stride and qk_scale
    arguments, so that a run passes tensors only.
    """

    def __init__(self, q, k_cache, v_cache, scale: float, return_lse: bool):
        # The kernels subtract the running max before scaling, which needs qk_scale = |scale| * log2(e)
        # >= 0: a negative scale negates q instead.
        self.negate = scale < 0
        qk_scale = (-scale if self.negate else scale) * LOG2E.value
        q_strides = (-q).stride() if self.negate else q.stride()
        self.copy_caches = k_cache.stride() != v_cache.stride()
        cache_strides = contiguous_strides(k_cache.shape) if self.copy_caches else k_cache.stride()
        self.qk_scale = qk_scale
        # Allocation arguments of the outputs, resolved once (each attribute read costs ~1 µs a run).
        self.out_args = (tuple(q.shape), q.dtype, q.device)
        # Without return_lse the kernels' lse goes to scratch of the plan's own, written by every run
        # and never read: one allocation less a run (~5 µs of host time on the H200's host).
        self.lse_scratch = (
            None if return_lse else torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        )
        self.kwargs = dict(
            zip(("stride_qt", "stride_qh", "stride_qd"), q_strides, strict=True),
            **dict(zip(("stride_page", "stride_tok", "stride_kvh", "stride_d"), cache_strides, strict=True)),
            qk_scale=qk_scale,
        )

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh out [num_tokens, num_heads, head_dim] (q's dtype) and lse [num_tokens, num_heads]
        float32 (the scratch without return_lse)."""
        shape, dtype, device = self.out_args
        out = torch.empty(shape, dtype=dtype, device=device)
        if self.lse_scratch is not None:
            return out, self.lse_scratch
        return out, torch.empty(shape[:2], dtype=torch.float32, device=device)

    def __call__(self, q, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k_cache, v_cache) as the kernel reads them."""
        if self.copy_caches:
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        return (-q if self.negate else q), k_cache, v_cache


def scores_in_float64(dtype: torch.dtype) -> bool:
    """float32 inputs get float64 scores q.k: float32 rounding of large scores would otherwise match
    the float32 oracle's own error, with no margin under contract §5's max gate."""
    return dtype == torch.float32


def padded_head_dim(head_dim: int) -> int:
    """Head dims that are not powers of two are padded (and masked) to the next power of two."""
    # Not triton.next_power_of_2: a JIT-wrapped callable, ~10 µs a call on the host (twice a plan).
    return max(MIN_DOT, 1 << (head_dim - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_size_constexpr(page_size: int, block_n: int) -> int:
    """The PAGE_SIZE_C kernel argument (see `kv_row_offsets`): block_n when whole pages hold every
    tile, page_size when it is a power of two below block_n (a shift and a mask per position; at
    most log2(block_n) compiled variants), else 0."""
    if page_size % block_n == 0:
        return block_n
    if page_size < block_n and page_size & (page_size - 1) == 0:
        return page_size
    return 0


class LastPlan:
    """A public operator's memo of its last plan: a call whose metadata tensors are the previous
    call's objects, unmodified since (PlanGuard's version counters), with the same layout object,
    scale and return_lse, and q and caches of the planned shapes, runs that plan without validating
    again (no host sync). Anything else plans afresh. `plan(*args, **kwargs)` builds a plan.
    """

    def __init__(self, plan):
        self.plan, self.key, self.last, self.layout = plan, None, None, None

    def __call__(self, q, k_cache, v_cache, *metadata, scale, layout, return_lse):
        key = (tuple(id(t) for t in metadata), id(layout), scale, return_lse)
        last = self.last
        if last is None or key != self.key or not last.guard.matches(q=q, k_cache=k_cache, v_cache=v_cache):
            last = self.plan(
                q, k_cache, v_cache, *metadata, scale=scale, layout=layout, return_lse=return_lse
            )
            # The plan's guard holds the metadata tensors and self.layout the layout: their ids stay theirs.
            self.key, self.last, self.layout = key, last, layout
        return last.run(q, k_cache, v_cache)


def planned_specialization(kernel, planned: dict) -> tuple:
    """What Triton's binder makes of a launch's planned arguments (`JITFunction.run`): constexprs by
    value, the others as `native_specialize_impl` classes them (type, and 1 / divisible by 16 /
    16-byte aligned), and the launch options by value. Two plans of one kernel that agree on this, and
    whose per-run tensors agree on dtype and alignment, get the same compiled kernel."""
    spec = []
    for param in kernel.params:
        if param.name not in planned:
            continue
        value = planned[param.name]
        if param.is_constexpr:
            spec.append((param.name, value))
        else:
            spec.append(
                native_specialize_impl(
                    BaseBackend,
                    value,
                    param.is_const,
                    not param.do_not_specialize,
                    not param.do_not_specialize_on_alignment,
                )  # fmt: skip
            )
    names = set(kernel.arg_names)
    spec += sorted((name, value) for name, value in planned.items() if name not in names)
    return tuple(spec)


# (kernel, device, planned_specialization, per-run tensors' dtypes and alignments) -> compiled kernel,
# shared by every BoundLaunch: an engine plans anew each step, and a plan's first launch through
# `kernel[grid]` took 0.1-0.2 ms of host time on the H200's host.
_COMPILED: dict = {}


class BoundLaunch:
    """One kernel launch of a plan: the grid and the planned arguments bound once, the per-run tensors
    (the kernel's first parameters) passed by position at each call; `device` is the plan's.

    On the GPU a call reuses the compiled kernel of an earlier call, of this plan or another, that
    Triton would specialize alike (`planned_specialization`, the tensors' dtypes and 16-byte
    alignment, the same current device) and launches it itself, as `JITFunction.run` would after
    binding the arguments: that binding took 30-45 µs of a launch on the H200
    (reports/gpu/kernel-ab.md). Any other call, and every call under the interpreter, goes through
    `kernel[grid]`, which compiles what it must. Triton's launch hooks (profilers) still see every
    launch.
    """

    def __init__(self, kernel, grid, device: torch.device, **planned):
        self.kernel, self.grid, self.planned = kernel, grid, planned
        names = kernel.arg_names
        self.num_per_run = sum(1 for name in names if name not in planned)
        # Per-run parameters first, then the planned ones, which keep their parameter order.
        if any(name in planned for name in names[: self.num_per_run]):
            raise TypeError("BoundLaunch: the kernel's per-run parameters must come before the planned ones")
        self.tail = [planned[name] for name in names[self.num_per_run :]]
        self.grid3 = (*grid, 1, 1)[:3]  # the compiled kernel's launcher takes three dims
        self.direct = device.type == "cuda" and not interpreted()
        self.compiled = {}  # this plan's: per-run key -> compiled kernel, filled from _COMPILED
        self.shared_key = (kernel, planned_specialization(kernel, planned)) if self.direct else None

    def __call__(self, *tensors: torch.Tensor) -> None:
        if len(tensors) != self.num_per_run:
            raise TypeError(f"BoundLaunch: {self.num_per_run} per-run tensors expected, got {len(tensors)}")
        if not self.direct:
            self.kernel[self.grid](*tensors, **self.planned)
            return
        device = torch.cuda.current_device()
        # A TMA descriptor (its shape and layout fixed by the plan) specializes by its base tensor.
        bases = (getattr(t, "base", t) for t in tensors)
        key = (device, *((t.dtype, t.data_ptr() % 16 == 0) for t in bases))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = _COMPILED.get((*self.shared_key, key))
            if compiled is None:
                compiled = self.kernel[self.grid](*tensors, **self.planned)
                _COMPILED[(*self.shared_key, key)] = self.compiled[key] = compiled
                return
            self.compiled[key] = compiled
        hooks = triton.knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        if enter.calls or leave.calls:
            compiled[self.grid3](*tensors, *self.tail)
            return
        stream = triton.runtime.driver.active.get_current_stream(device)
        encoded = _encoding_launcher(compiled)  # None for a kernel without descriptor parameters
        if encoded is not None:
            launch, metas = encoded
            args, d = [], 0
            for t in tensors:
                if hasattr(t, "launcher_args"):
                    args += t.launcher_args(metas[d])
                    d += 1
                else:
                    args.append(t)
            if d == len(metas):  # every descriptor encoded once; otherwise Triton's launcher encodes them
                run = compiled.run
                launch(
                    *self.grid3, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                    None, None, compiled.packed_metadata, None, None, None, *args, *self.tail,
                )  # fmt: skip
                return
        compiled.run(
            *self.grid3,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *tensors,
            *self.tail,
        )


@functools.cache
def _encoding_launcher(compiled):
    """For a compiled kernel with TMA descriptor parameters: Triton's C launcher beneath the wrapper
    that encodes each descriptor on every run (`wrap_handle_tensordesc`), and the descriptors'
    metadata, so that a run passes descriptors it encoded once (`launcher_args`, kernels/
    hopper_prefill.py's HostDescriptor). None where that does not hold as in triton 3.6 (scratch to
    allocate, no metadata, another wrapper): the run then goes through `compiled.run`."""
    run = compiled.run
    metas = getattr(compiled.metadata, "tensordesc_meta", None)
    closure = getattr(run.launch, "__closure__", None)
    if run.global_scratch_size or run.profile_scratch_size or not metas or None in metas or not closure:
        return None
    cells = dict(zip(run.launch.__code__.co_freevars, closure, strict=True))
    return (cells["launcher"].cell_contents, metas) if "launcher" in cells else None


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
        PAGE_SIZE_C=page_size_constexpr(batch.page_size, block_n),
        SCORES_F64=scores_in_float64(cache.dtype),
        OFFSETS_I32=offsets_fit_int32(cache),
    )


def list_kwargs(lists) -> dict:
    """The kernel arguments of a `tile_lists.TileLists`: the lists, their strides, the block mask."""
    stride_kind, stride_tile, stride_head = lists.list_strides()
    return dict(
        tile_lists=lists.lists,
        stride_list_kind=stride_kind,
        stride_list_tile=stride_tile,
        stride_list_head=stride_head,
        block_mask=lists.mask,
        stride_mask_head=lists.mask_head_stride(),
        tile_bits=lists.lists if lists.bits is None else lists.bits,  # unread without bits
        num_blocks=lists.mask.shape[1],
        sparse_block=lists.block_size,
        LAYOUT_MASK=lists.mask_mode,
    )


@triton.jit
def kv_row_offsets(
    p_bt, n, seq_len, page_size, stride_page, stride_tok, BLOCK_N, PAGE_SIZE_C, OFFSETS_I32, MASKED
):
    """Cache offsets of the key positions n .. n + BLOCK_N - 1 (n a multiple of BLOCK_N), read
    through a block-table row.

    PAGE_SIZE_C (`page_size_constexpr`): BLOCK_N when whole pages hold the tile (one table entry per
    tile); a power of two below BLOCK_N, the page size, so that each position's entry is found by a
    shift and a mask; 0 otherwise (a runtime division). Positions of one page read the same entry,
    which the hardware serves as one access. (Reading BLOCK_N // PAGE_SIZE_C entries as a vector and
    flattening [pages, PAGE_SIZE_C] offsets with tl.reshape took 1.28 ms against 0.70 at Phi-3 8k on
    the H200: the reshape costs a layout conversion per tile; reports/gpu/kernel-ab.md.) With
    MASKED, entries of positions past the sequence (seq_len) are never read. OFFSETS_I32: the host
    proved every offset of the cache fits in int32; otherwise page ids are widened to int64 first.
    """
    o_n = n + tl.arange(0, BLOCK_N)
    # Every branch ends in page and i_row (no early return: the compiler would go on past it).
    if PAGE_SIZE_C == BLOCK_N:
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
            page = tl.load(p_bt + i_page, mask=o_n < seq_len, other=0)
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
def attend(
    state,
    b_q,
    rows,
    kv,
    p_tiles,
    count,
    qk_scale,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE_C: tl.constexpr,
    EVEN_D: tl.constexpr,
    OFFSETS_I32: tl.constexpr,
    LAYOUT_MASK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over the `count` key tiles listed at p_tiles; returns the new state.

    state: (b_m [R] running max in raw q.k units, b_l [R] running sum, b_acc [R, HEAD_DIM_PAD],
        b_seen [R] whether the row has had an allowed key).
    rows: (q_pos, m_row, p_layout, layout_key): each row's position [R, 1] (or a scalar), whether it
        is a real row [R, 1], and how the partial tiles read the layout (LAYOUT_MASK, the MASK_* modes
        of kernels/tile_lists.py): ELEMENTS and ROWS, p_layout is each row's row of the block mask
        [R, 1] (the head's mask at its query block) and layout_key the sparse block size, the mask
        read at p_layout + key block per element or per row; BITS, p_layout points at the bits
        beside p_tiles and layout_key is each row's bit [R, 1]; NONE reads nothing. Unmasked tiles
        read none of these.
    kv: (p_k, p_v, p_bt, page_size, stride_page, stride_tok, stride_d, o_d, m_d, seq_len).
    Unmasked tiles are full (tile_lists.py): every row sees every key, so nothing is masked and every
    row counts as seen. MASKED tiles apply causality, the sequence end and the layout per element
    (scores -inf, never zero). BITS serves decode lists, where each row is a head at the sequence's
    last position: a row sees every key of the tile up to the sequence end or none of it.
    NaN rule: a non-finite score (a NaN or Inf query or key) becomes NaN, so that it reaches exactly
    the rows that see it through their weights; in masked tiles a non-finite V is zeroed and its key's
    score made NaN instead, since 0 * NaN in the weighted sum would reach rows that do not see it
    (with BITS, the rows that do not see the tile drop its weighted sum instead: keys past the
    sequence end load as 0).
    """
    b_m, b_l, b_acc, b_seen = state
    q_pos, m_row, p_layout, layout_key = rows
    p_k, p_v, p_bt, page_size, stride_page, stride_tok, stride_d, o_d, m_d, seq_len = kv
    # The next tile's start is loaded an iteration ahead, off the K/V address path (H200, Phi-3 8k
    # prefill: 0.633 ms against 0.668 loading it in its own iteration; reports/gpu/kernel-ab.md).
    i_next = tl.load(p_tiles, mask=count > 0, other=0)
    for i in range(0, count):
        n = (i_next & TILE_MASK) * BLOCK_N  # a partial entry may carry its halves' modes above
        i_next = tl.load(p_tiles + i + 1, mask=i + 1 < count, other=0)
        # [BLOCK_N]
        o_n = n + tl.arange(0, BLOCK_N)
        m_k = o_n < seq_len
        o_row = kv_row_offsets(
            p_bt, n, seq_len, page_size, stride_page, stride_tok, BLOCK_N, PAGE_SIZE_C, OFFSETS_I32, MASKED
        )
        # [BLOCK_N, HEAD_DIM_PAD]: K is loaded like V (and transposed for the dot), so that both
        # share one set of offsets and one block-table read.
        o_kv = o_row[:, None] + o_d[None, :] * stride_d
        # With EVEN_D the head-dim mask is left out: m_d compares against the runtime head_dim, so
        # the compiler cannot prove it constant along the contiguous dim and would split the loads
        # into scalar (2-byte) loads, which also defeats the asynchronous-copy pipeline.
        if MASKED and EVEN_D:
            b_k = tl.load(p_k + o_kv, mask=m_k[:, None], other=0.0)
            b_v = tl.load(p_v + o_kv, mask=m_k[:, None], other=0.0)
        elif MASKED:
            b_k = tl.load(p_k + o_kv, mask=m_k[:, None] & m_d[None, :], other=0.0)
            b_v = tl.load(p_v + o_kv, mask=m_k[:, None] & m_d[None, :], other=0.0)
        elif EVEN_D:
            b_k = tl.load(p_k + o_kv)
            b_v = tl.load(p_v + o_kv)
        else:
            b_k = tl.load(p_k + o_kv, mask=m_d[None, :], other=0.0)
            b_v = tl.load(p_v + o_kv, mask=m_d[None, :], other=0.0)
        # [R, BLOCK_N] raw scores q.k (float64 when b_q is: float32 kernels score in float64, so
        # their error stays below the float32 oracle's); the running max b_m is kept in these units.
        b_s = _dot(b_q, tl.trans(b_k.to(b_q.dtype)))
        # s + s * 0 is s when finite and NaN when +-Inf or NaN (one FMA per element).
        b_s = b_s + b_s * 0.0
        if MASKED:
            m_s = (o_n[None, :] <= q_pos) & m_k[None, :] & m_row
            if LAYOUT_MASK == 0:  # MASK_ELEMENTS
                m_s = m_s & (tl.load(p_layout + o_n[None, :] // layout_key, mask=m_s, other=0) != 0)
            elif LAYOUT_MASK == 1:  # MASK_ROWS
                m_s = m_s & (tl.load(p_layout + n // layout_key, mask=m_row, other=0) != 0)
            if LAYOUT_MASK == 2:  # MASK_BITS
                # [R, 1]: whether the row sees the tile at all.
                m_sees = m_row & (((tl.load(p_layout + i) >> layout_key) & 1) != 0)
                m_s = m_s & m_sees
            else:
                # [BLOCK_N]: keys whose V holds NaN or Inf; zeroed, and seen as a NaN score instead.
                m_v_bad = tl.max(((b_v != b_v) | (tl.abs(b_v) == float("inf"))).to(tl.int32), 1) > 0
                b_v = tl.where(m_v_bad[:, None], 0.0, b_v)
                b_s = tl.where(m_v_bad[None, :], float("nan"), b_s)
            b_s = tl.where(m_s, b_s, NEG_INF)
            b_seen = b_seen | (tl.max(m_s.to(tl.int32), 1) > 0)
        else:
            b_seen = b_seen | True
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
        b_pv = _dot(b_p.to(b_v.dtype), b_v)
        if MASKED and LAYOUT_MASK == 2:
            # A row sees all of the tile's keys or none (below), so the V of a row that does not see it
            # is kept out here, row by row, rather than scanned for NaN and Inf element by element.
            b_pv = tl.where(m_sees, b_pv, 0.0)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new
    return b_m, b_l, b_acc, b_seen


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
