"""The tolerance rule of contract §5 (docs/contract.md) and the one comparison helper built on it.

A kernel result `out` is accepted against the float64 oracle `ref` when

    max |out - ref|  <=  MAX_FACTOR  * max |base - ref|   + floor
    mean|out - ref|  <=  MEAN_FACTOR * mean|base - ref|  + floor

where `base` is the oracle computed in the input dtype and `floor` is twice the float32 rounding
step at the output's magnitude plus 1e-5. NaN or Inf in `out` where `ref` is finite never passes;
where `ref` is NaN (a row that sees a non-finite input, contract §4) `out` must be NaN too, and where
`ref` is infinite (lse of an empty row) `out` must equal it exactly.
"""

import math
from dataclasses import dataclass

import torch

# (MAX_FACTOR, MEAN_FACTOR) per input dtype. Changing one needs a written reason (contract §5).
TOLERANCE = {
    torch.float32: (2.0, 1.5),
    torch.float16: (2.0, 1.5),
    torch.bfloat16: (2.0, 1.5),
}
FLOOR_ABS = 1e-5
FLOAT32_MANTISSA_BITS = 23


def float32_floor(magnitude: float) -> float:
    """Twice the float32 rounding step (ulp) at `magnitude`, plus 1e-5."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return FLOOR_ABS
    ulp = 2.0 ** (math.floor(math.log2(magnitude)) - FLOAT32_MANTISSA_BITS)
    return 2.0 * ulp + FLOOR_ABS


@dataclass(frozen=True)
class ErrorStats:
    """What one comparison measured; `ratio` <= 1 on both gates means accepted."""

    max_err: float
    mean_err: float
    base_max_err: float
    base_mean_err: float
    floor: float
    allowed_max: float
    allowed_mean: float
    max_ratio: float  # max_err / allowed max
    mean_ratio: float  # mean_err / allowed mean
    bad_nonfinite: int  # out not finite where ref is, not NaN where ref is NaN, or infinities differ
    over_tolerance: int  # elements whose error exceeds the allowed max
    worst_index: tuple
    numel: int

    @property
    def ratio(self) -> float:
        return max(self.max_ratio, self.mean_ratio)

    @property
    def passed(self) -> bool:
        return self.bad_nonfinite == 0 and self.max_ratio <= 1.0 and self.mean_ratio <= 1.0


def error_stats(out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, dtype: torch.dtype) -> ErrorStats:
    """Measures `out` and `base` against `ref` on one device, with a single sync at the end."""
    if out.shape != ref.shape or base.shape != ref.shape:
        raise ValueError(
            f"shapes differ: out {tuple(out.shape)}, ref {tuple(ref.shape)}, base {tuple(base.shape)}"
        )
    max_factor, mean_factor = TOLERANCE[dtype]
    out, ref, base = (t.detach().double().to(ref.device) for t in (out, ref, base))
    finite, ref_nan = torch.isfinite(ref), torch.isnan(ref)
    infinite = ~finite & ~ref_nan
    bad = (finite & ~torch.isfinite(out)) | (ref_nan & ~torch.isnan(out)) | (infinite & (out != ref))
    err = torch.where(finite, (out - ref).abs(), torch.zeros_like(ref))
    base_err = torch.where(finite, (base - ref).abs(), torch.zeros_like(ref))
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    n = max(int(finite.sum()), 1)
    magnitude = float(torch.where(finite, ref.abs(), torch.zeros_like(ref)).max()) if ref.numel() else 0.0
    floor = float32_floor(magnitude)
    max_err = float(err.max()) if err.numel() else 0.0
    mean_err = float(err.sum()) / n
    base_max, base_mean = (float(base_err.max()) if base_err.numel() else 0.0), float(base_err.sum()) / n
    allowed_max = max_factor * base_max + floor
    allowed_mean = mean_factor * base_mean + floor
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape)) if err.numel() else ()
    return ErrorStats(
        max_err=max_err,
        mean_err=mean_err,
        base_max_err=base_max,
        base_mean_err=base_mean,
        floor=floor,
        allowed_max=allowed_max,
        allowed_mean=allowed_mean,
        max_ratio=max_err / allowed_max,
        mean_ratio=mean_err / allowed_mean,
        bad_nonfinite=int(bad.sum()),
        over_tolerance=int((err > allowed_max).sum()),
        worst_index=worst,
        numel=ref.numel(),
    )


def assert_close(
    name: str, out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, dtype: torch.dtype
) -> ErrorStats:
    """Raises AssertionError with the error profile unless `out` passes contract §5's rule."""
    s = error_stats(out, ref, base, dtype)
    if not s.passed:
        rms = s.mean_err / s.base_mean_err if s.base_mean_err else math.inf
        raise AssertionError(
            f"{name}: max|out-ref| {s.max_err:.3e} (allowed {s.allowed_max:.3e}), "
            f"mean {s.mean_err:.3e} (allowed {s.allowed_mean:.3e}), "
            f"mean-error ratio to base {rms:.2f}, {s.over_tolerance}/{s.numel} over tolerance, "
            f"{s.bad_nonfinite} non-finite mismatches, worst at {s.worst_index}"
        )
    return s
