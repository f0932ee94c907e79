"""What the campaign checks: per target, which cases it draws for an implementation and how one case
is judged, all through the harness.

- `prefill` / `decode`: cases from `harness.strategies.fuzz_attention_cases`, drawn within the
  implementation's declared capabilities, judged by `harness.judge.judge_attention` (contract §5's
  rule on `out`, and on `lse` where the implementation declares it).
- `write_kv`: the same cases' query tokens written into their scattered cache
  (`harness.cases.write_kv_inputs`), judged by `harness.judge.judge_write_kv` (bit for bit).
- `engine`: fuzz/engine_target.py.

Every case is drawn with one dtype and one compile-time key fixed (`keys(impl, device, dtype)`
draws the keys, `strategy(impl, device, dtype, key, shard)` the cases), so hypothesis can never
shrink a failure into another dtype, and a chunk of draws reuses its compiled kernels. `run_case`
runs one case with the implementation's own allocations NaN-poisoned (harness/poison.py), so an
output it never writes fails.

Imported only after TRITON_INTERPRET is set (by fuzz/worker.py or the replay path).
"""

import math

from backends.registry import LAYOUT_KINDS
from fuzz.engine_target import EngineTarget
from harness import judge, timing
from harness.cases import AttentionCase, write_kv_inputs
from harness.strategies import case_seeds, fuzz_attention_cases, fuzz_attention_shapes

TARGETS = ("prefill", "decode", "write_kv", "engine")


class AttentionTarget:
    """paged_prefill (decode=False) or paged_decode (decode=True) against the float64 oracle."""

    def __init__(self, name: str, decode: bool, families=()):
        self.name, self.decode, self.families = name, decode, tuple(families)
        self.op = "paged_decode" if decode else "paged_prefill"
        # With outside families (--layout-family), the layouts come from them alone.
        self.layout_kinds = () if self.families else LAYOUT_KINDS

    def refusal(self, impl) -> str | None:
        """Why this target cannot run on `impl` at all, or None."""
        return None if impl.provides(self.op) else f"{impl.name} provides no {self.op}"

    def dtypes(self, impl, requested) -> tuple[str, ...]:
        """The dtypes to draw: the declared ones, narrowed to `requested` (--dtype) when given."""
        return tuple(d for d in impl.capabilities.dtypes if not requested or d in requested)

    def keys(self, impl, device: str, dtype: str):
        """The compile-time parts a chunk of draws fixes (harness.cases.AttentionShape)."""
        return fuzz_attention_shapes(
            caps=impl.capabilities,
            device=device,
            dtypes=(dtype,),
            families=self.families,
            layout_kinds=self.layout_kinds,
        )

    def strategy(self, impl, device: str, dtype: str, key=None, shard=None):
        """Cases of `dtype` with the compile-time part `key` (None: drawn too); `shard` (k, n)
        draws only that shard's seeds (harness.strategies.case_seeds)."""
        return fuzz_attention_cases(
            caps=impl.capabilities,
            device=device,
            decode=self.decode,
            dtypes=(dtype,),
            shape=key,
            seeds=case_seeds(shard),
            families=self.families,
        )

    def case_from_dict(self, d: dict) -> AttentionCase:
        return AttentionCase.from_dict(d)

    def dtype_of(self, case) -> str:
        return case.dtype

    def describe(self, case) -> str:
        return case.describe()

    def run(self, impl, case, device) -> judge.Verdict:
        return judge.judge_attention(impl, case, decode=self.decode, device=device)


class WriteKVTarget(AttentionTarget):
    """write_kv against the oracle's write: both caches must match bit for bit afterwards."""

    def __init__(self):
        super().__init__("write_kv", decode=False)
        self.op = "write_kv"

    def describe(self, case) -> str:
        return (
            f"{sum(case.query_lens)} token(s) written for {len(case.seq_lens)} sequence(s) of "
            f"{list(case.seq_lens)} tokens (queries {list(case.query_lens)}), {case.num_kv_heads} kv heads, "
            f"head_dim {case.head_dim}, page size {case.page_size}, {case.dtype}"
        )

    def run(self, impl, case, device) -> judge.Verdict:
        return judge.judge_write_kv(impl, write_kv_inputs(case, device), case)


def all_targets(families=()) -> dict:
    """Target name -> target object; `families` (backends.layout_families.Family) give prefill and
    decode their layouts."""
    return {
        "prefill": AttentionTarget("prefill", decode=False, families=families),
        "decode": AttentionTarget("decode", decode=True, families=families),
        "write_kv": WriteKVTarget(),
        "engine": EngineTarget(),
    }


def plan(impl, names, requested_dtypes, families=()) -> tuple[dict, dict]:
    """({name: (target, dtypes to draw)}, {name: why it cannot run}) for the targets `names`."""
    targets, active, unavailable = all_targets(families), {}, {}
    for name in names:
        target = targets[name]
        reason = target.refusal(impl)
        dtypes = target.dtypes(impl, requested_dtypes)
        if reason is None and not dtypes:
            drawable = ", ".join(target.dtypes(impl, ())) or "none"
            asked = ", ".join(requested_dtypes)
            reason = (
                f"no dtype to draw: this target draws {drawable} for {impl.name}; --dtype asks for {asked}"
            )
        if reason:
            unavailable[name] = reason
        else:
            active[name] = (target, dtypes)
    return active, unavailable


def run_case(target_name: str, impl, case: dict, device) -> judge.Verdict:
    """One case, as plain values (a case file's or a message's), through the target of that name
    (the judge poisons the implementation's fresh allocations). The verdict's `seconds` say where
    the case's time went (harness/timing.py)."""
    target = all_targets()[target_name]
    timing.watch_compiles()
    timing.CLOCK.take()
    verdict = target.run(impl, target.case_from_dict(case), device)
    verdict.seconds = timing.CLOCK.take()
    return verdict


def _number(x) -> str:
    return x if isinstance(x, str) else f"{x:.3e}"


def errors_in_words(verdict) -> str:
    """The error of each judged output against its allowance, then the worst ratio, in one line."""
    parts = []
    for output in ("out", "lse"):
        s = verdict.stats.get(output)
        if isinstance(s, dict) and "max_err" in s:
            text = (
                f"{output}: max err {_number(s['max_err'])}, worst ratio {_number(s['max_ratio'])} "
                f"(allowed there {_number(s['allowed_at_worst'])}), "
                f"mean err {_number(s['mean_err'])} (allowed {_number(s['allowed_mean'])})"
            )
            if s.get("bad_nonfinite"):
                text += f", {s['bad_nonfinite']} non-finite mismatches"
            parts.append(text)
    if "mismatched_elements" in verdict.stats:
        parts.append(
            f"mismatched cache elements {verdict.stats['mismatched_elements']} of "
            f"{verdict.stats.get('numel')} each (allowed 0)"
        )
    if not parts:
        parts.append(verdict.message or "no error profile")
    ratio = verdict.ratio if isinstance(verdict.ratio, (int, float)) else math.inf
    return "; ".join(parts) + f"; worst ratio {ratio:.3g} (error / allowed error, <= 1 passes)"
