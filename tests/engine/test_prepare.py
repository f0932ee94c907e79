"""`ModelRunner.prepare` (one staging buffer, one copy) against the step's inputs computed token by token."""

import types

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.model_runner import ModelRunner, ScheduledSeq
from engine.sequence import SamplingParams, Sequence


@st.composite
def batches(draw):
    """(page size, a batch ordered one-query rows first) over random block tables and contexts."""
    page = draw(st.sampled_from([1, 2, 5, 16]))
    rows = []
    for i in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 70))
        done = draw(st.integers(0, length - 1))
        new = 1 if draw(st.booleans()) else draw(st.integers(1, length - done))
        seq = Sequence(
            i, draw(st.lists(st.integers(0, 99), min_size=length, max_size=length)), SamplingParams()
        )
        pages = -(-length // page)
        seq.block_table = draw(st.lists(st.integers(0, 999), min_size=pages, max_size=pages, unique=True))
        seq.num_computed_tokens = done
        rows.append(ScheduledSeq(seq, new))
    return page, sorted(rows, key=lambda r: r.num_tokens != 1)


def _table(rows) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0) or 1
    return [r + [0] * (width - len(r)) for r in rows]


@given(batch=batches())
def test_prepare_flattens_the_batch_token_by_token(batch):
    page, rows = batch
    runner = types.SimpleNamespace(config=types.SimpleNamespace(page_size=page), device=torch.device("cpu"))
    ids, positions, sample_rows, meta = ModelRunner.prepare(runner, rows)
    want_ids, want_pos, want_slots, want_samples, row = [], [], [], [], 0
    for r in rows:
        seq, start = r.seq, r.seq.num_computed_tokens
        for p in range(start, start + r.num_tokens):
            want_ids.append(seq.token_ids[p])
            want_pos.append(p)
            want_slots.append(seq.block_table[p // page] * page + p % page)
        row += r.num_tokens
        if r.samples:
            want_samples.append(row - 1)
    nd = sum(1 for r in rows if r.num_tokens == 1)
    lens = [r.seq.num_computed_tokens + r.num_tokens for r in rows]
    starts = [0]
    for r in rows[nd:]:
        starts.append(starts[-1] + r.num_tokens)
    assert ids.tolist() == want_ids and positions.tolist() == want_pos
    assert meta.slot_mapping.tolist() == want_slots and sample_rows.tolist() == want_samples
    assert meta.num_decode_tokens == nd
    assert meta.decode_block_tables.tolist() == _table([r.seq.block_table for r in rows[:nd]])
    assert meta.prefill_block_tables.tolist() == _table([r.seq.block_table for r in rows[nd:]])
    assert meta.decode_seq_lens.tolist() == lens[:nd] and meta.prefill_seq_lens.tolist() == lens[nd:]
    assert meta.prefill_query_start_loc.tolist() == starts
    int64 = (ids, positions, sample_rows, meta.slot_mapping)
    int32 = (meta.decode_block_tables, meta.decode_seq_lens, meta.prefill_block_tables, meta.prefill_seq_lens,
             meta.prefill_query_start_loc)  # fmt: skip
    assert all(t.dtype == torch.int64 for t in int64) and all(t.dtype == torch.int32 for t in int32)
    # Every field starts 16 bytes into its buffer (aligned wherever the device puts the buffer), as the
    # kernels' specialization prefers.
    assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % 16 == 0 for t in int64 + int32)
