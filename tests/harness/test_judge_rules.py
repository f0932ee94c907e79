"""The judge's own rules, each broken on purpose (meta-tests, as array-api-tests keeps them).

The suite judges other people's kernels, so every rule of harness/judge.py and harness/tolerance.py
faces an output or implementation built to violate exactly that rule, and must reject it: both
halves of the NaN rule, exact infinities and empty rows, the max gate, the mean gate, shapes and
dtypes, unsupported versus failed versus rejected, the bit-for-bit check without lse, poisoning of
every fresh allocation, write_kv exactness, and crashes and hangs.
"""

import math
from types import SimpleNamespace

import pytest
import torch

import reference
from backends import registry
from harness.cases import AttentionCase, LayoutSpec, attention_args, build_inputs, write_kv_inputs
from harness.isolation import Isolated
from harness.judge import judge_attention, judge_outputs, judge_write_kv, oracle
from harness.poison import poison_allocations
from tests.fuzz.implementations import named

CASE = AttentionCase(
    seed=7,
    seq_lens=(40, 19),
    query_lens=(25, 19),
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    page_size=8,
    dtype="float16",
    input_scale=5.0,
    layout=LayoutSpec("block_mask", block_size=8, density=0.5, mask_seed=3),
)


@pytest.fixture(scope="module")
def truth():
    """(inputs, oracle, exact out rounded to float16, exact lse in float32) of CASE."""
    inputs = build_inputs(CASE, "cpu")
    t = oracle(inputs)
    return inputs, t, t.out.to(torch.float16), t.lse.float()


def judge(truth, out, lse):
    inputs, t, _, _ = truth
    return judge_outputs("paged_prefill", (out, lse), t, torch.float16, inputs["q"].shape)


def test_the_exact_answer_passes(truth):
    _, _, out, lse = truth
    verdict = judge(truth, out, lse)
    assert verdict.passed, verdict.message


def test_nan_where_the_oracle_is_finite_fails(truth):
    _, t, out, lse = truth
    out = out.clone()
    out[tuple(torch.nonzero(torch.isfinite(t.out))[0].tolist())] = math.nan
    verdict = judge(truth, out, lse)
    assert verdict.failed and verdict.stats["out"]["bad_nonfinite"] == 1


def test_finite_where_the_oracle_is_nan_fails(truth):
    inputs, _, _, _ = truth
    poisoned = dict(inputs, q=inputs["q"].clone())
    poisoned["q"][3, 1, 0] = math.nan  # row (3, 1) sees a NaN: the oracle makes it NaN
    t = oracle(poisoned)
    out, lse = torch.nan_to_num(t.out).to(torch.float16), torch.nan_to_num(t.lse).float()
    verdict = judge_outputs("paged_prefill", (out, lse), t, torch.float16, inputs["q"].shape)
    assert verdict.failed
    assert (
        verdict.stats["out"]["bad_nonfinite"] == CASE.head_dim and verdict.stats["lse"]["bad_nonfinite"] == 1
    )


def test_empty_rows_must_be_exactly_zero_and_minus_inf(truth):
    _, t, out, lse = truth
    empty = torch.isinf(t.lse)
    assert empty.any(), "the case needs an empty row"
    row = torch.nonzero(empty)[0].tolist()
    nonzero = out.clone()
    nonzero[row[0], row[1], 0] = 2.0**-24  # the smallest float16 there is: still not 0
    assert judge(truth, nonzero, lse).failed
    finite_lse = lse.clone()
    finite_lse[row[0], row[1]] = -1e30
    assert judge(truth, out, finite_lse).stats["lse"]["bad_nonfinite"] == 1


def _perturbed(t, share: float, elements: int | None = None):
    """out (float64) moved by `share` of each element's max-gate allowance, on the first `elements`."""
    bound = t.bounds["out"][0]
    delta = share * torch.where(torch.isfinite(t.out), bound, 0.0)
    if elements is not None:
        keep = torch.zeros(delta.numel(), dtype=torch.bool)
        keep[torch.nonzero(delta.flatten() > 0)[:elements, 0]] = True
        delta = torch.where(keep.view(delta.shape), delta, 0.0)
    return t.out + delta


def test_max_gate_rejects_one_element_over_its_allowance(truth):
    inputs, t, _, lse = truth
    out = _perturbed(t, 1.5, elements=1)
    verdict = judge_outputs("paged_prefill", (out, lse), t, torch.float64, inputs["q"].shape)
    s = verdict.stats["out"]
    assert verdict.failed and s["over_tolerance"] == 1 and 1.4 < s["max_ratio"] < 1.6
    under = judge_outputs("paged_prefill", (_perturbed(t, 0.5, 1), lse), t, torch.float64, inputs["q"].shape)
    assert under.passed, under.message


def test_mean_gate_rejects_a_systematic_error_each_element_allows(truth):
    # Every element at 0.9 of its own allowance: each passes the max gate, but errors that large on
    # every row are no longer rounding noise (lambda_N < LAMBDA for many rows).
    inputs, t, _, lse = truth
    verdict = judge_outputs("paged_prefill", (_perturbed(t, 0.9), lse), t, torch.float64, inputs["q"].shape)
    s = verdict.stats["out"]
    assert verdict.failed and s["max_ratio"] <= 1.0 < s["mean_ratio"], s


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(lambda o: o[:, :2], id="shape"),
        pytest.param(lambda o: o.float(), id="dtype"),
        pytest.param(lambda o: o.tolist(), id="not-a-tensor"),
    ],
)
def test_out_of_the_wrong_shape_or_dtype_fails(truth, wrong):
    _, _, out, lse = truth
    verdict = judge(truth, wrong(out), lse)
    assert verdict.failed and "paged_prefill out: expected torch.float16" in verdict.message


def test_lse_of_the_wrong_dtype_fails(truth):
    _, _, out, lse = truth
    verdict = judge(truth, out, lse.double())
    assert verdict.failed and "lse: expected float32" in verdict.message


def _raising(exc):
    def paged_prefill(*args, **kwargs):
        raise exc

    return registry.Implementation("raises", None, paged_prefill, None)


@pytest.mark.parametrize(
    "exc, status, words",
    [
        pytest.param(
            NotImplementedError("page size"), "unsupported", "NotImplementedError: page size", id="nie"
        ),
        pytest.param(
            ValueError("S must divide P"), "failed", "rejected a valid input: ValueError", id="value"
        ),
        pytest.param(TypeError("bad"), "failed", "rejected a valid input: TypeError", id="type"),
        pytest.param(RuntimeError("boom"), "failed", "raised RuntimeError: boom", id="runtime"),
    ],
)
def test_only_not_implemented_is_unsupported(exc, status, words):
    verdict = judge_attention(_raising(exc), CASE, decode=False, device="cpu")
    assert verdict.status == status and words in verdict.message


def test_out_must_not_depend_on_return_lse():
    def paged_prefill(*args, return_lse=False, **kwargs):
        out, lse = reference.paged_prefill(*args, return_lse=True, **kwargs)
        return (out, lse) if return_lse else out + 2.0**-10

    impl = registry.Implementation("drifts", None, paged_prefill, None)
    verdict = judge_attention(impl, CASE, decode=False, device="cpu", check_without_lse=True)
    assert verdict.failed and "without return_lse differs" in verdict.message


def _writes_nothing(q, *args, return_lse=False, **kwargs):
    out = torch.empty_like(q)  # never written
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    return (out, lse) if return_lse else out


def test_an_unwritten_output_fails_whoever_allocates_it():
    verdict = judge_attention(
        registry.Implementation("lazy", None, _writes_nothing, None), CASE, decode=False, device="cpu"
    )
    assert verdict.failed and verdict.stats["out"]["bad_nonfinite"] > 0


def test_poisoning_covers_every_empty_allocation_and_nothing_else():
    before = torch.zeros(4)
    with poison_allocations():
        made = [
            torch.empty(3),
            torch.empty_like(before),
            before.new_empty(2),
            torch.empty_strided((2,), (1,)),
        ]
        ints = torch.empty(3, dtype=torch.int32)
        zeros = torch.zeros(3)
    assert all(bool(t.isnan().all()) for t in made)
    assert bool((ints == torch.iinfo(torch.int32).max).all()) and bool((zeros == 0).all())
    assert bool((before == 0).all())  # inputs made before the call are untouched


def test_write_kv_must_match_bit_for_bit():
    case = CASE
    inputs = write_kv_inputs(case, "cpu")

    def off_by_one_ulp(k, v, k_cache, v_cache, slot_mapping):
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
        k_cache.view(torch.int16)[0, 0, 0, 0] += 1

    verdict = judge_write_kv(SimpleNamespace(write_kv=off_by_one_ulp), inputs)
    assert verdict.failed and verdict.stats["mismatched_elements"]["k_cache"] == 1


def test_a_case_that_kills_its_process_is_a_crash():
    child = Isolated(named("SEGFAULTS"), "cpu", {"TRITON_INTERPRET": "1"})
    try:
        case = AttentionCase(
            **{**CASE.to_dict(), "layout": CASE.layout, "seq_lens": (41,), "query_lens": (41,)}
        )
        verdict = child.run("prefill", case.to_dict())
        assert verdict.status == "crashed" and verdict.failed and "SIGSEGV" in verdict.message
        # The next case runs in a fresh child.
        short = AttentionCase(
            **{**CASE.to_dict(), "layout": CASE.layout, "seq_lens": (9,), "query_lens": (9,)}
        )
        assert child.run("prefill", short.to_dict()).passed and child.starts == 2
    finally:
        child.close()


def test_a_case_that_does_not_return_is_a_hang():
    child = Isolated(named("HANGS"), "cpu", {"TRITON_INTERPRET": "1"}, case_timeout=2.0)
    try:
        three = AttentionCase(**{**CASE.to_dict(), "layout": CASE.layout, "num_heads": 3, "num_kv_heads": 1})
        verdict = child.run("prefill", three.to_dict())
        assert verdict.status == "hung" and verdict.failed and "per-case limit of 2 s" in verdict.message
    finally:
        child.close()


def test_decode_inputs_are_judged_like_prefill(truth):
    # paged_decode is prefill with one query per sequence: the same oracle and rule judge it.
    case = AttentionCase(**{**CASE.to_dict(), "layout": CASE.layout, "query_lens": (1, 1)})
    verdict = judge_attention(registry.load("reference"), case, decode=True, device="cpu")
    inputs = build_inputs(case, "cpu")
    assert verdict.passed and attention_args(inputs, True)[0].shape[0] == 2
