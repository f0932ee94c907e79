"""Where ptxas puts the P.V product's wait in FlashAttention-3's intra-group overlap (CPU only: Triton's
bundled ptxas and cuobjdump, no GPU).

`python -m reports.wgmma_wait_probe [--dump DIR]` compiles one small Gluon loop for sm_90a in several
orders and counts, for each P.V product in the SASS (the loop's, then the last tile's), the
exponentials (MUFU.EX2) between its first instruction and its wait (WARPGROUP.DEPBAR.LE gsb0, 0x0).
The overlap needs the next tile's there (32 weights and 2 rescale factors a step); ptxas's own notes
(C7514: products serialized) are printed with them. The loop is the Hopper path's
(kernels/hopper_prefill.py) full-tile step reduced to one warp group and one 64-key tile a step
(reports/gpu/kernel-ab.md §12, §13, §17):
- `fa3`: the next scores issued with this tile's P.V, wait for the scores, softmax, wait for the P.V;
- `keep_operand`: the same, the next P operand made to depend on this one (x_next ^ (x & zero), zero
  a run-time 0), so that ptxas cannot give it the in-flight operand's registers;
- `no_row_max` and `no_reductions` (wrong results, SASS only): the softmax without its row maximum,
  and without its row sum too;
- `scores_after_softmax`: the scores after next issued after the softmax, before the P.V's wait;
- `predicated_wait`: the P.V's wait issued in inline PTX under a predicate computed from the new row
  sums (always true), the compiler's own wait relaxed to one outstanding group;
- `convert_after_wait`: FlashAttention's CuTe DSL order (flash_attn/cute/flash_fwd_sm90.py): the
  weights become the next bf16 operand only after the P.V's wait;
- `barrier_before_wait`: a named-barrier arrival (bar.arrive, no waiter) after the row sums;
- `max_before_pv`: the next scores waited for and their row maximum taken first, then the held
  tile's P.V issued and the next exponentials run beside it;
- `pair_split`: two tiles a step, the second's weights made after the first's P.V is issued.
"""

import argparse
import pathlib
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ORDERS = [
    "fa3", "keep_operand", "no_row_max", "no_reductions", "scores_after_softmax", "predicated_wait",
    "convert_after_wait", "barrier_before_wait", "max_before_pv", "pair_split",
]  # fmt: skip


@gluon.jit
def _softmax_step(s, m, row_sum, scale, ORDER: gl.constexpr):
    """The online softmax of one tile's scores s [64, 64]: new max, rescale factor, weights, sum."""
    if ORDER == 2 or ORDER == 3:  # no_row_max, no_reductions
        m_new = m + 0.0
    else:
        m_new = gl.maximum(m, gl.max(s, 1))
    alpha = gl.exp2((m - m_new) * scale)
    p = gl.exp2(s * scale - (m_new * scale)[:, None])
    if ORDER == 3:
        row_sum = row_sum * alpha
    else:
        row_sum = row_sum * alpha + gl.sum(p, 1)
    return m_new, alpha, p, row_sum


@gluon.jit
def probe_kernel(q_ptr, k_ptr, v_ptr, o_ptr, n, zero, scale, ORDER: gl.constexpr):
    """n + 1 attention steps of one warp group over the same key tile, in the order ORDERS[ORDER]:
    q, k, v bf16 [64, 128]; o float32 [64, 128]; zero a run-time 0 (ptxas must not fold it)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    offs = gl.arange(0, 64, layout=gl.SliceLayout(1, io))[:, None] * 128
    offs = offs + gl.arange(0, 128, layout=gl.SliceLayout(0, io))[None, :]
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 128], smem, gl.load(k_ptr + offs))
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 128], smem, gl.load(v_ptr + offs))
    q_op = gl.convert_layout(gl.load(q_ptr + offs), q_layout)
    fence_async_shared()
    zs = gl.zeros([64, 64], gl.float32, s_layout)
    s = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    m = gl.full([64], -1e30, gl.float32, gl.SliceLayout(1, s_layout))
    row_sum = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    m, alpha, p, row_sum = _softmax_step(s, m, row_sum, scale, ORDER)
    x = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    o = gl.zeros([64, 128], gl.float32, o_layout)
    if ORDER == 9:  # pair_split: two tiles a step, the second's weights made while the first's P.V runs
        for _ in range(n):
            s0 = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
            s1 = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
            s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1))
            m_new = gl.maximum(m, gl.max(gl.maximum(s0, s1), 1))
            alpha = gl.exp2((m - m_new) * scale)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            shift = (m_new * scale)[:, None]
            p0 = gl.exp2(s0 * scale - shift)
            x0 = gl.convert_layout(p0.to(gl.bfloat16), p_layout)
            o = warpgroup_mma(x0, v_smem, o, is_async=True)
            p1 = gl.exp2(s1 * scale - shift)
            x1 = gl.convert_layout(p1.to(gl.bfloat16), p_layout)
            o = warpgroup_mma(x1, v_smem, o, is_async=True)
            o, x0, x1 = warpgroup_mma_wait(num_outstanding=0, deps=(o, x0, x1))
            row_sum = row_sum * alpha + gl.sum(p0 + p1, 1)
            m = m_new
    elif ORDER == 8:  # max_before_pv: scores and their row max first, then P.V beside the exponentials
        for _ in range(n):
            s = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_new = gl.maximum(m, gl.max(s, 1))
            o = warpgroup_mma(x, v_smem, o, is_async=True)
            alpha = gl.exp2((m - m_new) * scale)
            p = gl.exp2(s * scale - (m_new * scale)[:, None])
            o, x = warpgroup_mma_wait(num_outstanding=0, deps=(o, x))
            row_sum = row_sum * alpha + gl.sum(p, 1)
            x = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            m = m_new
    elif ORDER == 4:  # scores_after_softmax: S_{j+1} is ready as the step starts, P_j.V in flight
        o = warpgroup_mma(x, v_smem, o, is_async=True)
        s = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        for _ in range(n):
            m, alpha, p, row_sum = _softmax_step(s, m, row_sum, scale, ORDER)
            x_next = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            s = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
            o, x = warpgroup_mma_wait(num_outstanding=1, deps=(o, x))
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            o = warpgroup_mma(x_next, v_smem, o, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            x = x_next
    else:
        for _ in range(n):
            s = warpgroup_mma(q_op, k_smem.permute((1, 0)), zs, use_acc=False, is_async=True)
            o = warpgroup_mma(x, v_smem, o, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            m, alpha, p, row_sum = _softmax_step(s, m, row_sum, scale, ORDER)
            if ORDER == 6:  # convert_after_wait: the weights become the next operand after the wait
                o, x = warpgroup_mma_wait(num_outstanding=0, deps=(o, x))
            if ORDER == 7:  # barrier_before_wait: a named-barrier arrival after the row sums
                row_sum = gl.inline_asm_elementwise(
                    "{ bar.arrive 15, 128; mov.b32 $0, $1; }", "=r,r", [row_sum],
                    dtype=gl.float32, is_pure=False, pack=1,
                )  # fmt: skip
            x_next = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            if ORDER == 1:  # keep_operand
                z = gl.full(x.shape, zero, gl.int16, p_layout).to(gl.bfloat16, bitcast=True)
                x_next = gl.inline_asm_elementwise(
                    "{ .reg .b32 t; and.b32 t, $2, $3; xor.b32 $0, $1, t; }", "=r,r,r,r", [x_next, x, z],
                    dtype=gl.bfloat16, is_pure=True, pack=2,
                )  # fmt: skip
            if ORDER == 5:  # predicated_wait
                zl = gl.full(row_sum.shape, zero, gl.int32, row_sum.type.layout)
                alpha = gl.inline_asm_elementwise(
                    "{ .reg .pred p; .reg .b32 t; and.b32 t, $2, $3; setp.eq.b32 p, t, 0; "
                    "@p wgmma.wait_group.sync.aligned 0; mov.b32 $0, $1; }",
                    "=r,r,r,r", [alpha, row_sum, zl], dtype=gl.float32, is_pure=False, pack=1,
                )  # fmt: skip
                o, x = warpgroup_mma_wait(num_outstanding=1, deps=(o, x))
            elif ORDER != 6:
                o, x = warpgroup_mma_wait(num_outstanding=0, deps=(o, x))
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            x = x_next
    o = warpgroup_mma(x, v_smem, o, is_async=True)
    o, x = warpgroup_mma_wait(num_outstanding=0, deps=(o, x))
    o = o / gl.convert_layout(row_sum, gl.SliceLayout(1, o_layout))[:, None]
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + rows[:, None] * 128 + cols[None, :], o)


def compile_order(order: int) -> tuple[str, str]:
    """(ptxas's notes, SASS) of the probe in the given order (an index of ORDERS), for sm_90a."""
    from reports.kernel_inspect import compile_for, ptxas_and_sass  # exits under TRITON_INTERPRET

    t, o = torch.empty(64, 128, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.float32)
    compiled = compile_for(probe_kernel, (t, t, t, o, 9, 7, 0.1), dict(ORDER=order, num_warps=4), 90)
    return ptxas_and_sass(compiled, 90)


def overlap(sass: str) -> list[int]:
    """For each P.V product in the SASS (a group of HGMMA 64x128 instructions; the loop's, then the
    last tile's), the exponentials between its first instruction and the next full wait."""
    counts, open_pv = [], None
    for line in sass.splitlines():
        if "HGMMA.64x128x16" in line and open_pv is None:
            open_pv = 0
        elif "MUFU.EX2" in line and open_pv is not None:
            open_pv += 1
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and open_pv is not None:
            counts.append(open_pv)
            open_pv = None
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--dump", type=pathlib.Path, help="write each order's SASS here")
    args = parser.parse_args(argv)
    print("| order | exponentials beside the P.V (the loop's, then the last tile's) | ptxas notes |")
    print("| --- | --- | --- |")
    for i, name in enumerate(ORDERS):
        notes, sass = compile_order(i)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.sass").write_text(sass)
        flags = sorted(set(re.findall(r"\(C\d+\)", notes)))
        print(f"| {name} | {overlap(sass)} | {' '.join(flags) or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
