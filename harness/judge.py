"""Run one case through an implementation and judge it: the one run-and-judge step of the suite.

The tests, the fuzz campaign, the accuracy report and the engine checks all come here. A verdict is
`passed`, `failed` (with a readable message) or `unsupported` (the implementation raised
NotImplementedError, or ValueError on an input the contract allows, contract §3 and §9).
"""

import math
import traceback
from dataclasses import asdict, dataclass, field

import torch

import reference
from harness.cases import DTYPES, AttentionCase, attention_args, build_inputs
from harness.records import jsonable
from harness.tolerance import ErrorStats, error_stats
from reference.paged_prefill import prefill_in_dtype
from reference.validation import validate_paged_prefill

# Bit-level views used to compare caches exactly (NaN payloads included).
BIT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
UNSUPPORTED = (NotImplementedError, ValueError)


@dataclass
class Verdict:
    """The verdict on one case. `ratio` is contract §5's worst gate ratio (<= 1 passes; inf for a crash
    or a non-finite mismatch); `stats` holds each output's error profile as plain values."""

    status: str  # "passed", "failed" or "unsupported"
    ratio: float = 0.0
    message: str = ""
    stats: dict = field(default_factory=dict)
    outputs: tuple | None = field(default=None, repr=False, compare=False)  # (out, lse or None)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def oracle_and_base(inputs: dict):
    """The oracle on built case inputs: ((ref_out, ref_lse), (base_out, base_lse)).

    `ref` is the float64 oracle, unrounded; `base` the same computation in the input dtype (the
    `base` of contract §5's rule).
    """
    q = inputs["q"]
    batch = validate_paged_prefill(
        *attention_args(inputs, decode=False), scale=inputs["scale"], layout=inputs["layout"]
    )
    args = (batch, q, inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["layout"])
    ref = prefill_in_dtype(*args, torch.float64, cast_outputs=False)
    base = prefill_in_dtype(*args, q.dtype)
    return ref, base


def stats_dict(s: ErrorStats) -> dict:
    return jsonable(asdict(s))


def crash(exc: BaseException) -> Verdict:
    tail = "".join(traceback.format_exception(exc)[-3:]).strip()
    return Verdict("failed", math.inf, f"crash: {type(exc).__name__}: {exc}", {"traceback": tail})


def _describe_failure(op: str, name: str, s: ErrorStats) -> str:
    return (
        f"{op} {name}: max err {s.max_err:.3e} (allowed {s.allowed_max:.3e}), mean err {s.mean_err:.3e} "
        f"(allowed {s.allowed_mean:.3e}), {s.over_tolerance}/{s.numel} over, "
        f"{s.bad_nonfinite} non-finite mismatches (NaN exactly where the oracle has NaN), "
        f"worst at {s.worst_index}"
    )


def judge_outputs(op: str, outputs, oracle, dtype: torch.dtype, shape) -> Verdict:
    """Judges (out, lse or None) against the oracle's ((ref_out, ref_lse), (base_out, base_lse))."""
    out, lse = outputs
    (ref_out, ref_lse), (base_out, base_lse) = oracle
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != tuple(shape):
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        return Verdict(
            "failed", math.inf, f"{op} out: expected {dtype} {tuple(shape)}, got {got}", outputs=outputs
        )
    checks = {"out": error_stats(out, ref_out, base_out, dtype)}
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != ref_lse.shape:
            got = f"{lse.dtype} {tuple(lse.shape)}" if isinstance(lse, torch.Tensor) else type(lse).__name__
            return Verdict(
                "failed",
                math.inf,
                f"{op} lse: expected float32 {tuple(ref_lse.shape)}, got {got}",
                outputs=outputs,
            )
        checks["lse"] = error_stats(lse, ref_lse, base_lse, dtype)
    ratio = max(s.ratio if s.bad_nonfinite == 0 else math.inf for s in checks.values())
    stats = {k: stats_dict(s) for k, s in checks.items()}
    bad = [k for k, s in checks.items() if not s.passed]
    message = "; ".join(_describe_failure(op, k, checks[k]) for k in bad)
    return Verdict("failed" if bad else "passed", ratio, message, stats, outputs)


def call_attention(impl, inputs: dict, decode: bool, with_lse: bool):
    """The implementation's (out, lse or None) on built inputs; exceptions propagate."""
    fn = impl.op("paged_decode" if decode else "paged_prefill")
    kwargs = dict(scale=inputs["scale"], layout=inputs["layout"])
    if with_lse:
        out, lse = fn(*attention_args(inputs, decode), **kwargs, return_lse=True)
        return out, lse
    return fn(*attention_args(inputs, decode), **kwargs), None


def judge_attention(
    impl, case: AttentionCase, *, decode: bool, device, inputs=None, oracle=None, check_without_lse=False
) -> Verdict:
    """Runs `case` through the implementation's paged_prefill (or paged_decode) and judges it.

    With the `lse` capability the log-sum-exp is judged too; with `check_without_lse`, a second call
    without `return_lse` must give the same `out`, bit for bit. `inputs` and `oracle` may be passed in
    when the caller has built them (the report reuses one oracle for several implementations).
    """
    op = "paged_decode" if decode else "paged_prefill"
    refused = impl.refuses(case, op)
    if refused:
        return Verdict("unsupported", message=refused)
    inputs = build_inputs(case, device) if inputs is None else inputs
    with_lse = impl.capabilities.lse
    try:
        outputs = call_attention(impl, inputs, decode, with_lse)
        alone = call_attention(impl, inputs, decode, False)[0] if check_without_lse and with_lse else None
    except UNSUPPORTED as exc:
        return Verdict("unsupported", message=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001  (any crash of the implementation is a finding)
        return crash(exc)
    oracle = oracle_and_base(inputs) if oracle is None else oracle
    verdict = judge_outputs(op, outputs, oracle, DTYPES[case.dtype], inputs["q"].shape)
    if alone is not None and verdict.status == "passed" and not same_bits(alone, outputs[0]):
        return Verdict("failed", math.inf, f"{op}: out without return_lse differs from out with it")
    return verdict


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so that equal NaN payloads compare equal."""
    return t.contiguous().view(BIT_VIEWS[t.element_size()])


def same_bits(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(bits(a), bits(b))
    )


def judge_write_kv(impl, inputs: dict, case=None) -> Verdict:
    """write_kv on clones of the inputs' caches against the oracle's write: equal bit for bit.

    With `case`, an implementation that does not declare it (or provides no write_kv) is
    `unsupported` rather than called.
    """
    refused = impl.refuses(case, "write_kv") if case is not None else None
    if refused:
        return Verdict("unsupported", message=refused)
    expect = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}
    got = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}
    reference.write_kv(inputs["k"], inputs["v"], expect["k_cache"], expect["v_cache"], inputs["slot_mapping"])
    try:
        impl.write_kv(inputs["k"], inputs["v"], got["k_cache"], got["v_cache"], inputs["slot_mapping"])
    except UNSUPPORTED as exc:
        return Verdict("unsupported", message=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        return crash(exc)
    wrong = {k: int((bits(got[k]) != bits(expect[k])).sum()) for k in got}
    stats = {"mismatched_elements": wrong, "numel": expect["k_cache"].numel()}
    if not any(wrong.values()):
        return Verdict("passed", 0.0, "", stats, (got["k_cache"], got["v_cache"]))
    return Verdict("failed", math.inf, f"write_kv: mismatched cache elements {wrong}", stats)
