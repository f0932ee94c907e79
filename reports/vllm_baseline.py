"""vLLM's block-sparse prefill kernel as a same-process baseline for issue 16's speed target.

Issue 16's vLLM times were measured in another run; the same Hopper binary has moved by 10% between
runs (reports/gpu/kernel-ab.md §15), so the target's ratio is only sound with vLLM's kernel timed in
the same process. vllm 0.9.2 is the last release that ships it (`vllm/attention/ops/
blocksparse_attention/blocksparse_attention_kernel.py`, a Triton kernel; 0.10 and later do not).

    python -m reports.vllm_baseline --fetch DIR   pip-downloads the wheel (no dependencies) and takes
                                                  out that one file into DIR (git-ignored: .vllm/),
                                                  with stubs for the one vllm import it makes
    python -m reports.vllm_baseline --check DIR   runs it on a small Phi-3-style prefill against the
                                                  float64 oracle, with our Triton kernel beside it
                                                  (CPU: under TRITON_INTERPRET=1)

`reports/hopper_ab.py --vllm DIR` times it beside our paths on every Phi-3 row. Its host function
checks that a sequence's queries are all its tokens or one; the kernel itself takes a prefix (its
`past_len`), so the copy drops that check, and the rows with 50/25/10% of the tokens as queries run.
It reads the layout as a CSR of key blocks per query head and block row: `csr` builds that from our
layout's block mask, so it computes exactly the layout the oracle does, with int64 indices as vLLM's
own `dense_to_crow_col` makes them. So fed, its times on the H200 match issue 16's within 0-2%; an
int32 CSR slows it by 5-15% (reports/gpu/kernel-ab.md §16).
"""

import argparse
import importlib
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import torch

VERSION = "0.9.2"
KERNEL = "vllm/attention/ops/blocksparse_attention/blocksparse_attention_kernel.py"
HOST_CHECK = "assert torch.logical_or(q_lens == 1, k_lens == q_lens).all(), ("
STUBS = {
    "vllm/__init__.py": "",
    "vllm/attention/__init__.py": "",
    "vllm/attention/ops/__init__.py": "",
    "vllm/attention/ops/blocksparse_attention/__init__.py": "",
    "vllm/triton_utils.py": "import triton\nimport triton.language as tl\n",
}


def fetch(dest: pathlib.Path) -> None:
    """vLLM's kernel file (host check dropped) and the stub modules it imports, under dest."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps", "-q", "-d", tmp],
            check=True,
        )
        (wheel,) = pathlib.Path(tmp).glob("vllm-*.whl")
        source = zipfile.ZipFile(wheel).read(KERNEL).decode()
    if source.count(HOST_CHECK) != 1:
        raise ValueError(f"vllm {VERSION}'s {KERNEL} no longer holds its host check")
    for path, text in {**STUBS, KERNEL: source.replace(HOST_CHECK, "assert True, (")}.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)


def csr(block_mask: torch.Tensor, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout as vLLM's kernel reads it: crow [H, NB + 1] and col [H, max row] (key blocks of each
    block row, ascending, padded with -1), from block_mask bool [H, NB, NB]. int64 by default, as
    vLLM's own `dense_to_crow_col` makes them (numpy's index arrays)."""
    counts = block_mask.sum(-1, dtype=dtype)
    crow = torch.nn.functional.pad(counts.cumsum(-1, dtype=dtype), (1, 0))
    heads, width = block_mask.shape[0], int(crow[:, -1].max())
    col = torch.full((heads, max(width, 1)), -1, dtype=dtype)
    for h in range(heads):
        col[h, : int(crow[h, -1])] = block_mask[h].nonzero()[:, 1].to(dtype)
    return crow, col


class VllmPrefill:
    """vLLM's kernel on one prefill: q [queries, H, D], the sequence's k and v [n, H_kv, D] (contiguous),
    its last `queries` tokens the queries; `block_mask` bool [H, NB, NB] with causality included.

    The host function (its syncs and small copies) runs once, at construction, with its launch
    recorded; a call relaunches that kernel with the same arguments and returns out [queries, H, D].
    `index_dtype`: the CSR's (vLLM's int64; int32 for a check that it does not slow the kernel).
    """

    def __init__(
        self, dest: pathlib.Path, q, k, v, block_mask: torch.Tensor, block_size: int, scale: float,
        index_dtype: torch.dtype = torch.int64,
    ):  # fmt: skip
        if str(dest) not in sys.path:  # one baseline a row, the path once
            sys.path.insert(0, str(dest))
        module = importlib.import_module(KERNEL.removesuffix(".py").replace("/", "."))
        kernel, launches = module._fwd_kernel_batch_inference, []

        class Recorder:  # stands in for the kernel while the host function runs
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append((grid, args, kwargs))
                    return kernel[grid](*args, **kwargs)

                return launch

        crow, col = (t.to(q.device) for t in csr(block_mask, index_dtype))
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        module._fwd_kernel_batch_inference = Recorder()
        try:
            self.out = module.blocksparse_flash_attn_varlen_fwd(
                q, k, v, cu_k, cu_q, scale, (crow, col), block_size=block_size, max_seqlen=k.shape[0]
            )
        finally:
            module._fwd_kernel_batch_inference = kernel
        ((self.grid, self.args, self.kwargs),) = launches
        self.kernel = kernel

    def __call__(self) -> torch.Tensor:
        self.kernel[self.grid](*self.args, **self.kwargs)
        return self.out


def check(dest: pathlib.Path, device: str) -> dict:
    """vLLM's kernel and our op judged against the float64 oracle (contract §5: passed, and the error's
    ratio to its allowance) on one Phi-3-style prefill (local and vertical blocks per head, 192 queries
    after a 320-token prefix, GQA 2)."""
    from harness.cases import AttentionCase, LayoutSpec, attention_args, build_inputs
    from harness.judge import error_stats, oracle
    from kernels import paged_prefill
    from reference.validation import validate_paged_prefill

    layout = LayoutSpec("local_strided", 64, 2, 2, num_heads_total=4)
    case = AttentionCase(0, (512,), (192,), 4, 2, 64, 16, "float16", layout=layout)
    inputs = build_inputs(case, device)
    truth = oracle(inputs)
    table = inputs["block_tables"][0, : 512 // 16].long()  # the rest of the row is padding
    k, v = (inputs[c][table].flatten(0, 1)[:512] for c in ("k_cache", "v_cache"))
    mask = inputs["layout"].block_mask(4, 512 // 64)
    args = attention_args(inputs, decode=False)
    ours = paged_prefill(*args, scale=inputs["scale"], layout=inputs["layout"])
    scale = validate_paged_prefill(*args, scale=inputs["scale"], layout=inputs["layout"]).scale
    theirs = VllmPrefill(dest, inputs["q"], k, v, mask, 64, scale)()
    judged = {}
    for name, out in (("vllm", theirs), ("ours", ours)):
        stats = error_stats(out, truth.out, *truth.bounds["out"], truth.rows)
        judged[name] = dict(passed=stats.passed, ratio=stats.ratio)
    return judged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--fetch", type=pathlib.Path)
    parser.add_argument("--check", type=pathlib.Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.fetch:
        fetch(args.fetch)
        print(f"vllm_baseline: vllm {VERSION}'s kernel in {args.fetch}")
    if args.check:
        judged = check(args.check, args.device)
        print("against the float64 oracle:", judged)
        return 0 if all(v["passed"] for v in judged.values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
