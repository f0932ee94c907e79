"""A crash is a result (contract §9, STYLE 24): cases run where a death can be seen and reported.

Two mechanisms, one rule: the case being run is known to someone outside the process that may die.

- `Isolated` runs cases of one implementation in a child process (the campaign's drivers and
  `--replay` use it). A child that dies gives the verdict `crashed` (with its exit code or
  signal), one that does not answer within the per-case limit is killed and gives `hung`, and one
  whose CUDA context is left unusable answers `crashed` and exits. The next case starts a fresh child,
  so a failure never poisons the cases after it, and hypothesis can shrink a crash by re-running
  candidates, each in a fresh process, the way libFuzzer's fork mode does.
- `InFlight` is the pytest side: before each call, a worker writes the case it is about to run to a
  file of its own and arms a hang guard (`faulthandler`, which needs no GIL to fire); the xdist
  controller, when the worker dies, reads the file and reports the test by name with its case and a
  replay command (tests/conftest.py). A worker whose device is left unusable exits on purpose, so
  xdist replaces it and later tests run on a fresh CUDA context.

Heavy imports happen inside the child, after its environment is set (TRITON_INTERPRET,
CUDA_VISIBLE_DEVICES must be in place before torch and triton load).
"""

import faulthandler
import json
import multiprocessing as mp
import os
import pathlib
import signal
import time

# A child must say it is ready (torch imported, implementation loaded) within this time.
START_LIMIT_S = 600.0
DEFAULT_CASE_TIMEOUT_S = 120.0
INFLIGHT_ENV = "SUITE_INFLIGHT_DIR"
# Exit code of a pytest worker that leaves on purpose after its device became unusable.
DEVICE_LOST_EXIT = 70


def _verdict(status: str, message: str):
    import math

    from harness.judge import Verdict

    return Verdict(status, math.inf, message)


def death_in_words(exitcode) -> str:
    """How a child process ended: `killed by signal 11 (SIGSEGV)` or `exit code 3`."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _serve(conn, backend: str, device: str, env: dict) -> None:
    """Child entry: set the environment, load the implementation, then judge cases until told to stop."""
    os.environ.update(env)
    import torch

    from backends import registry
    from fuzz import backend_names, targets

    if os.environ.get("TRITON_INTERPRET") == "1":  # one thread per worker: the CPU has few cores
        torch.set_num_threads(1)
    impl = registry.load(backend_names.loadable(backend))
    conn.send(("ready", None))
    while True:
        request = conn.recv()
        if request is None:
            return
        name, case = request
        verdict = targets.run_case(name, impl, case, device)
        verdict.outputs = None
        conn.send(("verdict", verdict))
        if verdict.status == "crashed":
            return  # the device is unusable: a fresh child takes the next case


class Isolated:
    """Cases of one implementation, run one at a time in a child process that is replaced when it dies.

    Args:
        backend: the implementation's canonical registry name (fuzz/backend_names.py).
        device: "cpu" or "cuda" (as the child sees it).
        env: environment of the child (TRITON_INTERPRET, CUDA_VISIBLE_DEVICES, ...).
        case_timeout: seconds a case may run before it is `hung`.
    """

    def __init__(
        self, backend: str, device: str, env: dict | None = None, case_timeout=DEFAULT_CASE_TIMEOUT_S
    ):
        self.backend, self.device, self.env = backend, device, dict(env or {})
        self.case_timeout = case_timeout
        self.proc = self.conn = None
        self.starts = 0  # children started so far
        self.last_start_s = 0.0  # how long the last one took to be ready (torch, the implementation)

    def _start(self) -> None:
        started = time.monotonic()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.backend, self.device, self.env), daemon=True)
        self.proc.start()
        child.close()
        self.starts += 1
        if not self.conn.poll(START_LIMIT_S):
            self._kill()
            raise RuntimeError(f"the child for {self.backend} did not start within {START_LIMIT_S:g} s")
        try:
            self.conn.recv()  # ("ready", None)
            self.last_start_s = time.monotonic() - started
        except EOFError as exc:
            self.proc.join(5)
            code = self.proc.exitcode
            self._kill()
            raise RuntimeError(
                f"the child for {self.backend} died while loading it ({death_in_words(code)})"
            ) from exc

    def _kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(10)
        self.proc = self.conn = None

    def run(self, target: str, case: dict):
        """The verdict on one case (a `harness.judge.Verdict`), `crashed` or `hung` included."""
        if self.proc is None or not self.proc.is_alive():
            self._kill()
            self._start()
        try:
            self.conn.send((target, case))
        except (BrokenPipeError, OSError):  # died between two cases: start afresh once
            self._kill()
            self._start()
            self.conn.send((target, case))
        start = time.monotonic()
        if self.conn.poll(self.case_timeout):
            try:
                _, verdict = self.conn.recv()
                if verdict.status == "crashed":
                    self._kill()
                return verdict
            except EOFError:
                pass
        elapsed = time.monotonic() - start
        if self.proc.is_alive() and elapsed >= self.case_timeout:
            self._kill()
            return _verdict("hung", f"HANG: no result within the per-case limit of {self.case_timeout:g} s")
        self.proc.join(10)
        how = death_in_words(self.proc.exitcode)
        self._kill()
        return _verdict("crashed", f"CRASH: the process running the case died ({how})")

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        self._kill()


class InProcess:
    """`Isolated`'s interface without the child: cases run in this process (no crash isolation).

    For the suite's own tests that patch the engine or the pool in place, which a child would not see.
    """

    def __init__(self, backend: str, device: str, **_):
        from backends import registry
        from fuzz import backend_names, targets

        self.impl = registry.load(backend_names.loadable(backend))
        self.device, self.targets = device, targets
        self.starts, self.last_start_s = 0, 0.0

    def run(self, target: str, case: dict):
        return self.targets.run_case(target, self.impl, case, self.device)

    def close(self) -> None:
        pass


class InFlight:
    """The case a pytest worker is running, on disk for whoever sees it die, and a hang guard.

    `folder` is shared with the controller (INFLIGHT_ENV); each worker writes `<worker>.json`.
    """

    def __init__(self, folder, worker: str, case_timeout: float):
        self.path = pathlib.Path(folder) / f"{worker}.json"
        self.case_timeout = case_timeout
        self.last: dict = {}

    def begin(self, record: dict) -> None:
        """Before the call: the record (test id, target, backend, case) and the start time."""
        data = dict(record, started=time.time(), case_timeout=self.case_timeout)
        self.last = data
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
        # Dumps every thread's stack and exits the process when the case overruns: xdist sees a crash.
        faulthandler.dump_traceback_later(self.case_timeout, exit=True)

    def end(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.path.unlink(missing_ok=True)

    def device_lost(self, message: str) -> None:
        """The case left the device unusable: keep the record, marked, for the controller, and leave."""
        faulthandler.cancel_dump_traceback_later()
        self.path.write_text(json.dumps(dict(self.last, status="crashed", message=message)))
        os._exit(DEVICE_LOST_EXIT)

    @staticmethod
    def read(folder, worker: str) -> dict | None:
        """The record a dead worker left, or None."""
        path = pathlib.Path(folder) / f"{worker}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None


def crash_status(record: dict, now: float | None = None) -> str:
    """`hung` when the dead worker's case had run past its limit, else `crashed`."""
    elapsed = (now or time.time()) - record.get("started", 0.0)
    return "hung" if elapsed >= record.get("case_timeout", float("inf")) * 0.95 else "crashed"
