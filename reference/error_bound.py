"""The rounding-error model of contract §5: how far a correct kernel's attention may be from the oracle.

A kernel of the admissible family (contract §5) computes `softmax(scale * q k^T) v` in float32
arithmetic (unit roundoff `u`): any order and tiling of its sums, exp or exp2 with the scale folded
into log2(e), online rescaling, split-K, P rounded to the input dtype before P·V, one rounding of
`out`. `attention_bounds` evaluates, per output element and from the float64 oracle's own
intermediates, an upper bound on how far any such kernel can land from the exact result. The
derivation is in docs/contract.md §5; in short, for one row (a query and a head) with visible keys j:

    s_j = scale * q.k_j,  p_j = softmax(s)_j,  o = sum_j p_j v_j,  n = number of visible keys
    Delta_j = g(D) * |scale| * sum_d |q_d k_jd|            the q.k dot product (any order)
            + C_SCORE * u * (|s_j| + |max s|)              scale folding, max subtraction
            + C_EXP * u * (1 + lam * sqrt(n))              exp / exp2, and up to n rescalings
    |out - o| <= e^max(Delta) sqrt(sum_j p_j expm1(Delta_j)^2) sqrt(sum_j p_j (v_j - o)^2)
               + e^(2 max Delta) (g(2n + 2) (sum_j p_j |v_j| + |o|) + P-rounding term)
               + (u_out + u) |o| + tiny_out

with g(n) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1, the probabilistic gamma of Higham & Mary
(SIAM J. Sci. Comput. 41(5), 2019): any order of n rounded operations, errors modelled as
independent and mean-zero, holds with probability >= 1 - 2 n exp(-lam^2 / 2). The P-rounding term is
min(lam ||b||_2, ||b||_1) with b_j = (u_p p_j + tiny_p / L) (|v_j| + |o|) (Hoeffding's bound on a sum
of independent roundings, or the worst case when that is smaller). The lse gets the matching terms.
Constants and unit roundoffs come in as a `RoundingModel`; their one table is harness/tolerance.py.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoundingModel:
    """The constants of the model for one input dtype (values: harness/tolerance.py's table).

    u: float32 arithmetic. p_round, p_tiny: relative and absolute error of rounding one weight to the
    input dtype before P·V (p_tiny covers subnormals and flush to zero; p_round 0 when P stays in
    float32). out_round, out_tiny: the one rounding of out to its dtype. lse_round: the rounding of
    lse to float32. c_score, c_exp, c_lse: how many roundings of their kind the derivation counts.
    (The lambda of the probabilistic bounds comes with each evaluation: `attention_bounds`' level.)
    """

    u: float
    p_round: float
    p_tiny: float
    out_round: float
    out_tiny: float
    lse_round: float
    c_score: float
    c_exp: float
    c_lse: float


def gamma(n: torch.Tensor, u: float, lam: float) -> torch.Tensor:
    """Higham & Mary's probabilistic gamma~_n(lam) for n rounded operations (elementwise in n)."""
    return torch.expm1(lam * torch.sqrt(n) * u + n * (u * u / (1.0 - u)))


def attention_bounds(
    q, k, v, mask, scale: float, scores, probs, out, pivot, lse, model: RoundingModel, level: tuple
):
    """Per-element allowances of one block of rows, from the oracle's float64 intermediates.

    Args:
        q: [num_heads, num_queries, head_dim] and k, v: [num_heads, num_keys, head_dim], float64
            with non-finite values zeroed (KV heads already repeated per query head).
        mask: bool [num_heads, num_queries, num_keys]; scale: the score scale.
        scores: [num_heads, num_queries, num_keys], scale * q.k (-inf where masked).
        probs: [num_heads, num_queries, num_keys] softmax weights (0 where masked).
        out: [num_heads, num_queries, head_dim]; pivot, lse: [num_heads, num_queries, 1], the row
            maximum of the scaled scores (0 for an empty row) and the log-sum-exp.
        model: the constants; level: (lam, share): the lambda of the probabilistic terms, and the share
            of its worst case that each single final rounding (of out, of lse) counts for: 1 for a
            bound on every element, 1/2 for the mean error of many (a rounding to nearest errs by
            at most half a unit in the last place, by a quarter on average).
    Returns:
        out_bound [num_heads, num_queries, head_dim] and lse_bound [num_heads, num_queries, 1],
        float64, 0 on rows with no visible key.
    """
    u = model.u
    lam, share = level
    head_dim = q.shape[-1]
    has_key = mask.any(-1, keepdim=True)
    n = mask.sum(-1, keepdim=True).to(q.dtype)
    magnitude = torch.einsum("hqd,hkd->hqk", q.abs(), k.abs()) * abs(scale)
    dot = gamma(torch.tensor(float(head_dim), dtype=q.dtype), u, lam) * magnitude
    delta = (
        dot
        + model.c_score * u * (torch.where(mask, scores.abs(), 0.0) + pivot.abs())
        + model.c_exp * u * (1 + lam * n.sqrt())
    )
    delta = torch.where(mask, delta, torch.zeros_like(delta))
    delta_max = delta.amax(-1, keepdim=True) if delta.shape[-1] else torch.zeros_like(n)
    # Consistent perturbations of the weights (numerator and denominator alike) move out by
    # (1/Z) sum_j p_j expm1(d_j) (v_j - o): Cauchy-Schwarz keeps the cancellation of a one-hot row.
    spread = (torch.einsum("hqk,hkd->hqd", probs, v * v) - out * out).clamp_min(0)
    weighted = (probs * torch.expm1(delta) ** 2).sum(-1, keepdim=True)
    scores_term = torch.exp(delta_max) * weighted.sqrt() * spread.sqrt()
    # Accumulation of P.V and of l: at most n additions, n rescalings and a split-K combine each.
    accumulate = gamma(2 * n + 2, u, lam)
    abs_v = v.abs()
    accumulate_term = accumulate * (torch.einsum("hqk,hkd->hqd", probs, abs_v) + out.abs())
    # P rounded to the input dtype: per key (u_p p_j + tiny / L) (|v_j| + |o|).
    denom = torch.exp(lse - pivot)  # L, the sum of exp(s_j - max)
    c = torch.where(mask, model.p_round * probs + model.p_tiny / denom, torch.zeros_like(probs))
    c2 = c * c
    l1 = torch.einsum("hqk,hkd->hqd", c, abs_v) + out.abs() * c.sum(-1, keepdim=True)
    l2 = (
        torch.einsum("hqk,hkd->hqd", c2, v * v)
        + 2 * out.abs() * torch.einsum("hqk,hkd->hqd", c2, abs_v)
        + out * out * c2.sum(-1, keepdim=True)
    )
    rounding_term = torch.minimum(lam * l2.sqrt(), l1)
    second_order = torch.exp(2 * delta_max)
    out_bound = (
        scores_term
        + second_order * (accumulate_term + rounding_term)
        + share * ((model.out_round + u) * out.abs() + model.out_tiny)
    )
    lse_scores = torch.log((probs * torch.exp(delta)).sum(-1, keepdim=True).clamp_min(1.0))
    lse_rounding = torch.minimum(lam * c2.sum(-1, keepdim=True).sqrt(), c.sum(-1, keepdim=True))
    finite_lse = torch.where(has_key, lse, torch.zeros_like(lse))
    lse_bound = (
        lse_scores
        + accumulate / (1 - accumulate)
        + lse_rounding
        + share
        * (model.c_lse * u * (pivot.abs() + finite_lse.abs() + 1) + model.lse_round * finite_lse.abs())
    )
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    return torch.where(has_key, out_bound, zero), torch.where(has_key, lse_bound, zero)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a floating dtype: half the distance from 1 to the next larger number."""
    return torch.finfo(dtype).eps / 2
