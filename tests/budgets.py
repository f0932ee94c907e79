"""Per-test example budgets as multiples of the loaded hypothesis profile (ci, dev or nightly).

`@examples(4)` on a cheap test runs four times the profile's `max_examples`, `@examples(0.5)` on an
expensive one half, so that every profile keeps the same balance between tests.
"""

from hypothesis import settings


def examples(factor: float) -> settings:
    return settings(max_examples=max(1, round(settings.default.max_examples * factor)))
