"""The one list of implementations under test, and the loader for anyone else's (contract §9).

An implementation is named by one string, the same for `nox -s tests -- --backend NAME`,
`nox -s kernel-fuzz -- --backend NAME`, `nox -s report -- --backend NAME` and
`engine.LLM(backend=NAME)`:

    triton | reference | sdpa | flex        the built-in names below
    package.module:attribute                 an importable object
    path/to/file.py:attribute                a file anywhere on disk (outside the repository is fine)

The object needs the attributes `write_kv`, `paged_prefill` and `paged_decode` (callables with the
operator signatures of contract §4, or None where not provided; a missing attribute counts as None)
and may have `capabilities`, a mapping with any of the keys of `Capabilities`. It may also provide
`plan_write_kv` / `plan_prefill` / `plan_decode` (the planned path of `kernels`); the engine uses them
when present.
"""

import hashlib
import importlib
import importlib.util
import inspect
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields

OPERATORS = ("write_kv", "paged_prefill", "paged_decode")
PLANNERS = ("plan_write_kv", "plan_prefill", "plan_decode")
ALL_DTYPES = ("float32", "float16", "bfloat16")
# The layout capability vocabulary of contract §9. "block_mask" is any layout through the protocol of
# reference/layouts.py (an outside family included): a kernel that declares it takes every block mask.
LAYOUT_KINDS = ("dense", "local_strided", "block_mask")
DEFAULT_BACKEND = "triton"
REPO = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Capabilities:
    """What an implementation declares it supports; cases outside it are never drawn or collected.

    The first five keys are contract §9's; the size keys extend it, so that a kernel limited to, say,
    power-of-two sparse blocks >= 16 declares `block_sizes=(16, 32, 64, 128)` instead of refusing
    most drawn cases one by one.
    """

    dtypes: tuple[str, ...] = ALL_DTYPES
    layouts: tuple[str, ...] = LAYOUT_KINDS
    lse: bool = True  # return_lse=True is supported
    context: bool = True  # prefill with a cached context (C > 0)
    validates: bool = True  # bad input raises ValueError / TypeError (contract §4)
    # Its plans read their metadata tensors at every launch, so that a plan captured in a CUDA graph stays
    # right when they are rewritten in place: decode sequences no longer than planned, the same table
    # width, write_kv slots of the same count; prefill plans `replan` in place (docs/contract.md). The
    # engine's whole-step graphs need it (False: eager steps, and layers in graphs between attention).
    graphs: bool = False
    block_sizes: tuple[int, ...] | None = None  # sparse block sizes S of sparse layouts; None: any
    page_sizes: tuple[int, ...] | None = None  # page sizes P; None: any
    head_dims: tuple[int, ...] | None = None  # head dims D; None: any

    @classmethod
    def from_mapping(cls, mapping, where: str) -> "Capabilities":
        """Validated capabilities; ValueError/TypeError naming the key for anything unknown or malformed."""
        if mapping is None:
            return cls()
        if not hasattr(mapping, "items"):
            raise TypeError(f"{where}: capabilities must be a mapping, got {type(mapping).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"{where}: unknown capabilities {unknown}; known: {sorted(known)}")
        values = {}
        for key, value in mapping.items():
            if key in ("lse", "context", "validates", "graphs"):
                if not isinstance(value, bool):
                    raise TypeError(f"{where}: capabilities[{key!r}] must be a bool, got {value!r}")
                values[key] = value
                continue
            if value is None and key in ("block_sizes", "page_sizes", "head_dims"):
                continue
            if isinstance(value, str) or not hasattr(value, "__iter__"):
                raise TypeError(f"{where}: capabilities[{key!r}] must be a collection, got {value!r}")
            items = tuple(value)
            allowed = {"dtypes": ALL_DTYPES, "layouts": LAYOUT_KINDS}.get(key)
            if allowed is not None:
                bad = [v for v in items if v not in allowed]
                if bad or not items:
                    raise ValueError(
                        f"{where}: capabilities[{key!r}] must be a non-empty subset of {allowed}"
                    )
                values[key] = tuple(v for v in allowed if v in items)
            else:
                if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
                    raise ValueError(f"{where}: capabilities[{key!r}] must hold positive ints, got {items}")
                values[key] = tuple(sorted(set(items)))
        return cls(**values)

    def refuses(self, case, op: str) -> str | None:
        """Why an attention or write case lies outside these capabilities, or None if it does not."""
        if case.dtype not in self.dtypes:
            return f"dtype {case.dtype} not declared (declares {', '.join(self.dtypes)})"
        if self.head_dims is not None and case.head_dim not in self.head_dims:
            return f"head_dim {case.head_dim} not declared"
        if self.page_sizes is not None and case.page_size not in self.page_sizes:
            return f"page size {case.page_size} not declared"
        if op == "write_kv":
            return None
        kind = case.layout.capability
        if kind not in self.layouts:
            return f"layout {kind} not declared (declares {', '.join(self.layouts)})"
        if (
            kind != "dense"
            and self.block_sizes is not None
            and case.layout.block_size not in self.block_sizes
        ):
            return f"sparse block size {case.layout.block_size} not declared"
        if op == "paged_prefill" and not self.context and any(case.context_lens):
            return "prefill with a cached context not declared"
        return None

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Implementation:
    """A loaded implementation: its operators, what it declares, and where its code lives."""

    name: str
    write_kv: Callable | None
    paged_prefill: Callable | None
    paged_decode: Callable | None
    capabilities: Capabilities = Capabilities()
    description: str = ""
    planners: dict = field(default_factory=dict)  # "plan_prefill" / "plan_decode" -> callable

    def op(self, name: str) -> Callable | None:
        if name not in OPERATORS:
            raise ValueError(f"unknown operator {name!r}; operators: {OPERATORS}")
        return getattr(self, name)

    def provides(self, name: str) -> bool:
        return self.op(name) is not None

    def refuses(self, case, op: str) -> str | None:
        """Why this implementation is not asked for `case` through `op`, or None."""
        if not self.provides(op):
            return f"{self.name} provides no {op}"
        return self.capabilities.refuses(case, op)


def own_doc(obj) -> str:
    """The object's own docstring: an instance (a SimpleNamespace, say) does not inherit its class's."""
    if inspect.ismodule(obj):
        return ""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)) and obj.__doc__ == type(obj).__doc__:
        return ""
    return inspect.getdoc(obj) or ""


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton():
    import kernels

    # Triton's CPU interpreter computes bfloat16 on raw bits (docs/triton-interpreter.md).
    dtypes = ("float32", "float16") if _interpreted() else ALL_DTYPES
    return kernels, {**kernels.capabilities, "dtypes": dtypes}


def _reference():
    import reference

    return reference, None


def _sdpa():
    from backends import comparison

    return comparison.SDPA, comparison.SDPA.capabilities


def _flex():
    from backends import comparison

    return comparison.load_flex(), comparison.FLEX_CAPABILITIES


# name -> (loader returning (object, capabilities or None), description). The only list of names.
BUILTINS = {
    "triton": (_triton, "the Triton kernels of kernels/ (bfloat16 only on a GPU)"),
    "reference": (_reference, "the float64 oracle itself (always passes; smoke tests)"),
    "sdpa": (_sdpa, "torch scaled_dot_product_attention over gathered K/V: dense causal, no lse"),
    "flex": (_flex, "torch FlexAttention, eager, any layout through a mask_mod"),
}


def _load_file(path: pathlib.Path):
    """The module of an implementation file. Its folder is appended to sys.path first, so that the
    file can import modules beside it; appended, so that this repository's own package names
    (reference, kernels, harness, ...) are never shadowed by a file of the same name there."""
    if not path.is_file():
        raise ValueError(f"file {path} does not exist")
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"_implementation_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses and pickling look it up
    spec.loader.exec_module(module)
    return module


def resolve(name: str, what: str):
    """The object a `package.module:attribute` or `path/to/file.py:attribute` name points at; ValueError
    naming `what` (an implementation, a layout family) when the module has no such attribute."""
    where, _, attr = name.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(pathlib.Path(where).expanduser().resolve())
    else:
        module = importlib.import_module(where)
    if not hasattr(module, attr):
        raise ValueError(f"{where} has no attribute {attr!r} ({what} {name!r})")
    return getattr(module, attr)


def load(name: str) -> Implementation:
    """The implementation called `name` (a built-in name, `module:attr` or `file.py:attr`).

    Raises ValueError naming the forms it accepts when `name` is none of them, and ImportError (or
    whatever the user's module raises) when it cannot be imported.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"an implementation name must be a non-empty str, got {name!r}")
    if name in BUILTINS:
        loader, description = BUILTINS[name]
        obj, caps = loader()
    elif ":" in name:
        obj = resolve(name, "implementation")
        caps = getattr(obj, "capabilities", None)
        description = own_doc(obj).split("\n")[0]
    else:
        raise ValueError(
            f"unknown implementation {name!r}: use a built-in name ({', '.join(BUILTINS)}), "
            "package.module:attribute, or path/to/file.py:attribute"
        )
    ops = {}
    for op in OPERATORS:
        fn = getattr(obj, op, None)
        if fn is not None and not callable(fn):
            raise TypeError(
                f"implementation {name!r}: {op} must be callable or None, got {type(fn).__name__}"
            )
        ops[op] = fn
    if not any(ops.values()):
        raise ValueError(f"implementation {name!r} provides none of {', '.join(OPERATORS)}")
    planners = {p: getattr(obj, p) for p in PLANNERS if callable(getattr(obj, p, None))}
    return Implementation(
        name=name,
        **ops,
        capabilities=Capabilities.from_mapping(caps, f"implementation {name!r}"),
        description=description,
        planners=planners,
    )


def describe_names() -> str:
    """The accepted implementation names, for --help texts."""
    builtins = "; ".join(f"{n}: {d}" for n, (_, d) in BUILTINS.items())
    return f"{builtins}; or package.module:attribute, or path/to/file.py:attribute"
