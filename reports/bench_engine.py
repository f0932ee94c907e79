"""Engine time to first token (TTFT) against prefix-cache hit share, measured through `engine.LLM`.

For each prompt length L and hit share h: reset the prefix cache, warm it with a request whose prompt
is a shared prefix of h*L tokens, then time `generate` of one prompt of L tokens that starts with that
prefix (max_tokens=1: prefill plus the first token), between two `torch.cuda.synchronize()` calls.
The median of several runs after warm-up runs is reported, with the hit share the engine actually
reported (`num_cached_tokens / L`, whole pages only). Target: TTFT(h) / TTFT(0) <= (1 - h) + 0.1.

`python3 -m reports.bench --only engine` runs the GPU setting (phi3-small-attn, triton backend) and
writes reports/gpu/engine-ttft.{md,json,png}. `python3 -m reports.bench_engine --smoke --out DIR`
runs a tiny CPU setting (reference backend) to check the script, not to measure anything.
"""

import argparse
import json
import math
import pathlib
import platform
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from engine import LLM, SamplingParams

HIT_SHARES = (0.0, 0.25, 0.5, 0.75, 0.9)
TARGET_SLACK = 0.1  # TTFT(h) / TTFT(0) <= (1 - h) + TARGET_SLACK
TIME_CAP_S = 200.0  # rows not started by then are reported as skipped


@dataclass(frozen=True)
class Setting:
    model: str
    backend: str
    prompt_lens: tuple[int, ...]
    page_size: int = 16
    warmup: int = 2
    repeats: int = 5
    dtype: str | None = None


GPU_SETTING = Setting("phi3-small-attn", "triton", (2048, 8192))
SMOKE_SETTING = Setting("tiny", "reference", (64, 160), warmup=1, repeats=2, dtype="float32")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(llm: LLM, prompt_len: int, share: float, setting: Setting, vocab: int) -> dict:
    """TTFT of one L-token prompt whose first share*L tokens were warmed into the cache."""
    prefix_len = int(share * prompt_len)
    times, cached = [], []
    for run in range(setting.warmup + setting.repeats):
        rng = random.Random(prompt_len * 1000 + run)
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: a request still holds pages")
        if prefix_len:
            llm.generate([prompt[:prefix_len]], SamplingParams(max_tokens=1))
        _sync()
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=1))
        _sync()
        elapsed = time.perf_counter() - start
        if run >= setting.warmup:
            times.append(elapsed * 1e3)
            cached.append(out[0].num_cached_tokens)
    return dict(
        prompt_len=prompt_len,
        hit_share=share,
        prefix_len=prefix_len,
        cached_tokens=int(statistics.median(cached)),
        actual_hit_share=statistics.median(cached) / prompt_len,
        ttft_ms=statistics.median(times),
        ttft_ms_runs=times,
    )


def run_setting(setting: Setting, deadline: float) -> list[dict]:
    max_len = max(setting.prompt_lens)
    llm = LLM(
        setting.model,
        backend=setting.backend,
        page_size=setting.page_size,
        num_pages=2 * math.ceil(max_len / setting.page_size) + 8,
        max_num_batched_tokens=max_len,  # one chunk: TTFT of a whole prompt in one step
        max_num_seqs=4,
        dtype=setting.dtype,
    )
    rows = []
    for prompt_len in setting.prompt_lens:
        base = None
        for share in HIT_SHARES:
            if time.perf_counter() > deadline:
                rows.append(dict(prompt_len=prompt_len, hit_share=share, skipped="time cap reached"))
                continue
            try:
                row = measure(llm, prompt_len, share, setting, llm.args.vocab_size)
            except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
                traceback.print_exc()
                rows.append(dict(prompt_len=prompt_len, hit_share=share, skipped=f"error: {exc!r}"[:200]))
                continue
            base = row["ttft_ms"] if share == 0.0 else base
            row["ratio"] = row["ttft_ms"] / base if base else math.nan
            row["target"] = (1.0 - row["actual_hit_share"]) + TARGET_SLACK
            row["meets_target"] = bool(row["ratio"] <= row["target"])
            rows.append(row)
            print(
                f"engine-ttft L={prompt_len} h={share:.2f} cached={row['cached_tokens']} "
                f"ttft={row['ttft_ms']:.2f} ms ratio={row['ratio']:.3f} target<={row['target']:.3f}",
                flush=True,
            )
    return rows


def environment(setting: Setting) -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(
        setting=asdict(setting),
        device=gpu or f"cpu ({platform.processor() or platform.machine()})",
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


def write_markdown(path: pathlib.Path, rows: list[dict], env: dict) -> None:
    s = env["setting"]
    lines = [
        "# Engine TTFT against prefix-cache hit share",
        "",
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; {env['date']}.",
        f"Model `{s['model']}`, backend `{s['backend']}`, page size {s['page_size']}, one prefill chunk; "
        f"median of {s['repeats']} runs after {s['warmup']} warm-up runs, through `LLM.generate` "
        "(max_tokens=1).",
        f"Target: TTFT(h) / TTFT(0) <= (1 - h) + {TARGET_SLACK}, with h the hit share the engine reported.",
        "",
        "| prompt tokens | hit share asked | cached tokens | hit share | TTFT ms "
        "| TTFT(h)/TTFT(0) | target | ok |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :-: |",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['prompt_len']} | {r['hit_share']:.2f} | | | | | | skipped ({r['skipped']}) |")
            continue
        ok = "yes" if r["meets_target"] else "NO"
        lines.append(
            f"| {r['prompt_len']} | {r['hit_share']:.2f} | {r['cached_tokens']} "
            f"| {r['actual_hit_share']:.3f} | {r['ttft_ms']:.2f} | {r['ratio']:.3f} "
            f"| {r['target']:.3f} | {ok} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: pathlib.Path, rows: list[dict], env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for prompt_len in sorted({r["prompt_len"] for r in rows}):
        done = [r for r in rows if r["prompt_len"] == prompt_len and "skipped" not in r]
        ax.plot(
            [r["actual_hit_share"] for r in done], [r["ratio"] for r in done], "o-", label=f"L={prompt_len}"
        )
    h = [0.0, 1.0]
    ax.plot(h, [1 - x + TARGET_SLACK for x in h], "k--", label=f"target (1-h)+{TARGET_SLACK}")
    ax.set_xlabel("prefix-cache hit share h")
    ax.set_ylabel("TTFT(h) / TTFT(0)")
    ax.set_title(f"engine TTFT, {env['setting']['model']} ({env['device']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(out_dir: pathlib.Path, smoke: bool = False) -> None:
    """Measures and writes engine-ttft.md, .json and .png under `out_dir`."""
    setting = SMOKE_SETTING if smoke or not torch.cuda.is_available() else GPU_SETTING
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(setting)
    rows = run_setting(setting, time.perf_counter() + TIME_CAP_S)
    (out_dir / "engine-ttft.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=2) + "\n")
    write_markdown(out_dir / "engine-ttft.md", rows, env)
    write_plot(out_dir / "engine-ttft.png", rows, env)
    print(f"engine-ttft: wrote {out_dir}/engine-ttft.{{md,json,png}}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/gpu"))
    parser.add_argument("--smoke", action="store_true", help="tiny CPU setting (reference backend)")
    args = parser.parse_args()
    main(args.out, smoke=args.smoke)
