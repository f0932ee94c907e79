"""Flattens a scheduled batch into paged-attention inputs, runs the model and samples.

Per step, rows with one query token (decodes, and one-token prefill chunks) go first and are served
by the backend's `paged_decode`; the other rows by `paged_prefill`. Every layer calls `write_kv`
first, so attention reads every key, new or cached, through the block tables (contract §4).

When the backend has a planned path (`plan_write_kv` / `plan_prefill` / `plan_decode`, as `kernels`
does), the step's metadata is validated and planned once per operator (and layout) at the first
layer that needs it, and every later layer only runs the plan: one host sync per plan instead of one
per layer and operator.
"""

from dataclasses import dataclass, field

import torch

from backends import registry
from engine.config import EngineConfig
from engine.model import Decoder, ModelArgs
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """A sequence and the number of its tokens computed this step (from `num_computed_tokens` on)."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last token, so the step yields the sequence's next token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Paged-attention inputs of one step; the first `num_decode_tokens` rows are one-query rows.

    slot_mapping: int64 [num_tokens]. decode_*: [num_decode] rows. prefill_*: the other rows, with
    prefill_query_start_loc int32 [num_prefill + 1]. Block tables are int32, padded with page 0
    (never read: the oracle and kernels read only cdiv(seq_len, page_size) entries).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    plans: dict = field(default_factory=dict)  # "write_kv" or (operator, id of layout) -> the step's plan


@dataclass(frozen=True, slots=True)
class Sample:
    token_id: int
    logprob: float
    logits: torch.Tensor | None


def backend_refusal(impl, args: ModelArgs, dtype: str, page_size: int) -> str | None:
    """Why the engine cannot run `impl` (a loaded implementation) for this model, or None.

    The engine calls all three operators, in the model's dtype, over its dense and local-strided
    layers, with cached contexts (prefix-cache hits and chunked prefill): an implementation that does
    not provide or declare all of that would fail at the first step that needs it.
    """
    missing = [op for op in registry.OPERATORS if not impl.provides(op)]
    if missing:
        return f"provides no {', '.join(missing)}; the engine needs all three operators"
    caps = impl.capabilities
    layouts = {"dense"} | ({"local_strided"} if any(args.layout(i) for i in range(args.n_layers)) else set())
    sparse = "local_strided" in layouts
    needs = [
        (dtype in caps.dtypes, f"dtype {dtype}"),
        (layouts <= set(caps.layouts), f"layouts {', '.join(sorted(layouts))}"),
        (caps.context, "prefill with a cached context (prefix-cache hits and chunked prefill read one)"),
        (caps.page_sizes is None or page_size in caps.page_sizes, f"page size {page_size}"),
        (caps.head_dims is None or args.head_dim in caps.head_dims, f"head_dim {args.head_dim}"),
        (
            caps.block_sizes is None or not sparse or args.sparse_block_size in caps.block_sizes,
            f"sparse block size {args.sparse_block_size}",
        ),
    ]
    undeclared = [what for ok, what in needs if not ok]
    if undeclared:
        return f"does not declare what the engine needs: {'; '.join(undeclared)} (contract §9)"
    return None


def load_backend(name: str, args: ModelArgs, dtype: str, page_size: int):
    """The implementation called `name` (backends/registry.py); ValueError, before any step runs, unless
    it provides and declares everything the engine will ask of it (`backend_refusal`)."""
    impl = registry.load(name)
    why = backend_refusal(impl, args, dtype, page_size)
    if why:
        raise ValueError(f"backend {name!r} {why}")
    return impl


def _block_tables(rows: list[list[int]], device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table.to(device)


class ModelRunner:
    """Owns the weights, the per-layer KV caches and the sampler's generator."""

    def __init__(self, config: EngineConfig, args: ModelArgs):
        self.config = config
        self.args = args
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        default = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, config.dtype or default)
        self.ops = load_backend(
            config.backend, args, str(self.dtype).removeprefix("torch."), config.page_size
        )
        with self.device:  # build the layers on the device: no large CPU init for big configs
            # No sequence outgrows the cache, so its positions stay below num_pages * page_size; the
            # rotary tables then take 4 * head_dim bytes a position, a few percent of its KV.
            capacity = config.num_pages * config.page_size
            self.model = Decoder(args, capacity).init_weights(config.seed, self.device, self.dtype)
        shape = (config.num_pages, config.page_size, args.n_kv_heads, args.head_dim)
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            for _ in range(args.n_layers)
        ]
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)

    def prepare(self, batch: list[ScheduledSeq]):
        """Flattens a batch ordered one-query rows first. Returns (input_ids, positions, metadata)."""
        page = self.config.page_size
        ids, positions, slots = [], [], []
        tables, lens, starts = [], [], [0]
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            pos = torch.arange(start, start + item.num_tokens)
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            ids.append(torch.tensor(seq.token_ids[start : start + item.num_tokens], dtype=torch.int64))
            positions.append(pos)
            slots.append(table[pos // page] * page + pos % page)
            tables.append(seq.block_table)
            lens.append(start + item.num_tokens)
            starts.append(starts[-1] + item.num_tokens)
        num_decode = next((i for i, item in enumerate(batch) if item.num_tokens != 1), len(batch))
        dev = self.device
        prefill_starts = [s - starts[num_decode] for s in starts[num_decode:]]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            num_decode_tokens=num_decode,
            decode_block_tables=_block_tables(tables[:num_decode], dev),
            decode_seq_lens=torch.tensor(lens[:num_decode], dtype=torch.int32, device=dev),
            prefill_block_tables=_block_tables(tables[num_decode:], dev),
            prefill_seq_lens=torch.tensor(lens[num_decode:], dtype=torch.int32, device=dev),
            prefill_query_start_loc=torch.tensor(prefill_starts, dtype=torch.int32, device=dev),
        )
        return torch.cat(ids).to(dev), torch.cat(positions).to(dev), meta

    def attend(self, meta: AttentionMetadata, layer: int, q, k, v) -> torch.Tensor:
        """write_kv, then paged_decode on the one-query rows and paged_prefill on the rest."""
        k_cache, v_cache = self.kv_caches[layer]
        layout, nd = self.model.layouts[layer], meta.num_decode_tokens
        self._planned(meta, "write_kv", "write_kv", (k, v, k_cache, v_cache), (meta.slot_mapping,))
        attention = dict(scale=self.args.scale, layout=layout)
        parts = []
        if nd:
            metadata = (meta.decode_block_tables, meta.decode_seq_lens)
            per_call = (q[:nd].contiguous(), k_cache, v_cache)
            parts.append(
                self._planned(meta, ("decode", id(layout)), "paged_decode", per_call, metadata, **attention)
            )
        if nd < q.shape[0]:
            metadata = (meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_query_start_loc)
            per_call = (q[nd:].contiguous(), k_cache, v_cache)
            parts.append(
                self._planned(meta, ("prefill", id(layout)), "paged_prefill", per_call, metadata, **attention)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _planned(self, meta: AttentionMetadata, key, op: str, per_call: tuple, metadata: tuple, **kwargs):
        """`op(*per_call, *metadata, **kwargs)` through the step's plan under `key`, made at the first layer
        that needs it, or the plain operator when the backend has no planner for it."""
        planner = self.ops.planners.get("plan_" + op.removeprefix("paged_"))
        if planner is None:
            return self.ops.op(op)(*per_call, *metadata, **kwargs)
        if key not in meta.plans:
            meta.plans[key] = planner(*per_call, *metadata, **kwargs)
        return meta.plans[key].run(*per_call)

    def run(self, batch: list[ScheduledSeq]) -> list[Sample | None]:
        """One forward pass over `batch`; a Sample for every row whose chunk reaches its last token."""
        order = sorted(range(len(batch)), key=lambda i: batch[i].num_tokens != 1)  # stable
        ordered = [batch[i] for i in order]
        input_ids, positions, meta = self.prepare(ordered)
        ends = torch.tensor([item.num_tokens for item in ordered]).cumsum(0) - 1
        sampling = [j for j, item in enumerate(ordered) if item.samples]
        logits = self.model(
            input_ids,
            positions,
            lambda i, q, k, v: self.attend(meta, i, q, k, v),
            ends[sampling].to(self.device),
        )
        samples: list[Sample | None] = [None] * len(batch)
        temperatures = [ordered[j].seq.params.temperature for j in sampling]
        for j, sample in zip(sampling, self._sample(logits, temperatures), strict=True):
            samples[order[j]] = sample
        return samples

    def _sample(self, logits: torch.Tensor, temperatures: list[float]) -> list[Sample]:
        """One Sample per row of logits [num_samples, vocab_size]. Greedy rows are taken together
        with one device-to-host copy for the step (a read per row was two syncs per sequence); the
        others draw from the runner's generator row by row, in order."""
        kept = logits.cpu() if self.config.record_logits else None
        out: list[Sample | None] = [None] * len(temperatures)
        greedy = [r for r, t in enumerate(temperatures) if t == 0.0]
        if greedy:
            rows = logits if len(greedy) == len(temperatures) else logits[greedy]
            tokens = torch.argmax(rows, dim=-1)
            logprobs = torch.log_softmax(rows, dim=-1).gather(-1, tokens[:, None])[:, 0]
            # float64 holds every token id and float32 logprob exactly.
            pairs = torch.stack((tokens.double(), logprobs.double()), dim=1).tolist()
            for r, (token, logprob) in zip(greedy, pairs, strict=True):
                out[r] = Sample(int(token), logprob, None if kept is None else kept[r])
        for r, temperature in enumerate(temperatures):
            if temperature != 0.0:
                logprobs = torch.log_softmax(logits[r] / temperature, dim=-1)
                token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
                out[r] = Sample(token, float(logprobs[token]), None if kept is None else kept[r])
        return out
