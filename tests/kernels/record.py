"""Error-ratio log of the kernel tests, read by reports/gpu_kernel_check.py.

When KERNEL_STATS_FILE is set, every accepted comparison appends one JSON line (operator, output,
dtype, both gate ratios, shape summary); otherwise nothing happens.
"""

import json
import os

STATS_ENV = "KERNEL_STATS_FILE"


def record(op: str, case, stats, output: str) -> None:
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    line = dict(
        op=op,
        output=output,
        dtype=case.dtype,
        max_ratio=stats.max_ratio,
        mean_ratio=stats.mean_ratio,
        layout=case.layout.kind,
        max_seq_len=max(case.seq_lens),
        num_heads=case.num_heads,
        head_dim=case.head_dim,
        page_size=case.page_size,
    )
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
