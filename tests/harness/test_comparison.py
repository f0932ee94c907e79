"""The comparison implementations (backends/comparison.py): the flex adapter keeps its mask functions
free of default arguments (torch 2.11's FlexAttention on CUDA baked a default argument of a cached
mask function into later calls, pytorch issue 178365), and sdpa and flex, loaded through the
registry, pass small dense and sparse cases on the CPU."""

import pytest
import torch

from backends import comparison, registry
from backends.registry import LAYOUT_KINDS
from harness.cases import AttentionCase, LayoutSpec
from harness.judge import judge_attention
from reference.paged_prefill import token_mask

NUM_HEADS, SEQ_LEN = 4, 21
LAYOUTS = {
    "dense": LayoutSpec(),
    "local_strided": LayoutSpec("local_strided", block_size=4, local_blocks=1, vert_stride=2),
    "block_mask": LayoutSpec("block_mask", block_size=4, density=0.5, mask_seed=1),
}


def functions_reachable(fn):
    """fn and every function held in its closure, recursively."""
    seen, todo = [], [fn]
    while todo:
        f = todo.pop()
        if callable(f) and hasattr(f, "__code__") and f not in seen:
            seen.append(f)
            todo += [c.cell_contents for c in f.__closure__ or ()]
    return seen


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_flex_mask_mod_has_no_default_arguments(kind):
    layout = LAYOUTS[kind].build(NUM_HEADS, SEQ_LEN)
    mask_mod = comparison.flex_mask_mod(layout, NUM_HEADS, SEQ_LEN, "cpu")
    for fn in functions_reachable(mask_mod):
        assert fn.__defaults__ is None, f"{fn.__qualname__} has default arguments {fn.__defaults__}"
        assert fn.__kwdefaults__ is None, f"{fn.__qualname__} has keyword defaults {fn.__kwdefaults__}"


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_flex_mask_mod(kind):
    layout = LAYOUTS[kind].build(NUM_HEADS, SEQ_LEN)
    mask_mod = comparison.flex_mask_mod(layout, NUM_HEADS, SEQ_LEN, "cpu")
    pos = torch.arange(SEQ_LEN)
    want = token_mask(layout, NUM_HEADS, pos, pos)
    for h in range(NUM_HEADS):
        got = mask_mod(0, torch.tensor(h), pos.view(-1, 1), pos.view(1, -1))
        assert torch.equal(got.expand_as(want[h]), want[h]), h


def small_case(kind: str, decode: bool) -> AttentionCase:
    """Two sequences, one with a cached context that is not a multiple of the sparse block."""
    return AttentionCase(
        seed=3,
        seq_lens=(SEQ_LEN, 9),
        query_lens=(1, 1) if decode else (13, 9),
        num_heads=NUM_HEADS,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype="float32",
        layout=LAYOUTS[kind],
    )


@pytest.fixture(scope="module", params=["sdpa", "flex"])
def comparison_impl(request):
    try:
        return registry.load(request.param)
    except ImportError as exc:  # flex needs a torch with FlexAttention's AuxRequest
        pytest.skip(f"{request.param} unavailable: {exc}")


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", ["dense", "local_strided"])
def test_comparison_implementation(comparison_impl, kind, decode):
    case = small_case(kind, decode)
    op = "paged_decode" if decode else "paged_prefill"
    verdict = judge_attention(comparison_impl, case, decode=decode, device="cpu")
    if comparison_impl.refuses(case, op):
        assert verdict.status == "unsupported", verdict.message  # sdpa: dense only
    else:
        assert verdict.status == "passed", verdict.message
