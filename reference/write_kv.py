"""Oracle of the KV-cache write: scatter each token's K/V to its flat slot (contract §3)."""

from reference.validation import PlanGuard, validate_write_kv


class ReferenceWritePlan:
    """The oracle's planned write: the validated slots, applied to any K/V and caches of the planned
    shapes (every layer of a step). The twin of `kernels.write_kv.WritePlan`, with the same refusals."""

    def __init__(self, k, v, k_cache, v_cache, slot_mapping):
        validate_write_kv(k, v, k_cache, v_cache, slot_mapping)
        self.guard = PlanGuard(
            dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache), dict(slot_mapping=slot_mapping)
        )
        self.slots = slot_mapping.tolist()

    def run(self, k, v, k_cache, v_cache) -> None:
        """Writes token t's K/V to its planned slot, in place."""
        self.guard.check(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
        page_size = k_cache.shape[1]
        for t, slot in enumerate(self.slots):
            if slot >= 0:
                k_cache[slot // page_size, slot % page_size] = k[t]
                v_cache[slot // page_size, slot % page_size] = v[t]


def plan_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Validates a `write_kv` call once; returns a plan whose `run(k, v, k_cache, v_cache)` writes it.

    Arguments as `write_kv`; `run` refuses (ValueError) tensors of other shapes, dtypes or devices and a
    slot_mapping modified in place after planning.
    """
    return ReferenceWritePlan(k, v, k_cache, v_cache, slot_mapping)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Writes token t's K/V to slot `slot_mapping[t] = page_id * page_size + offset`, in place.

    Args:
        k, v (torch.Tensor):
            [num_tokens, num_kv_heads, head_dim].
        k_cache, v_cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim], k's dtype; written in place.
        slot_mapping (torch.Tensor):
            int64 [num_tokens]; -1 means "do not write" (padding). No slot appears twice.
    Returns:
        None.
    """
    plan_write_kv(k, v, k_cache, v_cache, slot_mapping).run(k, v, k_cache, v_cache)
