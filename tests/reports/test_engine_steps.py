"""reports/engine_steps.py's device-idle split against a count over a grid of integer instants."""

from hypothesis import given
from hypothesis import strategies as st

from reports.engine_steps import device_idle

intervals = st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1]))


@given(st.lists(intervals, max_size=8), st.integers(0, 10), st.integers(0, 10))
def test_device_idle_counts_every_idle_instant_once(kernels, lead, tail):
    start = min((k[0] for k in kernels), default=0) - lead
    end = max((k[1] for k in kernels), default=0) + tail
    busy = {t for k0, k1 in kernels for t in range(k0, k1)}
    before, between, after = device_idle((start, end), [tuple(map(float, k)) for k in kernels])
    if not kernels:
        assert (before, between, after) == (end - start, 0, 0)
        return
    first, last = min(k[0] for k in kernels), max(k[1] for k in kernels)
    assert before == first - start and after == end - last
    assert between == sum(1 for t in range(first, last) if t not in busy)
