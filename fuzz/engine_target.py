"""The engine target: the block pool against the reference cache model, then cold vs warm runs.

One `harness.cases.EngineCase` (prompts cut from shared stems, per-prompt salts, 1-3 rounds of
`generate`) is checked twice:

1. `engine.block_pool.BlockPool` and `reference.prefix_cache.PrefixCacheModel` replay the same stream
   (lookup, allocate, offer full pages, free, then a reset): hits, block tables, the LRU free order,
   the cached pages and the counters must be equal after every round (structural, so exact), and the
   pool's invariants must hold.
2. The engine (`engine.LLM`, tiny model in float32, greedy) on the implementation under test, with
   prefix caching off and on, must be equivalent by the one rule of harness/engine_check.py (the same
   function tests/engine/test_engine.py asserts with).

The engine calls all three operators of the implementation, in float32, over the tiny model's
dense and local-strided layers with cached contexts, so an implementation that does not provide or
declare all of that makes the target unavailable (with the reason) instead of failing.
"""

import math
from types import SimpleNamespace

from hypothesis import strategies as st

from harness.cases import EngineCase
from harness.engine_check import compare_cold_warm
from harness.judge import Verdict, raised, unsupported
from harness.strategies import ENGINE_PAGE_SIZES, case_seeds, engine_cases
from harness.timing import phase

MODEL = "tiny"
DTYPE = "float32"  # the equivalence allowance is float32's floor


class EngineTarget:
    """Engine equivalence with and without prefix caching, and the pool against its model."""

    name = "engine"

    def refusal(self, impl) -> str | None:
        """Why the engine cannot run on `impl`: a missing operator, or a capability it does not declare."""
        from engine.model import ModelArgs
        from engine.model_runner import backend_refusal

        why = backend_refusal(
            impl, ModelArgs.from_name(MODEL), DTYPE, (impl.capabilities.page_sizes or (16,))[0]
        )
        return None if why is None else f"{impl.name} {why}"

    def dtypes(self, impl, requested) -> tuple[str, ...]:
        return (DTYPE,) if DTYPE in impl.capabilities.dtypes and (not requested or DTYPE in requested) else ()

    def keys(self, impl, device: str, dtype: str):
        """Page sizes: the engine's only compile-time choice (the tiny model fixes everything else)."""
        declared = impl.capabilities.page_sizes
        sizes = [p for p in ENGINE_PAGE_SIZES if declared is None or p in declared]
        if not sizes:
            raise ValueError(f"no declared page size among the engine's {ENGINE_PAGE_SIZES}")
        return st.sampled_from(sizes)

    def strategy(self, impl, device: str, dtype: str, key=None, shard=None):
        if key is None:
            return self.keys(impl, device, dtype).flatmap(
                lambda p: self.strategy(impl, device, dtype, p, shard)
            )
        return engine_cases(page_size=key, seeds=case_seeds(shard))

    def case_from_dict(self, d: dict) -> EngineCase:
        return EngineCase.from_dict(d)

    def dtype_of(self, case) -> str:
        return DTYPE

    def describe(self, case) -> str:
        return case.describe()

    def run(self, impl, case, device) -> Verdict:
        sizes = impl.capabilities.page_sizes
        if sizes is not None and case.page_size not in sizes:  # a replay on another implementation
            return Verdict("unsupported", message=f"page size {case.page_size} not declared")
        try:
            with phase("oracle"):  # the reference cache model
                problem = pool_check(case)
            if problem:
                return Verdict("failed", math.inf, f"block pool vs model: {problem}")
            with phase("implementation"):  # the engine on the implementation, cold and warm
                cold = engine_runs(case, impl.name, device, caching=False)
                warm = engine_runs(case, impl.name, device, caching=True)
        except NotImplementedError as exc:
            return unsupported(exc)
        except Exception as exc:  # noqa: BLE001  (any exception of the engine or the implementation is a finding)
            return raised(exc, device)
        worst = 0.0
        for k, (c, w) in enumerate(zip(cold, warm, strict=True)):
            result = compare_cold_warm(c, w)
            worst = max(worst, result.worst_ratio)
            if result.problem:
                return Verdict("failed", worst, f"cold vs warm, round {k}: {result.problem}")
        return Verdict("passed", worst)


def engine_runs(case: EngineCase, backend: str, device: str, caching: bool) -> list[list]:
    """The outputs of each round of `case` on a fresh float32 engine (prefix caching on or off)."""
    import engine

    llm = engine.LLM(
        MODEL,
        page_size=case.page_size,
        num_pages=case.num_pages,
        enable_prefix_caching=caching,
        backend=backend,
        seed=case.seed % 1000,
        record_logits=True,
        dtype=DTYPE,
        device=device,
    )
    params = engine.SamplingParams(max_tokens=case.max_tokens, temperature=0.0)
    return [
        llm.generate([list(case.prompts[j]) for j in rnd], params, cache_salt=[case.salts[j] for j in rnd])
        for rnd in case.rounds
    ]


def pool_check(case: EngineCase) -> str:
    """Replays the case's stream on the pool and the model; returns the first difference or ""."""
    from engine.block_pool import BlockPool, pages_for
    from reference.prefix_cache import PrefixCacheModel

    size = case.page_size
    pool = BlockPool(case.num_pages, size, case.seed % 1000, True)
    model = PrefixCacheModel(case.num_pages, size)
    for k, rnd in enumerate(case.rounds):
        tables = []
        for j in rnd:
            tokens, salt = list(case.prompts[j]), case.salts[j]
            seq = SimpleNamespace(
                token_ids=tokens,
                cache_salt=salt,
                page_keys=[],
                encoded_pages=[],
                block_table=[],
                num_computed_tokens=0,
            )
            seq.num_offered_pages = 0
            where = f"round {k}, prompt {j}"
            hits = pool.lookup(seq)
            if hits != model.lookup(tokens, salt):
                return f"{where}: lookup {hits} vs model {model.lookup(tokens, salt)}"
            new = pages_for(len(tokens), size) - len(hits)
            if pool.can_allocate(hits, new) != model.can_allocate(hits, new):
                return f"{where}: can_allocate differs"
            if not pool.can_allocate(hits, new):
                continue
            table, want = pool.allocate(hits, new, len(tokens)), model.allocate(hits, new, len(tokens))
            if table != want:
                return f"{where}: allocate {table} vs model {want}"
            seq.block_table, seq.num_computed_tokens = table, len(tokens)
            pool.cache_full_pages(seq)
            model.cache(table, tokens, salt, 0, len(tokens) // size)
            tables.append(table)
            pool.check_invariants()
        for table in tables:
            pool.free(table)
            model.free(table)
        pool.check_invariants()
        state = _pool_state(pool), _model_state(model)
        if state[0] != state[1]:
            return f"after round {k}: pool {state[0]} vs model {state[1]}"
    if pool.reset() != model.reset():
        return "reset() differs"
    return ""


def _pool_state(pool) -> tuple:
    return (
        list(pool.lru),
        sorted(pool.cached.values()),
        pool.stats.evictions,
        pool.stats.queries,
        pool.stats.hits,
    )


def _model_state(model) -> tuple:
    return model.free_order(), sorted(model.page_of.values()), model.evictions, model.queries, model.hits
