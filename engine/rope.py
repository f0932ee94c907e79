"""Rotary position embeddings of the decoder (engine/model.py): the tables built once per model, the
rotation, and `split_rotary`, which turns a layer's fused projection into attention's q, k and v.

`split_rotary` here is the definition; engine/rope_triton.py is its one-kernel twin for the GPU, with
the same signature and, element for element, the same result.
"""

import torch


def rope_tables(max_positions: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary factors of positions 0 .. max_positions - 1, float32 [max_positions, head_dim] each,
    built once per model so that a step only gathers its rows: cos of pair j's angle at columns j and
    j + head_dim // 2, and its sin at column j + head_dim // 2 and negated at column j (`rotary`)."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, pair j being (x_j, x_{j + head_dim // 2}). x: [num_tokens, num_heads, head_dim];
    cos, sin: float32 [num_tokens, 1, head_dim] (rows of `rope_tables`).

    x * cos + roll(x) * sin is (x1 cos - x2 sin, x2 cos + x1 sin) bit for bit (a - b = a + (-b)): each
    product and the sum round once in float32, then the result once to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos + xf.roll(half, dims=-1) * sin).to(x.dtype)


def validate_split_rotary(qkv, cos, sin, n_heads: int, n_kv_heads: int) -> None:
    """`split_rotary`'s refusals, shared by its twins: TypeError for a wrong type or dtype, ValueError
    for a wrong shape, device or head count."""
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    if not qkv.is_floating_point():
        raise TypeError(f"qkv must be a floating-point tensor, got {qkv.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if cos.dim() != 3 or cos.shape[1] != 1:
        raise ValueError(f"cos must be [num_tokens, 1, head_dim], got {list(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {list(cos.shape)}, got {list(sin.shape)}")
    num_tokens, _, head_dim = cos.shape
    if head_dim % 2:
        raise ValueError(f"head_dim (cos.shape[-1]) must be even, got {head_dim}")
    width = (n_heads + 2 * n_kv_heads) * head_dim
    if qkv.dim() != 2 or tuple(qkv.shape) != (num_tokens, width):
        raise ValueError(
            f"qkv must be [num_tokens, (n_heads + 2 * n_kv_heads) * head_dim] = [{num_tokens}, {width}], "
            f"got {list(qkv.shape)}"
        )
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv's columns must be adjacent (stride 1), got stride {qkv.stride(-1)}")
    if cos.device != qkv.device or sin.device != qkv.device:
        raise ValueError(
            f"cos and sin must be on qkv's device {qkv.device}, got {cos.device} and {sin.device}"
        )


def split_rotary(qkv, cos, sin, n_heads: int, n_kv_heads: int):
    """A layer's attention inputs from its fused projection: q and k rotated (`rotary`), v as it is.

    Args:
        qkv: [num_tokens, (n_heads + 2 * n_kv_heads) * head_dim], q's columns, then k's, then v's;
            its columns adjacent (stride 1).
        cos, sin: float32 [num_tokens, 1, head_dim], rows of `rope_tables` at the tokens' positions.
    Returns:
        q [num_tokens, n_heads, head_dim] and v [num_tokens, n_kv_heads, head_dim], contiguous, and k
        [num_tokens, n_kv_heads, head_dim], a view here (its rows strided), contiguous in the twin; all
        of qkv's dtype.
    """
    validate_split_rotary(qkv, cos, sin, n_heads, n_kv_heads)
    head_dim = cos.shape[-1]
    qk_size = (n_heads + n_kv_heads) * head_dim
    # q's and k's columns are adjacent: one rotary call turns both, element for element as two would.
    qk = rotary(qkv[:, :qk_size].reshape(-1, n_heads + n_kv_heads, head_dim), cos, sin)
    q, k = qk.split([n_heads, n_kv_heads], dim=1)
    # q and v contiguous here, so that a graph of this (engine/cuda_graphs.py) makes the copies attention
    # needs.
    v = qkv[:, qk_size:].reshape(-1, n_kv_heads, head_dim).contiguous()
    return q.contiguous(), k, v
