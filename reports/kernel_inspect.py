"""Compile the kernels for a GPU target on a machine without one, and report what the compiler did.

`python -m reports.kernel_inspect [--arch 90] [--case NAME ...] [--dump DIR] [--hopper]` runs the
public ops on CPU tensors with every launch intercepted, compiles each launch for `sm_<arch>` with
triton's bundled ptxas (no driver needed), and prints per kernel: registers and spills (ptxas -v),
shared memory, whether the key loop's loads became asynchronous copies (software pipelining), and how
many warpgroup (wgmma) and plain (mma) matrix instructions the SASS holds. It costs no device time,
so a kernel change can be checked for spills or a lost pipeline before it is timed on the GPU.
`--hopper` plans the prefill on its Hopper path (kernels/hopper_prefill.py, a Gluon kernel).

Must run without TRITON_INTERPRET (the kernels must be compiled, not interpreted).
"""

import argparse
import contextlib
import importlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("reports.kernel_inspect compiles the kernels: run it without TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime import jit  # noqa: E402

import kernels  # noqa: E402
from harness.cases import AttentionCase, LayoutSpec, attention_args, build_inputs  # noqa: E402

decode_module = importlib.import_module("kernels.paged_decode")
hopper_module = importlib.import_module("kernels.hopper_prefill")

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PHI3 = LayoutSpec("local_strided", 64, 16, 8, num_heads_total=32)
# name -> (case, decode): Phi-3-small shapes (32 q heads, 8 KV heads, D 128, S 64, pages of 16).
CASES = {
    "prefill-phi3": (AttentionCase(0, (4096,), (4096,), 32, 8, 128, 16, "bfloat16", layout=PHI3), False),
    "prefill-dense": (AttentionCase(0, (4096,), (4096,), 32, 8, 128, 16, "bfloat16"), False),
    "prefill-block-mask": (
        AttentionCase(
            0, (1024,), (1024,), 32, 8, 128, 16, "bfloat16", layout=LayoutSpec("block_mask", 64, density=0.3)
        ),
        False,
    ),
    "decode-dense": (AttentionCase(0, (4096,) * 4, (1,) * 4, 32, 8, 128, 16, "bfloat16"), True),
    "decode-phi3": (AttentionCase(0, (4096,) * 4, (1,) * 4, 32, 8, 128, 16, "bfloat16", layout=PHI3), True),
}
H200_SMS = 132  # the Hopper path's persistent grid
DECODE_SPLITS = 8  # what _num_splits picks needs a device; any count compiles the same kernel


@contextlib.contextmanager
def intercepted_launches(hopper: bool):
    """Within the block, kernel launches record (kernel, args, kwargs) instead of running; with
    `hopper`, plans take the Hopper path as they would on an sm_90 GPU."""
    launches, original = [], jit.JITFunction.run
    on_hopper, hopper_module.on_hopper = hopper_module.on_hopper, lambda device: hopper
    enabled, hopper_module.ENABLED = hopper_module.ENABLED, hopper
    num_sms, hopper_module.num_sms = hopper_module.num_sms, lambda device: H200_SMS

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    jit.JITFunction.run = record
    splits, decode_module._num_splits = decode_module._num_splits, lambda *a: DECODE_SPLITS
    try:
        yield launches
    finally:
        jit.JITFunction.run = original
        decode_module._num_splits = splits
        hopper_module.on_hopper, hopper_module.ENABLED = on_hopper, enabled
        hopper_module.num_sms = num_sms


def compile_for(kernel, args, kwargs, arch: int):
    """The compiled kernel for sm_<arch>, specialized exactly as a launch with these arguments is."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    return triton.compile(
        source(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
    )


def ptxas_and_sass(compiled, arch: int) -> tuple[str, str]:
    """What ptxas -v reports (registers, spills, its C#### notes) and the SASS of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        arch_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        report = subprocess.run(
            [BIN / "ptxas", "-v", f"-arch={arch_name}", str(ptx), "-o", str(pathlib.Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        ).stderr
        sass = subprocess.run(
            [BIN / "cuobjdump", "--dump-sass", str(pathlib.Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        ).stdout
    return report, sass


def resources(compiled, arch: int) -> dict:
    """Registers, spill bytes and matrix/async instruction counts of a compiled kernel."""
    report, sass = ptxas_and_sass(compiled, arch)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    ttgir = compiled.asm["ttgir"]
    return dict(
        registers=int(regs.group(1)) if regs else None,
        spill_stores=int(spills.group(1)) if spills else None,
        spill_loads=int(spills.group(2)) if spills else None,
        shared_bytes=compiled.metadata.shared,
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        async_copies=ttgir.count("async_copy_global_to_local"),
        wgmma=len(re.findall(r"\bHGMMA\b", sass)),
        mma=len(re.findall(r"\bHMMA\b", sass)),
    )


def inspect_case(name: str, arch: int, dump: pathlib.Path | None, hopper: bool = False) -> list[dict]:
    case, decode = CASES[name]
    inputs = build_inputs(case, "cpu")
    fn = kernels.paged_decode if decode else kernels.paged_prefill
    with intercepted_launches(hopper) as launches:
        fn(*attention_args(inputs, decode), scale=inputs["scale"], layout=inputs["layout"], return_lse=True)
    rows = []
    for kernel, args, kwargs in launches:
        compiled = compile_for(kernel, args, kwargs, arch)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                (dump / f"{name}-{kernel.fn.__name__}.{ext}").write_text(compiled.asm[ext])
        rows.append(dict(case=name, kernel=kernel.fn.__name__) | resources(compiled, arch))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="repeatable; default: all")
    parser.add_argument("--dump", type=pathlib.Path, help="also write each kernel's TTGIR and PTX here")
    parser.add_argument("--hopper", action="store_true", help="plans take the Hopper (Gluon) path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cols = ("case", "kernel", "num_warps", "num_stages", "registers", "spill_stores", "spill_loads",
            "shared_bytes", "async_copies", "wgmma", "mma")  # fmt: skip
    print(" | ".join(cols))
    for name in args.case or sorted(CASES):
        for row in inspect_case(name, args.arch, args.dump, args.hopper):
            print(" | ".join(str(row[c]) for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
