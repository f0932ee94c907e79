"""Cold-vs-warm equivalence of two engine runs: contract §6's correctness property as one rule.

The engine runs the same requests with prefix caching off (cold) and on (warm). Request by request,
the warm run must match the cold one:

- every generated step's logits are within the float32 floor of the cold run's (2 ulp at the
  logits' magnitude + 1e-5, harness/tolerance.py), at every element and on average: the runs differ
  only by float32 GEMMs over other batch shapes, and attention within contract §5's allowance;
- the greedy tokens are identical wherever the cold run's top-2 logit gap exceeds that allowance.
  At the first step where they differ within it, the sequences legitimately diverge, and the rest of
  that request is not compared;
- the cold run reports no cached tokens.

Both tests/engine/test_engine.py and the fuzz campaign's engine target (fuzz/engine_target.py) judge
with `compare_cold_warm`, so the two can never drift apart.
"""

import math
from dataclasses import dataclass

import torch

from harness.tolerance import float32_floor


@dataclass(frozen=True)
class LogitsGap:
    """warm logits against cold ones: the worst element, the allowance, and whether NaN/Inf differ."""

    max_err: float
    allowed: float
    nonfinite_mismatch: bool

    @property
    def ratio(self) -> float:
        return math.inf if self.nonfinite_mismatch else self.max_err / self.allowed

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0


def logits_gap(warm: torch.Tensor, cold: torch.Tensor) -> LogitsGap:
    """Compares two float32 logits vectors [vocab_size] by the module's rule."""
    warm, cold = warm.double(), cold.double()
    finite = torch.isfinite(cold)
    mismatch = bool(
        (finite != torch.isfinite(warm)).any() or (~finite & (warm != cold) & ~cold.isnan()).any()
    )
    err = (warm - cold).abs()[finite & torch.isfinite(warm)]
    magnitude = float(cold[finite].abs().max()) if bool(finite.any()) else 0.0
    return LogitsGap(float(err.max()) if err.numel() else 0.0, float32_floor(magnitude), mismatch)


@dataclass(frozen=True)
class Equivalence:
    """The outcome of one comparison: steps compared, the worst logits gate ratio (contract §5,
    <= 1 passes) and the first violation in words ("" when the runs are equivalent)."""

    compared: int
    worst_ratio: float
    problem: str = ""

    @property
    def equivalent(self) -> bool:
        return not self.problem


def _logits(output, run: str, n: int) -> list:
    if output.logits is None:
        raise ValueError(f"request {n} of the {run} run has no logits: build the LLM with record_logits=True")
    return output.logits


def compare_cold_warm(cold: list, warm: list) -> Equivalence:
    """Judges warm (prefix caching on) against cold (off) by the module's rule.

    Args:
        cold, warm: list[RequestOutput], the same requests in the same order, recorded with
            `record_logits=True` (logits: one float32 [vocab_size] tensor per generated token).
    Returns:
        An `Equivalence`; it stops at the first violation.
    """
    if len(cold) != len(warm):
        return Equivalence(0, 0.0, f"{len(cold)} cold outputs vs {len(warm)} warm outputs")
    compared, worst = 0, 0.0
    for n, (c, w) in enumerate(zip(cold, warm, strict=True)):
        if c.num_cached_tokens:
            return Equivalence(
                compared, worst, f"request {n}: the cold run reports {c.num_cached_tokens} cached tokens"
            )
        cold_logits, warm_logits = _logits(c, "cold", n), _logits(w, "warm", n)
        diverged = False
        for step, (cl, wl) in enumerate(zip(cold_logits, warm_logits, strict=False)):
            s = logits_gap(wl, cl)
            worst = max(worst, s.ratio)
            compared += 1
            if not s.passed:
                extra = ", NaN or Inf where the cold run has none" if s.nonfinite_mismatch else ""
                return Equivalence(
                    compared,
                    worst,
                    f"request {n} step {step}: logits differ by {s.max_err:.3e} "
                    f"(allowed {s.allowed:.3e}{extra})",
                )
            if c.token_ids[step] != w.token_ids[step]:
                top2 = cl.double().topk(2).values
                gap = float(top2[0] - top2[1])
                if gap > s.allowed:
                    return Equivalence(
                        compared,
                        worst,
                        f"request {n} step {step}: tokens {c.token_ids[step]} (cold) vs {w.token_ids[step]} "
                        f"(warm) with a top-2 gap of {gap:.3e} > the allowance {s.allowed:.3e}",
                    )
                diverged = True  # a near-tie: past it the contexts differ, so nothing later is compared
                break
        lengths = (len(c.token_ids), len(w.token_ids), len(cold_logits), len(warm_logits))
        if not diverged and len(set(lengths)) != 1:
            return Equivalence(
                compared,
                worst,
                f"request {n}: {lengths[0]} cold vs {lengths[1]} warm tokens "
                f"({lengths[2]} vs {lengths[3]} logits recorded)",
            )
    return Equivalence(compared, worst)
