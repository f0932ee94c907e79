"""Implementations under test for the campaign's own tests, named like anyone's kernel (contract §9):
`tests.fuzz.implementations:HEAD_ONE_ZEROED` and so on. Each is the oracle with one planted behaviour."""

from types import SimpleNamespace

import torch

import reference


def named(attr: str) -> str:
    """The registry name of one of this module's implementations."""
    return f"{__name__}:{attr}"


def _out_lse(result):
    return result if isinstance(result, tuple) else (result, None)


def _with_out(out, lse):
    return out if lse is None else (out, lse)


def head_one_zeroed_prefill(*args, **kwargs):
    """The oracle with query head 1 zeroed: wrong whenever a case has 2+ heads and a non-empty row."""
    out, lse = _out_lse(reference.paged_prefill(*args, **kwargs))
    out = out.clone()
    if out.shape[1] > 1:
        out[:, 1] = 0
    return _with_out(out, lse)


# Wrong in every dtype, so a shrink that moved the dtype would still fail (and show it).
HEAD_ONE_ZEROED = SimpleNamespace(write_kv=None, paged_prefill=head_one_zeroed_prefill, paged_decode=None)


def one_percent_off_prefill(*args, **kwargs):
    """The oracle's output times 1.01: every case with a non-empty row fails."""
    out, lse = _out_lse(reference.paged_prefill(*args, **kwargs))
    return _with_out(out * 1.01, lse)


ONE_PERCENT_OFF = SimpleNamespace(write_kv=None, paged_prefill=one_percent_off_prefill, paged_decode=None)


def _odd_tokens_refused(fn):
    def refusing(q, *args, **kwargs):
        if q.shape[0] % 2:
            raise NotImplementedError("an odd number of tokens")
        return fn(q, *args, **kwargs)

    return refusing


# Refuses about half of all cases (contract §9: such cases are unsupported, never passed or failed).
REFUSES_ODD_TOKENS = SimpleNamespace(
    write_kv=None,
    paged_prefill=_odd_tokens_refused(reference.paged_prefill),
    paged_decode=_odd_tokens_refused(reference.paged_decode),
)

NARROW_CAPABILITIES = {"dtypes": ("float16",), "layouts": ("dense",), "lse": False, "context": False}


def _check_declared(q, layout, return_lse) -> None:
    # AssertionError on purpose: judged as a crash, so a case outside the declaration fails the test.
    assert q.dtype == torch.float16, f"asked for {q.dtype}"
    assert layout is None, f"asked for layout {layout!r}"
    assert not return_lse, "asked for the lse"


def narrow_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs):
    """The oracle, refusing (by AssertionError) anything outside NARROW_CAPABILITIES."""
    _check_declared(q, kwargs.get("layout"), kwargs.get("return_lse", False))
    queries = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    assert queries == seq_lens.tolist(), f"asked for a cached context: {seq_lens.tolist()} vs {queries}"
    return reference.paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs)


def narrow_decode(q, *args, **kwargs):
    """The oracle's decode (whose context is inherent), refusing other dtypes, layouts and lse."""
    _check_declared(q, kwargs.get("layout"), kwargs.get("return_lse", False))
    return reference.paged_decode(q, *args, **kwargs)


def narrow_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """The oracle's write, refusing other dtypes."""
    assert k.dtype == torch.float16, f"asked for {k.dtype}"
    return reference.write_kv(k, v, k_cache, v_cache, slot_mapping)


NARROW = SimpleNamespace(
    write_kv=narrow_write_kv,
    paged_prefill=narrow_prefill,
    paged_decode=narrow_decode,
    capabilities=NARROW_CAPABILITIES,
)


def context_drift_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs):
    """The oracle, off by 1e-3 whenever a sequence has a cached context: the engine's warm runs (prefix
    cache hits) then differ from its cold runs."""
    result = reference.paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs)
    out, lse = _out_lse(result)
    if bool((query_start_loc[1:] - query_start_loc[:-1] < seq_lens).any()):
        out = out + 1e-3
    return _with_out(out, lse)


CONTEXT_DRIFT = SimpleNamespace(
    write_kv=reference.write_kv, paged_prefill=context_drift_prefill, paged_decode=reference.paged_decode
)


def expects_poison_prefill(*args, **kwargs):
    """The oracle, after checking that its own fresh allocation is NaN (the campaign poisons them)."""
    scratch = torch.empty(4, 4)
    if not bool(torch.isnan(scratch).all()):
        raise RuntimeError("a fresh allocation of the implementation was not NaN-poisoned")
    return reference.paged_prefill(*args, **kwargs)


EXPECTS_POISON = SimpleNamespace(write_kv=None, paged_prefill=expects_poison_prefill, paged_decode=None)


def _segfault() -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a kernel's wild pointer would


def segfaults_on_long_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs):
    """The oracle, except that a sequence of more than 40 tokens kills the process (SIGSEGV)."""
    if int(seq_lens.max()) > 40:
        _segfault()
    return reference.paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs)


# Crashes on about half of the drawn cases; shrinks to one sequence of 41 tokens.
SEGFAULTS = SimpleNamespace(write_kv=None, paged_prefill=segfaults_on_long_prefill, paged_decode=None)


def hangs_on_threes(q, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
    """The oracle, except that three query heads, or three sequences, never return (the heads are a
    compile-time key the campaign fixes for a chunk of draws; the sequences vary within one)."""
    if q.shape[1] == 3 or seq_lens.shape[0] == 3:
        import time

        while True:
            time.sleep(1)
    return reference.paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs)


HANGS = SimpleNamespace(write_kv=None, paged_prefill=hangs_on_threes, paged_decode=None)


def _far_read_kernel():
    """A Triton kernel that loads from `ptr + offset`, unmasked (built on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def far_read(p_src, p_dst, offset):
        tl.store(p_dst, tl.load(p_src + offset))

    return far_read


_FAR_READ = []


def illegal_address_on_big_pages(q, k_cache, *args, **kwargs):
    """The oracle, except that a page size of 100 or more reads 2^40 elements past the cache: on a GPU an
    illegal memory access, which leaves the CUDA context unusable (a sticky error)."""
    if k_cache.shape[1] >= 100:
        if not _FAR_READ:
            _FAR_READ.append(_far_read_kernel())
        sink = torch.zeros(1, dtype=k_cache.dtype, device=k_cache.device)
        _FAR_READ[0][(1,)](k_cache, sink, 2**40)
    return reference.paged_prefill(q, k_cache, *args, **kwargs)


# For the GPU: the kind of fault a kernel under development has (the campaign's worker is replaced).
ILLEGAL_ADDRESS = SimpleNamespace(
    write_kv=None, paged_prefill=illegal_address_on_big_pages, paged_decode=None
)


def _shard_offset_dropped(op):
    """`op` of the Triton kernels, called with a local-strided layout's tensor-parallel offset dropped."""

    def call(*args, layout=None, **kwargs):
        if isinstance(layout, reference.LocalStridedLayout) and layout.head_offset:
            layout = reference.LocalStridedLayout(
                layout.block_size,
                layout.local_blocks,
                layout.vert_stride,
                layout.homo_head,
                layout.num_heads_total,
                0,
            )
        return op(*args, layout=layout, **kwargs)

    return call


def _triton_shard_offset_dropped():
    import kernels
    from backends import registry

    return SimpleNamespace(
        write_kv=kernels.write_kv,
        paged_prefill=_shard_offset_dropped(kernels.paged_prefill),
        paged_decode=_shard_offset_dropped(kernels.paged_decode),
        capabilities=registry.load("triton").capabilities.as_dict(),
    )


def __getattr__(name: str):
    # Built on first use: importing this module must not import triton (the CPU tests set the
    # interpreter first).
    if name == "TRITON_SHARD_OFFSET_DROPPED":
        return _triton_shard_offset_dropped()
    raise AttributeError(name)
