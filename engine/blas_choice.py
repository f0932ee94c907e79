"""Which BLAS library multiplies each linear layer in the CUDA graphs of each token bucket, and which
token buckets the graphs keep, chosen from timings on the device (issue 17).

cuBLAS picks its kernel for a shape by heuristic, and at a few hundred rows the pick can be far from
the best one. On an H100, qkv took 83 µs at 832 rows and 68 µs at 896 rows; at 208 rows cuBLASLt
took 31.9 µs for `down` against cuBLAS's 39.5 (reports/gpu/gemm-sweep-h100.json and
gemm-probe-h100-splitk.json). So, before a runner's first prefill graph (`StepGraphs`):
- each weight of `WEIGHTS` is timed at each token bucket through each library of `LIBRARIES`
  (`time_linears`);
- each bucket takes the fastest library for each weight (`fastest`);
- a bucket is dropped where a larger bucket's linear layers take less time (`kept_buckets`). Its steps
  then take the larger bucket: every op of a step works row by row, so padding rows change no result.
Outside `choosing` (eager steps, decode graphs, the CPU), `linear` is torch's default product.
"""

import contextlib
import math
import statistics
from collections.abc import Callable

import torch
from torch import nn

# Read when a runner's graphs are made (`StepGraphs`): off, every graph multiplies through torch's
# default library and every token bucket is kept. On since the thirty-first session: tests/engine passed
# with it on an H100 (121 of 121, twice), where two exact-equality tests had failed before `calibrated`
# (each engine calibrating for itself). Measured on the H200 (reports/gpu/blas-h200.txt): TTFT with 90%
# cached 7.12 -> 6.90 ms at 2k and 20.43 -> 20.20 ms at 8k in one process (docs/engine-notes.md,
# "Linear layers by measured cost").
ENABLED = True
LIBRARIES = ("cublas", "cublaslt")  # the first one is torch's default
WEIGHTS = ("qkv", "out", "up", "down")  # the `nn.Linear` attributes of engine.model.DecoderLayer
# Another library, or a larger bucket, is taken only when it is this much faster than the default
# library or than the bucket itself: then the timings' spread between runs seldom flips a choice.
MARGIN = 0.03
# A timing cycles over the weights of up to this many layers: the 32-layer model's weights then hold
# more bytes than the L2 cache, so each call reads its weight from memory, as a step's calls do.
TIMED_LAYERS = 8
REPLAYS = 5

_chosen: dict[str, str] = {}  # weight name -> library, set by `choosing`
# Each model shape's calibration in this process (`calibrated`): its engines then multiply through the same
# libraries and give the same bits, as engines of one model did before the choice. Timings differ from run
# to run, so two engines that each calibrated could take different libraries at a bucket near the margin
# (two of tests/engine's exact-equality tests failed so on an H100).
_calibrations: dict[tuple, tuple[list[int], dict[int, dict[str, str]]]] = {}


def linear(x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """x [rows, in_features] times weight [out_features, in_features] transposed, through the library
    that `choosing` gives `name`, else torch's default."""
    library = _chosen.get(name)
    if library is None or not x.is_cuda:
        return nn.functional.linear(x, weight)
    with _preferred(library):
        return nn.functional.linear(x, weight)


@contextlib.contextmanager
def _preferred(library: str):
    """torch's products through `library` within it (torch's setting is process-wide)."""
    default = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(default)


@contextlib.contextmanager
def choosing(libraries: dict[str, str]):
    """Within it, `linear(x, weight, name)` multiplies through `libraries[name]` (a name of LIBRARIES)
    where it has one."""
    unknown = set(libraries.values()) - set(LIBRARIES)
    if unknown:
        raise ValueError(f"libraries must be among {LIBRARIES}, got {sorted(unknown)}")
    before = dict(_chosen)
    _chosen.clear()
    _chosen.update(libraries)
    try:
        yield
    finally:
        _chosen.clear()
        _chosen.update(before)


@torch.no_grad()
def time_linears(layers, rows: int, capture) -> dict[str, dict[str, float]]:
    """µs a call of each weight of `WEIGHTS` at `rows` rows, through each library of LIBRARIES. Each time
    comes from a CUDA graph (`capture`, as engine/cuda_graphs.py's `cuda_capture`) of one call per layer,
    over the weights of up to TIMED_LAYERS of `layers`. It is the median of REPLAYS replays."""
    times = {}
    for name in WEIGHTS:
        weights = [getattr(layer, name).weight for layer in layers[:TIMED_LAYERS]]
        out_features, in_features = weights[0].shape
        x = torch.randn(rows, in_features, dtype=weights[0].dtype, device=weights[0].device)
        y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)

        def calls(weights=weights, x=x, y=y):
            for w in weights:
                torch.mm(x, w.t(), out=y)
            return (y,)

        times[name] = {}
        for library in LIBRARIES:
            with _preferred(library):
                calls()  # lazy initialization (handles, workspaces) stays out of the graph
                replay, _ = capture(calls, None, {})
            replay()
            spans = []
            for _ in range(REPLAYS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                replay()
                end.record()
                end.synchronize()
                spans.append(start.elapsed_time(end) * 1e3 / len(weights))
            times[name][library] = statistics.median(spans)
    return times


def fastest(times: dict[str, float]) -> str:
    """The library of `times` (µs by library name) that is fastest by MARGIN over the default one, else
    the default (LIBRARIES[0])."""
    best = min(times, key=times.get)
    return best if times[best] < times[LIBRARIES[0]] * (1 - MARGIN) else LIBRARIES[0]


def kept_buckets(costs: dict[int, float]) -> list[int]:
    """The buckets of `costs` (µs by bucket) that no larger bucket undercuts by MARGIN, in order; the
    largest is always kept."""
    kept, cheapest = [], math.inf
    for bucket in sorted(costs, reverse=True):
        if cheapest >= costs[bucket] * (1 - MARGIN):
            kept.append(bucket)
        cheapest = min(cheapest, costs[bucket])
    return sorted(kept)


def shape_key(layers) -> tuple:
    """What `time_linears` over `layers` depends on: the device, dtype and shapes of the timed weights."""
    weights = [getattr(layers[0], name).weight for name in WEIGHTS]
    timed = min(len(layers), TIMED_LAYERS)
    return (str(weights[0].device), weights[0].dtype, tuple(tuple(w.shape) for w in weights), timed)


def calibrated(key: tuple, buckets: list[int], timer: Callable[[int], dict[str, dict[str, float]]]):
    """`calibrate(buckets, timer)`, measured at the first call with `key` (`shape_key` of the timed layers)
    and these buckets in this process, and the same result at every later one."""
    key = (key, tuple(buckets))
    if key not in _calibrations:
        _calibrations[key] = calibrate(buckets, timer)
    kept, choices = _calibrations[key]
    return list(kept), {rows: dict(libraries) for rows, libraries in choices.items()}


def calibrate(buckets: list[int], timer: Callable[[int], dict[str, dict[str, float]]]):
    """(kept buckets, {bucket: {weight name: library}}) from `timer(rows)`, the times `time_linears`
    gives, at each of `buckets`. A bucket's cost is the sum of its weights' times through their
    libraries."""
    choices, costs = {}, {}
    for rows in buckets:
        times = timer(rows)
        choices[rows] = {name: fastest(by_library) for name, by_library in times.items()}
        costs[rows] = sum(by_library[choices[rows][name]] for name, by_library in times.items())
    return kept_buckets(costs), choices
