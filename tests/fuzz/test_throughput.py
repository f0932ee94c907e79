"""What makes a campaign fast on a GPU host, checked without one: workers shared out over every
visible GPU, a named kernel cache, compile-aware draws (one compile-time key per chunk, every key
reachable), and the time split that says where the time went."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import registry
from backends.registry import LAYOUT_KINDS
from fuzz import campaign, targets
from fuzz.summary import TIME_PHASES, Tally, time_split
from fuzz.worker import Worker
from harness import timing
from harness.cases import AttentionShape
from harness.strategies import attention_cases, attention_shapes, sample

GIB = 2**30


@pytest.fixture
def gpu_memory(monkeypatch):
    def set_bytes(per_gpu: int) -> None:
        monkeypatch.setattr(campaign, "gpu_memory_bytes", lambda index: per_gpu)

    return set_bytes


def test_cpu_host_runs_one_interpreted_worker_per_core():
    n, envs = campaign.plan_workers(None, cores=3, gpus=[])
    assert n == 3 and all(env == {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"} for env in envs)


def test_gpu_host_shares_its_cores_out_over_every_visible_gpu(gpu_memory):
    gpu_memory(140 * GIB)
    n, envs = campaign.plan_workers(None, cores=32, gpus=["2", "5"])
    assert n == 32
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs].count("2") == 16
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs].count("5") == 16
    assert envs[0]["CUDA_VISIBLE_DEVICES"] != envs[1]["CUDA_VISIBLE_DEVICES"]  # round-robin
    assert {env["OMP_NUM_THREADS"] for env in envs} == {"1"}


def test_gpu_memory_caps_the_workers_of_a_small_gpu(gpu_memory):
    gpu_memory(20 * GIB)  # room for two workers of WORKER_GPU_BYTES each
    n, envs = campaign.plan_workers(None, cores=16, gpus=["0"])
    assert n == 20 * GIB // campaign.WORKER_GPU_BYTES == 2
    assert {env["OMP_NUM_THREADS"] for env in envs} == {"8"}  # the idle cores become threads
    n, _ = campaign.plan_workers(5, cores=16, gpus=["0"])
    assert n == 5  # --workers wins


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,7")
    assert campaign.visible_gpus() == ["3", "7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert campaign.visible_gpus() == ["0", "1"]


def test_kernel_cache_is_named_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    env = campaign.cache_environment(tmp_path)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert campaign.cache_environment(None)["TRITON_CACHE_DIR"] == str(campaign.KERNEL_CACHE / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert campaign.cache_environment(None) == {}  # the user's own cache stays


@settings(max_examples=25)
@given(data=st.data())
def test_a_fixed_shape_fixes_every_compile_time_field_and_nothing_else(data):
    shape = data.draw(attention_shapes(max_heads=8))
    case = data.draw(attention_cases(shape=shape, max_seq_len=64))
    assert AttentionShape.of(case) == shape


def test_every_layout_family_and_dtype_is_drawn_as_a_key():
    keys = sample(attention_shapes(), 200, seed_value=1)
    assert {k.layout_kind for k in keys} == set(LAYOUT_KINDS)
    assert {k.dtype for k in keys} == {"float32", "float16", "bfloat16"}
    assert len({(k.head_dim, k.page_size) for k in keys}) > 50


def test_a_chunk_draws_one_key_and_the_next_chunk_another(monkeypatch):
    worker = Worker(
        dict(worker_id=0, backend="reference", targets=["prefill"], seed=0, ledger="none.json",
             max_failures=1, failures_dir="unused", device="cpu", in_process=True),
        [],
    )  # fmt: skip
    worker.impl = registry.load("reference")
    target = targets.all_targets()["prefill"]
    keys = [worker.next_key(target, "float16") for _ in range(8)]
    assert len(set(keys)) > 1 and all(k.dtype == "float16" for k in keys)
    cases = sample(target.strategy(worker.impl, "cpu", "float16", keys[0], None), 8, seed_value=2)
    assert len(cases) > 1 and {AttentionShape.of(c) for c in cases} == {keys[0]}
    assert len({(c.seq_lens, c.seed) for c in cases}) == len(cases)  # all the rest varies


def test_clock_takes_compile_time_out_of_the_phase_it_happened_in():
    clock = timing.Clock()
    with clock.phase("implementation"):
        clock.compile_started()
        time.sleep(0.05)
        clock.compile_ended()
    seconds = clock.take()
    assert seconds["compile"] >= 0.05 and seconds["implementation"] < seconds["compile"]
    assert clock.take() == dict.fromkeys(timing.PHASES, 0.0)


def test_time_split_adds_up_per_target():
    tally = Tally(start=0.0)
    tally.on((0, "case", "prefill", "float16", 0.1, "passed"))
    tally.on((0, "case", "prefill", "float16", 0.1, "passed"))
    tally.on(
        (0, "seconds", "prefill", {"compile": 3.0, "implementation": 0.5, "oracle": 0.5, "harness": 1.0})
    )
    tally.on((1, "seconds", "prefill", {"compile": 1.0, "startup": 2.0}))
    split = time_split(tally)["prefill"]
    assert split["cases"] == 2 and set(split["seconds"]) == set(TIME_PHASES)
    assert split["seconds"]["compile"] == 4.0 and split["ms_per_case"]["compile"] == 2000.0
    # Each share is rounded to 3 decimals: their sum is within half a unit of the last place each of 1.
    assert abs(sum(split["share"].values()) - 1.0) <= len(TIME_PHASES) * 5e-4 + 1e-12
