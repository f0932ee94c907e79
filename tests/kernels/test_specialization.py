"""Plans share compiled kernels (kernels._common._COMPILED) only where Triton would compile one kernel:
`planned_specialization` must tell apart every planned argument that Triton specializes on."""

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from kernels._common import planned_specialization


def _probe(x, n, stride, BLOCK: tl.constexpr):
    pass


# A JITFunction built directly: under TRITON_INTERPRET=1 `triton.jit` gives the interpreter's wrapper.
PROBE = JITFunction(_probe, do_not_specialize=["stride"])
X = torch.zeros(64)
PLANNED = dict(x=X, n=32, stride=7, BLOCK=64, num_warps=4)


@pytest.mark.parametrize(
    "change",
    [
        dict(n=33),  # no longer divisible by 16
        dict(n=1),  # the value 1 compiles in
        dict(n=2**40),  # int64
        dict(BLOCK=32),  # a constexpr, by value
        dict(num_warps=8),  # a launch option
        dict(x=X[1:]),  # a base no longer 16-byte aligned
        dict(x=X.double()),  # another dtype
    ],
    ids=lambda change: ",".join(
        f"{k}={v if not isinstance(v, torch.Tensor) else 'tensor'}" for k, v in change.items()
    ),
)
def test_what_triton_compiles_apart_is_told_apart(change):
    assert planned_specialization(PROBE, PLANNED) != planned_specialization(PROBE, PLANNED | change)


@pytest.mark.parametrize(
    "change",
    [
        dict(n=48),  # divisible by 16, as 32 is
        dict(stride=32),  # do_not_specialize
        dict(x=X[4:]),  # 16 bytes on: still aligned
        dict(x=torch.ones(128)),  # another tensor of the same dtype
    ],
    ids=lambda change: ",".join(change),
)
def test_what_triton_compiles_alike_shares_a_kernel(change):
    assert planned_specialization(PROBE, PLANNED) == planned_specialization(PROBE, PLANNED | change)
