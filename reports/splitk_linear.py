"""`linear` (y = x @ weight^T) split over K as one Triton kernel whose last part to end sums the parts: a
probe of issue 17 (reports/gemm_small_m.py), the GPU's twin of `torch.nn.functional.linear` without bias.

spec: `torch.nn.functional.linear(x, weight)`. At 208 rows (a 2k prompt, 90% cached) cuBLAS's kernels for
the 32-layer model's `out` and `down` cover the output in 64 to 128 tiles on 132 SMs
(reports/gpu/l2-probe-h100.json: `out` runs at about 390 TFLOP/s there, 740 at 2048 rows). Split over K in
SPLIT_K parts, SPLIT_K times as many programs share the work. Measured on an H100, no tile of it beat
cuBLAS at 208 or 832 rows, and the fastest tiles were unsplit (reports/gpu/gemm-small-m-h100.json), so the
engine does not use it.

How the parts meet, deterministically: each program stores its float32 part of its output tile into
`partials[part]`, then counts itself in `counts[tile]` (an atomic add, acquire-release at GPU scope, after
a barrier of the program's threads: the release then covers every thread's stores). The program that
counts last loads the parts in the order 0, 1, ..., SPLIT_K - 1 and sums them, so the result has the same
bits whichever part ends last; it stores y and sets the count back to 0 for the next call. So calls that
share `counts` must run one after another (one stream).
"""

import torch
import triton
import triton.language as tl

COUNTS = 4096  # output tiles a call may have: the length of each device's `counts`
_counts: dict[torch.device, torch.Tensor] = {}


# Grid: (cdiv(M, BLOCK_M) * (N // BLOCK_N) * SPLIT_K,); an M tile's neighbours share its weight tile.
@triton.jit
def splitk_linear_kernel(
    x,
    w,
    y,
    partials,  # float32 [SPLIT_K, M, N]
    counts,  # int32 [COUNTS], zeros between calls
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid, num_m, num_n = tl.program_id(0), tl.cdiv(M, BLOCK_M), N // BLOCK_N
    pid_m, pid_n, part = pid % num_m, (pid // num_m) % num_n, pid // (num_m * num_n)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = K // SPLIT_K
    o_k = part * k_len + tl.arange(0, BLOCK_K)
    m_m = o_m < M
    p_x = x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :]
    p_w = w + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        acc = tl.dot(tl.load(p_x, mask=m_m[:, None], other=0.0), tl.load(p_w), acc, input_precision=PRECISION)
        p_x += BLOCK_K
        p_w += BLOCK_K
    p_y = y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    if SPLIT_K == 1:
        tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_m[:, None])
    else:
        rows = o_m[:, None].to(tl.int64) * N + o_n[None, :]
        tl.store(partials + part * M * N + rows, acc, mask=m_m[:, None])
        tl.debug_barrier()  # every thread's part stored before the count's release
        tile = pid_n * num_m + pid_m
        if tl.atomic_add(counts + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.load(partials + rows, mask=m_m[:, None], cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + s * M * N + rows, mask=m_m[:, None], cache_modifier=".cg")
            tl.store(p_y, total.to(y.dtype.element_ty), mask=m_m[:, None])
            tl.atomic_xchg(counts + tile, 0)


def validate_linear(x, weight, tile: tuple[int, ...]) -> None:
    """TypeError for a non-tensor or a dtype other than x's floating one; ValueError for shapes or devices
    that do not make x [M, K] @ weight [N, K]^T, or a tile that does not divide them (N by BLOCK_N, K by
    SPLIT_K * BLOCK_K) or has more output tiles than COUNTS."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must be x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    block_m, block_n, block_k, split_k = tile[:4]
    (m, k), n = x.shape, weight.shape[0]
    if n % block_n or k % (split_k * block_k):
        raise ValueError(
            f"tile: N ({n}) must be a multiple of BLOCK_N ({block_n}) and K ({k}) of SPLIT_K * BLOCK_K "
            f"({split_k} * {block_k})"
        )
    output_tiles = triton.cdiv(m, block_m) * (n // block_n)
    if output_tiles > COUNTS:
        raise ValueError(f"tile: at most {COUNTS} output tiles, got {output_tiles}")


def counts(device: torch.device) -> torch.Tensor:
    """The device's tile counts (int32 [COUNTS], zeros between calls), made at its first call: make it
    before a CUDA graph's capture (`linear` once), so that the graph does not own it."""
    if device not in _counts:
        _counts[device] = torch.zeros(COUNTS, dtype=torch.int32, device=device)
    return _counts[device]


def linear(
    x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, ...] = (64, 64, 32, 2, 2, 4), out=None
) -> torch.Tensor:
    """y = x @ weight^T.

    spec: `torch.nn.functional.linear(x, weight)`, within float32 accumulation's rounding (the K products
    summed in another order) and one rounding to x's dtype. The same inputs give the same bits.

    Args:
        x: [M, K], float32, float16 or bfloat16, rows contiguous.
        weight: [N, K], x's dtype and device.
        tile: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps); BLOCK_N divides N and
            SPLIT_K * BLOCK_K divides K.
        out: y's tensor [M, N] (x's dtype and device, rows contiguous), else a new one.
    Returns:
        y: [M, N], x's dtype.
    """
    validate_linear(x, weight, tile)
    block_m, block_n, block_k, split_k, stages, warps = tile
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    (m, k), n = x.shape, weight.shape[0]
    y = x.new_empty(m, n) if out is None else out
    if y.shape != (m, n) or y.dtype != x.dtype or y.device != x.device or y.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] of x's dtype and device, rows contiguous")
    if not m or not n:
        return y
    partials = torch.empty(split_k if split_k > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    splitk_linear_kernel[(triton.cdiv(m, block_m) * (n // block_n) * split_k,)](
        x,
        weight,
        y,
        partials,
        counts(x.device),
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32 is moot for 16-bit inputs
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_stages=stages,
        num_warps=warps,
    )
    return y
