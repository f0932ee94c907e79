"""Kernel benchmark (GPU only): prefill against vLLM's numbers, Flex and SDPA; prefix-cached prefill;
decode against the copy ceiling; an A/B with the previous commit's kernels. One run, one process.

`python3 -m reports.bench --only kernels [--previous .ab]` writes kernels-bench.md and .json under the
output folder. Phi-3-small shapes: 32 query heads, 8 KV heads, head_dim 128, sparse block 64, local
16, vertical stride 8, per-head columns, bfloat16, batch 1, pages of 16 tokens through a shuffled
block table. Times are medians of triton.testing.do_bench (warm-up, L2 flushed). "planned" times
`plan.run` with the metadata planned outside the timed region (as vLLM's launcher precomputes its
layout); "op" times the public operator, validation and planning included. Effective TFLOP/s count
4 * head_dim FLOPs per attended (query, key) pair only. The vLLM column quotes the issue's run (its
original block-sparse Triton prefill, contiguous K/V, same GPU): it is not re-measured here.
"""

import importlib
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton

import kernels
import reference as ref

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SPARSE_BLOCK, LOCAL_BLOCKS, VERT_STRIDE = 64, 16, 8
PAGE_SIZE = 16
DTYPE = torch.bfloat16
SCALE = 1.0 / 128
WARMUP_MS, REP_MS = 25, 150
FLOPS_PER_PAIR_PER_DIM = 4  # q.k and p.v: 2 multiply-adds per dimension
MS_TO_GBPS = 1e6  # bytes per millisecond -> GB/s
COPY_BYTES = 2 * 2**30
MATMUL_N = 8192
# (tokens, queries) of the issue's table, with vLLM's times there (ms) and the speed targets.
ROWS = (
    (8192, 8192),
    (8192, 2048),
    (8192, 832),
    (32768, 32768),
    (32768, 8192),
    (131072, 131072),
    (131072, 13120),
)
VLLM_MS = {
    (8192, 8192): 0.505,
    (8192, 2048): 0.174,
    (8192, 832): 0.093,
    (32768, 32768): 4.056,
    (32768, 8192): 1.565,
    (131072, 131072): 48.62,
    (131072, 13120): 8.90,
}
# Issue 16's whole table: 8k, 32k and 128k tokens, all of them queries, then the last 50%, 25% and 10%
# (rounded up to a sparse block: 832, 3328 and 13120 queries at 10%). VLLM_MS has vLLM's times for
# seven of its twelve rows; reports/hopper_ab.py --vllm times vLLM's kernel on all twelve.
ISSUE_TABLE = tuple(
    (n, -(-n * percent // (100 * SPARSE_BLOCK)) * SPARSE_BLOCK)
    for n in (8192, 32768, 131072)
    for percent in (100, 50, 25, 10)
)
TARGET_VS_VLLM = 0.8  # at most 0.8x vLLM's time: vLLM ms / ours >= 1.25
FLEX_PROXY = {8192: 1.35, 32768: 1.35, 131072: 1.27}  # at least this speed-up over the best Flex
FLEX_BLOCKS = {8192: ((64, 64), (128, 64)), 32768: ((64, 64), (128, 64)), 131072: ((128, 64),)}
OP_OVERHEAD_TARGET = 1.10  # the op at most 1.10x the planned time, at every prefill row
ENQUEUE_TARGET_US = 40.0  # a planned launch enqueues in at most this many microseconds
ENQUEUE_CALLS, ENQUEUE_ROUNDS = 50, 31  # many short rounds: the host's noise comes in bursts
PREFIX_GAP_TARGET = 0.03  # t(queries) / t(full) within +0.03 of the ideal work ratio
DECODE_BATCH, DECODE_CONTEXTS = 64, (8192, 32768)
DECODE_TARGET = 0.75  # of the copy ceiling, in K/V bytes the step must read


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def enqueue_us(fn) -> float:
    """Host microseconds per call of `fn`, median of rounds of ENQUEUE_CALLS calls: time to enqueue,
    with the GPU still busy with earlier calls (the queue never fills in one round)."""
    fn()
    rounds = []
    for _ in range(ENQUEUE_ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(ENQUEUE_CALLS):
            fn()
        rounds.append((time.perf_counter() - start) / ENQUEUE_CALLS * 1e6)
    torch.cuda.synchronize()
    return sorted(rounds)[len(rounds) // 2]


def phi3_layout():
    return ref.LocalStridedLayout(SPARSE_BLOCK, LOCAL_BLOCKS, VERT_STRIDE, num_heads_total=HEADS)


def block_pairs(n: int, layout) -> torch.Tensor:
    """Attended (q, k) pairs of each query block, summed over heads: [n // S] (n a multiple of S)."""
    nb = n // SPARSE_BLOCK
    mask = (
        layout.block_mask(HEADS, nb) if layout else ref.causal_block_mask(nb).expand(HEADS, -1, -1)
    ).long()
    diag = torch.eye(nb, dtype=torch.int64)
    per_block = SPARSE_BLOCK * SPARSE_BLOCK * (1 - diag) + SPARSE_BLOCK * (SPARSE_BLOCK + 1) // 2 * diag
    return (mask * per_block).sum(dim=(0, 2))


def paged(n: int, batch: int, gen):
    """A cache holding `batch` sequences of n tokens in shuffled pages, and their block tables."""
    pages = n // PAGE_SIZE
    order = torch.randperm(pages * batch, generator=gen).cuda()
    k_cache = torch.randn(pages * batch, PAGE_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    return k_cache, torch.randn_like(k_cache), order.view(batch, pages).to(torch.int32)


class Prefill:
    """One prefill problem (n tokens, the last `queries` of them queries) and its timings."""

    def __init__(self, n: int, queries: int, layout, gen):
        self.n, self.queries, self.layout = n, queries, layout
        self.k, self.v, self.tables = paged(n, 1, gen)
        self.q = torch.randn(queries, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.seq_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        self.qsl = torch.tensor([0, queries], dtype=torch.int32, device="cuda")
        pairs = block_pairs(n, layout)
        self.pairs = int(pairs[(n - queries) // SPARSE_BLOCK :].sum())
        self.work_share = self.pairs / float(pairs.sum())

    def args(self):
        return self.q, self.k, self.v, self.tables, self.seq_lens, self.qsl

    def planned(self) -> float:
        plan = kernels.plan_prefill(*self.args(), scale=SCALE, layout=self.layout)
        return bench(lambda: plan.run(self.q, self.k, self.v))

    def op(self) -> float:
        return bench(lambda: kernels.paged_prefill(*self.args(), scale=SCALE, layout=self.layout))

    def previous(self) -> float:
        module = importlib.import_module("kernels_prev.paged_prefill")
        plan = module.plan_prefill(*self.args(), scale=SCALE, layout=self.layout)
        return bench(lambda: plan.run(self.q, self.k, self.v))

    def enqueue_us(self) -> float:
        plan = kernels.plan_prefill(*self.args(), scale=SCALE, layout=self.layout)
        return enqueue_us(lambda: plan.run(self.q, self.k, self.v))

    def gathered(self):
        """k, v [n, kv_heads, head_dim]: the sequence's K and V gathered through the block table."""
        return (c[self.tables[0].long()].reshape(-1, KV_HEADS, HEAD_DIM) for c in (self.k, self.v))

    def contiguous(self):
        """q, k, v as [1, heads, tokens, head_dim], K/V gathered through the block table."""
        k, v = self.gathered()
        return (t.transpose(0, 1)[None].contiguous() for t in (self.q, k, v))

    def tflops(self, ms: float) -> float:
        return FLOPS_PER_PAIR_PER_DIM * HEAD_DIM * self.pairs / ms / 1e9


def flex_block_mask(n: int, block_q: int, block_kv: int):
    """Flex's BlockMask of the Phi-3 layout over n tokens (full prefill), full and partial blocks apart."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = n // SPARSE_BLOCK
    mask = phi3_layout().block_mask(HEADS, nb).cuda()  # [H, NB, NB]
    rq, rk = block_q // SPARSE_BLOCK, block_kv // SPARSE_BLOCK
    grid = mask.view(HEADS, nb // rq, rq, nb // rk, rk)
    any_, all_ = grid.any(4).any(2), grid.all(4).all(2)
    qi = torch.arange(nb // rq, device="cuda").view(-1, 1)
    ki = torch.arange(nb // rk, device="cuda").view(1, -1)
    # A key tile is causally full for a query tile when its last key precedes the tile's first query.
    full = all_ & ((ki + 1) * block_kv <= qi * block_q + 1)
    partial = any_ & ~full

    def compact(m):
        counts = m.sum(-1, dtype=torch.int32)
        order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return counts[None].contiguous(), order[None].contiguous()

    step = max(1, VERT_STRIDE // HEADS)

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // SPARSE_BLOCK, kv_idx // SPARSE_BLOCK
        return (kv_idx <= q_idx) & (((qb - kb) < LOCAL_BLOCKS) | ((kb + h * step + 1) % VERT_STRIDE == 0))

    return BlockMask.from_kv_blocks(
        *compact(partial), *compact(full), BLOCK_SIZE=(block_q, block_kv), mask_mod=mask_mod
    )


def time_flex(flex, p: Prefill, block_q: int, block_kv: int, ours: torch.Tensor) -> dict:
    """Compiled FlexAttention on p's contiguous K/V with the given block sizes: ms and max |diff| to ours."""
    name = f"flex_{block_q}x{block_kv}"
    try:
        qh, kh, vh = p.contiguous()
        mask = flex_block_mask(p.n, block_q, block_kv)
        options = dict(BLOCK_M=block_q, BLOCK_N=block_kv)

        def call():
            return flex(qh, kh, vh, block_mask=mask, scale=SCALE, enable_gqa=True, kernel_options=options)

        diff = (call()[0].transpose(0, 1).float() - ours.float()).abs().max().item()
        return {f"{name}_ms": bench(call), f"{name}_max_diff": diff}
    except Exception as exc:  # noqa: BLE001 - a failed baseline is reported, not fatal
        return {f"{name}_error": repr(exc)[:200]}


def time_sdpa(p: Prefill, name: str) -> dict:
    """torch SDPA (dense causal) on p's contiguous K/V through one backend ("flash" or "cudnn")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    qh, kh, vh = p.contiguous()
    group = HEADS // KV_HEADS
    kr, vr = (t.repeat_interleave(group, 1).contiguous() for t in (kh, vh))
    try:
        with sdpa_kernel(backend):
            return {
                f"sdpa_{name}_ms": bench(
                    lambda: F.scaled_dot_product_attention(qh, kr, vr, is_causal=True, scale=SCALE)
                )
            }
    except Exception as exc:  # noqa: BLE001
        return {f"sdpa_{name}_error": repr(exc)[:200]}


def prefill_rows(previous, gen) -> tuple[list[dict], list[dict]]:
    """The issue's table (Phi-3 layout) with Flex at the full-prefill points, and dense against SDPA."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    rows, dense_rows = [], []
    for n, queries in ROWS:
        p = Prefill(n, queries, phi3_layout(), gen)
        row = dict(tokens=n, queries=queries, vllm_ms=VLLM_MS[(n, queries)], work_share=p.work_share)
        row |= dict(planned_ms=p.planned(), op_ms=p.op(), enqueue_us=p.enqueue_us())
        row["tflops"] = p.tflops(row["planned_ms"])
        if previous is not None and n < 131072:
            row["previous_ms"] = p.previous()
        if queries == n:
            ours = kernels.paged_prefill(*p.args(), scale=SCALE, layout=p.layout)
            for block_q, block_kv in FLEX_BLOCKS[n]:
                row |= time_flex(flex, p, block_q, block_kv, ours)
        rows.append(row)
        print(row, flush=True)
        if queries == n and n <= 32768:
            d = Prefill(n, n, None, gen)
            dense = dict(tokens=n, planned_ms=d.planned(), op_ms=d.op())
            dense["tflops"] = d.tflops(dense["planned_ms"])
            if previous is not None:
                dense["previous_ms"] = d.previous()
            dense |= time_sdpa(d, "flash") | time_sdpa(d, "cudnn")
            dense_rows.append(dense)
            print(dense, flush=True)
    return rows, dense_rows


def must_read_bytes(n: int, layout) -> int:
    """K/V bytes one decode step must read for one sequence: every key block some query head of a
    KV head's group may see (dense: all), for K and V."""
    nb = -(-n // SPARSE_BLOCK)
    if layout is None:
        blocks = nb * KV_HEADS
    else:
        last = layout.block_mask(HEADS, nb)[:, -1, :]  # [H, NB]: the query's block row
        blocks = int(last.view(KV_HEADS, HEADS // KV_HEADS, nb).any(1).sum())
    return 2 * blocks * SPARSE_BLOCK * HEAD_DIM * torch.finfo(DTYPE).bits // 8


class Decode:
    """One decode step of DECODE_BATCH sequences of n tokens and its timings."""

    def __init__(self, n: int, layout, gen):
        self.k, self.v, self.tables = paged(n, DECODE_BATCH, gen)
        self.q = torch.randn(DECODE_BATCH, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.seq_lens = torch.full((DECODE_BATCH,), n, dtype=torch.int32, device="cuda")
        self.layout = layout
        self.nbytes = DECODE_BATCH * must_read_bytes(n, layout)

    def args(self):
        return self.q, self.k, self.v, self.tables, self.seq_lens

    def planned(self) -> float:
        plan = kernels.plan_decode(*self.args(), scale=SCALE, layout=self.layout)
        return bench(lambda: plan.run(self.q, self.k, self.v))

    def op(self) -> float:
        return bench(lambda: kernels.paged_decode(*self.args(), scale=SCALE, layout=self.layout))

    def previous(self) -> float:
        module = importlib.import_module("kernels_prev.paged_decode")
        plan = module.plan_decode(*self.args(), scale=SCALE, layout=self.layout)
        return bench(lambda: plan.run(self.q, self.k, self.v))

    def enqueue_us(self) -> float:
        plan = kernels.plan_decode(*self.args(), scale=SCALE, layout=self.layout)
        return enqueue_us(lambda: plan.run(self.q, self.k, self.v))


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, bytes read plus bytes written."""
    src = torch.empty(COPY_BYTES // 2, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / bench(lambda: dst.copy_(src)) / MS_TO_GBPS


def decode_rows(previous, copy_gbps: float, gen) -> list[dict]:
    rows = []
    for n in DECODE_CONTEXTS:
        for name, layout in (("dense", None), ("Phi-3 sparse", phi3_layout())):
            d = Decode(n, layout, gen)
            row = dict(
                context=n,
                layout=name,
                must_read_mb=d.nbytes / 1e6,
                planned_ms=d.planned(),
                op_ms=d.op(),
                enqueue_us=d.enqueue_us(),
            )
            if previous is not None:
                row["previous_ms"] = d.previous()
            for key in ("planned", "op", "previous"):
                if f"{key}_ms" in row:
                    row[f"{key}_of_copy"] = d.nbytes / row[f"{key}_ms"] / MS_TO_GBPS / copy_gbps
            rows.append(row)
            print(row, flush=True)
            del d
    return rows


def matmul_tflops() -> float:
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=DTYPE)
    b = torch.randn_like(a)
    return 2 * MATMUL_N**3 / bench(lambda: a @ b) / 1e9


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _met(ok) -> str:
    return "met" if ok else "NOT met"


def _table(header: tuple[str, ...], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


PREFILL_COLUMNS = (
    "tokens",
    "queries",
    "ours planned ms (TFLOP/s)",
    "ours op ms",
    "op / planned (target <= 1.10)",
    "planned enqueue µs (target <= 40)",
    "vLLM ms (issue)",
    "vLLM / ours (target >= 1.25)",
    "Flex 64x64 ms",
    "Flex 128x64 ms",
    "best Flex / ours",
    "proxy target",
    "previous commit ms",
)
PREFIX_COLUMNS = (
    "tokens",
    "queries",
    "ms",
    "full ms",
    "time / full",
    "ideal work ratio",
    "gap",
    "target <= +0.03",
)
DENSE_COLUMNS = (
    "tokens",
    "ours planned ms (TFLOP/s)",
    "ours op ms",
    "SDPA flash ms",
    "SDPA cuDNN ms",
    "ours / flash time",
    "target <= 1",
    "previous commit ms",
)
DECODE_COLUMNS = (
    "context",
    "layout",
    "must-read MB",
    "planned ms",
    "planned / copy",
    "op ms",
    "op / copy",
    "target >= 0.75 (planned, op)",
    "planned enqueue µs",
    "previous commit ms",
)


def prefill_table(rows) -> list[str]:
    cells = []
    for r in rows:
        flex = [r.get(f"flex_{bq}x{bkv}_ms") for bq, bkv in ((64, 64), (128, 64))]
        best = min((f for f in flex if f is not None), default=None)
        proxy = FLEX_PROXY.get(r["tokens"]) if r["queries"] == r["tokens"] else None
        speedup = best / r["planned_ms"] if best else None
        vs = r["planned_ms"] / r["vllm_ms"]
        overhead = r["op_ms"] / r["planned_ms"]
        cells.append(
            [
                r["tokens"],
                r["queries"],
                f"{r['planned_ms']:.3f} ({r['tflops']:.0f})",
                f"{r['op_ms']:.3f}",
                f"{overhead:.2f}: {_met(overhead <= OP_OVERHEAD_TARGET)}",
                f"{r['enqueue_us']:.0f}: {_met(r['enqueue_us'] <= ENQUEUE_TARGET_US)}",
                f"{r['vllm_ms']:.3f}",
                f"{1 / vs:.2f}: {_met(vs <= TARGET_VS_VLLM)}",
                _fmt(flex[0]),
                _fmt(flex[1]),
                _fmt(speedup, 2),
                "-" if proxy is None else f">= {proxy}: {_met(speedup and speedup >= proxy)}",
                _fmt(r.get("previous_ms")),
            ]
        )
    return _table(PREFILL_COLUMNS, cells)


def prefix_table(rows) -> list[str]:
    full = {r["tokens"]: r["planned_ms"] for r in rows if r["queries"] == r["tokens"]}
    cells = []
    for r in rows:
        if r["queries"] != r["tokens"] and r["tokens"] in full:
            ratio = r["planned_ms"] / full[r["tokens"]]
            gap = ratio - r["work_share"]
            cells.append(
                [
                    r["tokens"],
                    r["queries"],
                    f"{r['planned_ms']:.3f}",
                    f"{full[r['tokens']]:.3f}",
                    f"{ratio:.3f}",
                    f"{r['work_share']:.3f}",
                    f"{gap:+.3f}",
                    _met(gap <= PREFIX_GAP_TARGET),
                ]
            )
    return _table(PREFIX_COLUMNS, cells)


def dense_table(dense_rows) -> list[str]:
    cells = []
    for d in dense_rows:
        flash = d.get("sdpa_flash_ms")
        vs = d["planned_ms"] / flash if flash else None
        cells.append(
            [
                d["tokens"],
                f"{d['planned_ms']:.3f} ({d['tflops']:.0f})",
                f"{d['op_ms']:.3f}",
                _fmt(flash),
                _fmt(d.get("sdpa_cudnn_ms")),
                _fmt(vs, 2),
                _met(vs is not None and vs <= 1),
                _fmt(d.get("previous_ms")),
            ]
        )
    return _table(DENSE_COLUMNS, cells)


def decode_table(decode) -> list[str]:
    cells = []
    for r in decode:
        met = ", ".join(_met(r[f"{k}_of_copy"] >= DECODE_TARGET) for k in ("planned", "op"))
        cells.append(
            [
                r["context"],
                r["layout"],
                f"{r['must_read_mb']:.0f}",
                f"{r['planned_ms']:.3f}",
                f"{r['planned_of_copy']:.2f}",
                f"{r['op_ms']:.3f}",
                f"{r['op_of_copy']:.2f}",
                met,
                f"{r['enqueue_us']:.0f}",
                _fmt(r.get("previous_ms")),
            ]
        )
    return _table(DECODE_COLUMNS, cells)


def markdown(device, matmul, copy_gbps, rows, dense_rows, decode, previous) -> str:
    method = " ".join(__doc__.split("\n\n")[1].split())
    lines = [
        "# Kernel benchmark",
        "",
        f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}. {method}",
        "",
        f"Ceilings measured in this run: bf16 matmul {MATMUL_N}^3 at {matmul:.0f} TFLOP/s; device copy at "
        f"{copy_gbps:.0f} GB/s (bytes read + written).",
        "",
        "## Sparse prefill (Phi-3 layout), against vLLM's kernel and FlexAttention",
        "",
        *prefill_table(rows),
    ]
    if rows:
        worst = max(r["op_ms"] / r["planned_ms"] for r in rows)
        lines += [
            "",
            f"Public op: at most {worst:.2f}x the planned time over the rows (target <= "
            f"{OP_OVERHEAD_TARGET}: {_met(worst <= OP_OVERHEAD_TARGET)}).",
        ]
    lines += [
        "",
        "## Prefix-cached sparse prefill: time(queries) / time(full) against the ideal work ratio",
        "",
    ]
    lines += prefix_table(rows)
    lines += ["", "## Dense causal prefill against SDPA", "", *dense_table(dense_rows)]
    lines += [
        "",
        f"## Decode, batch {DECODE_BATCH}, against the copy ceiling",
        "",
        "Bytes: the K/V one step must read (Phi-3: every key block some query head of the KV head's group "
        "may see; dense: all of it).",
        "",
        *decode_table(decode),
    ]
    if previous is not None:
        lines += [
            "",
            f"Previous commit: the kernels of `{previous}` (reports/previous_kernels.sh), timed in the "
            "same process through their own plans (`plan.run`, metadata planned outside the timed region).",
        ]
    return "\n".join(lines) + "\n"


def main(out_dir: pathlib.Path, previous: pathlib.Path | None = None) -> None:
    """Runs every section and writes kernels-bench.md and kernels-bench.json under `out_dir`."""
    commit = None
    if previous is not None:
        sys.path.insert(0, str(pathlib.Path(previous).resolve()))
        commit = (pathlib.Path(previous) / "kernels_prev" / "COMMIT").read_text().strip()
    gen = torch.Generator().manual_seed(0)
    matmul, copy_gbps = matmul_tflops(), copy_bandwidth()
    decode = decode_rows(previous, copy_gbps, gen)
    rows, dense_rows = prefill_rows(previous, gen)
    device = torch.cuda.get_device_name()
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(device, matmul, copy_gbps, rows, dense_rows, decode, commit)
    (out_dir / "kernels-bench.md").write_text(md)
    data = dict(
        device=device,
        matmul_tflops=matmul,
        copy_gbps=copy_gbps,
        prefill=rows,
        dense=dense_rows,
        decode=decode,
        previous_commit=commit,
    )
    (out_dir / "kernels-bench.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(md)
    print(f"bench kernels: wrote {out_dir / 'kernels-bench.md'} and {out_dir / 'kernels-bench.json'}")
