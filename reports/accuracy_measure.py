"""Measurements of the accuracy report (reports/accuracy.py): every case judged by harness.judge.

`load_implementations` looks the requested names up in the registry (an implementation that cannot be
loaded is kept with the reason), `Runner` builds a case's inputs and oracle once and hands them to
`judge_attention` / `judge_write_kv` for every implementation, `columns` turns a verdict into the
report's extra columns (ratios to base, max ULP, share over tolerance, NaN/Inf) and `aggregate` folds
the verdicts of one table row. Judging itself (contract §5's rule) happens in harness.judge only.
"""

import math
from collections import Counter

import torch

from backends import registry
from harness.cases import build_inputs, write_kv_inputs
from harness.judge import bits, judge_attention, judge_write_kv, oracle

# ULPs are counted where |ref| >= this share of max|ref| (near zero the ULP shrinks without bound).
ULP_MAGNITUDE_CUTOFF = 2.0**-10
# What a row (or matrix cell) shows when the implementation lacks the operator altogether.
NOT_PROVIDED = "not provided"


def load_implementations(names) -> tuple[dict, dict]:
    """({name: Implementation}, {name: why it could not be loaded}) for the requested names."""
    loaded, unavailable = {}, {}
    for name in names:
        try:
            loaded[name] = registry.load(name)
        except Exception as exc:  # noqa: BLE001  (flex on an old torch, a broken user file: say why)
            unavailable[name] = f"{type(exc).__name__}: {exc}"
    return loaded, unavailable


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers whose differences count ULPs between floats of t's dtype (sign-magnitude unfolded)."""
    i = bits(t).long()
    magnitude = i & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(i < 0, -magnitude, magnitude)


def max_ulp(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Max ULP distance in out's dtype between out and ref rounded to it.

    Over finite elements with |ref| >= ULP_MAGNITUDE_CUTOFF * max|ref|: near zero the ULP shrinks
    without bound, so tiny elements would dominate with meaningless counts.
    """
    rounded = ref.to(out.dtype)
    finite = torch.isfinite(out) & torch.isfinite(rounded)
    if not bool(finite.any()):
        return 0
    magnitude = torch.where(finite, ref.double().abs(), torch.zeros_like(ref, dtype=torch.float64))
    finite &= magnitude >= ULP_MAGNITUDE_CUTOFF * float(magnitude.max())
    return int((ordered_bits(out) - ordered_bits(rounded)).abs()[finite].max())


def _number(x) -> float:
    # harness.judge.stats_dict stores non-finite floats as the strings "inf" / "nan".
    return float(x)


def columns(stats: dict, out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The report's columns for one output, from the verdict's stats and the tensor it judged."""
    s = {k: _number(stats[k]) for k in ("max_err", "mean_err", "max_ratio", "mean_ratio")}
    gate = max(s["max_ratio"], s["mean_ratio"])
    return dict(
        s,
        gate=gate if stats["bad_nonfinite"] == 0 else math.inf,
        max_ulp=max_ulp(out, ref),
        over=stats["over_tolerance"],
        numel=stats["numel"],
        nan=int(torch.isnan(out).sum()),
        inf=int(torch.isinf(out).sum()),
    )


class Runner:
    """Judges cases on implementations, building each case's inputs and oracle once for all of them."""

    def __init__(self, device: str):
        self.device = device
        self._cached = {}

    def oracle(self, case):
        """(inputs, harness.judge.Oracle) of an attention case."""
        if case not in self._cached:
            self._cached.clear()  # one case at a time: GPU-sized oracles are large
            inputs = build_inputs(case, self.device)
            self._cached[case] = (inputs, oracle(inputs))
        return self._cached[case]

    def attention(self, impl, case, decode: bool) -> dict:
        """One attention case on one implementation: status, message, and columns where judged."""
        op = "paged_decode" if decode else "paged_prefill"
        if not impl.provides(op):
            return {"status": NOT_PROVIDED, "message": f"{impl.name} provides no {op}"}
        inputs, truth = self.oracle(case)
        v = judge_attention(impl, case, decode=decode, device=self.device, inputs=inputs, truth=truth)
        result = {"status": "failed" if v.failed else v.status, "message": v.message}
        if "out" in v.stats and v.outputs is not None:
            out, lse = v.outputs
            result["out"] = columns(v.stats["out"], out, truth.out)
            if "lse" in v.stats:
                result["lse"] = columns(v.stats["lse"], lse, truth.lse)
        return result

    def write_kv(self, impl, case) -> dict:
        """One cache write on one implementation; its output is structural, so exact or wrong."""
        if not impl.provides("write_kv"):
            return {"status": NOT_PROVIDED, "message": f"{impl.name} provides no write_kv"}
        v = judge_write_kv(impl, write_kv_inputs(case, self.device), case)
        result = {"status": "failed" if v.failed else v.status, "message": v.message}
        if "numel" in v.stats:
            wrong = sum(v.stats["mismatched_elements"].values())
            worst = 0.0 if v.status == "passed" else math.inf
            result["out"] = dict(
                max_err=None,
                mean_err=None,
                max_ratio=None,
                mean_ratio=None,
                gate=worst,
                max_ulp=None,
                over=wrong,
                numel=2 * v.stats["numel"],  # k_cache and v_cache
                nan=None,
                inf=None,
            )
        return result


def _worst(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def aggregate(measures: list[dict]) -> dict:
    """One table row from per-case measures: the row's status and case counts, the worst case for
    ratio-type columns, the element-weighted mean error, and sums for counts."""
    counts = Counter(m["status"] for m in measures)
    if counts["failed"]:
        status = "failed"
    elif counts["passed"]:
        status = "passed"
    elif counts["unsupported"]:
        status = "unsupported"
    else:
        status = NOT_PROVIDED
    row = dict(
        status=status,
        cases=len(measures),
        passed=counts["passed"],
        failed=counts["failed"],
        unsupported=counts["unsupported"],
        failures=sorted({m["message"] for m in measures if m["status"] == "failed"}),
        refusals=sorted({m["message"] for m in measures if m["status"] in ("unsupported", NOT_PROVIDED)}),
    )
    outs = [m["out"] for m in measures if "out" in m]
    if outs:
        numel = sum(o["numel"] for o in outs)
        means = [o["mean_err"] * o["numel"] for o in outs if o["mean_err"] is not None]
        row |= dict(
            max_err=_worst(o["max_err"] for o in outs),
            mean_err=sum(means) / max(numel, 1) if means else None,
            max_ratio=_worst(o["max_ratio"] for o in outs),
            mean_ratio=_worst(o["mean_ratio"] for o in outs),
            gate=_worst(o["gate"] for o in outs),
            max_ulp=_worst(o["max_ulp"] for o in outs),
            over_share=sum(o["over"] for o in outs) / max(numel, 1),
            nan=None if outs[0]["nan"] is None else sum(o["nan"] for o in outs),
            inf=None if outs[0]["inf"] is None else sum(o["inf"] for o in outs),
        )
    lses = [m["lse"] for m in measures if "lse" in m]
    if lses:
        row["lse_gate"] = _worst(o["gate"] for o in lses)
        row["lse_max_err"] = _worst(o["max_err"] for o in lses)
    return row
