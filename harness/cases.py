"""The case model: small frozen dataclasses of plain values, and the tensors built from them.

A case is JSON-ready (a fuzz failure is saved and replayed as one), and its tensors come from its
seed alone (`build_inputs`, `write_kv_case_inputs`), never element by element from hypothesis.
"""

import base64
import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch

import reference
from backends.registry import ALL_DTYPES

DTYPES = {name: getattr(torch, name) for name in ALL_DTYPES}
# Out-of-range ids placed in block-table padding: a kernel that reads one faults or goes wrong.
PADDING_IDS = (-1, 2**31 - 1)
# Share of write_kv's tokens whose slot is -1 ("do not write") in the attention-derived writes.
PADDING_SLOT_SHARE = 0.125


@dataclass(frozen=True)
class LayoutSpec:
    """A layout as plain values. kind: "dense" (layout=None), "local_strided", "block_mask", or
    "family": a layout drawn from an outside family (backends/layout_families.py), kept as its block
    mask (`mask`, `encode_mask`) so that the case replays without the family's code."""

    kind: str = "dense"
    block_size: int = 16
    local_blocks: int = 1
    vert_stride: int = 1
    homo_head: bool = False
    num_heads_total: int | None = None
    head_offset: int = 0
    density: float = 1.0  # block_mask: probability that a causal block is kept
    mask_seed: int = 0
    shared_heads: bool = False  # block_mask: one [NB, NB] mask for every head
    family: str | None = None  # family: the family's name
    mask: str = ""  # family: the drawn layout's block mask (`encode_mask`)
    words: str = ""  # family: the drawn layout's repr

    @classmethod
    def of_family(cls, family: str, layout, num_heads: int, max_len: int) -> "LayoutSpec":
        """The spec of `layout` (drawn from `family`) for `num_heads` heads and positions < max_len."""
        num_blocks = max(1, math.ceil(max_len / layout.block_size))
        mask = reference.layouts.layout_block_mask(layout, num_heads, num_blocks)
        words = repr(layout)
        return cls(
            kind="family",
            block_size=layout.block_size,
            family=family,
            mask=encode_mask(mask),
            words=words if len(words) <= MAX_WORDS else words[: MAX_WORDS - 3] + "...",
        )

    @property
    def capability(self) -> str:
        """The layout kind an implementation must declare for it (contract §9): a family's layouts are
        general block masks."""
        return "block_mask" if self.kind == "family" else self.kind

    def build(self, num_heads: int, max_len: int):
        """The layout object for `num_heads` heads and sequences up to `max_len` tokens."""
        if self.kind == "dense":
            return None
        if self.kind == "local_strided":
            return reference.LocalStridedLayout(
                self.block_size,
                self.local_blocks,
                self.vert_stride,
                homo_head=self.homo_head,
                num_heads_total=self.num_heads_total,
                head_offset=self.head_offset,
            )
        if self.kind == "block_mask":
            num_blocks = max(1, math.ceil(max_len / self.block_size))
            mask = reference.random_block_mask(
                1 if self.shared_heads else num_heads, num_blocks, self.density, self.mask_seed
            )
            return reference.BlockMaskLayout(mask[0] if self.shared_heads else mask, self.block_size)
        if self.kind == "family":
            return reference.BlockMaskLayout(decode_mask(self.mask), self.block_size)
        raise ValueError(f"unknown layout kind {self.kind!r}")

    def describe(self) -> str:
        """The layout in words, e.g. `local_strided S=64 local=16 stride=8`."""
        if self.kind == "dense":
            return "dense causal"
        if self.kind == "local_strided":
            heads = "homo" if self.homo_head else "per-head columns"
            shard = ""
            if self.num_heads_total is not None or self.head_offset:
                total = "all" if self.num_heads_total is None else self.num_heads_total
                shard = f", shard: heads from {self.head_offset} of {total}"
            return (
                f"local_strided S={self.block_size} local={self.local_blocks} stride={self.vert_stride} "
                f"({heads}{shard})"
            )
        if self.kind == "family":
            return f"{self.words} from family {self.family}"
        return f"block_mask S={self.block_size} density={self.density:g}"


# A family layout's repr is cut to this many characters in its spec.
MAX_WORDS = 200


def encode_mask(mask: torch.Tensor) -> str:
    """A bool mask [heads, NB, NB] as text: "heads,NB:" then its bits, packed, deflated, base64."""
    heads, nb, _ = mask.shape
    bits = torch.nn.functional.pad(mask.reshape(-1).to(torch.uint8), (0, (-mask.numel()) % 8))
    packed = (bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
    return f"{heads},{nb}:" + base64.b64encode(zlib.compress(packed.numpy().tobytes(), 9)).decode()


def decode_mask(text: str) -> torch.Tensor:
    """The mask `encode_mask` wrote: bool [heads, NB, NB]."""
    shape, _, data = text.partition(":")
    heads, nb = (int(v) for v in shape.split(","))
    if not heads * nb:
        return torch.zeros(heads, nb, nb, dtype=torch.bool)
    packed = torch.frombuffer(bytearray(zlib.decompress(base64.b64decode(data))), dtype=torch.uint8)
    bits = (packed.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.view(-1)[: heads * nb * nb].view(heads, nb, nb).bool()


@dataclass(frozen=True)
class AttentionShape:
    """The part of an attention case that kernels typically compile for: dtype, heads, head dim,
    page size, layout kind and sparse block size (Triton constexprs, the divisibility of strides).

    The campaign fixes one shape for a chunk of draws and varies everything else (fuzz/worker.py),
    so a chunk compiles once.
    """

    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layout_kind: str
    block_size: int  # 0 for a family's layouts: the family draws its block size
    family: str | None = None  # layout_kind "family": the family's name

    @classmethod
    def of(cls, case: "AttentionCase") -> "AttentionShape":
        family = case.layout.kind == "family"
        return cls(
            case.dtype,
            case.num_heads,
            case.num_kv_heads,
            case.head_dim,
            case.page_size,
            case.layout.kind,
            0 if family else case.layout.block_size,
            case.layout.family if family else None,
        )


@dataclass(frozen=True)
class AttentionCase:
    """One paged-attention problem: batch shape, cache geometry, layout, dtype and a seed."""

    seed: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]  # the last query_lens[b] tokens of sequence b are queries
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    input_scale: float = 1.0
    scale: float | None = None
    layout: LayoutSpec = LayoutSpec()
    spare_pages: int = 2  # pages no sequence owns; they hold garbage

    @property
    def context_lens(self) -> tuple[int, ...]:
        return tuple(n - q for n, q in zip(self.seq_lens, self.query_lens, strict=True))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionCase":
        d = dict(d)
        d["layout"] = LayoutSpec(**d["layout"])
        d["seq_lens"], d["query_lens"] = tuple(d["seq_lens"]), tuple(d["query_lens"])
        return cls(**d)

    def describe(self) -> str:
        """The case in words: contexts (and whether each is a multiple of the sparse block), queries,
        heads, head dim, page size, layout, dtype and scale."""
        size = self.layout.block_size
        if self.layout.kind == "dense":
            contexts = ", ".join(str(c) for c in self.context_lens)
        else:
            contexts = ", ".join(
                f"{c} ({'a multiple' if c % size == 0 else 'not a multiple'} of S={size})"
                for c in self.context_lens
            )
        return (
            f"{len(self.seq_lens)} sequence(s): context {contexts}; queries {list(self.query_lens)}; "
            f"heads {self.num_heads}/{self.num_kv_heads} kv, head_dim {self.head_dim}, page size "
            f"{self.page_size}, {self.layout.describe()}, {self.dtype}, "
            f"scale {'1/sqrt(D)' if self.scale is None else f'{self.scale:.4g}'}"
        )


def build_inputs(case: AttentionCase, device) -> dict:
    """Tensors of a case, from its seed alone.

    Pages are scattered at random over the cache; unused pages and the unused tail of each
    sequence's last page hold NaN, and block-table padding holds out-of-range page ids, so a kernel
    that reads what it must not fails loudly.

    Returns a dict with q [num_tokens, num_heads, head_dim], k_cache and v_cache
    [num_pages, page_size, num_kv_heads, head_dim], block_tables int32 [num_seqs, max_pages_per_seq],
    seq_lens int32 [num_seqs], query_start_loc int32 [num_seqs + 1], layout and scale.
    """
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    page = case.page_size
    pages_per_seq = [math.ceil(n / page) for n in case.seq_lens]
    num_pages = sum(pages_per_seq) + case.spare_pages
    width = max(pages_per_seq, default=0) + 1 + int(torch.randint(0, 3, (1,), generator=gen))
    order = torch.randperm(num_pages, generator=gen)
    table = torch.tensor(PADDING_IDS, dtype=torch.int64)[
        torch.randint(0, len(PADDING_IDS), (len(case.seq_lens), width), generator=gen)
    ]
    cache_shape = (num_pages, page, case.num_kv_heads, case.head_dim)
    k_cache = torch.full(cache_shape, math.nan, dtype=torch.float32)
    v_cache = torch.full(cache_shape, math.nan, dtype=torch.float32)
    used = 0
    for b, n in enumerate(case.seq_lens):
        ids = order[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        table[b, : len(ids)] = ids
        for cache in (k_cache, v_cache):
            values = torch.randn(n, case.num_kv_heads, case.head_dim, generator=gen) * case.input_scale
            flat = cache[ids].reshape(-1, case.num_kv_heads, case.head_dim)
            flat[:n] = values
            cache[ids] = flat.view(len(ids), page, case.num_kv_heads, case.head_dim)
    num_tokens = sum(case.query_lens)
    q = torch.randn(num_tokens, case.num_heads, case.head_dim, generator=gen) * case.input_scale
    starts = [0]
    for n in case.query_lens:
        starts.append(starts[-1] + n)
    return dict(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=table.to(torch.int32).to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        layout=case.layout.build(case.num_heads, max(case.seq_lens, default=1)),
        scale=case.scale,
    )


def attention_args(inputs: dict, decode: bool) -> list:
    """The positional arguments of `paged_prefill` (or `paged_decode`) from built inputs."""
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens"] + ([] if decode else ["query_start_loc"])
    return [inputs[k] for k in names]


def write_kv_inputs(case: AttentionCase, device) -> dict:
    """The case's paged cache plus new K/V for its query tokens and their slots (-1 for some).

    Returns a dict with k, v [num_tokens, num_kv_heads, head_dim], k_cache, v_cache and
    slot_mapping int64 [num_tokens].
    """
    inputs = build_inputs(case, "cpu")
    gen = torch.Generator().manual_seed(case.seed + 1)
    num_tokens, page = sum(case.query_lens), case.page_size
    shape = (num_tokens, case.num_kv_heads, case.head_dim)
    k = torch.randn(shape, generator=gen) * case.input_scale
    v = torch.randn(shape, generator=gen) * case.input_scale
    slots = []
    for b, (n, q) in enumerate(zip(case.seq_lens, case.query_lens, strict=True)):
        for p in range(n - q, n):
            slots.append(int(inputs["block_tables"][b, p // page]) * page + p % page)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    slot_mapping[torch.rand(num_tokens, generator=gen) < PADDING_SLOT_SHARE] = -1
    dtype = DTYPES[case.dtype]
    return dict(
        k=k.to(dtype).to(device),
        v=v.to(dtype).to(device),
        k_cache=inputs["k_cache"].to(device),
        v_cache=inputs["v_cache"].to(device),
        slot_mapping=slot_mapping.to(device),
    )


@dataclass(frozen=True)
class WriteKVCase:
    """One cache write: token count, cache geometry, dtype, share of padding (-1) slots, seed."""

    seed: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: str
    pad_fraction: float


def write_kv_case_inputs(case: WriteKVCase, device) -> dict:
    """k, v [num_tokens, num_kv_heads, head_dim], random caches and distinct slots (some -1)."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    slots = torch.randperm(case.page_size * case.num_pages, generator=gen)[: case.num_tokens]
    slots[torch.rand(case.num_tokens, generator=gen) < case.pad_fraction] = -1
    shape = (case.num_tokens, case.num_kv_heads, case.head_dim)
    cache_shape = (case.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen).to(dtype).to(device) for _ in range(2))
    return dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots.to(device))


@dataclass(frozen=True)
class EngineRequest:
    """One request of a stream; it arrives `arrival_steps` engine steps after the previous one."""

    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    arrival_steps: int = 0


@dataclass(frozen=True)
class EngineStream:
    """A request stream and the engine geometry it runs on (plain values, JSON-ready)."""

    requests: tuple[EngineRequest, ...]
    page_size: int
    num_pages: int
    max_num_batched_tokens: int
    max_num_seqs: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineStream":
        d = dict(d)
        d["requests"] = tuple(EngineRequest(**{**r, "prompt": tuple(r["prompt"])}) for r in d["requests"])
        return cls(**d)


@dataclass(frozen=True)
class EngineCase:
    """A request stream for the engine: prompts sharing prefixes, sent in rounds of `generate` calls.

    `rounds[i]` lists the prompt indexes of the i-th `generate` call (repeats allowed, so a round can
    hit pages cached by an earlier one); `salts[j]` is prompt j's cache_salt.
    """

    seed: int
    page_size: int
    num_pages: int
    max_tokens: int
    prompts: tuple[tuple[int, ...], ...]
    salts: tuple[str | None, ...]
    rounds: tuple[tuple[int, ...], ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineCase":
        d = dict(d)
        d["prompts"] = tuple(tuple(p) for p in d["prompts"])
        d["rounds"] = tuple(tuple(r) for r in d["rounds"])
        d["salts"] = tuple(d["salts"])
        return cls(**d)

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        return (
            f"{len(self.prompts)} prompt(s) of {lens} tokens in {len(self.rounds)} round(s), page size "
            f"{self.page_size}, {self.num_pages} pages, max_tokens {self.max_tokens}"
        )
