"""Fuzz campaigns of any implementation (contract §9) and of the engine against the oracle (`python -m fuzz`).

Modules: `campaign` (the parent: workers, progress line, ledger replay, summary), `worker` (the
hypothesis loop and shrinking in one spawned process), `targets` and `engine_target` (what one case
checks, through the harness), `summary` (counts and how they are said), `case_file` (save and
replay), `backend_names` (implementation names that mean the same from any working directory) and
`ledger` (known failures). The implementations come from `backends.registry` only.
This package imports nothing heavy at import time: the parent sets TRITON_INTERPRET and
CUDA_VISIBLE_DEVICES for each worker before torch or triton are imported there.
"""
