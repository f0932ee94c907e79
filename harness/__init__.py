"""The suite's harness: everything tests/, fuzz/, reports/ and the engine checks share.

    cases        the case model (plain values) and the tensors built from a case's seed
    strategies   hypothesis strategies over cases, drawn within an implementation's capabilities
    registry     the one list of implementations; loads `module:attr` and `file.py:attr` too
    comparison   the comparison implementations (torch SDPA, FlexAttention)
    tolerance    contract §5's tolerance rule and the comparison helper
    judge        run one case through an implementation and judge it against the oracle
    bad_inputs   the edge-case table of contract §4 (bad input, views, non-finite values)
    poison       NaN poisoning of an implementation's allocations
    cache_layouts conversions between the suite's paged cache and the layouts kernels use
    stats_log    the error-ratio log of the operator tests
    records      the versions behind a stored result, and JSON without inf or NaN

Nothing here imports tests/.
"""
