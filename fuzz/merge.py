"""`python -m fuzz --merge SUMMARY...`: the shards of one campaign as one report.

Each shard (`--shard K/N`) is a complete campaign that writes its own JSON summary (`--summary`),
run by whatever runs jobs: a Slurm array, a Kubernetes Job, a CI matrix. The merge folds the
summaries into one: counts and time per target, dtype and status added up, worst ratios and the
first failure taken over all shards, failures listed once per distinct case (a case that one shard
found and the others replayed from the example database names them all), the ledgers' stale entries
united. It checks that the summaries belong together (one implementation, seed and shard count) and
that no shard is missing: a missing or failed shard makes the merged run fail.
"""

import json
import math
import pathlib
import sys

from fuzz import case_file, summary
from harness.records import jsonable

SAME = ("backend", "seed", "targets", "dtypes", "layout_families")


def _case_identity(failure: dict) -> str:
    """The failing case itself (its file's plain values), else its words."""
    try:
        data = case_file.load(failure["file"])
        return json.dumps([data["target"], data["case"]], sort_keys=True)
    except (OSError, ValueError, KeyError):
        return json.dumps([failure["target"], failure["case"]])


def _label(data: dict, path) -> str:
    return f"shard {data['shard'][0]}/{data['shard'][1]}" if data.get("shard") else str(path)


def merge(paths) -> tuple[dict, summary.Tally]:
    """(the merged summary, the tally it was folded into) of the shard summaries at `paths` (JSON
    files); ValueError when they are not shards of one campaign."""
    loaded = [(pathlib.Path(p), json.loads(pathlib.Path(p).read_text())) for p in paths]
    first = loaded[0][1]
    for path, data in loaded[1:]:
        differ = [k for k in SAME if data.get(k) != first.get(k)]
        if differ:
            raise ValueError(
                f"--merge: {path} is another campaign ({', '.join(differ)} differ from {loaded[0][0]})"
            )
    tally, notes, by_case, stale, ledgers = summary.Tally(start=0.0), [], {}, set(), set()
    shards = [tuple(d["shard"]) for _, d in loaded if d.get("shard")]
    if shards:
        counts = {n for _, n in shards}
        if len(counts) > 1 or len(shards) != len(loaded):
            raise ValueError(
                f"--merge: shard counts differ or some summaries are not shards: {sorted(shards)}"
            )
        (n,) = counts
        repeated = sorted({k for k, _ in shards if [s[0] for s in shards].count(k) > 1})
        if repeated:
            raise ValueError(f"--merge: shard(s) {repeated} of {n} given twice")
        missing = sorted(set(range(1, n + 1)) - {k for k, _ in shards})
        if missing:
            notes.append(f"INCOMPLETE: shard(s) {', '.join(f'{k}/{n}' for k in missing)} missing")
    for path, data in loaded:
        label = _label(data, path)
        for target, by_target in data.get("counts", {}).items():
            for dtype, by_status in by_target.get("by_dtype", {}).items():
                for status, count in by_status.items():
                    tally.counts[target][dtype][status] += count
        for target, by_dtype in data.get("worst_ratio", {}).items():
            for dtype, ratio in by_dtype.items():
                ratio = math.inf if ratio == "inf" else ratio
                tally.worst[target][dtype] = max(tally.worst[target].get(dtype, 0.0), ratio)
        for target, row in data.get("time_split", {}).items():
            tally.on((0, "seconds", target, row["seconds"]))
        for failure in data.get("failures", []):
            key = _case_identity(failure)
            if key in by_case:
                by_case[key].setdefault("also_found_by", []).append(label)
            else:
                by_case[key] = dict(failure, found_by=label)
        when = data.get("first_failure_s")
        if when is not None and (tally.first_failure_s is None or when < tally.first_failure_s):
            tally.first_failure_s = when
        tally.unavailable.update(data.get("unavailable", {}))
        notes += [f"{label}: {note}" for note in data.get("notes", [])]
        stale.update(data.get("stale_ledger_entries", []))
        ledgers.add(data.get("ledger"))
        if data.get("exit_code") == 1 and not data.get("failures") and not data.get("stale_ledger_entries"):
            notes.append(f"{label}: exited 1 (incomplete)")
    tally.failures = sorted(by_case.values(), key=lambda f: f.get("saved_after_s", 0.0))
    tally.notes = notes
    elapsed = max(d.get("elapsed_s", 0.0) for _, d in loaded)
    merged = {k: first.get(k) for k in SAME}
    merged |= {
        "shards": [_label(d, p) for p, d in loaded],
        "summaries": [str(p) for p, _ in loaded],
        "workers": sum(d.get("workers", 0) for _, d in loaded),
        "ledgers": sorted(x for x in ledgers if x),
    }
    merged |= summary.summary_dict(tally, elapsed)
    # Shards run side by side: the campaign's rate is the sum of theirs.
    merged["cases_per_minute"] = _summed_rates(loaded)
    failed = bool(
        tally.failures or tally.failed or stale or any("INCOMPLETE" in n or "exited 1" in n for n in notes)
    )
    nothing = all(d.get("exit_code") == 2 for _, d in loaded)
    merged |= {"stale_ledger_entries": sorted(stale), "exit_code": 1 if failed else (2 if nothing else 0)}
    return merged, tally


def _summed_rates(loaded) -> dict:
    rates: dict[str, float] = {}
    for _, data in loaded:
        for target, rate in data.get("cases_per_minute", {}).items():
            rates[target] = round(rates.get(target, 0.0) + rate, 1)
    return rates


def main_merge(paths, out=None) -> int:
    """Prints the merged report (and writes its JSON to `out`); returns its exit code."""
    try:
        merged, tally = merge(paths)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    for note in merged["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for f in tally.failures:
        replay = case_file.REPLAY_COMMAND.format(path=case_file.display_path(f["file"]))
        by = ", ".join([f["found_by"], *f.get("also_found_by", [])])
        print(summary.failure_text(f, merged["backend"], replay) + f"\n  found by: {by}")
    print(
        f"merged: backend {merged['backend']}, {len(paths)} summaries ({', '.join(merged['shards'])}), "
        f"{merged['workers']} worker(s), {merged['elapsed_s']} s; {summary.WORST_RATIO}"
    )
    print(summary.status_table(tally) or "  no case ran")
    if merged["time_split"]:
        print(summary.time_table(merged["time_split"]))
    text = json.dumps(jsonable(merged), indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
    return merged["exit_code"]
