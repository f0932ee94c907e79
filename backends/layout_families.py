"""Layout families, each named by one string, like an implementation (contract §2, §9):

    package.module:attribute | path/to/file.py:attribute    (a file outside the repository is fine)

The attribute is a callable `attr(num_heads)` returning a hypothesis strategy of layouts: objects of
the protocol in reference/layouts.py (`block_size`, `block_mask(num_heads, num_blocks)`, optionally
`token_mask`). `--layout-family NAME` of `nox -s tests`, `nox -s kernel-fuzz` and `nox -s report`
sweeps such a family like a built-in one; `examples/sliding_window_sinks.py:family` is one. A family
needs that one file: the oracle, validation and the kernels read layouts through the protocol only.
"""

from collections.abc import Callable
from dataclasses import dataclass

from backends import registry


@dataclass(frozen=True)
class Family:
    """A loaded layout family: its name, `layouts(num_heads)` (a hypothesis strategy) and its summary."""

    name: str
    layouts: Callable
    description: str = ""


def load(name: str) -> Family:
    """The layout family called `name` (`module:attr` or `file.py:attr`); ValueError or TypeError when
    it is not one."""
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(
            f"a layout family is named package.module:attribute or path/to/file.py:attribute, got {name!r}"
        )
    layouts = registry.resolve(name, "layout family")
    if not callable(layouts):
        raise TypeError(
            f"layout family {name!r} must be a callable num_heads -> hypothesis strategy of layouts, "
            f"got {type(layouts).__name__}"
        )
    return Family(name=name, layouts=layouts, description=registry.own_doc(layouts).split("\n")[0])
