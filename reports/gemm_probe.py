"""The 32-layer model's linear layers at a cached prompt's few rows: cuBLAS against Triton tiles (issue 17).

A prefill step over a 90% cached prompt multiplies 208 rows (2k prompt) or 832 (8k) by each layer's
weights, where the step's time is mostly reading them. For each weight (qkv, out, up, down: bf16 [N, K])
and each row count M: `torch.mm` through cuBLAS and through cuBLASLt
(`torch.backends.cuda.preferred_blas_library`), split-K over cuBLAS's batched product (`split_k`, with
its error against float32's), and a plain Triton kernel (`mm_kernel`: one output tile a
program, pointer loads or tensor descriptors) over a grid of tile shapes, stages and warps; the eight
fastest Triton configurations are kept. Each time is a CUDA graph of REPLAYS calls cycling over COPIES
weight copies (more bytes than the L2 holds, so each call reads its weight from HBM), µs a call, the
median of 15 replays; `hbm_bound_us` is the weight's bytes at 3.35 TB/s (an H100's HBM). A Triton
result more than 1% off float32's is dropped (printed).

`python3 -m reports.gemm_probe [--rows 208,832] [--out FILE.json] [--no-tiles]` (a GPU; a few minutes: each
configuration compiles once; with --no-tiles, cuBLAS and cuBLASLt alone, seconds).
"""

import argparse
import itertools
import json
import pathlib
import statistics
import time

import torch
import triton
import triton.language as tl

WEIGHTS = {"qkv": (6144, 4096), "out": (4096, 4096), "up": (8192, 4096), "down": (4096, 8192)}  # N, K
COPIES, REPLAYS = 6, 24
HBM_BYTES_PER_S = 3.35e12
BLOCKS, K_BLOCKS, STAGES, WARPS = (64, 128, 256), (64, 128), (3, 4, 5), (4, 8)
SMEM_BYTES = 200 * 1024
SPLITS = (2, 4)  # split-K parts of `split_k`


@triton.jit
def mm_kernel(
    x, w, y, M, N, K, sxm, swn, sym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """y[M, N] = x[M, K] @ w[N, K]^T, an output tile a program, the M tiles of an N tile adjacent (they
    share its weight tile through the L2). K a multiple of BLOCK_K, N of BLOCK_N."""
    pid, num_m = tl.program_id(0), tl.cdiv(M, BLOCK_M)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xp = x + rm[:, None].to(tl.int64) * sxm + rk[None, :]
    wp = w + rn[None, :].to(tl.int64) * swn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(xp, mask=rm[:, None] < M, other=0.0), tl.load(wp), acc)
        xp += BLOCK_K
        wp += BLOCK_K
    out = y + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=rm[:, None] < M)


@triton.jit
def mm_desc_kernel(x, w, y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`mm_kernel` through tensor descriptors (TMA loads; rows past M read as zeros, not stored)."""
    pid, num_m = tl.program_id(0), tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    xd = tl.make_tensor_descriptor(x, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    wd = tl.make_tensor_descriptor(w, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    yd = tl.make_tensor_descriptor(y, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(xd.load([pid_m * BLOCK_M, k]), wd.load([pid_n * BLOCK_N, k]).T, acc)
    yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y.dtype.element_ty))


def configs() -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) whose tile fits the registers of its warps and whose
    pipeline fits the shared memory."""
    out = []
    for bm, bn, bk, stages, warps in itertools.product(BLOCKS, BLOCKS, K_BLOCKS, STAGES, WARPS):
        fits = bm * bn <= 128 * 256 and (warps == 8 or (bm * bn < 128 * 128 and bm < 256))
        if fits and (bm + bn) * bk * 2 * stages <= SMEM_BYTES:
            out.append((bm, bn, bk, stages, warps))
    return out


def triton_mm(descriptors: bool, config: tuple):
    bm, bn, bk, stages, warps = config

    def run(x, w, y):
        (M, K), N = x.shape, w.shape[0]
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        options = dict(num_stages=stages, num_warps=warps)
        if descriptors:
            mm_desc_kernel[grid](x, w, y, M, N, K, bm, bn, bk, **options)
        else:
            mm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), bm, bn, bk, **options)

    return run


def cublas(x, w, y):
    torch.mm(x, w.t(), out=y)


def split_k(parts: int):
    """y = x @ w^T as `parts` products over slices of K in one batched cuBLAS call (strided views, no copy),
    summed by torch.sum (float32 accumulation) into y: a split-K GEMM from cuBLAS's own kernels, with
    `parts` times the output tiles of one product."""

    def run(x, w, y):
        (M, K), N = x.shape, w.shape[0]
        a = x.view(M, parts, K // parts).transpose(0, 1)  # [parts, M, K / parts]
        b = w.view(N, parts, K // parts).permute(1, 2, 0)  # [parts, K / parts, N]
        torch.sum(torch.bmm(a, b), 0, out=y)

    return run


def relative_error(y: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of y against the float32 product `want`, over want's largest magnitude."""
    return float((y.float() - want).abs().max() / want.abs().max())


def time_call(fn, xs, ws, ys) -> float:
    """µs a call: a graph of REPLAYS calls cycling over the copies, the median of 15 replays."""
    for i in range(3):
        fn(xs[i % COPIES], ws[i % COPIES], ys[i % COPIES])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPLAYS):
            fn(xs[i % COPIES], ws[i % COPIES], ys[i % COPIES])
    graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPLAYS)
    return statistics.median(times)


def operands(rows: list[int]):
    """(weight name, M, xs, ws, ys) for each weight of WEIGHTS and each row count M of `rows`: COPIES seeded
    bf16 weights [N, K], inputs [M, K] and outputs [M, N] on the GPU."""
    torch.manual_seed(0)
    for name, (N, K) in WEIGHTS.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(COPIES)]
        for M in rows:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
            ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
            yield name, M, xs, ws, ys


def measure(rows: list[int], tiles: bool = True) -> list[dict]:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    results = []
    for name, M, xs, ws, ys in operands(rows):
        (N, K), want = WEIGHTS[name], xs[0].float() @ ws[0].float().t()
        row = dict(weight=name, M=M, N=N, K=K, hbm_bound_us=N * K * 2 / HBM_BYTES_PER_S * 1e6)
        row["cublas_us"] = time_call(cublas, xs, ws, ys)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_us"] = time_call(cublas, xs, ws, ys)
        torch.backends.cuda.preferred_blas_library("cublas")
        for parts in SPLITS:
            split_k(parts)(xs[0], ws[0], ys[0])
            row[f"split{parts}_error"] = relative_error(ys[0], want)
            row[f"split{parts}_us"] = time_call(split_k(parts), xs, ws, ys)
        tried = []
        for descriptors, config in itertools.product((False, True), configs() if tiles else ()):
            fn = triton_mm(descriptors, config)
            fn(xs[0], ws[0], ys[0])
            error = relative_error(ys[0], want)
            if error > 1e-2:
                print(f"dropped: {name} M={M} descriptors={descriptors} {config}: error {error:.3g}")
                continue
            tried.append(["desc" if descriptors else "ptr", *config, time_call(fn, xs, ws, ys)])
        # each: loads, BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, µs
        row["triton_best"] = sorted(tried, key=lambda r: r[-1])[:8]
        results.append(row)
        print(
            f"{name} M={M}: bound {row['hbm_bound_us']:.1f} µs, cuBLAS {row['cublas_us']:.1f}, "
            f"cuBLASLt {row['cublaslt_us']:.1f}, "
            + "".join(f"split-K {k} {row[f'split{k}_us']:.1f}, " for k in SPLITS)
            + f"Triton best {row['triton_best'][:1]}",
            flush=True,
        )
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="208,832", help="row counts M, comma-separated")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gemm-probe.json"))
    parser.add_argument("--no-tiles", action="store_true", help="cuBLAS and cuBLASLt only (no compiles)")
    args = parser.parse_args(argv)
    start = time.time()
    rows = measure([int(m) for m in args.rows.split(",")], tiles=not args.no_tiles)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    args.out.write_text(json.dumps(dict(**env, wall_s=time.time() - start, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
