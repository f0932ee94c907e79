"""Host and device time of one engine step: where a step's time goes when the GPU is not the limit.

Rows (GPU settings): the prefill step of an L-token prompt with share h of it cached (the step that
samples its first token), and decode steps at batch B over C-token contexts, of the 4- and the
32-layer model, each in one process with CUDA graphs on (the engine's default: a prefill step of at most
2048 tokens whole, attention included), prefill steps in pieces around eager attention
(`StepGraphs.whole_prefill` off) and without graphs (`enforce_eager`), the A/Bs of
engine/cuda_graphs.py, and decode steps each launched after the one before was read ("read first":
`async_decode` off). Columns, medians over the timed steps after
warm-up ones:
    step ms     `LLM.step` wall time, host to sampled token (it ends with the sampling's device read);
                decode rows: a step's wall time among consecutive steps (a decode step may be launched
                before the one it follows was read: `async_decode`);
    host ms     from the step's start to its sampling (every kernel enqueued; a plan's validation sync
                inside is host time too), unprofiled runs;
    kernels ms  the step's device time summed over its kernels and copies (torch.profiler; decode rows:
                over a window of consecutive steps, per step);
    launches    kernel launches a step (runtime API calls, graph launches counted once);
    host/layer  (host - launch API time) / layers, in µs: the host's own work a layer beyond the
                launches themselves (issue 17: about 30 µs at most);
    phases      the host's ms in the scheduler, `prepare`, the plans, a whole step's graphs (their inputs
                packed and copied, the prefill plans replanned, the replays launched), the sampler (its
                wait for the device included) and `postprocess` (`StepClock`);
    device idle ms  in profiled steps (the profiler slows the host): before the step's first kernel,
                between its kernels (inside graphs too), after its last (`device_idle`; decode rows:
                of the window, per step).
`python3 -m reports.engine_steps [--out DIR] [--profile N] [--rows gpu|split-one-round|fused]` runs the GPU
settings (or an A/B's rows, each with its kernels/hopper_prefill.py or engine/model.py settings) and writes
engine-steps.{md,json} (`--profile N`: also the N operators of most host time per row, from the
profiler, to the log); `--smoke` a tiny CPU setting that checks the script, not the numbers.
"""

import argparse
import json
import math
import pathlib
import random
import statistics
import time
from dataclasses import asdict, dataclass
from unittest import mock

import torch

from engine import LLM, SamplingParams
from engine import model as engine_model
from kernels import hopper_prefill

LAUNCH_APIS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
)


@dataclass(frozen=True)
class Row:
    model: str
    kind: str  # "prefill" or "decode"
    tokens: int  # prefill: prompt length; decode: context length
    share: float = 0.0  # prefill: the share of the prompt cached
    batch: int = 1  # decode: sequences a step
    eager: bool = False  # LLM(enforce_eager=...): no CUDA graphs
    pieces: bool = False  # prefill steps in piece graphs around eager attention (whole_prefill off)
    read_first: bool = False  # each decode step launched after the one before was read (async_decode off)
    hopper: tuple = ()  # (name, value) settings of kernels/hopper_prefill.py during the row: an A/B
    layer: tuple = ()  # (name, value) settings of engine/model.py (FUSED_ROTARY, FUSED_NORM): an A/B

    @property
    def graphs(self) -> str:
        return "no" if self.eager else "pieces" if self.pieces else "read first" if self.read_first else "yes"


GPU_ROWS = tuple(
    Row(*args, eager=eager, pieces=pieces, read_first=read_first)
    for args in (
        ("phi3-small-attn", "prefill", 2048, 0.0),
        ("phi3-small-attn", "prefill", 2048, 0.9),
        ("phi3-small", "prefill", 2048, 0.0),
        ("phi3-small", "prefill", 2048, 0.9),
        ("phi3-small", "prefill", 8192, 0.9),
        ("phi3-small", "decode", 1024, 0.0, 1),
        ("phi3-small", "decode", 1024, 0.0, 64),
    )
    for eager, pieces, read_first in (
        (False, False, False),
        (False, True, False),
        (False, False, True),
        (True, False, False),
    )  # fmt: skip
    if (not pieces or args[1] == "prefill") and (not read_first or args[1] == "decode")
)
# --rows split-one-round: the 2k prefill step over a 90% cached prompt (issue 17) without, with, with
# and without SPLIT_ONE_ROUND (a lone round's items split over the idle programs), in one process. With
# nothing cached its plans hold no split states (hopper_prefill.split_slots): the same step either way.
SPLIT_ONE_ROUND_ROWS = tuple(
    Row(model, "prefill", 2048, 0.9, hopper=hopper)
    for model in ("phi3-small-attn", "phi3-small")
    for hopper in ((), (("SPLIT_ONE_ROUND", True),), (("SPLIT_ONE_ROUND", True),), ())
)
# --rows fused: the 32-layer model's 2k prefill step, nothing and 90% cached (issue 17's ratio), with the
# layer's small kernels fused (engine/model.py's settings, the default), without, and with each alone;
# then the 90% cached step without graphs, where every launch costs host time (a fused kernel's is
# Triton's, the small kernels' torch's).
FUSED_OFF = (("FUSED_ROTARY", False), ("FUSED_NORM", False))
FUSED_ROWS = tuple(
    Row("phi3-small", "prefill", 2048, share, layer=layer)
    for share in (0.0, 0.9)
    for layer in ((), FUSED_OFF, FUSED_OFF[:1], FUSED_OFF[1:], FUSED_OFF, ())
) + tuple(
    Row("phi3-small", "prefill", 2048, 0.9, eager=True, layer=layer)
    for layer in ((), FUSED_OFF, FUSED_OFF, ())
)
SMOKE_ROWS = (Row("tiny", "prefill", 64, 0.5, eager=True), Row("tiny", "decode", 48, batch=4, eager=True))
ROW_SETS = {"gpu": GPU_ROWS, "split-one-round": SPLIT_ONE_ROUND_ROWS, "fused": FUSED_ROWS}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepClock:
    """Stamps where an engine's step spends its host time: it wraps the scheduler's `schedule` and
    `postprocess`, the runner's `prepare` and sampler, and the backend's planners, and stamps the moment
    a step reaches its sampler (every kernel enqueued). What the phases leave of a step's host time is
    the forward pass's own: the layers (or their graphs' replays) and the attention runs."""

    PHASES = ("schedule", "prepare", "plans", "graphs", "sample", "postprocess")

    def __init__(self, llm: LLM):
        self.reached = None
        self.phases = dict.fromkeys(self.PHASES, 0.0)
        self._wrap(llm.scheduler, "schedule", "schedule")
        self._wrap(llm.scheduler, "advance", "postprocess")
        self._wrap(llm.scheduler, "fill", "postprocess")
        self._wrap(llm.runner, "prepare", "prepare")
        if llm.runner.graphs is not None:
            self._wrap(llm.runner.graphs, "step_logits", "graphs")
        self._wrap(llm.runner, "_sample", "sample", stamp=True)
        planners = llm.runner.ops.planners
        for name, planner in list(planners.items()):
            planners[name] = self._timed(planner, "plans")

    def _timed(self, fn, phase: str, stamp: bool = False):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            if stamp:
                self.reached = start
            try:
                return fn(*args, **kwargs)
            finally:
                self.phases[phase] += time.perf_counter() - start

        return timed

    def _wrap(self, owner, name: str, phase: str, stamp: bool = False) -> None:
        setattr(owner, name, self._timed(getattr(owner, name), phase, stamp))

    def step(self, llm: LLM, sync: bool = True) -> tuple[float, float, dict]:
        """(host ms, step ms, the phases' ms) of one `llm.step()`, the device idle first unless not `sync`."""
        if sync:
            _sync()
        self.phases = dict.fromkeys(self.PHASES, 0.0)
        start = time.perf_counter()
        llm.step()
        end = time.perf_counter()
        return (self.reached - start) * 1e3, (end - start) * 1e3, {k: v * 1e3 for k, v in self.phases.items()}


def _engine(row: Row) -> LLM:
    options = dict(enforce_eager=row.eager, async_decode=not row.read_first)
    if row.kind == "prefill":
        pages = 2 * math.ceil(row.tokens / 16) + 8
        llm = LLM(row.model, num_pages=pages, max_num_batched_tokens=row.tokens, max_num_seqs=4, **options)
    else:
        pages = row.batch * math.ceil((row.tokens + 64) / 16) + 8
        budget = max(row.tokens, min(16384, row.batch * row.tokens))
        llm = LLM(
            row.model, num_pages=pages, max_num_batched_tokens=budget, max_num_seqs=row.batch, **options
        )
    if row.pieces:
        llm.runner.graphs.whole_prefill = False
    return llm


def _prefill_steps(llm: LLM, row: Row, runs: int):
    """Yields before each timed prefill step, the cache warmed with the prompt's shared prefix."""
    vocab, prefix = llm.args.vocab_size, int(row.share * row.tokens)
    for run in range(runs):
        rng = random.Random(run)
        prompt = [rng.randrange(vocab) for _ in range(row.tokens)]
        llm.reset_prefix_cache()
        if prefix:
            llm.generate([prompt[:prefix]], SamplingParams(max_tokens=1))
        rid = llm.add_request(prompt, SamplingParams(max_tokens=1))
        yield
        llm.take_output(rid)


def _decode_steps(llm: LLM, row: Row, runs: int):
    """Yields before each timed decode step of `row.batch` sequences of about `row.tokens` tokens."""
    rng = random.Random(0)
    vocab = llm.args.vocab_size
    ids = [
        llm.add_request(
            [rng.randrange(vocab) for _ in range(row.tokens - i % 8)], SamplingParams(max_tokens=runs + 8)
        )
        for i in range(row.batch)
    ]
    sched = llm.scheduler
    while sched.waiting or any(seq.num_uncomputed_tokens > 1 for seq in sched.running):
        llm.step()  # prefill chunks
    for _ in range(runs):
        yield
    llm.abort(ids)


def _windows(llm: LLM, row: Row, steps: int):
    """Yields, before each profiled window, its number of steps: a prefill step alone (the cache warmed
    before it), or `steps` consecutive decode steps (a decode step may be launched while the one before
    it runs)."""
    if row.kind == "prefill":
        for _ in _prefill_steps(llm, row, steps):
            yield 1
        return
    decodes = _decode_steps(llm, row, steps)
    next(decodes)
    yield steps
    for _ in decodes:  # then aborted
        pass


def _steps(llm: LLM, row: Row, runs: int):
    return _prefill_steps(llm, row, runs) if row.kind == "prefill" else _decode_steps(llm, row, runs)


def device_idle(step: tuple[float, float], kernels: list[tuple[float, float]]) -> tuple[float, float, float]:
    """How long the device idles in a step, in the step's time unit: (before its first kernel, between
    kernels, after its last). step: (start, end); kernels: (start, end) of each kernel or copy."""
    if not kernels:
        return step[1] - step[0], 0.0, 0.0
    kernels = sorted(kernels)
    busy, reach = 0.0, kernels[0][0]
    for start, end in kernels:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return kernels[0][0] - step[0], reach - kernels[0][0] - busy, step[1] - reach


def _device_profile(
    llm: LLM, clock: StepClock, row: Row, steps: int, top: int
) -> tuple[float, float, float, list, str]:
    """(device ms, launch API ms, launches, device idle ms (`device_idle`)) a step, over `_windows`, and
    with `top` the operators of most host and of most device time and a cProfile of the same steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    device = api_ms = count = 0.0
    idle, tables = [], []
    ran = 0  # steps whose kernels ran in the windows
    for window in _windows(llm, row, steps):
        _sync()
        ahead = llm._ahead is not None  # a step launched before the window ran before it
        with profile(activities=activities) as prof, record_function("engine_step"):
            for _ in range(window):
                clock.step(llm, sync=False)
            _sync()
        window += (llm._ahead is not None) - ahead  # one launched ahead in the window runs in it
        ran += window
        timed = prof.events()
        step = next(
            e.time_range for e in timed if e.name == "engine_step" and e.device_type == DeviceType.CPU
        )
        # The device's own events (kernels, copies; the annotation's device-side twin spans them all): an
        # operator's entry repeats its kernels' time.
        ranges = [
            (e.time_range.start, e.time_range.end)
            for e in timed
            if e.device_type == DeviceType.CUDA and e.name != "engine_step"
        ]
        idle.append([t / 1e3 / window for t in device_idle((step.start, step.end), ranges)])
        events = prof.key_averages()
        device += sum(
            e.self_device_time_total
            for e in events
            if e.device_type == DeviceType.CUDA and e.key != "engine_step"
        )
        launches = [e for e in events if e.key in LAUNCH_APIS]
        api_ms += sum(e.self_cpu_time_total for e in launches)
        count += sum(e.count for e in launches)
        if top and not tables:
            tables.append(events.table(sort_by="self_cpu_time_total", row_limit=top))
            tables.append(events.table(sort_by="self_device_time_total", row_limit=top))
    if top:  # the Python side of the same kind of steps
        import cProfile
        import io
        import pstats

        python = cProfile.Profile()
        for window in _windows(llm, row, steps):
            python.enable()
            for _ in range(window):
                clock.step(llm, sync=row.kind == "prefill")
            python.disable()
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(top)
        tables.append(text.getvalue())
    idle_ms = [statistics.median(phase) for phase in zip(*idle, strict=True)]
    return device / 1e3 / ran, api_ms / 1e3 / ran, count / ran, idle_ms, "\n".join(tables)


def measure(row: Row, warmup: int, runs: int, top: int) -> dict:
    # The engine's graphs are made within the settings.
    with mock.patch.dict(vars(hopper_prefill), row.hopper), mock.patch.dict(vars(engine_model), row.layer):
        llm = _engine(row)
        clock = StepClock(llm)
        host, wall, phases = [], [], []
        for i, _ in enumerate(_steps(llm, row, warmup + runs)):
            h, w, ph = clock.step(llm, sync=row.kind == "prefill")
            if i >= warmup:
                host.append(h)
                wall.append(w)
                phases.append(ph)
        device, api_ms, launches, idle, table = _device_profile(llm, clock, row, 3, top)
    n_layers = llm.args.n_layers
    host_ms, step_ms = statistics.median(host), statistics.median(wall)
    result = dict(
        asdict(row),
        layers=n_layers,
        step_ms=step_ms,
        host_ms=host_ms,
        kernels_ms=device,
        launches=launches,
        launch_api_ms=api_ms,
        host_per_layer_us=(host_ms - api_ms) / n_layers * 1e3,
        phases_ms={k: statistics.median(p[k] for p in phases) for k in StepClock.PHASES},
        device_idle_ms=idle,
        step_over_kernels=step_ms / device if device else math.nan,
        host_runs=host,
        step_runs=wall,
    )
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, table


def _fields(result: dict) -> dict:
    """The Row fields of a result (older results lack `pieces` and `read_first`)."""
    return {name: result.get(name, False) for name in Row.__dataclass_fields__}


def write_markdown(path: pathlib.Path, rows: list[dict], env: str) -> None:
    lines = [
        "# Engine step: host and device time",
        "",
        env,
        "",
        "| model | step | tokens | h / batch | graphs | step ms | host ms | kernels ms | step / kernels | "
        "launches | launch API ms | host/layer beyond launches µs | host ms: schedule / prepare / plans / "
        "graphs / sample / postprocess | device idle ms: before / between / after |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        which = f"h {r['share']:.2f}" if r["kind"] == "prefill" else f"B {r['batch']}"
        graphs = Row(**_fields(r)).graphs + "".join(
            f", {name} {value}" for name, value in (*r.get("hopper", ()), *r.get("layer", ()))
        )
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['tokens']} | {which} | {graphs} | "
            f"{r['step_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{r['kernels_ms']:.3f} | {r['step_over_kernels']:.2f} | {r['launches']:.0f} | "
            f"{r['launch_api_ms']:.2f} | {r['host_per_layer_us']:.0f} | "
            f"{' / '.join(f'{v:.2f}' for v in r['phases_ms'].values())} | "
            f"{' / '.join(f'{v:.2f}' for v in r.get('device_idle_ms', ()))} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/gpu"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", type=int, default=0, help="print this many operators a row")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="the rows of these MODEL:KIND (e.g. phi3-small:decode)")
    parser.add_argument("--rows", choices=ROW_SETS, default="gpu", help="the GPU rows, or an A/B's")
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    rows = SMOKE_ROWS if smoke else ROW_SETS[args.rows]
    if args.only:
        rows = [row for row in rows if f"{row.model}:{row.kind}" in args.only]
    results = []
    for row in rows:
        result, table = measure(
            row, warmup=1 if smoke else 2, runs=2 if smoke else args.runs, top=args.profile
        )
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_runs")}), flush=True)
        if table:
            print(table, flush=True)
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    env = (
        f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. `python3 -m reports.engine_steps`."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine-steps.json").write_text(
        json.dumps(dict(environment=env, rows=results), indent=2) + "\n"
    )
    write_markdown(args.out / "engine-steps.md", results, env)


if __name__ == "__main__":
    main()
