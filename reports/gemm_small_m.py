"""The 32-layer model's linear layers at a cached prompt's few rows, two ways past torch's pick (issue 17):
every algorithm of cuBLASLt's heuristic list (reports/cublaslt.py; torch takes its first), and a Triton
product split over K whose last part sums the parts (reports/splitk_linear.py), over a grid of tiles.

For each weight of reports/gemm_probe.py's WEIGHTS and each row count: torch's cuBLAS and cuBLASLt, then
each algorithm and each tile, µs a call (gemm_probe's `time_call`: a CUDA graph cycling over weight copies
that outgrow the L2, the median of 15 replays), each checked against a float32 product (an error over 1%
drops it, printed) and, for the split tiles, run twice for the same bits.

`python3 -m reports.gemm_small_m [--rows 208,832] [--lt-only] [--out FILE.json]` (a GPU; a few minutes).
"""

import argparse
import itertools
import json
import pathlib
import time

import torch
import triton

from reports import cublaslt, splitk_linear
from reports.gemm_probe import WEIGHTS, cublas, operands, relative_error, time_call

ALGOS = 32  # how many algorithms to ask cuBLASLt's heuristic for


def tiles(rows: int, n: int) -> list[tuple[int, ...]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, stages, warps) whose accumulator fits its warps' registers,
    whose pipeline fits the shared memory and that make 100 to 400 programs at `rows` rows and N = n."""
    out = []
    blocks = (64, 128, 256)
    for bm, bn, bk, split, warps in itertools.product(blocks, blocks, (64, 128), (1, 2, 4), (4, 8)):
        stages = 4 if bk == 64 else 3
        fits = (bm * bn <= 128 * 128 and bm <= 128) if warps == 4 else 128 * 64 <= bm * bn <= 256 * 128
        programs = triton.cdiv(rows, bm) * (n // bn) * split
        if fits and (bm + bn) * bk * 2 * stages <= 220 * 1024 and 100 <= programs <= 400:
            out.append((bm, bn, bk, split, stages, warps))
    return out


def measure(rows: list[int], splits: bool) -> list[dict]:
    results = []
    for name, M, xs, ws, ys in operands(rows):
        (N, K), want = WEIGHTS[name], xs[0].float() @ ws[0].float().t()
        row = dict(weight=name, M=M, N=N, K=K, cublas_us=time_call(cublas, xs, ws, ys))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_us"] = time_call(cublas, xs, ws, ys)
        torch.backends.cuda.preferred_blas_library("cublas")
        product, row["algos"] = cublaslt.Product(xs[0], ws[0], ys[0]), []
        for i, (algo, config) in enumerate(product.algos(ALGOS)):

            def run(x, w, y, algo=algo, product=product):
                product.run(algo, x, w, y)

            try:
                run(xs[0], ws[0], ys[0])
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"algo {i} {config}: {e}")
                continue
            config.update(rank=i, error=relative_error(ys[0], want))
            if config["error"] > 1e-2:
                print(f"dropped: {name} M={M} algo {i} {config}")
                continue
            config["us"] = time_call(run, xs, ws, ys)
            row["algos"].append(config)
        best = min(row["algos"], key=lambda a: a["us"])
        print(
            f"{name} M={M}: cuBLAS {row['cublas_us']:.1f} µs, cuBLASLt {row['cublaslt_us']:.1f}, "
            f"{len(row['algos'])} algos, first {row['algos'][0]['us']:.1f}, best {best['us']:.1f} {best}",
            flush=True,
        )
        row["tiles"] = []
        for tile in tiles(M, N) if splits else ():
            if K % (tile[3] * tile[2]):
                continue

            def run(x, w, y, tile=tile):
                splitk_linear.linear(x, w, tile, out=y)

            first = splitk_linear.linear(xs[0], ws[0], tile)
            same = torch.equal(first, splitk_linear.linear(xs[0], ws[0], tile))
            error = relative_error(first, want)
            if error > 1e-2 or not same:
                print(f"dropped: {name} M={M} tile {tile}: error {error:.3g}, same bits {same}")
                continue
            row["tiles"].append([*tile, time_call(run, xs, ws, ys)])
        row["tiles"].sort(key=lambda t: t[-1])
        if row["tiles"]:
            print(f"{name} M={M}: split-K tiles, best {row['tiles'][:3]}", flush=True)
        results.append(row)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="208,832", help="row counts M, comma-separated")
    parser.add_argument("--lt-only", action="store_true", help="cuBLASLt's algorithms only (no compiles)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gemm-small-m.json"))
    args = parser.parse_args(argv)
    start = time.time()
    constants, source = cublaslt.constants()
    print(f"cuBLASLt constants {source}", flush=True)
    rows = measure([int(m) for m in args.rows.split(",")], splits=not args.lt_only)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    result = dict(**env, constants=source, wall_s=time.time() - start, rows=rows)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
