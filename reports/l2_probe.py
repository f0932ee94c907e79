"""How much faster the 32-layer model's linear layers run from the L2 cache than from HBM, at a cached
prompt's few rows (issue 17): is a weight worth prefetching into the L2 while attention runs?

At the 2k step with 90% cached (208 rows), attention takes about 40 µs a layer on half the SMs and reads
a few MB, so the HBM idles; the projection that follows (`out`, 33.5 MB) then reads its weight from HBM.
For each weight (engine.model's shapes, bf16) and row count, through each library of
engine.blas_choice.LIBRARIES (cuBLAS, cuBLASLt), µs a call:
- `cold`: a CUDA graph of calls cycling over gemm_probe.COPIES weights (more bytes than the L2 holds);
- `touch`: a graph of `touch_kernel` over the first FRACTION of each weight alone (the prefetch's own time);
- `hot`: (a graph of touch then product, each weight in turn) minus `touch`: the product with that part of
  its weight in the L2.
Each is the median of 15 replays of REPLAYS calls (reports/gemm_probe.py's `time_call`).

`python3 -m reports.l2_probe [--rows 208,832,2048] [--out FILE.json]` (a GPU; seconds).
"""

import argparse
import json
import pathlib
import time

import torch
import triton
import triton.language as tl

from engine.blas_choice import LIBRARIES
from reports.gemm_probe import REPLAYS, cublas, operands, time_call

# The part of each weight touched: what fits the L2 (50 MB on the H100 and H200) beside attention's KV.
FRACTION = {"qkv": 0.75, "out": 1.0, "up": 0.5, "down": 0.5}
TOUCH_PROGRAMS = (66, 132)  # half the SMs (those attention leaves idle at 208 rows) and all of them


@triton.jit
def touch_kernel(src, sink, n, BLOCK: tl.constexpr):
    """Reads src[:n] (int32) into the L2, grid-strided; the xor of what a program read goes to sink[pid]
    so that no load is dead."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(pid, tl.cdiv(n, BLOCK), programs):
        offs = i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(sink + pid, tl.xor_sum(acc, 0))


def touch(programs: int, fraction: float):
    sink = torch.empty(programs, dtype=torch.int32, device="cuda")

    def run(w):
        flat = w.view(-1).view(torch.int32)
        touch_kernel[(programs,)](flat, sink, int(flat.numel() * fraction), BLOCK=2048, num_warps=8)

    return run


def measure(rows: list[int]) -> list[dict]:
    results = []
    for name, M, xs, ws, ys in operands(rows):
        for library in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(library)
            row = dict(weight=name, M=M, library=library, fraction=FRACTION[name])
            row["cold_us"] = time_call(cublas, xs, ws, ys)
            for programs in TOUCH_PROGRAMS:
                pre = touch(programs, FRACTION[name])

                def alone(x, w, y, pre=pre):
                    pre(w)

                def both(x, w, y, pre=pre):
                    pre(w)
                    cublas(x, w, y)

                row[f"touch{programs}_us"] = time_call(alone, xs, ws, ys)
                row[f"hot{programs}_us"] = time_call(both, xs, ws, ys) - row[f"touch{programs}_us"]
            results.append(row)
            print(
                f"{name} M={M} {library}: cold {row['cold_us']:.1f} µs; "
                + "; ".join(
                    f"{p} programs: touch {row[f'touch{p}_us']:.1f}, hot {row[f'hot{p}_us']:.1f}"
                    for p in TOUCH_PROGRAMS
                ),
                flush=True,
            )
    torch.backends.cuda.preferred_blas_library(LIBRARIES[0])
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="208,832,2048", help="row counts M, comma-separated")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("l2-probe.json"))
    args = parser.parse_args(argv)
    start = time.time()
    rows = measure([int(m) for m in args.rows.split(",")])
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    result = dict(**env, wall_s=time.time() - start, replays=REPLAYS, rows=rows)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
