"""The decoder's pre-norm step (engine/model.py): a residual sum, then LayerNorm over the last dim.

`add_layer_norm` here is the definition, in torch; engine/norm_triton.py is its one-kernel twin for the
GPU, with the same signature: the sum bit for bit, the normalized rows within float32's rounding.
"""

import torch
from torch import nn


def validate_add_layer_norm(x, residual, weight, bias, eps: float) -> None:
    """`add_layer_norm`'s refusals, shared by its twins: TypeError for a wrong type or dtype, ValueError
    for a wrong shape, device or eps."""
    tensors = (("x", x), ("weight", weight), ("bias", bias)) + (
        (("residual", residual),) if residual is not None else ()
    )
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, dim], got {list(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must be x's {list(x.shape)} {x.dtype}, got {list(residual.shape)} {residual.dtype}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if tuple(t.shape) != (x.shape[1],):
            raise ValueError(f"{name} must be [dim] = [{x.shape[1]}], got {list(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must be x's dtype {x.dtype}, got {t.dtype}")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"eps must be a float > 0, got {eps!r}")


def add_layer_norm(x, residual, weight, bias, eps: float):
    """The residual sum and its LayerNorm.

    Args:
        x: [num_tokens, dim].
        residual: x's shape and dtype, or None (no sum: x itself is normalized).
        weight, bias: [dim], the norm's affine factors.
        eps: added to each row's variance.
    Returns:
        h = x + residual (x when residual is None) and layer_norm(h) [num_tokens, dim], x's dtype.
    """
    validate_add_layer_norm(x, residual, weight, bias, eps)
    h = x if residual is None else x + residual
    return h, nn.functional.layer_norm(h, (h.shape[1],), weight, bias, eps)
