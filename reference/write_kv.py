"""Oracle of the KV-cache write: scatter each token's K/V to its flat slot (SPEC section 3)."""

from reference.validation import validate_write_kv


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
    validate_write_kv(k, v, k_cache, v_cache, slot_mapping)
    page_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // page_size, slot % page_size] = k[t]
        v_cache[slot // page_size, slot % page_size] = v[t]
