"""Correct attention kernels that round differently: members of contract §5's admissible family.

Each is plain PyTorch that computes what a FlashAttention-style kernel computes, operation by
operation in float32: key tiles of online softmax with a running max, exp or exp2 with the scale
folded into log2(e), P rounded to the input dtype before P·V, float32 accumulators, split-K partials
combined by rescaling, one rounding of `out`. They differ only in the order and kind of rounding, so
each must pass every test (the suite's false-alarm check, contract §5):

    fa2          exp2 with the scale folded in, max subtracted before scaling, 16-key tiles
    fused_exp2   exp2(s * c - m * c) as one fused multiply-add, keys in reverse, l summed from the
                 rounded P, 32-key tiles
    split_k      natural exp after subtracting the max, four splits of 64-key tiles, combined
    normalize_first  two passes: max and l first, then P / l rounded to the input dtype before P·V

Put one under the whole suite with one string (contract §9):

    nox -s tests -- --backend examples/rounding_family.py:fa2
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import reference
from backends.comparison import decode_via_prefill, sequences
from reference.paged_prefill import token_mask

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class Rounding:
    """How one family member rounds (see the module docstring)."""

    tile: int  # keys per tile of online softmax
    exp2: bool  # exp2 with the scale folded into log2(e), else natural exp of scale * q.k
    fused: bool = False  # exp2(fma(s, c, -m * c)) instead of exp2((s - m) * c)
    reverse: bool = False  # walk the key tiles last to first
    splits: int = 1  # split-K partials, combined at the end
    l_from_rounded: bool = False  # sum l from the P rounded to the input dtype
    normalize_first: bool = False  # two passes: P / l rounded before P·V


def _fp32(x):
    return x.to(torch.float32)


class _Softmax:
    """One member's arithmetic on raw float32 scores q.k: the units of its running max, its exps.

    natural: the max of s = q.k * scale, weights exp(s - m). exp2: the max of the raw q.k, weights
    exp2((q.k - m) * c) with c = scale * log2(e). fused (the Triton tutorial's form): the max of
    q.k * c, weights exp2(fma(q.k, c, -m)) with one rounding.
    """

    def __init__(self, rounding: Rounding, scale: float, device):
        self.r = rounding
        self.c = torch.tensor(scale * (LOG2E if rounding.exp2 else 1.0), dtype=torch.float32, device=device)

    def for_max(self, raw):
        """The tile's scores in the units the running max is kept in."""
        return raw if self.r.exp2 and not self.r.fused else raw * self.c

    def weights(self, raw, m):
        if not self.r.exp2:
            return torch.exp(raw * self.c - m)
        if self.r.fused:
            # One rounding of q.k * c - m: the product is exact in float64 before the subtraction.
            return torch.exp2(_fp32(raw.double() * self.c.double() - m.double()))
        return torch.exp2((raw - m) * self.c)

    def rescale(self, m_old, m_new):
        """exp(m_old - m_new) in natural units: the factor of earlier partial sums."""
        if not self.r.exp2:
            return torch.exp(m_old - m_new)
        return torch.exp2(m_old - m_new) if self.r.fused else torch.exp2((m_old - m_new) * self.c)

    def lse(self, m, l):
        """Natural-log lse from the running max and sum."""
        if not self.r.exp2:
            return m + torch.log(l)
        return ((m if self.r.fused else m * self.c) + torch.log2(l)) * LN2


def _attend(q, k, v, mask, scale: float, out_dtype, rounding: Rounding):
    """One sequence, float32 arithmetic: q [H, Q, D], k, v [H, K, D] (float32), mask bool [H, Q, K].

    Returns out [H, Q, D] in out_dtype and lse [H, Q] float32 (natural log).
    """
    if scale < 0:  # a non-negative scale keeps the max subtraction before scaling exact
        q, scale = -q, -scale
    sm = _Softmax(rounding, scale, q.device)
    heads, num_q, num_k = mask.shape
    tiles = list(range(0, num_k, rounding.tile))[:: -1 if rounding.reverse else 1]
    # A running max that starts far below any score, yet stays finite once multiplied by the scale.
    start_max = -1e30

    def tile(lo):
        hi = min(lo + rounding.tile, num_k)
        return torch.einsum("hqd,hkd->hqk", q, k[:, lo:hi]), mask[:, :, lo:hi], v[:, lo:hi]

    parts = []
    for split in range(rounding.splits):
        m = q.new_full((heads, num_q, 1), start_max)
        l, acc = q.new_zeros(heads, num_q, 1), q.new_zeros(heads, num_q, q.shape[-1])
        for lo in tiles[split :: rounding.splits]:
            s, seen, vt = tile(lo)
            m_new = torch.maximum(m, sm.for_max(s).masked_fill(~seen, -math.inf).amax(-1, keepdim=True))
            alpha = sm.rescale(m, m_new)
            p = torch.where(seen, sm.weights(s, m_new), 0.0)
            p_rounded = p.to(out_dtype).float()
            l = l * alpha + (p_rounded if rounding.l_from_rounded else p).sum(-1, keepdim=True)
            acc = acc * alpha + torch.einsum("hqk,hkd->hqd", p_rounded, vt)
            m = m_new
        parts.append((m, l, acc))
    # Split-K: the partials rescaled to the largest max and summed.
    m = torch.stack([pm for pm, _, _ in parts]).amax(0)
    l, acc = torch.zeros_like(parts[0][1]), torch.zeros_like(parts[0][2])
    for pm, pl, pacc in parts:
        w = sm.rescale(pm, m)
        l, acc = l + pl * w, acc + pacc * w
    seen = mask.any(-1, keepdim=True)
    safe = torch.where(seen, l, 1.0)
    if rounding.normalize_first:
        acc = torch.zeros_like(acc)
        for lo in tiles:
            s, visible, vt = tile(lo)
            p = torch.where(visible, sm.weights(s, m), 0.0)
            acc = acc + torch.einsum("hqk,hkd->hqd", (p / safe).to(out_dtype).float(), vt)
        out = acc
    else:
        out = acc / safe
    out = torch.where(seen, out, 0.0).to(out_dtype)
    lse = torch.where(seen, sm.lse(m, safe), -math.inf).squeeze(-1)
    return out, lse


def _prefill(rounding: Rounding):
    def paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None,
        return_lse=False,
    ):  # fmt: skip
        """Family-member attention of new tokens over a paged cache (contract §4)."""
        args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
        batch, per_sequence = sequences(*args, scale=scale, layout=layout, return_lse=return_lse)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
        for start, end, context, qb, k, v in per_sequence:
            group = batch.num_heads // batch.num_kv_heads
            seq_len = context + end - start
            q_pos = torch.arange(context, seq_len)
            mask = token_mask(layout, batch.num_heads, q_pos, torch.arange(seq_len)).to(q.device)
            # The NaN rule (contract §4): rows that see a non-finite value are NaN; the arithmetic
            # runs on zeroed copies so that 0 * NaN of an unseen key cannot reach another row.
            bad_q = ~torch.isfinite(qb).all(-1).T
            bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)).repeat_interleave(group, 1)
            bad = bad_q | (mask & bad_kv.T[:, None, :]).any(-1)
            qf, kf, vf = (_fp32(t.nan_to_num(0.0, 0.0, 0.0)).transpose(0, 1) for t in (qb, k, v))
            kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
            o, s = _attend(qf, kf, vf, mask, batch.scale, q.dtype, rounding)
            out[start:end] = o.masked_fill(bad[..., None], math.nan).transpose(0, 1)
            lse[start:end] = s.masked_fill(bad, math.nan).T
        return (out, lse) if return_lse else out

    return paged_prefill


def member(rounding: Rounding, doc: str) -> SimpleNamespace:
    """An implementation (contract §9) that rounds as `rounding` says; its write_kv is the oracle's."""
    prefill = _prefill(rounding)
    impl = SimpleNamespace(
        write_kv=reference.write_kv, paged_prefill=prefill, paged_decode=decode_via_prefill(prefill)
    )
    impl.__doc__ = doc
    return impl


fa2 = member(Rounding(tile=16, exp2=True), "FlashAttention-2 rounding: exp2, scale folded, 16-key tiles")
fused_exp2 = member(
    Rounding(tile=32, exp2=True, fused=True, reverse=True, l_from_rounded=True),
    "fused exp2(s*c - m*c), reversed keys, l from the rounded P",
)
split_k = member(Rounding(tile=64, exp2=False, splits=4), "natural exp, four split-K partials combined")
normalize_first = member(
    Rounding(tile=16, exp2=True, normalize_first=True), "two passes: P / l rounded before P.V"
)
