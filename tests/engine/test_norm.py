"""The decoder's pre-norm step: `add_layer_norm`'s twins (engine/norm.py, engine/norm_triton.py) against a
float64 LayerNorm of the rounded sum, and the layer's use of them against the layer's definition."""

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import norm, norm_triton
from engine.model import DecoderLayer, ModelArgs

EPS32 = torch.finfo(torch.float32).eps
# The interpreter holds bfloat16 as raw bits (TRITON-CPU facts): float32 and float16 there, all three on
# a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def norm_inputs(num_tokens, dim, dtype, residual, offset, seed, device, layout="contiguous"):
    """(x, residual, weight, bias, eps) of `add_layer_norm`; x a view with rows 8 columns apart beyond
    its own ("rows"), or transposed storage ("columns"), as `layout` says."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, shift=0.0):
        return (torch.randn(*shape, generator=gen) + shift).to(dtype).to(device)

    x = draw(num_tokens, dim + 8, shift=offset)[:, :dim]
    if layout == "contiguous":
        x = x.contiguous()
    elif layout == "columns":
        x = x.t().contiguous().t()
    return x, draw(num_tokens, dim) if residual else None, draw(dim), draw(dim), 1e-5


@given(
    num_tokens=st.integers(0, 9),
    dim=st.sampled_from([1, 16, 40, 128, 4096]),
    dtype=st.sampled_from(DTYPES),
    residual=st.booleans(),
    offset=st.sampled_from([0.0, 3.0]),
    layout=st.sampled_from(["contiguous", "rows", "columns"]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("twin", [norm, norm_triton], ids=["torch", "triton"])
def test_add_layer_norm_against_float64(twin, device, num_tokens, dim, dtype, residual, offset, layout, seed):
    """h is x + residual rounded once to the dtype (torch's sum, bit for bit); y is within one unit of
    the dtype's last place plus float32's rounding of the row's mean and variance (pairwise sums of at
    most 4096 terms: a few dozen eps32 of the row's scale, carried through rstd and weight) of the
    float64 LayerNorm of that h; for x of any strides."""
    x, r, w, b, eps = norm_inputs(num_tokens, dim, dtype, residual, offset, seed, device, layout)
    h, y = twin.add_layer_norm(x, r, w, b, eps)
    want_h = x if r is None else x + r
    assert h.dtype == y.dtype == x.dtype and h.shape == y.shape == x.shape
    assert torch.equal(h, want_h)
    h64, w64, b64 = (t.double() for t in (want_h, w, b))
    mean = h64.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(((h64 - mean) ** 2).mean(-1, keepdim=True) + eps)
    z = (h64 - mean) * rstd
    want = z * w64 + b64
    bound = torch.finfo(dtype).eps * want.abs() + 64 * EPS32 * (
        w64.abs() * (z.abs() + 1 + mean.abs() * rstd) + b64.abs()
    )
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


def test_add_layer_norm_twins_share_signature():
    assert inspect.signature(norm_triton.add_layer_norm) == inspect.signature(norm.add_layer_norm)


def _bad(edit):
    x, r, w, b, eps = norm_inputs(3, 8, torch.float32, True, 0.0, 0, "cpu")
    return edit(dict(x=x, residual=r, weight=w, bias=b, eps=eps))


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        pytest.param(_bad(lambda a: {**a, "x": a["x"].tolist()}), TypeError, "x", id="x-list"),
        pytest.param(_bad(lambda a: {**a, "x": a["x"].int()}), TypeError, "x", id="x-int"),
        pytest.param(_bad(lambda a: {**a, "x": a["x"][None]}), ValueError, "x", id="x-3d"),
        pytest.param(
            _bad(lambda a: {**a, "residual": a["residual"][:2]}), ValueError, "residual", id="residual-shape"
        ),
        pytest.param(
            _bad(lambda a: {**a, "residual": a["residual"].half()}),
            ValueError,
            "residual",
            id="residual-dtype",
        ),
        pytest.param(
            _bad(lambda a: {**a, "weight": a["weight"][:7]}), ValueError, "weight", id="weight-shape"
        ),
        pytest.param(_bad(lambda a: {**a, "bias": a["bias"].double()}), TypeError, "bias", id="bias-dtype"),
        pytest.param(_bad(lambda a: {**a, "eps": 0.0}), ValueError, "eps", id="eps-zero"),
        pytest.param(_bad(lambda a: {**a, "eps": 1}), ValueError, "eps", id="eps-int"),
    ],
)
@pytest.mark.parametrize("twin", [norm, norm_triton], ids=["torch", "triton"])
def test_add_layer_norm_refuses_bad_input(twin, kwargs, error, names):
    with pytest.raises(error, match=names):
        twin.add_layer_norm(**kwargs)


@given(num_tokens=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_layer_finish_adds_both_residuals(num_tokens, seed):
    """finish(h, o) is h2 + down(gelu(up(mlp_norm(h2)))) with h2 = h + out(o) (float64, where only the
    order of the GEMMs' sums differs)."""
    args = ModelArgs(
        vocab_size=8, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
        ffn_dim=48, sparse_block_size=16, local_blocks=1, vert_stride=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(args).double()
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    h = torch.randn(num_tokens, args.dim, generator=gen, dtype=torch.float64)
    o = torch.randn(num_tokens, args.n_heads, args.head_dim, generator=gen, dtype=torch.float64)
    h2 = h + o.reshape(num_tokens, -1) @ layer.out.weight.T
    x = torch.nn.functional.layer_norm(h2, (args.dim,), layer.mlp_norm.weight, layer.mlp_norm.bias, 1e-5)
    want = h2 + torch.nn.functional.gelu(x @ layer.up.weight.T) @ layer.down.weight.T
    torch.testing.assert_close(layer.finish(h, o), want, rtol=1e-12, atol=1e-12)
