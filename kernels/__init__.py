"""Triton twins of the oracle's operators (SPEC section 4), with identical signatures.

Each operator validates its arguments with the oracle's shared validation before any launch. The
same source runs on the GPU and on the CPU under TRITON_INTERPRET=1.
"""

from kernels.paged_decode import paged_decode
from kernels.paged_prefill import paged_prefill
from kernels.write_kv import write_kv

__all__ = ["paged_decode", "paged_prefill", "write_kv"]
