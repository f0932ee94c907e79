"""Engine knobs in one place: `EngineConfig` validates every value when it is built."""

from dataclasses import dataclass

import torch

from reference.layouts import check_int

DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_NUM_PAGES = 512
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_MAX_NUM_SEQS = 16


@dataclass(slots=True)
class EngineConfig:
    """Everything an `LLM` is built from.

    Args:
        model (str):
            A name of `engine.model.MODEL_CONFIGS`. Default: `"tiny"`.
        page_size (int):
            Tokens per KV-cache page, the prefix-cache unit. Default: `16`.
        num_pages (int):
            Pages in the KV cache (shared by all layers' caches). Default: `512`.
        enable_prefix_caching (bool):
            Automatic prefix caching (contract §6). Default: `True`.
        backend (str | None):
            The attention implementation, named as everywhere in the suite (backends/registry.py):
            `"reference"` (the float64 oracle), `"triton"` (the `kernels` module), or
            `package.module:attribute` / `path/to/file.py:attribute`; it must provide all three
            operators. Default: `None`, `"triton"` when a GPU is present, else `"reference"` (the CPU
            interpreter is slow).
        seed (int):
            Seeds the weights, the prefix-hash seed and the sampler. Default: `0`.
        max_num_batched_tokens (int):
            Token budget of one step; longer prompts are prefilled in chunks. Default: `512`.
        max_num_seqs (int):
            Most sequences running at once. Default: `16`.
        dtype (str | None):
            Weights, activations and KV cache. Default: `None`, float32 on the CPU, bfloat16 on a GPU.
        device (str | None):
            Default: `None`, `"cuda"` when a GPU is present, else `"cpu"`.
        record_logits (bool):
            Keep each sampled step's full logits on the output (for equivalence tests). Default: `False`.
        enforce_eager (bool):
            Run every step eagerly. Otherwise, on a GPU with a backend that declares the `graphs`
            capability, decode steps replay CUDA graphs (engine/cuda_graphs.py). Default: `False`.
        async_decode (bool):
            A decode step replayed from a CUDA graph launches the next decode step before its tokens
            are read, when every running sequence goes on decoding greedily (`LLM.step`): the GPU then
            runs while the host reads, schedules and packs. Default: `True`.
    """

    model: str = "tiny"
    page_size: int = 16
    num_pages: int = DEFAULT_NUM_PAGES
    enable_prefix_caching: bool = True
    backend: str | None = None
    seed: int = 0
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    dtype: str | None = None
    device: str | None = None
    record_logits: bool = False
    enforce_eager: bool = False
    async_decode: bool = True

    def __post_init__(self):
        if not isinstance(self.model, str):
            raise TypeError(f"model must be a str, got {type(self.model).__name__}")
        check_int("page_size", self.page_size, 1)
        check_int("num_pages", self.num_pages, 1)
        check_int("seed", self.seed, 0)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        for name in ("enable_prefix_caching", "record_logits", "enforce_eager", "async_decode"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.backend is None:
            self.backend = "triton" if torch.cuda.is_available() else "reference"
        if not isinstance(self.backend, str) or not self.backend:
            raise TypeError(f"backend must be an implementation name (str), got {self.backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be None or one of {DTYPES}, got {self.dtype!r}")
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"device must be a str or None, got {type(self.device).__name__}")
