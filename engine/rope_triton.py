"""`split_rotary` in one Triton kernel: the GPU's twin of engine/rope.py's.

spec: `engine.rope.split_rotary`. Its torch form takes eight launches a layer (the float32 copy, two
products, the roll, the sum, the cast, the copies of q and v); at the 32-layer model's prefill of 208
tokens each cost 2-6 µs on an H100, more than their work (reports/gpu/engine-step-kernels-h100.txt).
Here one program turns a block of one token's heads: the same float32 products and sum, each rounded
once (floating-point contraction off, so no fused multiply-add rounds them together), then the cast.
So q, k and v equal the torch form's bit for bit.
"""

import triton
import triton.language as tl

from engine.rope import validate_split_rotary
from kernels._common import dependent_launch_options

BLOCK_H = 16  # heads a program: the 32-layer model's 48 heads of a token in three programs


# Grid: (token, block of heads). Heads [0, n_heads) are q's, then n_kv_heads of k, then of v.
@triton.jit
def split_rotary_kernel(
    qkv,
    cos,
    sin,
    q,
    k,
    v,
    stride_qkv_t,
    stride_cos_t,
    stride_cos_d,
    stride_sin_t,
    stride_sin_d,
    n_heads,
    n_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
):
    if WAIT_PRIOR:  # a dependent launch (kernels/_common.py): the product may still be writing qkv
        tl.extra.cuda.gdc_wait()
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    half = head_dim // 2
    m_d = o_d < head_dim
    m_hd = (o_h < n_heads + 2 * n_kv_heads)[:, None] & m_d[None, :]
    # [BLOCK_H, BLOCK_D]: each element, and the other of its pair (rotate-half: column j's is j +- half)
    p_row = qkv + i_t * stride_qkv_t + o_h[:, None] * head_dim
    b_x = tl.load(p_row + o_d[None, :], mask=m_hd, other=0.0).to(tl.float32)
    o_pair = tl.where(o_d < half, o_d + half, o_d - half)
    b_pair = tl.load(p_row + o_pair[None, :], mask=m_hd, other=0.0).to(tl.float32)
    b_cos = tl.load(cos + i_t * stride_cos_t + o_d * stride_cos_d, mask=m_d, other=0.0)
    b_sin = tl.load(sin + i_t * stride_sin_t + o_d * stride_sin_d, mask=m_d, other=0.0)
    b_turned = b_x * b_cos[None, :] + b_pair * b_sin[None, :]
    b_out = tl.where((o_h < n_heads + n_kv_heads)[:, None], b_turned, b_x).to(q.dtype.element_ty)
    # Each head to its output, contiguous [num_tokens, heads, head_dim]; masked lanes store nothing.
    m_q = m_hd & (o_h < n_heads)[:, None]
    tl.store(q + (i_t * n_heads + o_h[:, None]) * head_dim + o_d[None, :], b_out, mask=m_q)
    o_k = o_h - n_heads
    m_k = m_hd & ((o_k >= 0) & (o_k < n_kv_heads))[:, None]
    tl.store(k + (i_t * n_kv_heads + o_k[:, None]) * head_dim + o_d[None, :], b_out, mask=m_k)
    o_v = o_k - n_kv_heads
    m_v = m_hd & (o_v >= 0)[:, None]
    tl.store(v + (i_t * n_kv_heads + o_v[:, None]) * head_dim + o_d[None, :], b_out, mask=m_v)


def split_rotary(qkv, cos, sin, n_heads: int, n_kv_heads: int):
    """A layer's attention inputs from its fused projection: q and k rotated, v as it is, in one launch.

    spec: `engine.rope.split_rotary` (the same refusals; q, k and v bit for bit).

    Args:
        qkv: [num_tokens, (n_heads + 2 * n_kv_heads) * head_dim], q's columns, then k's, then v's;
            its columns adjacent (stride 1).
        cos, sin: float32 [num_tokens, 1, head_dim], rows of `rope_tables` at the tokens' positions.
    Returns:
        q [num_tokens, n_heads, head_dim], k and v [num_tokens, n_kv_heads, head_dim], qkv's dtype,
        each contiguous.
    """
    validate_split_rotary(qkv, cos, sin, n_heads, n_kv_heads)
    num_tokens, _, head_dim = cos.shape
    q = qkv.new_empty(num_tokens, n_heads, head_dim)
    k, v = (qkv.new_empty(num_tokens, n_kv_heads, head_dim) for _ in range(2))
    heads = n_heads + 2 * n_kv_heads
    if num_tokens:
        split_rotary_kernel[(num_tokens, triton.cdiv(heads, BLOCK_H))](
            qkv,
            cos,
            sin,
            q,
            k,
            v,
            qkv.stride(0),
            cos.stride(0),
            cos.stride(2),
            sin.stride(0),
            sin.stride(2),
            n_heads,
            n_kv_heads,
            head_dim,
            BLOCK_H=BLOCK_H,
            BLOCK_D=triton.next_power_of_2(head_dim),
            **dependent_launch_options(qkv.device),
            enable_fp_fusion=False,
        )
    return q, k, v
