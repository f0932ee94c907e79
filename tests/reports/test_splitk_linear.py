"""`splitk_linear.linear` (reports/splitk_linear.py) against its spec, a float64 product: within float32
accumulation's rounding in any order and one rounding to the dtype, the same bits on every call, and bad
input refused."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reports import splitk_linear
from tests.budgets import examples

EPS32 = torch.finfo(torch.float32).eps
# The interpreter holds bfloat16 as raw bits (TRITON-CPU facts): float32 and float16 there, all three on
# a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, stages, warps)
    (16, 32, 32, 1, 2, 4),
    (16, 32, 32, 2, 2, 4),
    (32, 16, 16, 3, 2, 4),
    (16, 64, 16, 4, 2, 4),
]


def operands(rows, n_blocks, k_blocks, tile, dtype, strided, seed, device):
    """x [rows, K] (a view with rows 8 columns apart beyond its own when `strided`) and weight [N, K] whose
    N and K the tile divides."""
    gen = torch.Generator().manual_seed(seed)
    n, k = n_blocks * tile[1], k_blocks * tile[3] * tile[2]
    x = torch.randn(rows, k + 8 * strided, generator=gen)[:, :k]
    weight = torch.randn(n, k, generator=gen)
    return x.to(dtype).to(device), weight.to(dtype).to(device)


@examples(1)
@given(
    rows=st.integers(0, 70),
    n_blocks=st.integers(1, 3),
    k_blocks=st.integers(1, 3),
    tile=st.sampled_from(TILES),
    dtype=st.sampled_from(DTYPES),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_against_float64(device, rows, n_blocks, k_blocks, tile, dtype, strided, seed):
    """Each element within one rounding to the dtype of the float64 product plus float32 accumulation's
    worst case over K terms in any order, (K + 1) eps32 of the sum of the products' magnitudes; the same
    bits on a second call, and every tile count back at 0."""
    x, weight = operands(rows, n_blocks, k_blocks, tile, dtype, strided, seed, device)
    y = splitk_linear.linear(x, weight, tile)
    assert y.dtype == dtype and y.shape == (rows, weight.shape[0])
    want = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    bound = torch.finfo(dtype).eps / 2 * want.abs() + (x.shape[1] + 1) * EPS32 * magnitude
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
    assert torch.equal(splitk_linear.linear(x, weight, tile), y)
    assert not splitk_linear.counts(x.device).any()


def test_linear_writes_into_out(device):
    x, weight = operands(5, 2, 1, TILES[1], torch.float32, False, 0, device)
    out = torch.full((5, weight.shape[0]), float("nan"), device=device)
    assert splitk_linear.linear(x, weight, TILES[1], out=out) is out
    assert torch.equal(out, splitk_linear.linear(x, weight, TILES[1]))


def _bad(edit):
    x, weight = operands(3, 1, 1, TILES[1], torch.float32, False, 0, "cpu")
    return edit(dict(x=x, weight=weight, tile=TILES[1]))


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        pytest.param(_bad(lambda a: {**a, "x": a["x"].tolist()}), TypeError, "x", id="x-list"),
        pytest.param(_bad(lambda a: {**a, "x": a["x"].int()}), TypeError, "x", id="x-int"),
        pytest.param(_bad(lambda a: {**a, "weight": a["weight"].half()}), TypeError, "weight", id="dtypes"),
        pytest.param(_bad(lambda a: {**a, "weight": a["weight"][:, 1:]}), ValueError, "weight", id="k"),
        pytest.param(_bad(lambda a: {**a, "x": a["x"][0]}), ValueError, "x", id="x-1d"),
        pytest.param(_bad(lambda a: {**a, "tile": (16, 24, 32, 2, 2, 4)}), ValueError, "BLOCK_N", id="n"),
        pytest.param(_bad(lambda a: {**a, "tile": (16, 32, 32, 3, 2, 4)}), ValueError, "SPLIT_K", id="split"),
        pytest.param(_bad(lambda a: {**a, "out": torch.empty(3, 31)}), ValueError, "out", id="out-shape"),
    ],
)
def test_linear_refuses_bad_input(kwargs, error, names):
    with pytest.raises(error, match=names):
        splitk_linear.linear(**kwargs)
