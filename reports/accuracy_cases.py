"""Shapes and cases of the accuracy report (reports/accuracy.py): one profile per device, plus `tiny`.

A profile fixes heads, cache geometry and layouts; `summary_cases` gives the batches behind one cell of
the conformance matrix, `curve_cases` the points of the error curves. Every case is a plain
`harness.cases.AttentionCase`, its tensors built from its seed.
"""

import math
from dataclasses import dataclass, replace

from harness.cases import DTYPES, AttentionCase, LayoutSpec
from harness.strategies import sample

FIRST_SUMMARY_SEED = 11
CURVE_SEED = 21
FAMILY_SEED = 31
ALL_DTYPES = tuple(DTYPES)


@dataclass(frozen=True)
class Profile:
    """Shapes of one report."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    block_size: int
    local_blocks: int
    vert_stride: int
    dtypes: tuple[str, ...]
    curve_dtype: str
    # Summary cases: (seq_lens, context_lens) per case.
    batches: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    seq_lens: tuple[int, ...]  # sequence-length curve
    curve_len: int  # length of the sparsity and cached-prefix curves
    block_mask_density: float = 0.5  # of the summary's block_mask rows
    densities: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 1.0)
    prefix_shares: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 0.97)


PROFILES = {
    "cpu": Profile(
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        local_blocks=2,
        vert_stride=3,
        dtypes=ALL_DTYPES,
        curve_dtype="float16",
        batches=(((128,), (0,)), ((200, 37), (100, 0)), ((96, 17, 150), (90, 16, 64))),
        seq_lens=(16, 32, 64, 128, 256),
        curve_len=192,
    ),
    "cuda": Profile(
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        block_size=64,
        local_blocks=16,
        vert_stride=8,
        dtypes=ALL_DTYPES,
        curve_dtype="bfloat16",
        batches=(((2048,), (0,)), ((1500, 700), (1000, 0)), ((3000, 64, 1000), (2900, 0, 512))),
        seq_lens=(128, 256, 512, 1024, 2048, 4096),
        curve_len=2048,
    ),
    # For smoke tests of the report itself: every section, in seconds.
    "tiny": Profile(
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        block_size=4,
        local_blocks=1,
        vert_stride=2,
        dtypes=ALL_DTYPES,
        curve_dtype="float32",
        batches=(((12,), (0,)), ((10, 5), (6, 0))),
        seq_lens=(4, 16),
        curve_len=16,
        densities=(0.5, 1.0),
        prefix_shares=(0.0, 0.5),
    ),
}


def layout_spec(kind: str, p: Profile, density: float, seed: int) -> LayoutSpec:
    """The profile's layout of one kind (block_mask: random, of the given density)."""
    if kind == "dense":
        return LayoutSpec(block_size=p.block_size)
    if kind == "local_strided":
        return LayoutSpec("local_strided", p.block_size, p.local_blocks, p.vert_stride)
    return LayoutSpec("block_mask", p.block_size, density=density, mask_seed=seed)


def make_case(p: Profile, seq_lens, context_lens, dtype: str, kind: str, seed: int, density=None):
    """An attention case of the profile's heads and cache geometry."""
    return AttentionCase(
        seed=seed,
        seq_lens=tuple(seq_lens),
        query_lens=tuple(n - c for n, c in zip(seq_lens, context_lens, strict=True)),
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        page_size=p.page_size,
        dtype=dtype,
        layout=layout_spec(kind, p, p.block_mask_density if density is None else density, seed),
    )


def kept_share(case: AttentionCase) -> float:
    """Share of the causal (query block, key block) pairs a block-mask layout keeps."""
    nb = math.ceil(max(case.seq_lens) / case.layout.block_size)
    mask = case.layout.build(case.num_heads, max(case.seq_lens)).block_mask(case.num_heads, nb)
    causal = nb * (nb + 1) // 2 * case.num_heads
    return round(float(mask.sum()) / causal, 3)


def summary_cases(p: Profile, op: str, kind: str, dtype: str, family=None) -> list[AttentionCase]:
    """The profile's batches for one operator, layout kind and dtype (decode: one query per sequence).
    With an outside `family` (backends.layout_families.Family), its layouts instead: the same ones every
    run (hypothesis draws from a fixed seed, the family's simplest layout first), one per batch."""
    layouts = sample(family.layouts(p.num_heads), len(p.batches), FAMILY_SEED) if family else []
    cases = []
    for i, (lens, ctx) in enumerate(p.batches):
        context = tuple(n - 1 for n in lens) if op == "paged_decode" else ctx
        case = make_case(p, lens, context, dtype, kind, FIRST_SUMMARY_SEED + i)
        if family:
            drawn = layouts[i % len(layouts)]
            case = replace(case, layout=LayoutSpec.of_family(family.name, drawn, p.num_heads, max(lens)))
        cases.append(case)
    return cases


def curve_cases(p: Profile) -> dict:
    """{sweep: [(x, case, layout kind), ...]} for the curves against sequence length, sparsity (x is
    the density asked for; the curve plots the share kept) and cached-prefix share, in p.curve_dtype."""
    dt, n = p.curve_dtype, p.curve_len
    return {
        "seq_len": [
            (length, make_case(p, (length,), (0,), dt, kind, CURVE_SEED), kind)
            for kind in ("dense", "local_strided")
            for length in p.seq_lens
        ],
        "sparsity": [
            (d, make_case(p, (n,), (0,), dt, "block_mask", CURVE_SEED, density=d), "block_mask")
            for d in p.densities
        ],
        "prefix_share": [
            (share, make_case(p, (n,), (min(n - 1, round(share * n)),), dt, kind, CURVE_SEED), kind)
            for kind in ("dense", "local_strided")
            for share in p.prefix_shares
        ],
    }
