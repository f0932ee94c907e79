"""The engine target: cold vs warm prefix cache, and the block pool vs the reference cache model.

One `tests.strategies.EngineCase` (a request stream in rounds) is checked twice:
1. The engine (`engine.LLM`, tiny model in float32, greedy) with prefix caching on and off must
   agree (SPEC section 6) by the rule of tests/engine/test_engine.py: every step's logits pass SPEC
   section 5's rule against the cold run with `base` equal to it (the float32 floor: the runs differ
   only by GEMMs over other batch shapes), and tokens are identical wherever the cold run's top-2
   logit gap exceeds that allowance (past a near-tie the runs may diverge, and the rest of that
   request is not compared). The cold run must report no cached tokens.
2. `engine.block_pool.BlockPool` and `reference.prefix_cache.PrefixCacheModel` replay the same stream
   (lookup, allocate, offer full pages, free, then a reset): hits, block tables, the LRU free order,
   the cached pages and the counters must be equal after every step (structural, so exact), and the
   pool's invariants must hold.
"""

import math
from types import SimpleNamespace

ENGINE_BACKENDS = ("reference", "triton")


def compare_runs(cold, warm):
    """(worst error ratio, first problem or "") over the requests of one round."""
    import torch

    from tests.tolerance import error_stats

    worst, problem = 0.0, ""
    for r, (a, b) in enumerate(zip(cold, warm, strict=True)):
        if a.num_cached_tokens:
            return math.inf, f"request {r}: cold run reports {a.num_cached_tokens} cached tokens"
        for i, (la, lb) in enumerate(zip(a.logits, b.logits, strict=False)):
            s = error_stats(lb, la, la, torch.float32)
            worst = max(worst, s.ratio if s.bad_nonfinite == 0 else math.inf)
            if not s.passed and not problem:
                diff = f"{s.max_err:.3e} (allowed {s.allowed_max:.1e})"
                problem = f"request {r} step {i}: logits differ by {diff}"
            if a.token_ids[i] != b.token_ids[i]:
                top2 = la.double().topk(2).values
                gap = float(top2[0] - top2[1])
                if gap > s.allowed_max and not problem:
                    tokens = f"{a.token_ids[i]} vs {b.token_ids[i]}"
                    problem = f"request {r} step {i}: tokens {tokens}, top-2 gap {gap:.3e}"
                break  # past a divergence the contexts differ
        else:
            if len(a.token_ids) != len(b.token_ids) and not problem:
                problem = f"request {r}: {len(a.token_ids)} vs {len(b.token_ids)} tokens"
    return worst, problem


def engine_check(case, backend: str, device: str) -> tuple[float, str]:
    import engine

    runs = {}
    for caching in (False, True):
        llm = engine.LLM(
            "tiny",
            page_size=case.page_size,
            num_pages=case.num_pages,
            enable_prefix_caching=caching,
            backend=backend,
            seed=case.seed % 1000,
            record_logits=True,
            dtype="float32",  # the equivalence allowance is float32's floor
        )
        params = engine.SamplingParams(max_tokens=case.max_tokens, temperature=0.0)
        runs[caching] = [
            llm.generate(
                [list(case.prompts[j]) for j in rnd], params, cache_salt=[case.salts[j] for j in rnd]
            )
            for rnd in case.rounds
        ]
    worst, problem = 0.0, ""
    for k, (cold, warm) in enumerate(zip(runs[False], runs[True], strict=True)):
        ratio, why = compare_runs(cold, warm)
        worst = max(worst, ratio)
        problem = problem or (f"round {k}, {why}" if why else "")
    return worst, problem


def pool_check(case) -> str:
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
                token_ids=tokens, cache_salt=salt, page_keys=[], block_table=[], num_computed_tokens=0
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
    cached = sorted(pool.cached.values())
    return list(pool.lru), cached, pool.stats.evictions, pool.stats.queries, pool.stats.hits


def _model_state(model) -> tuple:
    cached = sorted(model.page_of.values())
    return model.free_order(), cached, model.evictions, model.queries, model.hits


class EngineTarget:
    """Engine equivalence with and without prefix caching, and the pool against its model."""

    name = "engine"

    def strategy(self, backend, device: str):
        from tests.strategies import engine_cases

        return engine_cases()

    def case_from_dict(self, d: dict):
        from tests.strategies import EngineCase

        return EngineCase.from_dict(d)

    def dtype_of(self, case) -> str:
        return "engine"

    def supported(self, ops, backend: str) -> str | None:
        if backend not in ENGINE_BACKENDS:
            return f"the engine runs on {' or '.join(ENGINE_BACKENDS)} attention, not {backend}"
        try:
            import engine
            import engine.block_pool  # noqa: F401
            import reference.prefix_cache  # noqa: F401

            engine.LLM  # noqa: B018
        except (ImportError, AttributeError) as exc:
            return f"engine unavailable ({type(exc).__name__}: {exc})"
        return None

    def run(self, case, ops, backend, device):
        from fuzz.targets import Result, guarded

        def go():
            problem = pool_check(case)
            if problem:
                return Result("failed", math.inf, f"block pool vs model: {problem}")
            ratio, problem = engine_check(case, backend.name, device)
            return Result(
                "failed" if problem else "passed", ratio, f"cold vs warm: {problem}" if problem else ""
            )

        return guarded(go)
