"""What the campaign's parent has heard from its workers, and how it says it: the progress line, the
FAILURE lines and the summary (printed as a table and as JSON).

Counts are kept per target and dtype and per status. The statuses are: `passed`, `failed` (a new
wrong answer, exception or rejected valid input), `crashed` (the case killed its process or left the
device unusable), `hung` (it overran the per-case limit), `unsupported` (the implementation raised
NotImplementedError, contract §9), `known` (a failure covered by a ledger entry) and `skipped` (a
ledger crash entry: never launched). `failed`, `crashed` and `hung` are failures. The worst ratio
is contract §5's worst gate ratio, error / allowed error over the max and mean gates of every
judged output; <= 1 passes.

Imports nothing heavy: the parent uses it before and while the workers run.
"""

import math
import time
from collections import defaultdict

# Where the workers' time went, per target (harness/timing.py; `startup` is a child process's start,
# `harness` all the rest: drawing, building inputs, judging, pipes).
TIME_PHASES = ("compile", "implementation", "oracle", "startup", "harness")
STATUSES = ("passed", "failed", "unsupported", "crashed", "hung", "known", "skipped")
FAILURE_STATUSES = ("failed", "crashed", "hung")
WORST_RATIO = "worst ratio = contract §5's worst gate ratio, error / allowed error (<= 1 passes)"
BAR_WIDTH = 20


def _statuses() -> dict:
    return dict.fromkeys(STATUSES, 0)


class Tally:
    """Counts per target, dtype and status, worst ratios, failures, and what could not run."""

    def __init__(self, start: float | None = None):
        self.counts = defaultdict(lambda: defaultdict(_statuses))  # target -> dtype -> status -> n
        self.worst = defaultdict(dict)  # target -> dtype -> worst ratio among judged cases
        self.failures: list[dict] = []
        self.unavailable: dict[str, str] = {}
        self.notes: list[str] = []
        self.shrinking = 0
        self.start = time.time() if start is None else start
        self.first_failure_s: float | None = None  # when the first failing case was judged
        self.seconds = defaultdict(lambda: dict.fromkeys(TIME_PHASES, 0.0))  # target -> phase -> s

    def on(self, msg: tuple) -> bool:
        """Applies one worker message; True when it says the worker is done."""
        kind, rest = msg[1], msg[2:]
        if kind == "case":
            target, dtype, ratio, status = rest
            self.counts[target][dtype][status] += 1
            if status in FAILURE_STATUSES and self.first_failure_s is None:
                self.first_failure_s = round(time.time() - self.start, 1)
            if status in ("passed", "failed", "known"):
                self.worst[target][dtype] = max(self.worst[target].get(dtype, 0.0), ratio)
        elif kind == "seconds":
            target, seconds = rest
            for phase, value in seconds.items():
                self.seconds[target][phase] += value
        elif kind == "shrinking":
            self.shrinking += 1
        elif kind == "failure":
            report = dict(rest[0])
            self.shrinking = max(0, self.shrinking - 1)
            if report["file"] not in (f["file"] for f in self.failures):
                report["saved_after_s"] = round(time.time() - self.start, 1)
                self.failures.append(report)
        elif kind == "unavailable":
            self.unavailable[rest[0]] = rest[1]
        elif kind == "note":
            note = f"worker {msg[0]} {rest[0]}: {rest[1]}"
            if note not in self.notes:  # a hypothesis error may repeat every chunk
                self.notes.append(note)
        return kind == "done"

    def status_counts(self, target: str) -> dict:
        """Status -> count over every dtype of `target`."""
        total = _statuses()
        for by_status in self.counts[target].values():
            for status, n in by_status.items():
                total[status] += n
        return total

    @property
    def total(self) -> int:
        return sum(sum(self.status_counts(t).values()) for t in self.counts)

    @property
    def failed(self) -> int:
        """Failures of every kind (wrong answers, crashes, hangs)."""
        return sum(self.status_counts(t)[s] for t in self.counts for s in FAILURE_STATUSES)

    def worst_overall(self) -> tuple[float, str]:
        best = (0.0, "-")
        for target, by_dtype in self.worst.items():
            for dtype, r in by_dtype.items():
                if r > best[0]:
                    best = (r, f"{target}/{dtype}")
        return best


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def progress_line(tally: Tally, elapsed: float, budget: float | None, planned: int | None, live: int) -> str:
    """One status line: progress against the time box and/or the case count, cases per target,
    failures, the worst ratio; past the time box, that the workers are finishing their last cases."""
    shares = [elapsed / budget if budget else 1.0] if budget is not None else []
    shares += [tally.total / planned] if planned else []
    done = min(BAR_WIDTH, int(BAR_WIDTH * max(shares, default=0.0)))
    if not live:
        state = f"done in {_clock(elapsed)}"
    elif budget is not None and elapsed >= budget:
        over = f"time box of {_clock(budget)} over ({_clock(elapsed)})"
        state = f"{over}: {live} worker(s) finishing their last cases"
    else:
        state = f"{_clock(elapsed)}/{_clock(budget)}" if budget is not None else _clock(elapsed)
    per = " ".join(f"{t} {sum(tally.status_counts(t).values())}" for t in sorted(tally.counts)) or "starting"
    worst, where = tally.worst_overall()
    shrinking = f"  {tally.shrinking} shrinking a failure" if tally.shrinking and live else ""
    return (
        f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] {state}  cases {tally.total}"
        f"{f'/{planned}' if planned else ''} ({per})  failures {len(tally.failures)}  "
        f"worst ratio {worst:.3g} ({where}; error/allowed, <= 1 passes){shrinking}"
    )


def failure_text(failure: dict, backend: str, replay_command: str) -> str:
    """The FAILURE lines of one saved failure: the shrunk case in words, its errors, the replay."""
    kind = {"crashed": "CRASH", "hung": "HANG"}.get(failure.get("status"), "FAILURE")
    lines = [
        f"{kind} {failure['target']} ({backend}, {failure['dtype']}): {failure['case']}",
        f"  error:  {failure['errors']}",
    ]
    if failure["message"] not in failure["errors"]:
        lines.append(f"  detail: {failure['message']}")
    return "\n".join(lines + [f"  replay: {replay_command}"])


def status_table(tally: Tally) -> str:
    """The per-target, per-dtype counts as aligned text lines."""
    lines = []
    for target in sorted(tally.counts):
        rows = sorted(tally.counts[target].items()) + [("all", tally.status_counts(target))]
        for dtype, by_status in rows:
            cells = [f"{s} {by_status[s]}" for s in STATUSES[:3]]
            cells += [f"{s} {by_status[s]}" for s in STATUSES[3:] if by_status[s]]
            worst = tally.worst[target].get(dtype) if dtype != "all" else None
            tail = f"  worst ratio {worst:.3g}" if worst is not None else ""
            lines.append(f"  {target:<9}{dtype:<10}" + "  ".join(cells) + tail)
    return "\n".join(lines)


def time_split(tally: Tally) -> dict:
    """Per target: worker seconds per phase, their shares, and the milliseconds per judged case."""
    split = {}
    for target in sorted(tally.seconds):
        seconds = tally.seconds[target]
        total = sum(seconds.values())
        cases = sum(tally.status_counts(target).values())
        split[target] = {
            "seconds": {p: round(v, 2) for p, v in seconds.items()},
            "share": {p: round(v / total, 3) if total else 0.0 for p, v in seconds.items()},
            "ms_per_case": {p: round(1e3 * v / cases, 1) if cases else None for p, v in seconds.items()},
            "cases": cases,
        }
    return split


def time_table(split: dict) -> str:
    """The time split as aligned text: a heading, then one line per target, the share of each phase."""
    lines = ["where the workers' time went (share of worker-seconds; ms per judged case):"]
    for target, row in split.items():
        cells = "  ".join(
            f"{p} {100 * row['share'].get(p, 0.0):.0f}%"
            + (f" ({row['ms_per_case'][p]:.0f} ms/case)" if row["ms_per_case"].get(p) else "")
            for p in TIME_PHASES
            if p in row["share"]
        )
        lines.append(f"  {target:<9}{sum(row['seconds'].values()):8.1f} worker-s  {cells}")
    return "\n".join(lines)


def summary_dict(tally: Tally, elapsed: float) -> dict:
    """The JSON summary's counts, rates and worst ratios (the campaign adds its settings and verdict)."""
    minutes = max(elapsed, 1e-9) / 60.0
    counts = {
        t: tally.status_counts(t) | {"by_dtype": {d: dict(s) for d, s in sorted(by.items())}}
        for t, by in sorted(tally.counts.items())
    }
    per_target = {t: round(sum(tally.status_counts(t).values()) / minutes, 1) for t in tally.counts}
    return {
        "elapsed_s": round(elapsed, 1),
        "counts": counts,
        "cases_per_minute": per_target | {"total": round(tally.total / minutes, 1)},
        "worst_ratio": {
            t: {d: (r if math.isfinite(r) else "inf") for d, r in by.items()} for t, by in tally.worst.items()
        },
        "worst_ratio_means": WORST_RATIO,
        "time_split": time_split(tally),
        "first_failure_s": tally.first_failure_s,
        "first_saved_failure_s": min((f["saved_after_s"] for f in tally.failures), default=None),
        "failures": tally.failures,
        "unavailable": tally.unavailable,
        "notes": tally.notes,
    }
