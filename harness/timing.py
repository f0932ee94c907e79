"""Where a case's time goes: compiling kernels, running the implementation, the oracle, the harness.

The judge marks its two calls (`phase("implementation")`, `phase("oracle")`); Triton's own hooks
mark every compilation, disk-cache hits and module loads included (`watch_compiles`), and that time
is taken out of the phase it happened in. Whatever a case costs beyond these three is the harness's
(building inputs, judging, poisoning, processes and pipes; the campaign works it out, fuzz/worker.py).
On a GPU the judge synchronizes after each call, so wall time is device time plus host time.
"""

import time
from contextlib import contextmanager

PHASES = ("compile", "implementation", "oracle")


class Clock:
    """Seconds per phase in this process since the last `take()`."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._compile_start: list[float] = []

    def take(self) -> dict:
        """The seconds per phase so far, and a fresh start."""
        taken, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return taken

    @contextmanager
    def phase(self, name: str):
        """Counts the block's wall time as `name`, less the compile time inside it."""
        start, compiled = time.perf_counter(), self.seconds["compile"]
        try:
            yield
        finally:
            inner = self.seconds["compile"] - compiled
            self.seconds[name] += max(0.0, time.perf_counter() - start - inner)

    def compile_started(self, *_, **__) -> None:
        self._compile_start.append(time.perf_counter())

    def compile_ended(self, *_, **__) -> None:
        if self._compile_start:
            self.seconds["compile"] += time.perf_counter() - self._compile_start.pop()


CLOCK = Clock()
_watching: list[bool] = []


def phase(name: str):
    """`with phase("oracle"): ...` on the process's clock."""
    return CLOCK.phase(name)


def watch_compiles() -> None:
    """Counts Triton's compilations and module loads of this process as `compile` (once per process;
    hooks already set are kept and called first). Does nothing where Triton is absent."""
    if _watching:
        return
    _watching.append(True)
    try:
        from triton import knobs
    except ImportError:
        return
    runtime = knobs.runtime
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def cache_hook(**info):
        # A true answer of an earlier hook skips the compilation: then nothing is timed.
        if before is not None and before(**info):
            return True
        CLOCK.compile_started()
        return None

    def post_compile_hook(**info):
        CLOCK.compile_ended()
        return None if after is None else after(**info)

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_compile_hook
    runtime.kernel_load_start_hook.add(CLOCK.compile_started)
    runtime.kernel_load_end_hook.add(CLOCK.compile_ended)
