"""Measurements of the accuracy report (reports/accuracy.py): SPEC section 5's quantities per case.

`Runner` runs one case on each backend of fuzz/backends.py against the oracle (computed once per
case), `measure` turns one output into the report's columns, `aggregate` folds a row's cases.
"""

import math

import torch

# ULPs are counted where |ref| >= this share of max|ref| (near zero the ULP shrinks without bound).
ULP_MAGNITUDE_CUTOFF = 2.0**-10


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers whose differences count ULPs between floats of t's dtype (sign-magnitude unfolded)."""
    from fuzz.targets import bits

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


def measure(out, ref, base, dtype: torch.dtype) -> dict:
    """SPEC section 5's quantities for one output tensor (inputs of `dtype`), plus ULPs and NaN/Inf."""
    from tests.tolerance import error_stats

    s = error_stats(out, ref, base, dtype)
    return dict(
        max_err=s.max_err,
        mean_err=s.mean_err,
        base_max_err=s.base_max_err,
        base_mean_err=s.base_mean_err,
        max_to_base=s.max_err / s.base_max_err if s.base_max_err else (0.0 if s.max_err == 0 else math.inf),
        mean_to_base=s.mean_err / s.base_mean_err
        if s.base_mean_err
        else (0.0 if s.mean_err == 0 else math.inf),
        gate=s.ratio if s.bad_nonfinite == 0 else math.inf,
        passed=s.passed,
        max_ulp=max_ulp(out, ref),
        over=s.over_tolerance,
        numel=s.numel,
        nan=int(torch.isnan(out).sum()),
        inf=int(torch.isinf(out).sum()),
    )


class Runner:
    """Runs cases on the backends, caching the oracle per case."""

    def __init__(self, device: str, backends: tuple[str, ...]):
        from fuzz.backends import get_backend, load_ops

        self.device = device
        self.ops, self.unavailable = {}, {}
        for name in backends:
            ops, reason = load_ops(name)
            if ops is None:
                self.unavailable[name] = reason
            else:
                self.ops[name] = (ops, get_backend(name))
        self._oracle = {}

    def oracle(self, case, decode: bool):
        from tests.oracle import oracle_and_base
        from tests.strategies import build_inputs

        key = (case, decode)
        if key not in self._oracle:
            self._oracle.clear()  # one case at a time: GPU-sized oracles are large
            inputs = build_inputs(case, self.device)
            self._oracle[key] = (inputs, oracle_and_base(inputs))
        return self._oracle[key]

    def attention(self, name: str, case, decode: bool) -> dict:
        """Measures one backend on one case: {"out": ..., "lse": ...} or {"error": ...}."""
        ops, backend = self.ops[name]
        if case.dtype not in backend.dtypes_on(self.device):
            return {"error": "n/a: dtype not checked on this device"}
        if case.layout.kind not in backend.layout_kinds:
            return {"error": "n/a: layout not supported"}
        fn = ops.paged_decode if decode else ops.paged_prefill
        if fn is None:
            return {"error": "n/a: no such operator"}
        inputs, ((ref_out, ref_lse), (base_out, base_lse)) = self.oracle(case, decode)
        args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
        if not decode:
            args.append(inputs["query_start_loc"])
        try:
            result = fn(*args, scale=inputs["scale"], layout=inputs["layout"], return_lse=backend.has_lse)
        except Exception as exc:  # noqa: BLE001  (a crash is a finding, reported in the table)
            return {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        out, lse = result if backend.has_lse else (result, None)
        dtype = inputs["q"].dtype
        row = {"out": measure(out, ref_out, base_out, dtype)}
        if lse is not None:
            row["lse"] = measure(lse, ref_lse, base_lse, dtype)
        return row

    def write_kv(self, name: str, case) -> dict:
        import reference
        from fuzz.targets import bits, write_kv_inputs

        ops, backend = self.ops[name]
        if ops.write_kv is None:
            return {"error": "n/a: no such operator"}
        if case.dtype not in backend.dtypes_on(self.device):
            return {"error": "n/a: dtype not checked on this device"}
        x = write_kv_inputs(case, self.device)
        want = [x["k_cache"].clone(), x["v_cache"].clone()]
        got = [x["k_cache"].clone(), x["v_cache"].clone()]
        reference.write_kv(x["k"], x["v"], *want, x["slot_mapping"])
        try:
            ops.write_kv(x["k"], x["v"], *got, x["slot_mapping"])
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        pairs = list(zip(got, want, strict=True))
        wrong = sum(int((bits(g) != bits(w)).sum()) for g, w in pairs)
        err = max(float(torch.nan_to_num((g.double() - w.double()).abs(), nan=0.0).max()) for g, w in pairs)
        # Structural output: exact or wrong, so the error ratios are 0 or infinite.
        worst = math.inf if wrong else 0.0
        stats = dict(max_err=err, mean_err=0.0, max_to_base=worst, mean_to_base=worst, gate=worst)
        stats |= dict(
            passed=not wrong, max_ulp=None, over=wrong, numel=sum(w.numel() for w in want), nan=0, inf=0
        )
        return {"out": stats}


def aggregate(measures: list[dict]) -> dict:
    """One table row from per-case measures: worst case for max-type columns, sums for counts."""
    rows = [m["out"] for m in measures if "out" in m]
    errors = [m["error"] for m in measures if "error" in m]
    if not rows:
        return {"error": errors[0] if errors else "not run"}
    numel = sum(r["numel"] for r in rows)
    agg = dict(
        cases=len(rows),
        max_err=max(r["max_err"] for r in rows),
        mean_err=sum(r["mean_err"] * r["numel"] for r in rows) / max(numel, 1),
        max_to_base=max(r["max_to_base"] for r in rows),
        mean_to_base=max(r["mean_to_base"] for r in rows),
        gate=max(r["gate"] for r in rows),
        max_ulp=max((r["max_ulp"] for r in rows if r["max_ulp"] is not None), default=None),
        over_share=sum(r["over"] for r in rows) / max(numel, 1),
        nan=sum(r["nan"] for r in rows),
        inf=sum(r["inf"] for r in rows),
        passed=all(r["passed"] for r in rows) and not errors,
    )
    lse = [m["lse"] for m in measures if "lse" in m]
    if lse:
        agg["lse_gate"] = max(r["gate"] for r in lse)
        agg["lse_max_err"] = max(r["max_err"] for r in lse)
        agg["passed"] = agg["passed"] and all(r["passed"] for r in lse)
    if errors:
        agg["error"] = errors[0]
    return agg
