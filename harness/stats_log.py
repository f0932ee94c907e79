"""Error-ratio log of the operator tests, read by reports/gpu_kernel_check.py.

When KERNEL_STATS_FILE is set, every passed comparison appends one JSON line (operator, output,
dtype, both gate ratios, shape summary); otherwise nothing happens.
"""

import json
import os

STATS_ENV = "KERNEL_STATS_FILE"


def record(op: str, case, verdict) -> None:
    path = os.environ.get(STATS_ENV)
    if not path or verdict.status != "passed":
        return
    with open(path, "a") as f:
        for output, stats in verdict.stats.items():
            line = dict(
                op=op,
                output=output,
                dtype=case.dtype,
                max_ratio=stats["max_ratio"],
                mean_ratio=stats["mean_ratio"],
                layout=case.layout.kind,
                max_seq_len=max(case.seq_lens),
                num_heads=case.num_heads,
                head_dim=case.head_dim,
                page_size=case.page_size,
            )
            f.write(json.dumps(line) + "\n")
