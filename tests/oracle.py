"""The oracle's two runs that every numerical test needs: float64 `ref` and in-dtype `base`."""

import torch

from reference.paged_prefill import prefill_in_dtype
from reference.validation import validate_paged_prefill


def oracle_and_base(inputs: dict):
    """Runs the oracle on built case inputs (tests.strategies.build_inputs).

    Returns ((ref_out, ref_lse), (base_out, base_lse)): the float64 oracle, unrounded, and the same
    computation in the input dtype (SPEC section 5's `base`).
    """
    q = inputs["q"]
    batch = validate_paged_prefill(
        q,
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["block_tables"],
        inputs["seq_lens"],
        inputs["query_start_loc"],
        scale=inputs["scale"],
        layout=inputs["layout"],
    )
    args = (batch, q, inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["layout"])
    ref = prefill_in_dtype(*args, torch.float64, cast_outputs=False)
    base = prefill_in_dtype(*args, q.dtype)
    return ref, base
