"""One setting (cublas, triton: linear_triton.ROWS, nn: `out` column-major, nnd: `out` and `down`) of the 32-layer model: 90%-cached TTFT at 8k and 2k and the step's kernel time (profiler): `python3 -m reports.linear_ab SETTING`."""
import random
import statistics
import sys
import time

import torch

from engine import SamplingParams
from engine import model as engine_model

setting = sys.argv[1]
engine_model.MEASURED_LINEAR = setting == "triton"
engine_model.COLUMN_MAJOR = {"nn": ("out",), "nnd": ("out", "down")}.get(setting, ())
from reports.ttft_phases import engine  # noqa: E402

llm = engine()
for length in (8192, 2048):
    ttfts, kernels = [], []
    for run in range(8):
        rng = random.Random(length * 1000 + run)
        prompt = [rng.randrange(llm.args.vocab_size) for _ in range(length)]
        llm.reset_prefix_cache()
        llm.generate([prompt[: int(0.9 * length)]], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        if run == 7:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate([prompt], SamplingParams(max_tokens=1))
                torch.cuda.synchronize()
            kernels.append(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3)
            continue
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        ttfts.append(1e3 * (time.perf_counter() - start))
    print(f"{setting} L={length} h=0.9: ttft {statistics.median(ttfts[2:]):.2f} ms, kernels {kernels[0]:.3f} ms", flush=True)
