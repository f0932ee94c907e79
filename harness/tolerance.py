"""The tolerance rule of contract §5 (docs/contract.md): the one table of its constants, and its gates.

The oracle evaluates, per output element, how far a kernel of the admissible family may land from
the exact float64 result (reference/error_bound.py, derivation in contract §5). `error_stats` judges
an output against those allowances with two gates:

    max gate    |out - ref| <= bound(LAMBDA)              at every element
    mean gate   mean |out - ref| <= mean bound(lambda_N)  lambda_N = min(LAMBDA, 1 + LAMBDA / sqrt(N))

where N is the number of judged rows (non-empty, finite). The per-element bound holds with
probability >= 1 - 2 n exp(-LAMBDA^2 / 2) per bounded sum; the mean gate uses that independent
rounding errors average out over many rows, which keeps a small systematic error (a few extra keys,
a slightly wrong scale) visible in 16-bit dtypes, where one element's allowance is wide. NaN or Inf
in `out` where `ref` is finite never passes; where `ref` is NaN (a row that sees a non-finite input,
contract §4) `out` must be NaN too, and where `ref` is infinite (lse of an empty row) `out` must
equal it exactly.
"""

import math
from dataclasses import dataclass

import torch

from reference.error_bound import RoundingModel, unit_roundoff

# lambda of the probabilistic bounds: a bound fails with probability <= 2 n exp(-LAMBDA^2 / 2),
# below 1e-10 for n <= 32k. The mean gate's lambda_N interpolates from 1 (many rows) up to it.
LAMBDA = 8.0
FLOAT32_U = unit_roundoff(torch.float32)
# Half the smallest subnormal is the error of rounding a tiny value; 2^-126, the smallest normal
# float32, covers a kernel that flushes tiny float32 (and bfloat16, which shares its range) to zero.
FLUSH_TO_ZERO = 2.0**-126
FLOAT16_TINY = 2.0**-25


def _model(p_round: float, tiny: float, out_round: float) -> RoundingModel:
    return RoundingModel(
        u=FLOAT32_U,
        p_round=p_round,
        p_tiny=tiny,
        out_round=out_round,
        out_tiny=tiny,
        lse_round=FLOAT32_U,
        # Roundings counted per score (contract §5): scale to float32, scale * log2(e), the product
        # with q.k, the max subtraction (or the separate m * c of a fused s * c - m * c).
        c_score=5.0,
        # exp2 / exp in hardware: within 2 ulp (4 u) of the exact result.
        c_exp=4.0,
        # lse = (m * c + log2(l)) * ln(2): the product, log2 within 2 ulp, the sum and the last product.
        c_lse=6.0,
    )


# The one table of contract §5's constants, per input dtype. P stays in float32 for float32 inputs.
TOLERANCE = {
    torch.float32: _model(0.0, FLUSH_TO_ZERO, FLOAT32_U),
    torch.float16: _model(unit_roundoff(torch.float16), FLOAT16_TINY, unit_roundoff(torch.float16)),
    torch.bfloat16: _model(unit_roundoff(torch.bfloat16), FLUSH_TO_ZERO, unit_roundoff(torch.bfloat16)),
}
# The levels (lambda, share of each single final rounding) the oracle evaluates its bounds at: the
# max gate's, a bound on every element; and the expected error of one element (lambda 1, half a
# rounding), the mean gate's floor. The mean gate interpolates between the two by lambda_N (the
# bound is convex in lambda, so the chord lies above it).
LEVELS = ((LAMBDA, 1.0), (1.0, 0.5))

# Engine logits (contract §6, harness/engine_check.py): twice the float32 step at their magnitude.
FLOOR_ABS = 1e-5
FLOAT32_MANTISSA_BITS = 23


def float32_floor(magnitude: float) -> float:
    """Twice the float32 rounding step (ulp) at `magnitude`, plus 1e-5."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return FLOOR_ABS
    ulp = 2.0 ** (math.floor(math.log2(magnitude)) - FLOAT32_MANTISSA_BITS)
    return 2.0 * ulp + FLOOR_ABS


def mean_gate_lambda(rows: int) -> float:
    """lambda_N of the mean gate for N judged rows."""
    return min(LAMBDA, 1.0 + LAMBDA / math.sqrt(max(rows, 1)))


@dataclass(frozen=True)
class ErrorStats:
    """What one comparison measured; `ratio` <= 1 (and no non-finite mismatch) means accepted."""

    max_err: float
    mean_err: float
    allowed_at_worst: float  # the max gate's bound at the element of the worst ratio
    allowed_mean: float  # the mean gate's allowance
    max_ratio: float  # worst |out - ref| / bound over the elements
    mean_ratio: float  # mean |out - ref| / allowed_mean
    bad_nonfinite: int  # out not finite where ref is, not NaN where ref is NaN, or infinities differ
    over_tolerance: int  # elements whose error exceeds their bound
    worst_index: tuple
    numel: int
    rows: int

    @property
    def ratio(self) -> float:
        return max(self.max_ratio, self.mean_ratio)

    @property
    def passed(self) -> bool:
        return self.bad_nonfinite == 0 and self.max_ratio <= 1.0 and self.mean_ratio <= 1.0


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """err / bound elementwise, 0 where both are 0 and inf where only the bound is."""
    return torch.where(err > 0, err / bound, torch.zeros_like(err))


def error_stats(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, bound_1: torch.Tensor, rows: int):
    """Judges `out` against the float64 oracle `ref` with its allowances, on one device, one sync.

    Args:
        out: the implementation's output, any float dtype; ref: float64 of the same shape.
        bound, bound_1: float64 per-element allowances at the two LEVELS (the oracle's, contract §5).
        rows: N of the mean gate, the number of judged (non-empty, finite) rows.
    Returns:
        An `ErrorStats`.
    """
    if out.shape != ref.shape or bound.shape != ref.shape or bound_1.shape != ref.shape:
        raise ValueError(
            f"shapes differ: out {tuple(out.shape)}, ref {tuple(ref.shape)}, bound {tuple(bound.shape)}"
        )
    out = out.detach().to(device=ref.device, dtype=torch.float64)
    finite, ref_nan = torch.isfinite(ref), torch.isnan(ref)
    infinite = ~finite & ~ref_nan
    bad = (finite & ~torch.isfinite(out)) | (ref_nan & ~torch.isnan(out)) | (infinite & (out != ref))
    zero = torch.zeros((), dtype=torch.float64, device=ref.device)
    err = torch.where(finite, (out - ref).abs(), zero)
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    ratios = _ratio(err, torch.where(finite, bound, zero))
    share = (mean_gate_lambda(rows) - 1.0) / (LAMBDA - 1.0)
    mean_bound = torch.where(finite, bound_1 + share * (bound - bound_1), zero)
    n = max(int(finite.sum()), 1)
    max_ratio = float(ratios.max()) if ratios.numel() else 0.0
    mean_err, allowed_mean = float(err.sum()) / n, float(mean_bound.sum()) / n
    worst = torch.unravel_index(ratios.argmax(), ratios.shape) if ratios.numel() else ()
    return ErrorStats(
        max_err=float(err.max()) if err.numel() else 0.0,
        mean_err=mean_err,
        allowed_at_worst=float(bound[worst]) if ratios.numel() else 0.0,
        allowed_mean=allowed_mean,
        max_ratio=max_ratio,
        mean_ratio=mean_err / allowed_mean if allowed_mean > 0 else (0.0 if mean_err == 0 else math.inf),
        bad_nonfinite=int(bad.sum()),
        over_tolerance=int((ratios > 1.0).sum()),
        worst_index=tuple(int(i) for i in worst),
        numel=ref.numel(),
        rows=rows,
    )
