"""The kernels launched as programmatic dependents (kernels/_common.py's DEPENDENT_LAUNCH) wait for the
kernel before them before they touch memory: compiled for Hopper with WAIT_PRIOR, each one's PTX holds
`griddepcontrol.wait` ahead of its first global load or store. Triton compiles for sm_90 without a GPU,
so this runs on the CPU too; the launches themselves run on the GPU machine's engine and operator tests."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.norm_triton import add_layer_norm_kernel
from engine.rope_triton import split_rotary_kernel
from kernels import _common
from kernels.write_kv import write_kv_kernel

# kernel, its constexprs with WAIT_PRIOR on, its pointer parameters (with their element types)
KERNELS = {
    "add_layer_norm": (
        add_layer_norm_kernel,
        dict(HAS_RESIDUAL=True, BLOCK_N=4096),
        dict(x="*bf16", residual="*bf16", weight="*bf16", bias="*bf16", h="*bf16", y="*bf16"),
    ),
    "split_rotary": (
        split_rotary_kernel,
        dict(BLOCK_H=16, BLOCK_D=128),
        dict(qkv="*bf16", cos="*fp32", sin="*fp32", q="*bf16", k="*bf16", v="*bf16"),
    ),
    "write_kv": (
        write_kv_kernel,
        dict(BLOCK_H=8, BLOCK_D=128),
        dict(k="*bf16", v="*bf16", k_cache="*bf16", v_cache="*bf16", slot_mapping="*i64"),
    ),
}
FIRST_MEMORY_ACCESS = re.compile(r"\b(ld|st)\.global")


def hopper_ptx(name: str) -> tuple[str, bool]:
    """The PTX of KERNELS[name] compiled for sm_90 with WAIT_PRIOR on and launch_pdl, and the launch_pdl
    of its metadata."""
    kernel, constexprs, pointers = KERNELS[name]
    constexprs = {**constexprs, "WAIT_PRIOR": True}
    signature = {
        arg: "constexpr" if arg in constexprs else pointers.get(arg, "fp32" if arg == "eps" else "i32")
        for arg in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True})
    return compiled.asm["ptx"], compiled.metadata.launch_pdl


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{name: (ptx, launch_pdl)} of every kernel, compiled in a child process: under the interpreter
    (the CPU tests' mode, which patches triton.language process-wide) Triton cannot compile for a GPU."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_dependent_launch"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=pathlib.Path(__file__).parents[2],
    )
    return json.loads(done.stdout)


@pytest.mark.ours
@pytest.mark.parametrize("name", KERNELS)
def test_a_dependent_launch_waits_before_its_first_memory_access(compiled, name):
    ptx, launch_pdl = compiled[name]
    wait, access = ptx.find("griddepcontrol.wait"), FIRST_MEMORY_ACCESS.search(ptx)
    assert wait >= 0, "no griddepcontrol.wait in the PTX"
    assert access is not None and wait < access.start(), "a global access comes before the wait"
    assert launch_pdl


@pytest.mark.ours
def test_dependent_launch_only_on_a_hopper_gpu_and_when_switched_on(monkeypatch):
    monkeypatch.setattr(_common, "DEPENDENT_LAUNCH", True)
    assert not _common.dependent_launch(torch.device("cpu"))
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert _common.dependent_launch(torch.device("cuda")) == (hopper and not _common.interpreted())
        monkeypatch.setattr(_common, "DEPENDENT_LAUNCH", False)
        assert not _common.dependent_launch(torch.device("cuda"))


@pytest.mark.ours
@pytest.mark.parametrize("dependent", [False, True])
def test_a_dependent_launch_always_waits(monkeypatch, dependent):
    """The launch option and the kernel's wait come from one answer: launched as a dependent without its
    wait, a kernel would read what the kernel before it may still be writing."""
    monkeypatch.setattr(_common, "dependent_launch", lambda device: dependent)
    options = _common.dependent_launch_options(torch.device("cpu"))
    assert options == {"WAIT_PRIOR": dependent, "launch_pdl": dependent}


if __name__ == "__main__":
    print(json.dumps({name: hopper_ptx(name) for name in KERNELS}))
