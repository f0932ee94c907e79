"""`add_layer_norm` in one Triton kernel: the GPU's twin of engine/norm.py's.

spec: `engine.norm.add_layer_norm`. torch's LayerNorm took 8.4 µs a call on an H100 at the 32-layer
model's 208-token prefill (reports/gpu/engine-step-kernels-h100.txt), and the residual sum before it
is one launch more. Here one program takes one row: the sum (rounded once to the rows' dtype, as torch
rounds it), then its mean and variance in float32 over the whole row at once, then the affine map.
"""

import triton
import triton.language as tl

from engine.norm import validate_add_layer_norm
from kernels._common import dependent_launch_options


# Grid: (token,). Each program sums and normalizes one row of BLOCK_N >= dim columns.
@triton.jit
def add_layer_norm_kernel(
    x,
    residual,
    weight,
    bias,
    h,
    y,
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
):
    if WAIT_PRIOR:  # a dependent launch (kernels/_common.py): x and residual may still be being written
        tl.extra.cuda.gdc_wait()
    i_t = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < dim
    b_h = tl.load(x + i_t * stride_x + o_n, mask=m_n, other=0.0)
    if HAS_RESIDUAL:
        b_r = tl.load(residual + i_t * stride_r + o_n, mask=m_n, other=0.0)
        b_h = (b_h.to(tl.float32) + b_r.to(tl.float32)).to(h.dtype.element_ty)
        tl.store(h + i_t * stride_h + o_n, b_h, mask=m_n)
    b_h = b_h.to(tl.float32)
    mean = tl.sum(b_h, 0) / dim
    b_d = tl.where(m_n, b_h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(b_d * b_d, 0) / dim + eps)
    b_w = tl.load(weight + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_b = tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(y + i_t * stride_y + o_n, (b_d * rstd * b_w + b_b).to(y.dtype.element_ty), mask=m_n)


def add_layer_norm(x, residual, weight, bias, eps: float):
    """The residual sum and its LayerNorm, in one launch.

    spec: `engine.norm.add_layer_norm` (the same refusals; h bit for bit, the norm within float32's
    rounding of the mean and variance).

    Args:
        x: [num_tokens, dim].
        residual: x's shape and dtype, or None (no sum: x itself is normalized).
        weight, bias: [dim], the norm's affine factors.
        eps: added to each row's variance.
    Returns:
        h = x + residual (x when residual is None) and layer_norm(h) [num_tokens, dim], x's dtype.
    """
    validate_add_layer_norm(x, residual, weight, bias, eps)
    num_tokens, dim = x.shape
    # The kernel steps through a row's columns one element at a time (the model's rows already are so).
    x, weight, bias = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight, bias))
    h = x if residual is None else x.new_empty(num_tokens, dim)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y = x.new_empty(num_tokens, dim)
    if num_tokens:
        block = triton.next_power_of_2(dim)
        add_layer_norm_kernel[(num_tokens,)](
            x,
            x if residual is None else residual,
            weight,
            bias,
            h,
            y,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            h.stride(0),
            y.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=block,
            **dependent_launch_options(x.device),
            num_warps=min(max(block // 512, 1), 16),
        )
    return h, y
