"""Rotary embeddings from the once-built tables against a float64 rotation of each (x1, x2) pair, and
the one-kernel `split_rotary` (engine/rope_triton.py) against its torch form, bit for bit."""

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import rope as rope_torch
from engine import rope_triton
from engine.model import DecoderLayer, ModelArgs
from engine.rope import rope_tables, rotary

MAX_POSITIONS, BASE = 4096, 10000.0
EPS32 = torch.finfo(torch.float32).eps


@given(
    positions=st.lists(st.integers(0, MAX_POSITIONS - 1), min_size=1, max_size=24),
    head_dim=st.sampled_from([2, 8, 16, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_rotary_rotates_each_pair_by_its_position_angle(positions, head_dim, seed):
    """Pair j of a token at position p turns by p * base^(-j / half): complex (x_j + i x_{j+half})
    times e^{i angle}, in float64."""
    cos, sin = rope_tables(MAX_POSITIONS, head_dim, BASE, "cpu")
    pos = torch.tensor(positions)
    x = torch.randn(len(positions), 3, head_dim, generator=torch.Generator().manual_seed(seed))
    got = rotary(x, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)).double()
    half = head_dim // 2
    angles = pos.double()[:, None, None] * BASE ** (-torch.arange(half, dtype=torch.float64) / half)
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    want = torch.cat((turned.real, turned.imag), dim=-1)
    # float32 angles are off by a few ulp of the largest one (inv_freq, the product, cos and sin each
    # round once), and the rotation itself rounds a few times at the pair's norm.
    norm = pairs.abs().repeat(1, 1, 2)
    bound = norm * (4 * EPS32 * MAX_POSITIONS + 8 * EPS32)
    assert bool(((got - want).abs() <= bound).all())


@given(
    heads=st.sampled_from([(1, 1), (4, 2), (6, 2)]),
    head_dim=st.sampled_from([2, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_layer_hands_attention_each_of_q_and_k_turned(heads, head_dim, dtype, seed):
    """The layer turns q and k in one call (their columns are adjacent): attention gets, bit for bit,
    `rotary` of each of the projection's q and k, and its v as it is."""
    n_heads, n_kv_heads = heads
    args = ModelArgs(
        vocab_size=8, dim=32, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        ffn_dim=16, sparse_block_size=16, local_blocks=1, vert_stride=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(args)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    layer = layer.to(dtype)
    h = torch.randn(11, 32, generator=gen).to(dtype)
    cos, sin = rope_tables(MAX_POSITIONS, head_dim, BASE, "cpu")
    pos = torch.randint(0, MAX_POSITIONS, (11,), generator=gen)
    rope = (cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    seen = []
    layer(h, rope, lambda q, k, v: seen.append((q, k, v)) or q.reshape(11, -1, head_dim)[:, :n_heads])
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    q, k, v = layer.qkv(layer.attn_norm(h)).split([q_size, kv_size, kv_size], dim=-1)
    [(got_q, got_k, got_v)] = seen
    assert torch.equal(got_q, rotary(q.reshape(11, n_heads, head_dim), *rope))
    assert torch.equal(got_k, rotary(k.reshape(11, n_kv_heads, head_dim), *rope))
    assert torch.equal(got_v, v.reshape(11, n_kv_heads, head_dim))


# The interpreter holds bfloat16 as raw bits (TRITON-CPU facts): float32 and float16 there, all three on
# a GPU.
SPLIT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def split_inputs(num_tokens, n_heads, n_kv_heads, head_dim, dtype, seed, device, pad=0):
    """(qkv, cos, sin) of `split_rotary`: qkv's rows `pad` columns apart beyond its own (a view), cos and
    sin rows of the tables at random positions."""
    gen = torch.Generator().manual_seed(seed)
    width = (n_heads + 2 * n_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + pad, generator=gen).to(dtype).to(device)[:, :width]
    cos, sin = rope_tables(MAX_POSITIONS, head_dim, BASE, device)
    pos = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen).to(device)
    return qkv, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)


@given(
    num_tokens=st.integers(0, 9),
    heads=st.sampled_from([(1, 1), (4, 2), (6, 2), (32, 8)]),
    head_dim=st.sampled_from([2, 6, 16, 128]),
    dtype=st.sampled_from(SPLIT_DTYPES),
    pad=st.sampled_from([0, 8]),
    seed=st.integers(0, 2**16),
)
def test_split_rotary_kernel_equals_torch_form(device, num_tokens, heads, head_dim, dtype, pad, seed):
    """The kernel's q, k and v are the torch form's bit for bit (each product and the sum rounded once
    in float32, no fused multiply-add), each contiguous, for any head count (blocks of heads that end
    inside q, k or v), head_dim (not a power of two too) and row stride."""
    args = (*split_inputs(num_tokens, *heads, head_dim, dtype, seed, device, pad), *heads)
    want = rope_torch.split_rotary(*args)
    got = rope_triton.split_rotary(*args)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.is_contiguous(), name
        assert torch.equal(g, w), f"{name}: {(g.float() - w.float()).abs().max().item()} off"


def test_split_rotary_twins_share_signature():
    assert inspect.signature(rope_triton.split_rotary) == inspect.signature(rope_torch.split_rotary)


def _bad(edit):
    qkv, cos, sin = split_inputs(3, 4, 2, 8, torch.float32, 0, "cpu")
    return edit(dict(qkv=qkv, cos=cos, sin=sin, n_heads=4, n_kv_heads=2))


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        pytest.param(_bad(lambda a: {**a, "qkv": a["qkv"].tolist()}), TypeError, "qkv", id="qkv-list"),
        pytest.param(_bad(lambda a: {**a, "qkv": a["qkv"].int()}), TypeError, "qkv", id="qkv-int"),
        pytest.param(_bad(lambda a: {**a, "cos": a["cos"].double()}), TypeError, "cos", id="cos-float64"),
        pytest.param(_bad(lambda a: {**a, "n_kv_heads": 3}), ValueError, "qkv", id="head-count"),
        pytest.param(_bad(lambda a: {**a, "n_heads": 0}), ValueError, "n_heads", id="no-heads"),
        pytest.param(_bad(lambda a: {**a, "qkv": a["qkv"][:2]}), ValueError, "qkv", id="token-count"),
        pytest.param(_bad(lambda a: {**a, "cos": a["cos"][:, 0]}), ValueError, "cos", id="cos-2d"),
        pytest.param(_bad(lambda a: {**a, "sin": a["sin"][:2]}), ValueError, "sin", id="sin-shape"),
        pytest.param(
            _bad(lambda a: {**a, "qkv": a["qkv"].t().contiguous().t()}), ValueError, "qkv", id="qkv-cols"
        ),
        pytest.param(
            _bad(
                lambda a: {**a, "qkv": a["qkv"][:, :42], "cos": a["cos"][..., :7], "sin": a["sin"][..., :7]}
            ),
            ValueError,
            "even",
            id="odd-head-dim",
        ),
    ],
)
@pytest.mark.parametrize("twin", [rope_torch, rope_triton], ids=["torch", "triton"])
def test_split_rotary_refuses_bad_input(twin, kwargs, error, names):
    with pytest.raises(error, match=names):
        twin.split_rotary(**kwargs)
