"""The planned prefill's Hopper path (kernels/hopper_prefill.py, on by default on sm_90) against the float64
oracle, on an sm_90 GPU: pages of 8 to 256 rows, head dims 64 and 128, fp16 and bf16, the partial
tiles' three layout modes, contexts, GQA, batches, odd scales and non-finite K and V.

Each case first checks that its plan takes the Hopper path, so that a fallback to the Triton kernel
cannot pass for it.
"""

import importlib
import math

import numpy as np
import pytest
import torch

from backends import registry
from harness.cases import AttentionCase, LayoutSpec, attention_args, build_inputs
from harness.judge import judge_attention, oracle
from tests.kernels import test_plan

device_walk = importlib.import_module("kernels.device_walk")
hopper_prefill = importlib.import_module("kernels.hopper_prefill")
paged_prefill = importlib.import_module("kernels.paged_prefill")
pytestmark = [pytest.mark.gpu, pytest.mark.operator("paged_prefill")]
PHI3 = LayoutSpec("local_strided", 64, 16, 8, num_heads_total=32)


def _case(seq_lens, query_lens, heads=8, kv=2, d=128, page=16, dtype="bfloat16", layout=None, **kw):
    return AttentionCase(
        0, seq_lens, query_lens, heads, kv, d, page, dtype, layout=layout or LayoutSpec(), **kw
    )


CASES = {
    "phi3-ctx0-q4096": _case((4096,), (4096,), 32, 8, layout=PHI3),
    "phi3-ctx4097-q4095-fp16": _case((8192,), (4095,), 32, 8, dtype="float16", layout=PHI3),
    "dense-ctx223-q777-P16": _case((1000,), (777,)),
    "dense-P8-D64-fp16-batch": _case((700, 1, 333), (700, 1, 100), d=64, page=8, dtype="float16"),
    "dense-P64-batch": _case((129, 64, 300), (129, 1, 71), page=64),
    "dense-P256-gqa4": _case((1500,), (900,), page=256),
    "elements-S16-P32": _case(
        (600, 257),
        (600, 100),
        d=64,
        page=32,
        dtype="float16",
        layout=LayoutSpec("block_mask", 16, density=0.5, mask_seed=3),
    ),
    "none-S64-P128": _case((900,), (500,), page=128, layout=LayoutSpec("local_strided", 64, 2, 3)),
    "rows-S128-P16": _case((1100,), (1100,), layout=LayoutSpec("block_mask", 128, density=0.6)),
    "scale-zero": _case((300,), (200,), scale=0.0, layout=LayoutSpec("local_strided", 64, 2, 3)),
    "scale-negative-x5": _case((300,), (200,), scale=-0.3, input_scale=5.0),
    "scale-saturating": _case((300,), (300,), scale=32.0, input_scale=5.0),
    "all-rows-empty": _case((400,), (400,), layout=LayoutSpec("block_mask", 64, density=0.0)),
}
# (case, cache, token of sequence 0, head dim index, value)
NON_FINITE = [
    ("dense-ctx223-q777-P16", "v_cache", 500, 3, math.nan),
    ("dense-ctx223-q777-P16", "v_cache", 990, 0, math.inf),  # in the last rows' diagonal tile
    ("dense-ctx223-q777-P16", "v_cache", 1003, 2, math.inf),  # past the sequence end, in its last page
    ("dense-ctx223-q777-P16", "k_cache", 100, 7, -math.inf),
    ("elements-S16-P32", "v_cache", 590, 1, math.nan),
    # Masked out for about half the later rows, in a masked tile that more of their masked tiles follow:
    # V_CHECK_AFTER's rare path must leave them a unit's state intact (the poisons above sit in rows'
    # last tiles, or in rows that see them).
    ("elements-S16-P32", "v_cache", 70, 1, math.nan),
]
CHECK_AFTER_CASES = ("phi3-ctx4097-q4095-fp16", "elements-S16-P32", "scale-zero", "all-rows-empty")
# Cases whose plans split items into parts of a tile or more (MIN_SPLIT_TILES = 1): masked layouts,
# batches, rows with no key, a zero and a saturating scale.
SPLIT_CASES = {
    name: CASES[name]
    for name in (
        "phi3-ctx4097-q4095-fp16",
        "elements-S16-P32",
        "dense-ctx223-q777-P16",
        "dense-P8-D64-fp16-batch",
    )
} | {
    "scale-zero-long": _case((1500,), (1500,), scale=0.0, layout=LayoutSpec("local_strided", 64, 2, 3)),
    "rows-empty-long": _case((1500,), (1500,), layout=LayoutSpec("block_mask", 64, density=0.15)),
    "scale-saturating-long": _case((1200,), (1000,), scale=32.0, input_scale=5.0),
}
# Cases of one round of items that leaves programs idle (SPLIT_ONE_ROUND), the engine's step over a cached
# 2k prompt among them, each split by `split_one_round` over its plan's programs (min(the most query tiles
# of a batch in the plan's bounds x heads, SMs) on a 132-SM GPU; tests/kernels/test_walk.py checks it).
ONE_ROUND_CASES = {
    "dense-P64-batch": CASES["dense-P64-batch"],
    "phi3-ctx1840-q208": _case((2048,), (208,), 32, 8, layout=PHI3),
    "dense-ctx800-q200-P16": _case((1000,), (200,)),
    "dense-P8-D64-fp16-batch-q150": _case((700, 1, 333), (150, 1, 60), d=64, page=8, dtype="float16"),
    "elements-S16-P32-q130": _case(
        (900,),
        (130,),
        d=64,
        page=32,
        dtype="float16",
        layout=LayoutSpec("block_mask", 16, density=0.5, mask_seed=3),
    ),
    "rows-empty-long-q200": _case((1500,), (200,), layout=LayoutSpec("block_mask", 64, density=0.15)),
    "scale-saturating-long-q150": _case((1200,), (150,), scale=32.0, input_scale=5.0),
}
PARAMS = [pytest.param(name, None, id=name) for name in CASES] + [
    pytest.param(name, poison, id=f"{name}-{poison[0]}-{poison[3]}@{poison[1]}")
    for name, *poison in NON_FINITE
]


@pytest.fixture
def hopper_path(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setattr(hopper_prefill, "ENABLED", True)
    monkeypatch.setattr(paged_prefill._LAST_PLAN, "last", None)


@pytest.mark.parametrize(("name", "poison"), PARAMS)
def test_hopper_prefill(hopper_path, name, poison):
    _judge(name, poison)


@pytest.mark.parametrize(
    ("walk", "rounds", "split", "cheapest_last"),
    [
        ("head-major", 0, False, False),
        ("last-round", 1, False, False),
        ("cheapest-last", 1, False, True),
        ("every-round", 10**6, False, False),
        ("every-round-split", 10**6, True, False),
    ],
)
def test_hopper_prefill_walks(hopper_path, monkeypatch, walk, rounds, split, cheapest_last):
    """The programs take the units `plan_walk` gives them, in head-major order, with rounds dealt by
    cost (the last one by default), with the cheapest items last (the default where it pays, as
    here), and with the last round split: 1024 items on the GPU's programs."""
    monkeypatch.setattr(hopper_prefill, "BALANCED_WALK", rounds > 0)
    monkeypatch.setattr(hopper_prefill, "BALANCED_ROUNDS", rounds)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", split)
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 0.0)
    monkeypatch.setattr(hopper_prefill, "CHEAPEST_LAST", cheapest_last)
    plan = _judge("phi3-ctx0-q4096", None)
    assert (plan.walk.num_slots > 0) == split
    if cheapest_last:  # the walk is not the dealt one
        tiles = [(0, t) for t in range(4096 // hopper_prefill.BLOCK_M)]
        dealt = hopper_prefill.plan_walk(plan.lists.counts, tiles, 32, plan.programs, 1, False)
        assert not np.array_equal(plan.walk.units, dealt.units)


@pytest.mark.parametrize(
    ("name", "poison"),
    [pytest.param(name, None, id=name) for name in SPLIT_CASES]
    + [param for param in PARAMS if param.values[1] is not None and param.values[0] in SPLIT_CASES],
)
def test_hopper_prefill_split_items(hopper_path, monkeypatch, name, poison):
    """Items split into parts of a tile or more, each part's softmax state merged by the last part to
    end (`_merge`): against the oracle, and the same bits on a second run (the parts' counts are
    reset for the next launch)."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", True)
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", 1)
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 0.0)
    plan = _judge(name, poison, SPLIT_CASES)
    assert plan.walk.num_slots > 0, "no item was split"
    inputs = build_inputs(SPLIT_CASES[name], "cuda")
    q, k_cache, v_cache = (inputs[key] for key in ("q", "k_cache", "v_cache"))
    again = _plan(inputs)
    first = again.run(q, k_cache, v_cache)
    assert torch.equal(again.run(q, k_cache, v_cache), first)


@pytest.mark.parametrize("name", list(ONE_ROUND_CASES))
def test_hopper_prefill_split_one_round(hopper_path, monkeypatch, name):
    """SPLIT_ONE_ROUND (on by default): a single round of items, fewer than the programs, split over
    the idle ones (parts of a tile or more): against the oracle, and the same bits on a second run."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", True)
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", 1)
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 0.0)
    plan = _judge(name, None, ONE_ROUND_CASES)
    assert plan.walk.num_slots > 0 and plan.split_slots >= plan.walk.num_slots, "no item was split"
    inputs = build_inputs(ONE_ROUND_CASES[name], "cuda")
    q, k_cache, v_cache = (inputs[key] for key in ("q", "k_cache", "v_cache"))
    again = _plan(inputs)
    first = again.run(q, k_cache, v_cache)
    assert torch.equal(again.run(q, k_cache, v_cache), first)


@pytest.mark.parametrize(
    ("name", "poison"),
    [param for param in PARAMS if param.values[1] is not None or param.values[0] in CHECK_AFTER_CASES],
)
def test_hopper_prefill_v_checked_first(hopper_path, monkeypatch, name, poison):
    """V_CHECK_AFTER off (on by default, where a masked tile's weights multiply V as it is, the tile
    taken again with V checked when that product is not finite): every masked tile's V checked and
    copied before its product; the non-finite cases and the masked layouts."""
    monkeypatch.setattr(hopper_prefill, "V_CHECK_AFTER", False)
    plan = _judge(name, poison)
    assert not plan.hopper.planned["V_CHECK_AFTER"], "the plan checked V after the product"


@pytest.mark.parametrize("name", list(CASES))
def test_hopper_prefill_device_descriptors(hopper_path, monkeypatch, name):
    """DEVICE_DESCRIPTORS on (off by default, where the host makes the caches' TMA descriptors): each
    program makes its own from the caches' pointers."""
    monkeypatch.setattr(hopper_prefill, "DEVICE_DESCRIPTORS", True)
    plan = _judge(name, None)
    assert plan.descriptors.on_device and plan.hopper.planned["DEVICE_DESCRIPTORS"]


def test_host_descriptors_encoded_once_per_cache(hopper_path, monkeypatch):
    """A run's host-made descriptors are encoded on its caches' first run only (`launcher_args`; a
    kernel's first launch, which compiles it, goes through Triton's launcher); caches at other addresses
    get their own maps, and every run gives the same bits."""
    inputs = build_inputs(CASES["dense-ctx223-q777-P16"], "cuda")
    q, k_cache, v_cache = (inputs[key] for key in ("q", "k_cache", "v_cache"))
    plan = _plan(inputs)
    assert not plan.descriptors.on_device
    first = plan.run(q, k_cache, v_cache)  # the kernel's first launch compiles it: Triton's own launch
    monkeypatch.setattr(hopper_prefill, "_ENCODED", {})
    assert torch.equal(plan.run(q, k_cache, v_cache), first)
    assert len(hopper_prefill._ENCODED) == 2
    assert torch.equal(plan.run(q, k_cache, v_cache), first)
    assert len(hopper_prefill._ENCODED) == 2
    assert torch.equal(plan.run(q, k_cache.clone(), v_cache.clone()), first)
    assert len(hopper_prefill._ENCODED) == 4


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-one-round"])
@pytest.mark.parametrize("walk", ["host", "device", "graph"])
@pytest.mark.parametrize(
    "name", ["dense-P64-batch", "dense-P8-D64-fp16-batch", "elements-S16-P32", "phi3-ctx0-q4096"]
)
def test_hopper_prefill_replanned_in_a_cuda_graph(hopper_path, monkeypatch, name, walk, split):
    """A plan made for one more sequence, each at the table's whole length, captured in a CUDA graph,
    then replanned for the case in place and replayed (`PrefillPlan.replan`), against the oracle: the
    small batches leave programs of the planned grid without an item, which take stand-in units, or,
    with SPLIT_ONE_ROUND, parts of the items, in the split states that the launch holds. Their walks
    are made by the host (kernels/device_walk.py off), by the GPU at the replan, or by the GPU inside
    the graph (`walk_launch`, as an engine's prefill graph holds it in its lead), with no replan."""
    monkeypatch.setattr(device_walk, "ENABLED", walk != "host")
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", split)
    if split:
        monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", 1)
        monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 0.0)
    case, plans = CASES[name], []
    inputs = build_inputs(case, "cuda")
    impl = test_plan.prefill_replanned(registry.load("triton"), plans, walk_in_graph=walk == "graph")
    verdict = judge_attention(
        impl, case, decode=False, device="cuda", inputs=inputs, truth=oracle(inputs), check_without_lse=True
    )
    assert verdict.status == "passed", verdict.message
    assert plans and all(plan.fixed_launch for plan in plans), "the plan did not take the Hopper path"
    if name == "phi3-ctx0-q4096":  # more than a round of items
        return
    lens, starts = inputs["seq_lens"].tolist(), inputs["query_start_loc"].tolist()
    tiles = paged_prefill._query_tiles(lens, starts, hopper_prefill.BLOCK_M)
    walks = [
        hopper_prefill.settled_walk(
            plan.lists.counts, tiles, plan.grid[1], plan.programs, (plan.split_slots, 10**6)
        )
        for plan in plans
    ]
    assert any((w.num_slots > 0) == split and (split or (w.units[:, 0] < 0).any()) for w in walks), (
        "no walk of the batch splits an item" if split else "no walk of the batch has a stand-in unit"
    )
    if walk == "host":
        assert all(plan.walk is not None for plan in plans)
    else:
        assert any(plan.walk is None for plan in plans), "no replanned walk written on the device"


def _plan(inputs):
    """The op's prefill plan of a case's inputs (`build_inputs`)."""
    return paged_prefill.plan_prefill(
        *attention_args(inputs, decode=False), scale=inputs["scale"], layout=inputs["layout"]
    )


def _judge(name, poison, cases=CASES):
    """The case (its cache poisoned at one element) through the op on the Hopper path, against the
    oracle; returns the case's plan."""
    case = cases[name]
    inputs = build_inputs(case, "cuda")
    if poison is not None:
        cache, token, dim, value = poison
        page_size = inputs[cache].shape[1]
        inputs[cache][inputs["block_tables"][0, token // page_size], token % page_size, 0, dim] = value
    plan = _plan(inputs)
    assert plan.hopper is not None, "the plan did not take the Hopper path"
    verdict = judge_attention(
        registry.load("triton"), case, decode=False, device="cuda", inputs=inputs, truth=oracle(inputs),
        check_without_lse=True,
    )  # fmt: skip
    assert verdict.status == "passed", verdict.message
    return plan


def test_hopper_timeline(hopper_path):
    """The diagnostic timeline (hopper_prefill.TIMELINE, reports/hopper_timeline.py) of a Phi-3 prefill:
    both consumers take every unit of the walk once, each unit's stamps come in phase order (its
    partial tiles' too, each with a mode), its list lengths are the plan's, and the output is the same
    as without it."""
    from kernels import tile_lists
    from reports import bench_kernels as bk
    from reports import hopper_timeline as ht

    n, queries = 4096, 2048
    p = bk.Prefill(n, queries, bk.phi3_layout(), torch.Generator().manual_seed(0))
    plan = paged_prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout)
    expected = plan.run(p.q, p.k, p.v)
    t, programs, out = ht.stamps(paged_prefill, p)
    assert torch.equal(out, expected)
    taken = t[..., ht.NS_START] > 0
    assert (taken.sum(dim=(0, 2)) == plan.walk.units.shape[0]).all()
    order = [ht.START, ht.AFTER_FULL, ht.AFTER_PARTIAL, ht.END]
    assert (t[..., order].diff(dim=-1)[taken] >= 0).all()
    assert (t[..., ht.NS_END] >= t[..., ht.NS_START])[taken].all()
    # Each stamped partial tile ends in order within the partial phase, with one of the modes.
    stamped = hopper_prefill.PARTIAL_STAMPS
    listed = taken[..., None] & (torch.arange(stamped) < (t[..., ht.COUNT] - t[..., ht.N_FULL])[..., None])
    ends = torch.where(
        listed, t[..., ht.PARTIAL_END : ht.PARTIAL_END + stamped], t[..., ht.AFTER_PARTIAL, None]
    )
    phase = torch.cat([t[..., ht.AFTER_FULL, None], ends, t[..., ht.AFTER_PARTIAL, None]], -1)
    assert (phase.diff(dim=-1)[taken] >= 0).all()
    modes = t[..., ht.PARTIAL_MODE : ht.PARTIAL_MODE + stamped][listed]
    assert torch.isin(modes, torch.tensor(list(ht.MODES))).all()
    lists = tile_lists.tile_lists(
        p.layout, bk.HEADS, n, hopper_prefill.BLOCK_M, hopper_prefill.BLOCK_N, 1, "cpu"
    )
    first = (n - queries) // hopper_prefill.BLOCK_M
    counts = lists.counts[:, first : n // hopper_prefill.BLOCK_M].expand(-1, -1, bk.HEADS).sum(dim=(1, 2))
    for consumer in range(2):
        mine = t[:, consumer][taken[:, consumer]]
        assert mine[:, ht.N_FULL].sum() == counts[0]
        assert mine[:, ht.COUNT].sum() == counts.sum()
    summary = ht.summarize(t)
    assert sum(summary["share"].values()) == pytest.approx(1.0)
    # Each partition enters before its first unit (or copy) and exits after its last.
    consumer = hopper_prefill.PROGRAM_CONSUMER
    entry, exit_ = programs[:, :, consumer], programs[:, :, consumer + 1]
    busy = taken.any(dim=2)
    assert (entry[busy] <= t[:, :, 0, ht.NS_START][busy]).all()
    assert (exit_[busy] >= t[..., ht.NS_END].amax(dim=2)[busy]).all()
    producer = programs[:, 0, hopper_prefill.PROGRAM_PRODUCER : hopper_prefill.PROGRAM_FIRST_COPY + 1]
    assert (producer[busy[:, 0]] > 0).all()
    assert (producer[:, 0] <= producer[:, 2])[busy[:, 0]].all()  # entry, then the first copy
    outside = ht.outside_units(t, programs)
    assert 0 <= outside["units_span_us"] <= outside["inside_us"]


def test_hopper_timeline_refuses_a_short_buffer(hopper_path, monkeypatch):
    """A timeline buffer that cannot hold every stamp is refused at planning, not written past."""
    inputs = build_inputs(CASES["dense-ctx223-q777-P16"], "cuda")
    monkeypatch.setattr(hopper_prefill, "TIMELINE", torch.zeros(1, 2, 1, 8, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="TIMELINE"):
        _plan(inputs)
