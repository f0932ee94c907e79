"""What the campaign fuzzes: per target, a case strategy and a check of one case against the oracle.

A target turns a drawn case (a JSON-ready dataclass from tests/strategies.py) into a `Result`. The
operator targets rebuild the inputs from the case's seed (`tests.strategies.build_inputs`) and
compare with SPEC section 5's rule (`tests.tolerance.error_stats` against
`tests.oracle.oracle_and_base`); `write_kv` is structural, so it is compared bit for bit. The engine
target lives in fuzz/engine_target.py.

Imported only after TRITON_INTERPRET is set (by fuzz/worker.py or the replay path).
"""

import math
import traceback
from dataclasses import asdict, dataclass, field

import torch

from tests.oracle import oracle_and_base
from tests.strategies import DTYPES, AttentionCase, build_inputs, fuzz_attention_cases
from tests.tolerance import error_stats

# Share of write_kv's tokens whose slot is -1 ("do not write").
PADDING_SLOT_SHARE = 0.125
# Bit-level views used to compare caches exactly (NaN payloads included).
BIT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Result:
    """The verdict on one case. status: passed, failed or unsupported (the backend raised ValueError
    on input the oracle accepts, which SPEC section 3 allows for unsupported P/S relations)."""

    status: str
    ratio: float = 0.0  # SPEC section 5's worst gate ratio (<= 1 passes); inf for a crash or a mismatch
    message: str = ""
    stats: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status != "failed"


def _stats_dict(s) -> dict:
    d = asdict(s)
    d["worst_index"] = list(s.worst_index)
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in d.items()}


def guarded(run):
    """Runs a check; a crash is a failure with its traceback, a ValueError is 'unsupported'."""
    try:
        return run()
    except ValueError as exc:
        return Result("unsupported", message=f"ValueError: {exc}")
    except Exception as exc:  # noqa: BLE001  (any crash of the backend is a finding)
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        return Result("failed", math.inf, f"crash: {type(exc).__name__}: {exc}", {"traceback": tail})


def _compare(name, inputs, backend, outputs) -> Result:
    (ref_out, ref_lse), (base_out, base_lse) = oracle_and_base(inputs)
    dtype = inputs["q"].dtype
    out, lse = outputs if backend.has_lse else (outputs, None)
    checks = {"out": error_stats(out, ref_out, base_out, dtype)}
    if lse is not None:
        checks["lse"] = error_stats(lse, ref_lse, base_lse, dtype)
    ratio = max(s.ratio if s.bad_nonfinite == 0 else math.inf for s in checks.values())
    bad = [k for k, s in checks.items() if not s.passed]
    stats = {k: _stats_dict(s) for k, s in checks.items()}
    if not bad:
        return Result("passed", ratio, "", stats)
    s = checks[bad[0]]
    message = (
        f"{name} {bad[0]}: max err {s.max_err:.3e} (allowed {s.allowed_max:.3e}), mean err "
        f"{s.mean_err:.3e} (allowed {s.allowed_mean:.3e}), {s.over_tolerance}/{s.numel} over, "
        f"{s.bad_nonfinite} non-finite, worst at {s.worst_index}"
    )
    return Result("failed", ratio, message, stats)


class AttentionTarget:
    """paged_prefill (decode=False) or paged_decode (decode=True) against the float64 oracle."""

    def __init__(self, name: str, decode: bool):
        self.name, self.decode = name, decode
        self.op = "paged_decode" if decode else "paged_prefill"

    def strategy(self, backend, device: str):
        return fuzz_attention_cases(
            device=device,
            decode=self.decode,
            dtypes=backend.dtypes_on(device),
            layout_kinds=backend.layout_kinds,
        )

    def case_from_dict(self, d: dict) -> AttentionCase:
        return AttentionCase.from_dict(d)

    def dtype_of(self, case) -> str:
        return case.dtype

    def supported(self, ops, backend: str) -> str | None:
        return None if getattr(ops, self.op, None) else f"backend has no {self.op}"

    def run(self, case, ops, backend, device) -> Result:
        def go():
            inputs = build_inputs(case, device)
            args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
            if not self.decode:
                args.append(inputs["query_start_loc"])
            outputs = getattr(ops, self.op)(
                *args, scale=inputs["scale"], layout=inputs["layout"], return_lse=backend.has_lse
            )
            return _compare(self.op, inputs, backend, outputs)

        return guarded(go)


def write_kv_inputs(case: AttentionCase, device) -> dict:
    """The case's paged cache plus new K/V for its query tokens and their slots (-1 for some).

    Returns a dict with k, v [num_tokens, num_kv_heads, head_dim], k_cache, v_cache and
    slot_mapping int64 [num_tokens].
    """
    inputs = build_inputs(case, "cpu")
    gen = torch.Generator().manual_seed(case.seed + 1)
    num_tokens, page = sum(case.query_lens), case.page_size
    shape = (num_tokens, case.num_kv_heads, case.head_dim)
    k = torch.randn(shape, generator=gen) * case.input_scale
    v = torch.randn(shape, generator=gen) * case.input_scale
    slots = []
    for b, (n, q) in enumerate(zip(case.seq_lens, case.query_lens, strict=True)):
        for p in range(n - q, n):
            slots.append(int(inputs["block_tables"][b, p // page]) * page + p % page)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    padding = torch.rand(num_tokens, generator=gen) < PADDING_SLOT_SHARE
    slot_mapping[padding] = -1
    dtype = DTYPES[case.dtype]
    return dict(
        k=k.to(dtype).to(device),
        v=v.to(dtype).to(device),
        k_cache=inputs["k_cache"].to(device),
        v_cache=inputs["v_cache"].to(device),
        slot_mapping=slot_mapping.to(device),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so that equal NaN payloads compare equal."""
    return t.contiguous().view(BIT_VIEWS[t.element_size()])


class WriteKVTarget:
    """write_kv against the oracle's write: both caches must match bit for bit afterwards."""

    name, op = "write_kv", "write_kv"

    def strategy(self, backend, device: str):
        return fuzz_attention_cases(device=device, dtypes=backend.dtypes_on(device))

    def case_from_dict(self, d: dict) -> AttentionCase:
        return AttentionCase.from_dict(d)

    def dtype_of(self, case) -> str:
        return case.dtype

    def supported(self, ops, backend: str) -> str | None:
        return None if getattr(ops, "write_kv", None) else "backend has no write_kv"

    def run(self, case, ops, backend, device) -> Result:
        import reference

        def go():
            inputs = write_kv_inputs(case, device)
            expect = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}
            got = {k: inputs[k].clone() for k in ("k_cache", "v_cache")}
            reference.write_kv(
                inputs["k"], inputs["v"], expect["k_cache"], expect["v_cache"], inputs["slot_mapping"]
            )
            ops.write_kv(inputs["k"], inputs["v"], got["k_cache"], got["v_cache"], inputs["slot_mapping"])
            wrong = {k: int((bits(got[k]) != bits(expect[k])).sum()) for k in got}
            stats = {"mismatched_elements": wrong, "numel": expect["k_cache"].numel()}
            if not any(wrong.values()):
                return Result("passed", 0.0, "", stats)
            return Result("failed", math.inf, f"write_kv: mismatched cache elements {wrong}", stats)

        return guarded(go)


def all_targets() -> dict:
    """Target name -> target object (each says itself whether it can run here: `supported`)."""
    from fuzz.engine_target import EngineTarget

    return {
        "prefill": AttentionTarget("prefill", decode=False),
        "decode": AttentionTarget("decode", decode=True),
        "write_kv": WriteKVTarget(),
        "engine": EngineTarget(),
    }
