"""`kernels.write_kv` against the oracle: an exact scatter (structural output, compared with equal)."""

import pytest
import torch
from hypothesis import given

import kernels as tri
import reference as ref
from tests.bad_inputs import WRITE_KV_CASES, valid_write_kv_args
from tests.strategies import DTYPES, write_kv_cases


def _inputs(case, device):
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    slots = torch.randperm(case.page_size * case.num_pages, generator=gen)[: case.num_tokens]
    slots[torch.rand(case.num_tokens, generator=gen) < case.pad_fraction] = -1
    shape = (case.num_tokens, case.num_kv_heads, case.head_dim)
    cache_shape = (case.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen).to(dtype).to(device) for _ in range(2))
    return k, v, k_cache, v_cache, slots.to(device)


@given(write_kv_cases())
def test_write_kv(device, case):
    k, v, k_cache, v_cache, slots = _inputs(case, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.write_kv(k, v, k_ref, v_ref, slots)
    tri.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_write_kv_strided_cache(device):
    # v_cache with other strides than k_cache (a permuted view of a contiguous buffer).
    k = torch.randn(5, 2, 16, device=device)
    v = torch.randn(5, 2, 16, device=device)
    k_cache = torch.zeros(3, 4, 2, 16, device=device)
    v_cache = torch.zeros(3, 2, 4, 16, device=device).transpose(1, 2)
    slots = torch.tensor([0, 11, -1, 4, 7], dtype=torch.int64, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.write_kv(k, v, k_ref, v_ref, slots)
    tri.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("name, mutate, error, text", WRITE_KV_CASES, ids=[c[0] for c in WRITE_KV_CASES])
def test_write_kv_bad_input(device, name, mutate, error, text):
    for twin in (ref, tri):
        args = valid_write_kv_args(device)
        mutate(args)
        with pytest.raises(error, match=text):
            twin.write_kv(**args)
