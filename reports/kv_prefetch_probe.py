"""Does attention at the engine's 2k step with 90% cached run faster with its cached K/V read into the L2
first (issue 17)? The Hopper kernel's timeline at that step (208 queries, 2048 keys; hopper_ab --only
timeline --rows engine) took 30.6 µs of units from a flushed L2 against 23.1 from a warm one with the
Phi-3 layout, and 41.1 against 34.9 dense: in a step the cached pages come from HBM (a prompt's
earlier step wrote them), while half the SMs idle through attention and a third through the qkv product.

For each layout, µs of the planned Hopper run alone (CUDA events around it, the median of RUNS), after:
- `cold`: the L2 flushed (as do_bench does);
- `warm`: the same run just before;
- `touched`: the L2 flushed, then `l2_probe.touch_kernel` over the K and V caches (evict-last loads);
- `touched_then_qkv`: the L2 flushed, the touch, then the qkv product at 208 rows (its 50 MB weight
  streams through the L2 between the touch and attention, as in a step);
- `qkv_then_touched`: the L2 flushed, the qkv product, then the touch;
- `beside`: the L2 flushed, then the touch on a second stream over IDLE_PROGRAMS programs while attention
  runs (timed until both end): what the programs that a lone round leaves idle (stand-ins) could do inside
  the kernel, reading the pages ahead of the working ones;
- `qkv_then_cold` and `qkv_beside_touch`: the qkv product and then attention, timed together after a flush,
  the second with the touch over TOUCH_PROGRAMS programs on a second stream beside the product (what a
  graph could fork at a layer's start, with no change to the kernels).
And the touch's own time on TOUCH_PROGRAMS programs.

`python3 -m reports.kv_prefetch_probe [--out FILE.json]` (a GPU with the Hopper path; seconds).
"""

import argparse
import json
import pathlib
import statistics

import torch

import kernels
from reports import bench_kernels as bk
from reports.hopper_timeline import L2_FLUSH_BYTES
from reports.l2_probe import touch

RUNS = 30
# A device-side wait queued before each timed run (cycles, about 1 ms): the host enqueues `before` and the
# run behind it, so the events time the GPU's work and not the launches' host cost.
HEAD_START_CYCLES = 2_000_000
TOUCH_PROGRAMS = 36  # about the SMs the qkv product leaves idle at 208 rows (96 tiles on 132 SMs)
IDLE_PROGRAMS = 68  # the stand-ins of the 2k step's walk on 132 programs (64 items)


def timed(before, run) -> float:
    """µs of `run` alone after `before`, the median of RUNS."""
    spans = []
    for _ in range(RUNS):
        torch.cuda._sleep(HEAD_START_CYCLES)
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end) * 1e3)
    return statistics.median(spans)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("kv-prefetch-probe.json"))
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    x = torch.randn(208, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) / 64
    y = torch.empty(208, 6144, device="cuda", dtype=torch.bfloat16)
    pre, beside_pre = touch(TOUCH_PROGRAMS, 1.0), touch(IDLE_PROGRAMS, 1.0)
    side = torch.cuda.Stream()
    rows = []
    for name, layout in (("phi3", bk.phi3_layout()), ("dense", None)):
        p = bk.Prefill(2048, 208, layout, gen)
        plan = kernels.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout)

        def run(plan=plan, p=p):
            plan.run(p.q, p.k, p.v)

        def touched(p=p):
            pre(p.k)
            pre(p.v)

        def qkv():
            torch.mm(x, w.t(), out=y)

        def beside(p=p, run=run):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                beside_pre(p.k)
                beside_pre(p.v)
            run()
            torch.cuda.current_stream().wait_stream(side)

        def qkv_beside(touched, run):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                touched()
            qkv()
            torch.cuda.current_stream().wait_stream(side)
            run()

        for _ in range(3):
            run()
        row = dict(layout=name, kv_bytes=2 * p.k.numel() * p.k.element_size())
        row["cold_us"] = timed(flush.zero_, run)
        row["warm_us"] = timed(run, run)
        row["touched_us"] = timed(lambda: (flush.zero_(), touched()), run)
        row["touched_then_qkv_us"] = timed(lambda: (flush.zero_(), touched(), qkv()), run)
        row["qkv_then_touched_us"] = timed(lambda: (flush.zero_(), qkv(), touched()), run)
        row["beside_us"] = timed(flush.zero_, beside)
        row["qkv_then_cold_us"] = timed(flush.zero_, lambda: (qkv(), run()))
        row["qkv_beside_touch_us"] = timed(flush.zero_, lambda: qkv_beside(touched, run))
        row["touch_alone_us"] = timed(flush.zero_, touched)
        row["qkv_alone_us"] = timed(flush.zero_, qkv)
        print(row, flush=True)
        rows.append(row)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    args.out.write_text(
        json.dumps(dict(**env, runs=RUNS, touch_programs=TOUCH_PROGRAMS, rows=rows), indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
