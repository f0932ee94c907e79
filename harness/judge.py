"""Run one case through an implementation and judge it: the one run-and-judge step of the suite.

The tests, the fuzz campaign, the accuracy report and the engine checks all come here. A verdict is
one of (contract §9):

    passed       within contract §5's allowances (attention) or bit for bit (write_kv)
    failed       a wrong answer, a wrong shape or dtype, an exception, or a ValueError / TypeError
                 on a valid input ("rejected a valid input")
    unsupported  the implementation raised NotImplementedError: neither passed nor failed
    crashed      the call left the device unusable (a sticky CUDA error), or, in an isolated run
                 (harness/isolation.py), killed its process
    hung         an isolated run did not return within the per-case limit

`crashed` and `hung` count as failures. Every call of an implementation runs with its fresh
allocations poisoned (harness/poison.py) and, on a GPU, is synchronized before judging, so that an
asynchronous device error is the implementation's and not the judge's.
"""

import math
import traceback
from dataclasses import asdict, dataclass, field

import torch

import reference
from harness.cases import DTYPES, AttentionCase, attention_args, build_inputs
from harness.poison import poison_allocations
from harness.records import jsonable
from harness.timing import phase
from harness.tolerance import LEVELS, TOLERANCE, ErrorStats, error_stats
from reference.paged_prefill import prefill_float64
from reference.validation import validate_paged_prefill

# Bit-level views used to compare caches exactly (NaN payloads included).
BIT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FAILURES = ("failed", "crashed", "hung")


@dataclass
class Verdict:
    """The verdict on one case. `ratio` is contract §5's worst gate ratio (<= 1 passes; inf for an
    exception, a crash or a non-finite mismatch); `stats` holds each output's error profile as plain
    values."""

    status: str  # "passed", "failed", "unsupported", "crashed" or "hung" (module docstring)
    ratio: float = 0.0
    message: str = ""
    stats: dict = field(default_factory=dict)
    outputs: tuple | None = field(default=None, repr=False, compare=False)  # (out, lse or None)
    seconds: dict = field(default_factory=dict, repr=False, compare=False)  # harness/timing.py's phases

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def failed(self) -> bool:
        """A failure of any kind: a wrong answer, a crash or a hang."""
        return self.status in FAILURES


def device_unusable(device) -> str | None:
    """Why the CUDA device can no longer run anything (a sticky error), or None; always None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as exc:  # noqa: BLE001  (whatever the driver reports)
        first_line = (str(exc).strip().splitlines() or [""])[0]  # the rest is CUDA's generic advice
        return f"{type(exc).__name__}: {first_line}"
    return None


def raised(exc: BaseException, device) -> Verdict:
    """The verdict on an exception of the implementation: failed, or crashed when the device is gone."""
    tail = "".join(traceback.format_exception(exc)[-3:]).strip()
    broken = device_unusable(device)
    if broken:
        return Verdict("crashed", math.inf, f"CRASH: the device is unusable after the call ({broken})")
    if isinstance(exc, (ValueError, TypeError)):
        message = f"rejected a valid input: {type(exc).__name__}: {exc}"
    else:
        message = f"raised {type(exc).__name__}: {exc}"
    return Verdict("failed", math.inf, message, {"traceback": tail})


def unsupported(exc: NotImplementedError) -> Verdict:
    return Verdict("unsupported", message=f"NotImplementedError: {exc}")


def guarded_call(fn, device):
    """fn() with fresh allocations poisoned, synchronized on a GPU: asynchronous device errors of the
    implementation surface inside the call, as its own."""
    with poison_allocations():
        result = fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return result


@dataclass(frozen=True)
class Oracle:
    """The float64 oracle of one attention case and its allowances (contract §5).

    out [num_tokens, num_heads, head_dim] and lse [num_tokens, num_heads], float64 and unrounded;
    `bounds[name]` is that output's allowances at the two LEVELS of harness/tolerance.py (every
    element; the expected error), float64 of its shape; `rows` is
    the number of judged rows (non-empty, finite).
    """

    out: torch.Tensor
    lse: torch.Tensor
    bounds: dict
    rows: int


def oracle(inputs: dict) -> Oracle:
    """The oracle and its allowances on built case inputs, for the dtype of their q."""
    q = inputs["q"]
    batch = validate_paged_prefill(
        *attention_args(inputs, decode=False), scale=inputs["scale"], layout=inputs["layout"]
    )
    args = (batch, q, inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["layout"])
    out, lse, ((out_b, lse_b), (out_b1, lse_b1)) = prefill_float64(*args, TOLERANCE[q.dtype], LEVELS)
    bounds = {"out": (out_b, out_b1), "lse": (lse_b, lse_b1)}
    return Oracle(out, lse, bounds, int(torch.isfinite(lse).sum()))


def stats_dict(s: ErrorStats) -> dict:
    return jsonable(asdict(s))


def _describe_failure(op: str, name: str, s: ErrorStats) -> str:
    return (
        f"{op} {name}: max err {s.max_err:.3e}, worst ratio {s.max_ratio:.3g} at {s.worst_index} "
        f"(allowed there {s.allowed_at_worst:.3e}), mean err {s.mean_err:.3e} (allowed "
        f"{s.allowed_mean:.3e}), {s.over_tolerance}/{s.numel} over, {s.bad_nonfinite} non-finite "
        "mismatches (NaN exactly where the oracle has NaN)"
    )


def judge_outputs(op: str, outputs, truth: Oracle, dtype: torch.dtype, shape) -> Verdict:
    """Judges (out, lse or None) against the oracle and its allowances (contract §5)."""
    out, lse = outputs
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != tuple(shape):
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        return Verdict(
            "failed", math.inf, f"{op} out: expected {dtype} {tuple(shape)}, got {got}", outputs=outputs
        )
    checks = {"out": error_stats(out, truth.out, *truth.bounds["out"], truth.rows)}
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != truth.lse.shape:
            got = f"{lse.dtype} {tuple(lse.shape)}" if isinstance(lse, torch.Tensor) else type(lse).__name__
            return Verdict(
                "failed",
                math.inf,
                f"{op} lse: expected float32 {tuple(truth.lse.shape)}, got {got}",
                outputs=outputs,
            )
        checks["lse"] = error_stats(lse, truth.lse, *truth.bounds["lse"], truth.rows)
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
    impl, case: AttentionCase, *, decode: bool, device, inputs=None, truth=None, check_without_lse=False
) -> Verdict:
    """Runs `case` through the implementation's paged_prefill (or paged_decode) and judges it.

    With the `lse` capability the log-sum-exp is judged too; with `check_without_lse`, a second call
    without `return_lse` must give the same `out`, bit for bit. `inputs` and `truth` (the `Oracle`)
    may be passed in when the caller has built them (the report reuses one oracle for several
    implementations).
    """
    op = "paged_decode" if decode else "paged_prefill"
    refused = impl.refuses(case, op)
    if refused:
        return Verdict("unsupported", message=refused)
    inputs = build_inputs(case, device) if inputs is None else inputs
    with_lse = impl.capabilities.lse
    try:
        with phase("implementation"):
            outputs = guarded_call(lambda: call_attention(impl, inputs, decode, with_lse), device)
            if check_without_lse and with_lse:
                alone = guarded_call(lambda: call_attention(impl, inputs, decode, False), device)[0]
            else:
                alone = None
    except NotImplementedError as exc:
        return unsupported(exc)
    except Exception as exc:  # noqa: BLE001  (any exception of the implementation is a finding)
        return raised(exc, device)
    if truth is None:
        with phase("oracle"):
            truth = oracle(inputs)
    verdict = judge_outputs(op, outputs, truth, DTYPES[case.dtype], inputs["q"].shape)
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
    with phase("oracle"):
        reference.write_kv(
            inputs["k"], inputs["v"], expect["k_cache"], expect["v_cache"], inputs["slot_mapping"]
        )
    device = got["k_cache"].device
    try:
        with phase("implementation"):
            guarded_call(
                lambda: impl.write_kv(
                    inputs["k"], inputs["v"], got["k_cache"], got["v_cache"], inputs["slot_mapping"]
                ),
                device,
            )
    except NotImplementedError as exc:
        return unsupported(exc)
    except Exception as exc:  # noqa: BLE001
        return raised(exc, device)
    wrong = {k: int((bits(got[k]) != bits(expect[k])).sum()) for k in got}
    stats = {"mismatched_elements": wrong, "numel": expect["k_cache"].numel()}
    if not any(wrong.values()):
        return Verdict("passed", 0.0, "", stats, (got["k_cache"], got["v_cache"]))
    return Verdict("failed", math.inf, f"write_kv: mismatched cache elements {wrong}", stats)
