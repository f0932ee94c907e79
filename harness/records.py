"""What produced a stored result and how it is stored: the versions, and JSON without inf or NaN.

The fuzz campaign's case files and summaries and the accuracy report's JSON use both.
"""

import math
import platform


def versions() -> dict:
    """Versions of what produced a result (triton None where it cannot be imported)."""
    import hypothesis
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    out["hypothesis"] = hypothesis.__version__
    return out


def jsonable(x):
    """`x` with non-finite floats as the strings "inf", "-inf", "nan" (JSON has none) and tuples as lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
