"""`linear` (y = x @ weight^T) as one Triton kernel: the GPU's twin of `torch.nn.functional.linear`
without bias, for the row counts where it beats cuBLAS.

spec: `torch.nn.functional.linear(x, weight)` (engine/model.py's layers). At a cached prompt's few
rows the 32-layer model's projections waste much of the GPU on cuBLAS's tile choice: at 832 rows (an
8k prompt, 90% cached) `out` took 65 µs on an H100 where a plain 128 x 128 tile takes 55
(reports/gpu/gemm-probe-h100.json, issue 17). `ROWS` says where this kernel runs instead, as measured
(`python3 -m reports.gemm_probe --sweep`, reports/gpu/gemm-sweep-h100.json); everywhere else the
layers keep cuBLAS.

The kernel: one output tile a program, the M tiles of an N tile adjacent (they share that weight
tile through the L2), float32 accumulation (IEEE for float32 inputs: no tf32), one rounding to x's
dtype at the end.
"""

import functools

import torch
import triton
import triton.language as tl

# (capability, (N, K)) -> [(rows from, rows to, (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps))]:
# the row counts (inclusive) where this kernel with that tile beat cuBLAS on the device measured.
# On an H100 (sm90) cuBLAS's heuristic picks a poor tile for `out` at 832 rows (x1.2 the Triton tile's
# time; at 768 and 896 rows it is 25-40% faster than any of these tiles) and for `down` at 224.
ROWS: dict[tuple[tuple[int, int], tuple[int, int]], list[tuple[int, int, tuple[int, ...]]]] = {
    ((9, 0), (4096, 4096)): [(769, 832, (128, 128, 64, 3, 8))],
    ((9, 0), (4096, 8192)): [(209, 224, (64, 128, 128, 4, 4))],
}


# Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).
@triton.jit
def linear_kernel(
    x,
    w,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: only rows are masked
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid, num_m = tl.program_id(0), tl.cdiv(M, BLOCK_M)
    o_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m, m_n = o_m < M, o_n < N
    p_x = x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :]
    p_w = w + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:
            b_x = tl.load(p_x, mask=m_m[:, None], other=0.0)
            b_w = tl.load(p_w)
        else:
            m_k = k + o_k < K
            b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_n[None, :] & m_k[:, None], other=0.0)
        acc = tl.dot(b_x, b_w, acc, input_precision=PRECISION)
        p_x += BLOCK_K
        p_w += BLOCK_K
    p_y = y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def validate_linear(x, weight) -> None:
    """TypeError for a non-tensor or a dtype other than x's floating one, ValueError for shapes or devices
    that do not make x [M, K] @ weight [N, K]^T."""
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


def linear(x, weight, tile: tuple[int, ...] = (64, 64, 32, 2, 4)):
    """y = x @ weight^T.

    spec: `torch.nn.functional.linear(x, weight)`, within float32 accumulation's rounding (any order of
    the K products) and one rounding to x's dtype.

    Args:
        x: [M, K], float32, float16 or bfloat16.
        weight: [N, K], x's dtype and device.
        tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps); `ROWS` holds the measured ones.
    Returns:
        y: [M, N], x's dtype.
    """
    validate_linear(x, weight)
    (m, k), n = x.shape, weight.shape[0]
    # The kernel steps through K one element at a time.
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    y = x.new_empty(m, n)
    if m and n:
        block_m, block_n, block_k, stages, warps = tile
        linear_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
            x,
            weight,
            y,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            EVEN=n % block_n == 0 and k % block_k == 0,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32 is moot for 16-bit inputs
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_stages=stages,
            num_warps=warps,
        )
    return y


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def measured_tile(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...] | None:
    """The tile of `ROWS` for x [M, K] @ weight [N, K]^T on x's GPU, or None (cuBLAS is as fast or
    faster there, or it was not measured)."""
    if not x.is_cuda:
        return None
    ranges = ROWS.get((_capability(x.device), tuple(weight.shape)), ())
    return next((tile for low, high, tile in ranges if low <= x.shape[0] <= high), None)
