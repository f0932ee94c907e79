"""Time-boxed fuzz campaigns of the kernels and the engine against the oracle (`python -m fuzz`).

Modules: `campaign` (the parent: workers, progress bar, summary), `worker` (hypothesis loop and
shrinking in one process), `targets` and `engine_target` (what one case checks), `backends` (the
implementations under test), `case_file` (save and replay), `ledger` (known failures).
This package imports nothing heavy at import time: the parent sets TRITON_INTERPRET and
CUDA_VISIBLE_DEVICES for each worker before torch or triton are imported there.
"""
