"""Rotary embeddings from the once-built tables against a float64 rotation of each (x1, x2) pair."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.model import rope_tables, rotary

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
