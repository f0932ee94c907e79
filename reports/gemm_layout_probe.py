"""cuBLAS with the weight stored [K, N] (NN) against [N, K] (TN), per weight and row count: `python3 -m reports.gemm_layout_probe` (a GPU)."""
import torch

from engine.cuda_graphs import PIECE_TOKEN_BUCKETS
from reports.gemm_probe import COPIES, WEIGHTS, cublas, time_call

torch.manual_seed(0)
ROWS = [1, 2, 4, 8, 16, 32, 64] + [m for m in PIECE_TOKEN_BUCKETS if m <= 2048 and m > 64] + [4096, 8192]
for name, (N, K) in WEIGHTS.items():
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(COPIES)]
    wts = [w.t().contiguous() for w in ws]
    line = []
    for M in ROWS:
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        tn = time_call(cublas, xs, ws, ys)
        nn = time_call(lambda x, wt, y: torch.mm(x, wt, out=y), xs, wts, ys)
        line.append(f"{M}:{tn:.1f}/{nn:.1f}={nn / tn:.2f}")
    print(name, " ".join(line), flush=True)
