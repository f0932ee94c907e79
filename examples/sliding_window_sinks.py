"""A layout family from outside the built-ins: a sliding window of blocks plus attention-sink blocks.

Query block qb of head h sees the first `sink_blocks` key blocks (StreamingLLM's attention sinks) and
the window of blocks ending at its own, causally:

    block_allowed(h, qb, kb) = kb <= qb and (kb < sink_blocks or qb - kb < window(h))

with window(h) = window_blocks, or window_blocks + h when `widening` (every head a different width).
This file is all a new family needs: the layout protocol of reference/layouts.py (`block_size`,
`block_mask`) and `family(num_heads)`, a hypothesis strategy of layouts. One string puts it under the
suite, with no edit anywhere else:

    nox -s tests -- --layout-family examples/sliding_window_sinks.py:family
    nox -s kernel-fuzz -- --layout-family examples/sliding_window_sinks.py:family --minutes 1
    nox -s report -- --layout-family examples/sliding_window_sinks.py:family
"""

import torch
from hypothesis import strategies as st


class SlidingWindowSinks:
    """Sliding window of `window_blocks` blocks plus `sink_blocks` sink blocks, blocks of `block_size`."""

    def __init__(self, block_size: int, window_blocks: int, sink_blocks: int, widening: bool = False):
        self.block_size = block_size
        self.window_blocks = window_blocks
        self.sink_blocks = sink_blocks
        self.widening = widening

    def __repr__(self) -> str:
        return (
            f"SlidingWindowSinks(block_size={self.block_size}, window_blocks={self.window_blocks}, "
            f"sink_blocks={self.sink_blocks}, widening={self.widening})"
        )

    def block_mask(self, num_heads: int, num_blocks: int) -> torch.Tensor:
        """bool [num_heads, num_blocks, num_blocks], causal (an expanded view when heads agree)."""
        idx = torch.arange(num_blocks)
        qb, kb = idx.view(1, -1, 1), idx.view(1, 1, -1)
        window = self.window_blocks + (torch.arange(num_heads).view(-1, 1, 1) if self.widening else 0)
        mask = (kb <= qb) & ((kb < self.sink_blocks) | (qb - kb < window))
        return mask.expand(num_heads, -1, -1)


def family(num_heads: int) -> st.SearchStrategy[SlidingWindowSinks]:
    """Sliding windows with sinks: any block size 1..128 (powers of two weighted up), windows of 1..8
    blocks, 0..3 sinks, one width for all heads or a different width per head."""
    return st.builds(
        SlidingWindowSinks,
        block_size=st.one_of(st.sampled_from((4, 8, 16, 32, 64)), st.integers(1, 128)),
        window_blocks=st.integers(1, 8),
        sink_blocks=st.integers(0, 3),
        widening=st.booleans() if num_heads > 1 else st.just(False),
    )
