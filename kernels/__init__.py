"""Triton twins of the oracle's operators (contract §4), with identical signatures.

Each operator validates its arguments with the oracle's shared validation before any launch. The
same source runs on the GPU and on the CPU under TRITON_INTERPRET=1. `plan_prefill` / `plan_decode`
are the planned path: validate once, then `plan.run(q, k_cache, v_cache)` per layer.
"""

import warnings

from kernels.paged_decode import paged_decode, plan_decode
from kernels.paged_prefill import paged_prefill, plan_prefill
from kernels.write_kv import plan_write_kv, write_kv

# Under TRITON_INTERPRET=1 numpy evaluates the kernels: masked scores are -inf and the NaN rule's
# inputs are non-finite on purpose (contract §4), so numpy's floating-point warnings say nothing.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")

# Contract §9's defaults, plus: the plans read their metadata at every launch (the engine's decode
# steps may run as CUDA graphs; kernels/paged_decode.py plans splits for any sequence up to the longest).
capabilities = {"graphs": True}

__all__ = ["paged_decode", "paged_prefill", "plan_decode", "plan_prefill", "plan_write_kv", "write_kv"]
