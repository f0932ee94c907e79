"""Implementations from files outside the repository, named by one string (contract §9).

Four implementations are written to a temporary folder and put under the operator tests with
`pytest tests/kernels --backend FILE:impl` (a subprocess, as a user would run it): a correct one
passes everything that applies, a buggy one fails with a readable message, a narrow one is never
asked for anything it did not declare (it raises AssertionError if it is), and one that raises
NotImplementedError has those cases counted as unsupported. The engine takes the same names.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from engine import LLM, SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[2]
# The oracle itself, re-exported: a correct implementation.
CORRECT = """
import reference
write_kv, paged_prefill, paged_decode = reference.write_kv, reference.paged_prefill, reference.paged_decode
"""
# The oracle with query head 1 zeroed: wrong on every case with two or more heads.
BUGGY = """
import reference

def _wrong(out):
    out, lse = out if isinstance(out, tuple) else (out, None)
    out = out.clone()
    out[:, 1:2] = 0
    return out if lse is None else (out, lse)

write_kv = reference.write_kv
def paged_prefill(*args, **kwargs):
    return _wrong(reference.paged_prefill(*args, **kwargs))
def paged_decode(*args, **kwargs):
    return _wrong(reference.paged_decode(*args, **kwargs))
"""
# float32, dense, no lse, no cached context, no write_kv; anything else is a bug of the suite.
NARROW = """
import torch
import reference
from reference.validation import validate_paged_decode, validate_paged_prefill

capabilities = {"dtypes": ("float32",), "layouts": ("dense",), "lse": False, "context": False}
write_kv = None

def _declared(q, layout, return_lse):
    assert q.dtype == torch.float32, f"asked for {q.dtype}"
    assert layout is None, f"asked for layout {layout!r}"
    assert not return_lse, "asked for the lse"

def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None,
                  return_lse=False):
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    validate_paged_prefill(*args, scale=scale, layout=layout, return_lse=return_lse)
    _declared(q, layout, return_lse)
    lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    assert lens == seq_lens.tolist(), "asked for a cached context"
    return reference.paged_prefill(*args, scale=scale)

def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    args = (q, k_cache, v_cache, block_tables, seq_lens)
    validate_paged_decode(*args, scale=scale, layout=layout, return_lse=return_lse)
    _declared(q, layout, return_lse)
    return reference.paged_decode(*args, scale=scale)
"""
# Refuses page sizes that are not powers of two at run time, as a kernel with a fixed tiling would.
REFUSING = """
import reference

def _check(k_cache):
    page = k_cache.shape[1]
    if page & (page - 1):
        raise NotImplementedError(f"page size {page} is not a power of two")

write_kv = reference.write_kv
def paged_prefill(q, k_cache, *args, **kwargs):
    _check(k_cache)
    return reference.paged_prefill(q, k_cache, *args, **kwargs)
def paged_decode(q, k_cache, *args, **kwargs):
    _check(k_cache)
    return reference.paged_decode(q, k_cache, *args, **kwargs)
"""
IMPLEMENTATIONS = {"correct": CORRECT, "buggy": BUGGY, "narrow": NARROW, "refusing": REFUSING}


def write_implementation(folder: pathlib.Path, name: str) -> str:
    """Writes one of the implementations above as a module file; returns its `FILE:impl` name."""
    path = folder / f"{name}_kernel.py"
    path.write_text(textwrap.dedent(IMPLEMENTATIONS[name]) + "\nimport sys\nimpl = sys.modules[__name__]\n")
    return f"{path}:impl"


def run_operator_tests(backend: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/kernels",
        "-q",
        "-p",
        "no:cacheprovider",
        "--backend",
        backend,
    ]
    env = os.environ | {"PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "smoke"}
    # A generous cap on a hung run, not a measure of speed: no assertion depends on the duration.
    return subprocess.run(cmd + list(extra), cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)


def summary(proc: subprocess.CompletedProcess) -> dict:
    """The counts of pytest's last line, e.g. {"passed": 165, "skipped": 21}."""
    return {
        word: int(n)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", proc.stdout.splitlines()[-1])
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("outside_the_repository")


def test_correct_implementation_passes_everything_that_applies(folder):
    proc = run_operator_tests(write_implementation(folder, "correct"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    counts = summary(proc)
    assert counts.get("passed", 0) > 100 and not counts.get("failed")


def test_buggy_implementation_fails_with_a_readable_message(folder):
    proc = run_operator_tests(write_implementation(folder, "buggy"), "-x", "-k", "vllm_regression")
    assert proc.returncode == 1
    assert re.search(
        r"paged_prefill out: max err \S+, worst ratio \S+ at .* \(allowed there \S+\)", proc.stdout
    ), proc.stdout[-3000:]


def test_narrow_implementation_is_asked_only_what_it_declared(folder):
    proc = run_operator_tests(write_implementation(folder, "narrow"), "-rs")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "asked for" not in proc.stdout
    assert "not declared: " in proc.stdout and "provides no write_kv" in proc.stdout


def test_refusing_implementation_has_unsupported_cases_counted(folder):
    proc = run_operator_tests(write_implementation(folder, "refusing"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"unsupported cases of .*refusing_kernel\.py:impl: [1-9]\d* in", proc.stdout), (
        proc.stdout[-3000:]
    )
    assert "unsupported by" in proc.stdout or "page size" in proc.stdout


def test_engine_runs_an_outside_implementation(folder):
    prompts, params = [[3, 1, 4, 1, 5, 9, 2, 6] * 3], SamplingParams(max_tokens=3)
    outside = LLM("tiny", backend=write_implementation(folder, "correct"), num_pages=16, dtype="float32")
    builtin = LLM("tiny", backend="reference", num_pages=16, dtype="float32")
    assert outside.generate(prompts, params)[0].token_ids == builtin.generate(prompts, params)[0].token_ids


def test_engine_refuses_an_implementation_without_all_operators(folder):
    with pytest.raises(ValueError, match="provides no write_kv"):
        LLM("tiny", backend=write_implementation(folder, "narrow"), num_pages=16)


def test_engine_refuses_an_implementation_without_a_cached_context(folder):
    # All three operators, but context=False: a prefix-cache hit would be the first thing to fail.
    path = folder / "no_context_kernel.py"
    path.write_text(CORRECT + "capabilities = {'context': False}\nimport sys\nimpl = sys.modules[__name__]\n")
    with pytest.raises(
        ValueError, match=r"does not declare what the engine needs: prefill with a cached context"
    ):
        LLM("tiny", backend=f"{path}:impl", num_pages=16, dtype="float32")
