"""The planned path: one plan serves every layer of a step, and a stale plan is refused, never used."""

import dataclasses
import importlib
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from engine.cuda_graphs import cuda_capture
from harness.cases import AttentionCase, LayoutSpec, attention_args, build_inputs
from harness.judge import judge_attention
from harness.strategies import attention_cases
from tests.kernels import test_paged_decode, test_paged_prefill

pytestmark = pytest.mark.planned
CASE = AttentionCase(
    seed=9,
    seq_lens=(70, 33),
    query_lens=(30, 33),
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    page_size=16,
    dtype="float16",
    layout=LayoutSpec(kind="local_strided", block_size=16, local_blocks=2, vert_stride=3),
)
OPS = {"prefill": False, "decode": True}
SYNC_WARNING = "called a synchronizing CUDA operation"


def _call(impl, op: str, device):
    decode = OPS[op]
    case = CASE if not decode else AttentionCase(**{**CASE.__dict__, "query_lens": (1, 1)})
    inputs = build_inputs(case, device)
    args = attention_args(inputs, decode)
    planner = impl.planners[f"plan_{op}"]
    plan = planner(*args, layout=inputs["layout"], return_lse=True)
    return impl.op(f"paged_{op}"), plan, args, inputs


@pytest.mark.parametrize("op", OPS)
def test_plan_reused_across_layers_equals_the_op(impl, device, op):
    fn, plan, args, inputs = _call(impl, op, device)
    q, k_cache, v_cache, *metadata = args
    gen = torch.Generator().manual_seed(1)
    for _layer in range(3):  # other values of q and caches with the planned shapes, as per layer
        q = torch.randn(q.shape, generator=gen).to(q)
        k_cache, v_cache = (torch.randn(c.shape, generator=gen).to(c) for c in (k_cache, v_cache))
        out, lse = plan.run(q, k_cache, v_cache)
        want_out, want_lse = fn(q, k_cache, v_cache, *metadata, layout=inputs["layout"], return_lse=True)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with t's shape and strides one element past a 16-byte boundary."""
    view = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return view.copy_(t)


@pytest.mark.parametrize("op", OPS)
def test_plan_runs_tensors_at_any_address(impl, device, op):
    """Tensors of the planned shapes and strides at another alignment give what their aligned
    twins give: a launch compiled for 16-byte aligned pointers is never reused for others."""
    _, plan, args, _ = _call(impl, op, device)
    tensors = args[:3]
    want = plan.run(*tensors)
    got = plan.run(*(_shifted(t) for t in tensors))
    again = plan.run(*tensors)
    for w, g, a in zip(want, got, again, strict=True):
        assert torch.equal(w, g) and torch.equal(w, a)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["block_tables", "seq_lens"])
def test_plan_refuses_metadata_modified_after_planning(impl, device, op, name):
    _, plan, args, _ = _call(impl, op, device)
    q, k_cache, v_cache, block_tables, seq_lens, *_ = args
    {"block_tables": block_tables, "seq_lens": seq_lens}[name].add_(0)  # any in-place write counts
    with pytest.raises(ValueError, match=f"stale plan: {name}"):
        plan.run(q, k_cache, v_cache)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda q, k, v: (q[:-1], k, v), id="q-fewer-tokens"),
        pytest.param(lambda q, k, v: (q.float(), k, v), id="q-dtype"),
        pytest.param(lambda q, k, v: (q, k[:-1], v), id="k_cache-fewer-pages"),
        pytest.param(lambda q, k, v: (q, k, v.float()), id="v_cache-dtype"),
        # Same shape, other memory layout: the plan's offset width was chosen from the planned strides.
        pytest.param(lambda q, k, v: (q, k, v.mT.contiguous().mT), id="v_cache-strides"),
    ],
)
def test_plan_refuses_tensors_it_was_not_built_for(impl, device, op, change):
    _, plan, args, _ = _call(impl, op, device)
    with pytest.raises(ValueError, match="does not match the plan"):
        plan.run(*change(*args[:3]))


def _write_plan(impl, device):
    from harness.bad_inputs import valid_write_kv_args

    args = valid_write_kv_args(device)
    return impl.planners["plan_write_kv"](**args), args


@pytest.mark.operator("write_kv")
def test_write_plan_reused_across_layers_equals_the_op(impl, device):
    plan, args = _write_plan(impl, device)
    gen = torch.Generator().manual_seed(2)
    for _layer in range(3):
        k, v = (torch.randn(args["k"].shape, generator=gen).to(args["k"]) for _ in range(2))
        caches = [torch.randn(args["k_cache"].shape, generator=gen).to(args["k_cache"]) for _ in range(2)]
        want = [c.clone() for c in caches]
        plan.run(k, v, *caches)
        impl.write_kv(k, v, *want, args["slot_mapping"])
        assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))


@pytest.mark.operator("write_kv")
def test_write_plan_refuses_stale_slots_and_other_tensors(impl, device):
    plan, args = _write_plan(impl, device)
    tensors = [args[name] for name in ("k", "v", "k_cache", "v_cache")]
    with pytest.raises(ValueError, match="does not match the plan"):
        plan.run(tensors[0][:-1], *tensors[1:])
    args["slot_mapping"].add_(0)
    with pytest.raises(ValueError, match="stale plan: slot_mapping"):
        plan.run(*tensors)


def _fresh(args):
    """The same values in new tensors: a call no memo can recognize."""
    return [a.clone() for a in args]


@pytest.mark.ours
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("write", ["block_tables", "seq_lens"])
def test_op_sees_metadata_written_in_place(impl, device, op, write):
    """The public op remembers its last plan (kernels._common.LastPlan); metadata written in place
    since (the version counter moves) is validated and planned afresh, never read through the old plan."""
    fn, _, args, inputs = _call(impl, op, device)
    q, k_cache, v_cache, block_tables, seq_lens, *rest = args
    first = fn(*args, layout=inputs["layout"], return_lse=True)
    if write == "block_tables":  # the first two pages of sequence 0 trade places
        block_tables[0, :2] = block_tables[0, :2].flip(0).clone()
    else:  # sequence 0 one token shorter (a cached context token fewer)
        seq_lens[:1] -= 1
    again = fn(*args, layout=inputs["layout"], return_lse=True)
    want = fn(*_fresh(args), layout=inputs["layout"], return_lse=True)
    assert all(torch.equal(a, w) for a, w in zip(again, want, strict=True))
    assert not all(torch.equal(a, f) for a, f in zip(again, first, strict=True)), "the write changed nothing"


@pytest.mark.ours
@pytest.mark.parametrize("op", OPS)
def test_op_validates_once_for_repeated_calls(impl, device, op, monkeypatch):
    module = importlib.import_module(f"kernels.paged_{op}")
    name = "validate_paged_decode" if OPS[op] else "validate_paged_prefill"
    calls = []
    validate = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or validate(*a, **k))
    fn, _, args, inputs = _call(impl, op, device)
    calls.clear()  # the explicit plan of _call
    for _ in range(3):
        fn(*args, layout=inputs["layout"])
    assert len(calls) == 1, "the same metadata, unmodified: one validation"
    fn(*args, layout=inputs["layout"], return_lse=True)
    fn(*args[:3], *_fresh(args[3:]), layout=inputs["layout"], return_lse=True)
    assert len(calls) == 3, "another return_lse, or other metadata tensors: planned again"


@pytest.mark.gpu
@pytest.mark.ours
@pytest.mark.parametrize("op", OPS)
def test_public_call_syncs_once_and_a_repeated_call_never(impl, device, op):
    """Validation reads the metadata back in one transfer; the plan copies to the device only
    asynchronously (pinned memory); a repeated call of the same metadata runs the kept plan."""
    fn, _, args, inputs = _call(impl, op, device)
    fn(*args, layout=inputs["layout"])  # the layout's tile lists, built once and kept
    fresh = _fresh(args)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*fresh, layout=inputs["layout"])
            cold = len(caught)
            fn(*fresh, layout=inputs["layout"])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # The mode also warns, once, that it is a prototype: only its "called a synchronizing" lines count.
    syncs = [str(w.message).splitlines()[0] for w in caught if SYNC_WARNING in str(w.message)]
    cold = sum(SYNC_WARNING in str(w.message) for w in caught[:cold])
    assert cold <= 1, syncs
    assert len(syncs) == cold, syncs


def _decode_planned_at_bounds(impl):
    """`impl` whose paged_decode plans as the engine's decode graphs do (engine/cuda_graphs.py): over
    every row at the block table's whole width and page 0, then runs that plan on the call's metadata
    written into the planned tensors."""
    plan_decode = impl.planners["plan_decode"]

    def paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False
    ):
        table = torch.zeros_like(block_tables)
        bound = block_tables.shape[1] * k_cache.shape[1]
        if hasattr(layout, "num_blocks"):  # a block mask of its own size (reference.BlockMaskLayout)
            bound = min(bound, layout.num_blocks * layout.block_size)
        lens = torch.full_like(seq_lens, bound)
        plan = plan_decode(
            q, k_cache, v_cache, table, lens, scale=scale, layout=layout, return_lse=return_lse
        )
        table.copy_(block_tables)
        lens.copy_(seq_lens)
        plan.guard.rebase()  # what a graph's replay does without asking
        return plan.run(q, k_cache, v_cache)

    return dataclasses.replace(impl, paged_decode=paged_decode)


@pytest.mark.requires(graphs=True)
@pytest.mark.operator("paged_decode")
@given(data=st.data())
def test_decode_plan_serves_metadata_rewritten_within_its_bounds(impl, device, expect, data):
    """The `graphs` capability: a decode plan made for longer sequences, its metadata then rewritten in
    place with the call's, gives the call's attention (contract §5 against the oracle)."""
    case = data.draw(attention_cases(caps=impl.capabilities, decode=True, **test_paged_decode.CAPS))
    expect(judge_attention(_decode_planned_at_bounds(impl), case, decode=True, device=device))


@pytest.mark.requires(graphs=True)
@pytest.mark.operator("paged_decode")
def test_decode_plan_bounds_cover_an_earlier_longer_row(impl, device, expect):
    """The rows planned for end in a block that sees only its diagonal, while the call's query sits in
    an earlier block that sees every block before it: the plan's splits must still cover its tiles."""
    case = test_paged_decode._case((100, 37), heads=(4, 4), head_dim=32)
    inputs = build_inputs(case, device)
    size = 16
    blocks = -(-inputs["block_tables"].shape[1] * case.page_size // size)
    mask = torch.ones(blocks, blocks, dtype=torch.bool)
    mask[-1, :-1] = False
    inputs["layout"] = reference.BlockMaskLayout(mask, size)
    case = dataclasses.replace(case, layout=LayoutSpec("block_mask", size, density=1.0))
    verdict = judge_attention(
        _decode_planned_at_bounds(impl), case, decode=True, device=device, inputs=inputs
    )
    expect(verdict, single=True)


def prefill_replanned(impl, plans: list | None = None, walk_in_graph: bool = False):
    """`impl` whose paged_prefill plans as the engine's prefill graphs do (engine/cuda_graphs.py): over
    one sequence more than the call's (never read after), each at the block table's whole width over
    page 0; then writes the call's metadata into the planned tensors, replans and runs, the run captured
    in a CUDA graph before the rewrite when the plan keeps its launch (`fixed_launch`). With
    `walk_in_graph`, the graph also holds the plan's `walk_launch` (where it has one), before the run,
    and a lone round (`lone_round`) is not replanned: the graph writes its walk. Each plan is appended to
    `plans`."""
    plan_prefill = impl.planners["plan_prefill"]

    def paged_prefill(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        *,
        scale=None,
        layout=None,
        return_lse=False,
    ):
        options = dict(scale=scale, layout=layout, return_lse=return_lse)
        if q.shape[0] == 0:  # a plan without queries has nothing to replan
            return plan_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **options).run(
                q, k_cache, v_cache
            )
        seqs, width = block_tables.shape
        bound = width * k_cache.shape[1]
        if hasattr(layout, "num_blocks"):  # a block mask of its own size (reference.BlockMaskLayout)
            bound = min(bound, layout.num_blocks * layout.block_size)
        table = block_tables.new_zeros(seqs + 1, width)
        lens = seq_lens.new_full((seqs + 1,), bound)
        starts = torch.cat([query_start_loc, query_start_loc[-1:]])
        plan = plan_prefill(q, k_cache, v_cache, table, lens, starts, **options)
        if plans is not None:
            plans.append(plan)
        replay = walk = None
        if q.is_cuda and plan.fixed_launch:
            walk = plan.walk_launch() if walk_in_graph else None

            def step():
                if walk is not None:
                    walk()
                return plan.run(q, k_cache, v_cache)

            step()  # compiles, outside the capture
            replay, captured = cuda_capture(step, None, {})
        table[:seqs].copy_(block_tables)
        lens[:seqs].copy_(seq_lens)
        starts[: seqs + 1].copy_(query_start_loc)
        if walk is not None and plan.lone_round(seq_lens.tolist(), query_start_loc.tolist()):
            plan.walk = None  # as `replan` leaves it: no host walk describes the buffer
        else:
            plan.replan(seq_lens.tolist(), query_start_loc.tolist())
        if replay is None:
            return plan.run(q, k_cache, v_cache)
        replay()
        return captured

    return dataclasses.replace(impl, paged_prefill=paged_prefill)


@pytest.mark.requires(graphs=True)
@pytest.mark.operator("paged_prefill")
@given(data=st.data())
def test_prefill_plan_replanned_within_its_bounds(impl, device, expect, data):
    """The `graphs` capability: a prefill plan made for one more sequence, all of the table's whole
    length, then rewritten in place with the call's metadata and replanned (on the GPU, replayed from a
    CUDA graph captured before), gives the call's attention (contract §5 against the oracle)."""
    case = data.draw(attention_cases(caps=impl.capabilities, **test_paged_prefill.CAPS))
    expect(judge_attention(prefill_replanned(impl), case, decode=False, device=device))


@given(
    st.sampled_from([16, 32, 64, 128]),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 300)), min_size=1, max_size=8),
)
def test_max_query_tiles_bounds_every_batch(block_m, rows):
    """`max_query_tiles` holds the query tiles of any batch of that many sequences and tokens; contexts
    ending just before a tile's end make few queries straddle two tiles, its worst case."""
    paged_prefill = importlib.import_module("kernels.paged_prefill")
    contexts = [max(0, tiles * block_m - before) for tiles, before, _ in rows]
    lens = [context + query for context, (_, _, query) in zip(contexts, rows, strict=True)]
    starts = [0]
    for *_, query in rows:
        starts.append(starts[-1] + query)
    tiles = paged_prefill._query_tiles(lens, starts, block_m)
    assert len(tiles) <= paged_prefill.max_query_tiles(len(rows), starts[-1], block_m)


@pytest.mark.parametrize(
    ("lens", "starts", "match"),
    [
        ([70, 33, 5], [0, 30, 63, 63], "at most 2 seq_lens"),
        ([70], [0, 30, 63], "one more query_start_loc"),
        ([70, 33], [0, 30, 64], "from 0 to at most 63"),
        ([20, 33], [0, 30, 63], "sequence 0"),
        ([70, 10**6], [0, 30, 63], "sequence 1"),
    ],
)
def test_prefill_replan_refuses_a_batch_out_of_its_bounds(device, lens, starts, match):
    """A replan outside the plan's bounds (sequences, q's tokens, the table's reach) or not a batch is
    a ValueError naming what is wrong; the plan still runs its last batch after."""
    paged_prefill = importlib.import_module("kernels.paged_prefill")
    inputs = build_inputs(CASE, device)
    plan = paged_prefill.plan_prefill(*attention_args(inputs, False), layout=inputs["layout"])
    before = plan.run(inputs["q"], inputs["k_cache"], inputs["v_cache"])
    with pytest.raises(ValueError, match=match):
        plan.replan(lens, starts)
    assert torch.equal(plan.run(inputs["q"], inputs["k_cache"], inputs["v_cache"]), before)
