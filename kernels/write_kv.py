"""KV-cache write in Triton: scatter each token's K/V rows to its flat slot.

spec: `reference.write_kv.write_kv`. Slot `page_id * page_size + offset`; -1 means "do not write".
Every tensor may be a non-contiguous view: K/V and caches are addressed through their strides.
"""

import triton
import triton.language as tl

from kernels._common import MIN_DOT, BoundLaunch, dependent_launch_options
from reference.validation import PlanGuard, validate_write_kv

NUM_WARPS = 4


# Grid: (token,). Each program copies one token's [num_kv_heads, head_dim] K and V rows.
@triton.jit(do_not_specialize=["page_size", "num_kv_heads", "head_dim"])
def write_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kp,
    stride_ks,
    stride_kch,
    stride_kcd,
    stride_vp,
    stride_vs,
    stride_vch,
    stride_vcd,
    page_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
):
    if WAIT_PRIOR:  # a dependent launch (_common.DEPENDENT_LAUNCH): k and v may still be being written
        tl.extra.cuda.gdc_wait()
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i_t)
    if slot >= 0:
        page = slot // page_size
        offset = slot % page_size
        # [BLOCK_H, BLOCK_D]
        o_h = tl.arange(0, BLOCK_H)
        o_d = tl.arange(0, BLOCK_D)
        m_hd = (o_h < num_kv_heads)[:, None] & (o_d < head_dim)[None, :]
        o_src_k = i_t * stride_kt + o_h[:, None] * stride_kh + o_d[None, :] * stride_kd
        o_src_v = i_t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :] * stride_vd
        o_dst_k = (
            page * stride_kp + offset * stride_ks + o_h[:, None] * stride_kch + o_d[None, :] * stride_kcd
        )
        o_dst_v = (
            page * stride_vp + offset * stride_vs + o_h[:, None] * stride_vch + o_d[None, :] * stride_vcd
        )
        tl.store(k_cache + o_dst_k, tl.load(k + o_src_k, mask=m_hd), mask=m_hd)
        tl.store(v_cache + o_dst_v, tl.load(v + o_src_v, mask=m_hd), mask=m_hd)


# The kernel's stride parameters, in order: k's, v's, k_cache's, v_cache's.
_ARGS = write_kv_kernel.arg_names
STRIDE_NAMES = _ARGS[_ARGS.index("stride_kt") : _ARGS.index("page_size")]


class WritePlan:
    """One validated `write_kv` call, ready to launch for any K/V and caches of the planned shapes.

    Built by `plan_write_kv`; `run` refuses with ValueError tensors that do not match the plan and a
    slot_mapping modified in place since it was built (a stale plan).
    """

    def __init__(self, k, v, k_cache, v_cache, slot_mapping):
        validate_write_kv(k, v, k_cache, v_cache, slot_mapping)
        self.guard = PlanGuard(
            dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache), dict(slot_mapping=slot_mapping)
        )
        # The kernel reads slot t at offset t (a no-op when slot_mapping already is contiguous).
        self.slot_mapping = slot_mapping.contiguous()
        num_tokens, num_kv_heads, head_dim = k.shape
        # Strides are planned: the guard holds every run's tensors to the planned ones.
        strides = dict(
            zip(STRIDE_NAMES, (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride()), strict=True)
        )
        self.launch = None
        if num_tokens:
            self.launch = BoundLaunch(
                write_kv_kernel,
                (num_tokens,),
                k.device,
                slot_mapping=self.slot_mapping,
                **strides,
                page_size=k_cache.shape[1],
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                BLOCK_H=triton.next_power_of_2(num_kv_heads),
                BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
                **dependent_launch_options(k.device),
                num_warps=NUM_WARPS,
            )

    def run(self, k, v, k_cache, v_cache) -> None:
        """Writes token t's K/V to its planned slot, in place."""
        self.guard.check(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
        if self.launch is not None:
            self.launch(k, v, k_cache, v_cache)


def plan_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Validates a `write_kv` call once; returns a plan whose `run(k, v, k_cache, v_cache)` launches it.

    spec: `reference.write_kv.plan_write_kv`. Only shapes, strides, dtypes and devices of K/V and the
    caches are planned, so one plan serves every layer of a step.
    """
    return WritePlan(k, v, k_cache, v_cache, slot_mapping)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Writes token t's K/V to slot `slot_mapping[t] = page_id * page_size + offset`, in place.

    spec: `reference.write_kv.write_kv`.

    Args:
        k, v (torch.Tensor):
            [num_tokens, num_kv_heads, head_dim].
        k_cache, v_cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim], k's dtype; written in place.
        slot_mapping (torch.Tensor):
            int64 [num_tokens]; -1 means "do not write" (padding). No slot appears twice.
    Returns:
        None.
    """
    plan_write_kv(k, v, k_cache, v_cache, slot_mapping).run(k, v, k_cache, v_cache)
