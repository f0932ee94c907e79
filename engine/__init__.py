"""A small serving engine over the suite's paged-attention ops, with automatic prefix caching.

Public names (contract §4.1): `LLM`, `SamplingParams`, `RequestOutput`. The pieces follow
nano-vllm's split: config, sequence, block_pool, scheduler, model_runner, model, engine; the model's
rotary embeddings and norms live in rope and norm, with their Triton twins for the GPU.
"""

from engine.engine import LLM
from engine.sequence import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
