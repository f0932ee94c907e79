"""The projections' Triton twin (engine/linear_triton.py) against a float64 product, and the layer's use
of it exactly where its table of measured row counts says."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import linear_triton
from engine import model as engine_model
from engine.model import DecoderLayer, ModelArgs

U32 = 2.0**-24  # float32's unit roundoff
# The interpreter holds bfloat16 as raw bits (TRITON-CPU facts): float32 and float16 there, all three on
# a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): the default, small ones that leave ragged edges at the
# drawn sizes, and one whose BLOCK_K exceeds most drawn K.
TILES = [(64, 64, 32, 2, 4), (16, 16, 16, 1, 1), (32, 16, 16, 2, 4), (16, 32, 64, 2, 2)]


def bound(x, w, y64, dtype):
    """Per element: float32 accumulation in any order (K products and sums, each within K * u32 of
    sum |x||w|), then one rounding to the dtype (half an ulp of |y|)."""
    k = x.shape[1]
    mass = x.double().abs() @ w.double().abs().t()
    return k * U32 * mass * 1.01 + torch.finfo(dtype).eps / 2 * y64.abs() + torch.finfo(dtype).tiny


@given(
    m=st.integers(0, 70),
    n=st.integers(1, 70),
    k=st.integers(0, 70),
    dtype=st.sampled_from(DTYPES),
    tile=st.sampled_from(TILES),
    scale=st.sampled_from([1.0, 5.0]),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_against_float64(device, m, n, k, dtype, tile, scale, strided, seed):
    """Within float32 accumulation's rounding and one rounding to the dtype of x @ w^T in float64, for any
    sizes (ragged or whole tiles) and x rows apart beyond their own."""
    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(m, k + 8 * strided, generator=gen)).to(dtype).to(device)[:, :k]
    w = (scale * torch.randn(n, k, generator=gen)).to(dtype).to(device)
    y = linear_triton.linear(x, w, tile)
    assert y.shape == (m, n) and y.dtype == dtype
    y64 = x.double() @ w.double().t()
    err = (y.double() - y64).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound(x, w, y64, dtype)).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bound_is_sharp(device, dtype):
    """A product with one weight row shifted by one column (a wrong stride) exceeds the bound."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 48, generator=gen).to(dtype).to(device)
    w = torch.randn(40, 48, generator=gen).to(dtype).to(device)
    wrong = w.clone()
    wrong[7] = w[7].roll(1)
    y64 = x.double() @ w.double().t()
    got = linear_triton.linear(x, wrong, TILES[1]).double()
    assert ((got - y64).abs() > bound(x, w, y64, dtype)).any()


@pytest.mark.parametrize(
    "x, w, error",
    [
        pytest.param([[1.0]], torch.ones(1, 1), TypeError, id="x-not-tensor"),
        pytest.param(torch.ones(2, 3, dtype=torch.int32), torch.ones(4, 3), TypeError, id="x-int"),
        pytest.param(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float16), TypeError, id="dtypes-differ"),
        pytest.param(torch.ones(2, 3), torch.ones(4, 5), ValueError, id="k-differs"),
        pytest.param(torch.ones(2, 3, 1), torch.ones(4, 3), ValueError, id="x-3d"),
        pytest.param(torch.ones(2, 3), torch.ones(3), ValueError, id="w-1d"),
    ],
)
def test_linear_refuses_bad_input(x, w, error):
    with pytest.raises(error):
        linear_triton.linear(x, w)


def test_measured_rows_are_well_formed():
    """Each entry of the table: ordered, disjoint row ranges, each with a tile the kernel takes."""
    for (capability, (n, k)), ranges in linear_triton.ROWS.items():
        assert len(capability) == 2 and n > 0 and k > 0
        for (low, high, tile), later in zip(ranges, [*ranges[1:], None], strict=True):
            assert 1 <= low <= high and (later is None or high < later[0])
            block_m, block_n, block_k, stages, warps = tile
            assert all(b >= 16 and b & (b - 1) == 0 for b in (block_m, block_n, block_k))
            assert stages >= 1 and warps in (1, 2, 4, 8)


@pytest.mark.parametrize("measured", [True, False])
def test_layer_projects_through_the_measured_tile(device, monkeypatch, measured):
    """With a tile measured for the layer's row count, each of its four projections runs the Triton
    kernel with that tile; without one, none does; the layer's outputs agree either way."""
    args = ModelArgs.from_name("tiny")
    layer = DecoderLayer(args).to(device)
    torch.manual_seed(0)
    h = torch.randn(5, args.dim, device=device)
    o = torch.randn(5, args.n_heads, args.head_dim, device=device)
    rope = engine_model.rope_tables(8, args.head_dim, args.rope_base, device)
    cos, sin = (t[torch.arange(5, device=device)].unsqueeze(1) for t in rope)
    with torch.no_grad():
        want = layer.attention_inputs(h, (cos, sin)), layer.finish(h, o)
    tile, calls = TILES[2], []
    monkeypatch.setattr(linear_triton, "measured_tile", lambda x, w: tile if measured else None)
    real = linear_triton.linear

    def linear(x, w, t):
        calls.append((tuple(w.shape), t))
        return real(x, w, t)

    monkeypatch.setattr(linear_triton, "linear", linear)
    with torch.no_grad():
        got = layer.attention_inputs(h, (cos, sin)), layer.finish(h, o)
    weights = [tuple(p.weight.shape) for p in (layer.qkv, layer.out, layer.up, layer.down)]
    assert calls == ([(w, tile) for w in weights] if measured else [])
    for a, b in zip([*want[0], want[1]], [*got[0], got[1]], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
