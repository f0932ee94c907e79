"""Kernel benchmark (GPU only): sparse prefill vs SDPA and FlexAttention, prefix-cached prefill, decode.

Called by `python3 -m reports.bench --only kernels` (nox -s bench). Phi-3-small shapes: 32 query
heads, 8 KV heads, head_dim 128, sparse block 64, local 16, vertical stride 8, bfloat16, batch 1,
pages of 16 tokens. Times are medians of triton.testing.do_bench (warm-up, L2 flushed between runs);
effective TFLOP/s counts 4 * head_dim FLOPs per attended (query, key) pair only. Writes
kernels-bench.md and kernels-bench.json under the output folder.
"""

import importlib
import json
import pathlib
import sys

import torch
import torch.nn.functional as F
import triton

import kernels as tri
import reference as ref

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SPARSE_BLOCK, LOCAL_BLOCKS, VERT_STRIDE = 64, 16, 8
PAGE_SIZE = 16
DTYPE = torch.bfloat16
SCALE = 1.0 / 128
LENGTHS = (8192, 32768)
CACHED_FRACTIONS = (0.25, 0.5, 0.75, 0.9)
DECODE_BATCH, DECODE_CONTEXT = 64, 8192
WARMUP_MS, REP_MS = 100, 500
COPY_BYTES = 2 * 2**30
FLEX_BLOCKS = ((64, 64), (128, 64))
MS_PER_S_TO_GB = 1e6  # bytes per millisecond -> GB/s
FLOPS_PER_PAIR_PER_DIM = 4  # q.k and p.v: 2 multiply-adds per dimension


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _layout():
    return ref.LocalStridedLayout(SPARSE_BLOCK, LOCAL_BLOCKS, VERT_STRIDE, num_heads_total=HEADS)


def _pairs_per_query_block(n: int) -> torch.Tensor:
    """Attended (q, k) pairs of each query block, summed over heads: [n // S] (n a multiple of S)."""
    nb = n // SPARSE_BLOCK
    mask = _layout().block_mask(HEADS, nb).to(torch.int64)
    diag = torch.eye(nb, dtype=torch.int64)
    per_block = SPARSE_BLOCK * SPARSE_BLOCK * (1 - diag) + SPARSE_BLOCK * (SPARSE_BLOCK + 1) // 2 * diag
    return (mask * per_block).sum(dim=(0, 2))


def _paged(n: int, batch: int, device, gen):
    """A scattered paged cache holding `batch` sequences of n tokens, and their block tables."""
    pages = n // PAGE_SIZE
    order = torch.randperm(pages * batch, generator=gen).to(device)
    shape = (pages * batch, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=DTYPE)
    v_cache = torch.randn(shape, device=device, dtype=DTYPE)
    tables = order.view(batch, pages).to(torch.int32)
    return k_cache, v_cache, tables


def _contiguous_kv(cache, table_row, n):
    return cache[table_row.long()].reshape(-1, KV_HEADS, HEAD_DIM)[:n]


def _prefill_launch_only(q, k_cache, v_cache, tables, seq_lens, qsl, layout):
    """The launch alone: validation (which syncs with the host) done once, outside the timed region."""
    module = importlib.import_module("kernels.paged_prefill")
    from reference.validation import validate_paged_prefill

    batch = validate_paged_prefill(q, k_cache, v_cache, tables, seq_lens, qsl, scale=SCALE, layout=layout)
    return lambda: module._launch(batch, q, k_cache, v_cache, tables, seq_lens, qsl, layout)


def _decode_launch_only(q, k_cache, v_cache, tables, seq_lens, layout):
    module = importlib.import_module("kernels.paged_decode")
    from reference.validation import validate_paged_decode

    batch = validate_paged_decode(q, k_cache, v_cache, tables, seq_lens, scale=SCALE, layout=layout)
    return lambda: module._launch(batch, q, k_cache, v_cache, tables, seq_lens, layout)


def _flex_block_mask(n: int, block_q: int, block_kv: int, device):
    from torch.nn.attention.flex_attention import BlockMask

    nb = n // SPARSE_BLOCK
    mask = _layout().block_mask(HEADS, nb).to(device)  # [H, NB, NB]
    rq, rk = block_q // SPARSE_BLOCK, block_kv // SPARSE_BLOCK
    grid = mask.view(HEADS, nb // rq, rq, nb // rk, rk)
    any_ = grid.any(4).any(2)
    all_ = grid.all(4).all(2)
    qi = torch.arange(nb // rq, device=device).view(-1, 1)
    ki = torch.arange(nb // rk, device=device).view(1, -1)
    causal_full = (ki + 1) * block_kv <= qi * block_q + 1
    full = all_ & causal_full
    partial = any_ & ~full

    def compact(m):
        counts = m.sum(-1, dtype=torch.int32)
        idx = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return counts[None].contiguous(), idx[None].contiguous()

    step = max(1, VERT_STRIDE // HEADS)

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // SPARSE_BLOCK, kv_idx // SPARSE_BLOCK
        return (kv_idx <= q_idx) & (((qb - kb) < LOCAL_BLOCKS) | ((kb + h * step + 1) % VERT_STRIDE == 0))

    kv_num, kv_idx = compact(partial)
    full_num, full_idx = compact(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block_q, block_kv), mask_mod=mask_mod
    )


def _prefill_at(n: int, flex, device, gen) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    k_cache, v_cache, tables = _paged(n, 1, device, gen)
    q = torch.randn(n, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    layout = _layout()
    sparse_pairs = int(_pairs_per_query_block(n).sum())
    dense_pairs = HEADS * n * (n + 1) // 2

    def add(name, ms, pairs, note=""):
        tflops = FLOPS_PER_PAIR_PER_DIM * HEAD_DIM * pairs / ms / 1e9 if ms == ms else float("nan")
        rows.append(dict(tokens=n, method=name, ms=ms, tflops=tflops, pairs=pairs, note=note))

    def ours():
        return tri.paged_prefill(q, k_cache, v_cache, tables, seq_lens, qsl, scale=SCALE, layout=layout)

    add(
        "ours: sparse prefill, launch only",
        _bench(_prefill_launch_only(q, k_cache, v_cache, tables, seq_lens, qsl, layout)),
        sparse_pairs,
    )
    add("ours: sparse prefill, op (validation + launch)", _bench(ours), sparse_pairs)
    dense = _prefill_launch_only(q, k_cache, v_cache, tables, seq_lens, qsl, None)
    add("ours: dense causal prefill, launch only", _bench(dense), dense_pairs)
    k = _contiguous_kv(k_cache, tables[0], n).transpose(0, 1)[None].contiguous()
    v = _contiguous_kv(v_cache, tables[0], n).transpose(0, 1)[None].contiguous()
    qh = q.transpose(0, 1)[None].contiguous()
    group = HEADS // KV_HEADS
    k_rep, v_rep = k.repeat_interleave(group, 1).contiguous(), v.repeat_interleave(group, 1).contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = lambda: F.scaled_dot_product_attention(qh, k_rep, v_rep, is_causal=True, scale=SCALE)
        add("torch SDPA flash, dense causal", _bench(sdpa), dense_pairs, "contiguous K/V")
    for bq, bkv in FLEX_BLOCKS:
        name = f"FlexAttention compiled, blocks {bq}x{bkv}"
        try:
            bm = _flex_block_mask(n, bq, bkv, device)
            opts = dict(BLOCK_M=bq, BLOCK_N=bkv)

            def fx(bm=bm, opts=opts):
                return flex(qh, k, v, block_mask=bm, scale=SCALE, enable_gqa=True, kernel_options=opts)

            ms = _bench(fx)
            # Same function as ours? A sanity check of the baseline, not a test.
            diff = (fx()[0].transpose(0, 1).float() - ours().float()).abs().max().item()
            add(name, ms, sparse_pairs, f"max abs diff vs ours {diff:.1e}")
        except Exception as e:  # noqa: BLE001 - a failed baseline is reported, not fatal
            add(name, float("nan"), sparse_pairs, f"failed: {e!r}"[:160])
    return rows


def _prefill_rows(device, gen) -> list[dict]:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    return [row for n in LENGTHS for row in _prefill_at(n, flex, device, gen)]


def _prefix_at(n: int, device, gen) -> list[dict]:
    k_cache, v_cache, tables = _paged(n, 1, device, gen)
    layout = _layout()
    per_block = _pairs_per_query_block(n).double()
    seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
    q_full = torch.randn(n, HEADS, HEAD_DIM, device=device, dtype=DTYPE)

    def prefill(context):
        q = q_full[context:].contiguous()
        qsl = torch.tensor([0, n - context], dtype=torch.int32, device=device)
        return _bench(_prefill_launch_only(q, k_cache, v_cache, tables, seq_lens, qsl, layout))

    full_ms = prefill(0)
    rows = []
    for frac in CACHED_FRACTIONS:
        context = int(n * frac)
        ms = prefill(context)
        # context is a multiple of S at these sizes: whole query blocks drop out of the work
        ideal = float(per_block[context // SPARSE_BLOCK :].sum() / per_block.sum())
        ratio = ms / full_ms
        rows.append(
            dict(tokens=n, cached=frac, ms=ms, full_ms=full_ms, ratio=ratio, ideal=ideal, gap=ratio - ideal)
        )
    return rows


def _prefix_rows(device, gen) -> list[dict]:
    return [row for n in LENGTHS for row in _prefix_at(n, device, gen)]


def _decode_rows(device, gen) -> list[dict]:
    src = torch.empty(COPY_BYTES // 2, dtype=DTYPE, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    copy_bw = 2 * COPY_BYTES / copy_ms / MS_PER_S_TO_GB  # GB/s, bytes read + bytes written
    k_cache, v_cache, tables = _paged(DECODE_CONTEXT, DECODE_BATCH, device, gen)
    q = torch.randn(DECODE_BATCH, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    seq_lens = torch.full((DECODE_BATCH,), DECODE_CONTEXT, dtype=torch.int32, device=device)
    kv_bytes = 2 * DECODE_BATCH * DECODE_CONTEXT * KV_HEADS * HEAD_DIM * k_cache.element_size()
    rows = [dict(method="device copy (read + write)", ms=copy_ms, gbps=copy_bw, frac=1.0)]
    for name, layout in (("dense", None), ("Phi-3 sparse", _layout())):
        op = lambda layout=layout: tri.paged_decode(
            q, k_cache, v_cache, tables, seq_lens, scale=SCALE, layout=layout
        )
        launch = _decode_launch_only(q, k_cache, v_cache, tables, seq_lens, layout)
        for how, fn in (("launch only", launch), ("op (validation + launch)", op)):
            ms = _bench(fn)
            gbps = kv_bytes / ms / MS_PER_S_TO_GB
            rows.append(
                dict(method=f"ours: paged decode, {name}, {how}", ms=ms, gbps=gbps, frac=gbps / copy_bw)
            )
    return rows


# Config sweep (predictions and outcomes go to docs/kernels-notes.md): alternatives to the defaults,
# timed in the same run. Prefill: (BLOCK_M, BLOCK_N, warps, stages); decode: the same without BLOCK_M,
# plus programs per SM (how many splits).
PREFILL_SWEEP = (
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 4),
    (128, 32, 8, 3),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
)
DECODE_SWEEP = (
    (64, 2, 3, 16),
    (64, 4, 3, 8),  # the default before the 2-warp config was adopted
    (64, 2, 2, 16),
    (64, 2, 3, 8),
    (128, 4, 2, 8),
    (128, 2, 3, 16),
)


def _sweep_rows(device, gen) -> list[dict]:
    decode_module = importlib.import_module("kernels.paged_decode")
    prefill_module = importlib.import_module("kernels.paged_prefill")

    rows = []
    n = LENGTHS[0]
    k_cache, v_cache, tables = _paged(n, 1, device, gen)
    q = torch.randn(n, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    default = prefill_module.CONFIG_LARGE_D
    for config in PREFILL_SWEEP:
        prefill_module.CONFIG_LARGE_D = config
        try:
            ms = _bench(_prefill_launch_only(q, k_cache, v_cache, tables, seq_lens, qsl, _layout()))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported
            ms, config = float("nan"), (*config, repr(e)[:80])
        rows.append(dict(op=f"sparse prefill {n}", config=str(config), ms=ms))
    prefill_module.CONFIG_LARGE_D = default
    k_cache, v_cache, tables = _paged(DECODE_CONTEXT, DECODE_BATCH, device, gen)
    q = torch.randn(DECODE_BATCH, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    seq_lens = torch.full((DECODE_BATCH,), DECODE_CONTEXT, dtype=torch.int32, device=device)
    defaults = decode_module.CONFIG_GPU, decode_module.PROGRAMS_PER_SM
    for *config, per_sm in DECODE_SWEEP:
        decode_module.CONFIG_GPU, decode_module.PROGRAMS_PER_SM = tuple(config), per_sm
        try:
            ms = _bench(_decode_launch_only(q, k_cache, v_cache, tables, seq_lens, None))
        except Exception as e:  # noqa: BLE001
            ms, per_sm = float("nan"), f"{per_sm} {e!r}"[:80]
        rows.append(
            dict(
                op=f"dense decode B{DECODE_BATCH} L{DECODE_CONTEXT}",
                config=f"{tuple(config)}, {per_sm}/SM",
                ms=ms,
            )
        )
    decode_module.CONFIG_GPU, decode_module.PROGRAMS_PER_SM = defaults
    return rows


def _markdown(device_name, prefill, prefix, decode, sweep) -> str:
    lines = [
        "# Kernel benchmark",
        "",
        f"Device: {device_name}; torch {torch.__version__}, triton {triton.__version__}. Phi-3-small shapes: "
        f"{HEADS} q heads, {KV_HEADS} KV heads, D {HEAD_DIM}, S {SPARSE_BLOCK}, local {LOCAL_BLOCKS}, "
        f"vertical stride {VERT_STRIDE}, bf16, batch 1, pages of {PAGE_SIZE}. Median of do_bench "
        f"(warm-up {WARMUP_MS} ms, {REP_MS} ms of repeats, L2 flushed). TFLOP/s count "
        f"{FLOPS_PER_PAIR_PER_DIM}*D FLOPs per attended (q, k) pair only.",
        "",
        "## Prefill",
        "",
        "| tokens | method | ms | effective TFLOP/s | time / ours (sparse, launch only) | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in prefill:
        ours = next(
            x["ms"]
            for x in prefill
            if x["tokens"] == r["tokens"] and x["method"] == "ours: sparse prefill, launch only"
        )
        cells = (
            r["tokens"],
            r["method"],
            f"{r['ms']:.3f}",
            f"{r['tflops']:.1f}",
            f"{r['ms'] / ours:.2f}",
            r["note"],
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "## Prefix-cached sparse prefill (prefix read through the block table)",
        "",
        "| tokens | cached | ms | full prefill ms | time / full | ideal work ratio | gap |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in prefix:
        lines.append(
            f"| {r['tokens']} | {r['cached']:.0%} | {r['ms']:.3f} | {r['full_ms']:.3f} | {r['ratio']:.3f} | "
            f"{r['ideal']:.3f} | {r['gap']:+.3f} |"
        )
    lines += [
        "",
        f"## Decode (batch {DECODE_BATCH}, context {DECODE_CONTEXT}, pages of {PAGE_SIZE})",
        "",
        "| method | ms | GB/s (KV bytes read; copy: read + write) | fraction of copy bandwidth |",
        "| --- | --- | --- | --- |",
    ]
    for r in decode:
        lines.append(f"| {r['method']} | {r['ms']:.3f} | {r['gbps']:.0f} | {r['frac']:.2f} |")
    lines += [
        "",
        "## Config sweep (first row of each operator is the committed default)",
        "",
        "| operator | config | ms |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {r['op']} | {r['config']} | {r['ms']:.3f} |" for r in sweep]
    return "\n".join(lines) + "\n"


def main(out_dir: pathlib.Path) -> None:
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; nothing to do.")
        return
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    prefill = _prefill_rows(device, gen)
    prefix = _prefix_rows(device, gen)
    decode = _decode_rows(device, gen)
    sweep = _sweep_rows(device, gen)
    md = _markdown(torch.cuda.get_device_name(), prefill, prefix, decode, sweep)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels-bench.md").write_text(md)
    (out_dir / "kernels-bench.json").write_text(
        json.dumps(dict(prefill=prefill, prefix=prefix, decode=decode, sweep=sweep), indent=1, default=str)
        + "\n"
    )
    print(md)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path("reports/gpu"))
