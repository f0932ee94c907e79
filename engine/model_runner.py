"""Flattens a scheduled batch into paged-attention inputs, runs the model and samples.

Per step, rows with one query token (decodes, and one-token prefill chunks) go first and are served
by the backend's `paged_decode`; the other rows by `paged_prefill`. Every layer calls `write_kv`
first, so attention reads every key, new or cached, through the block tables (contract §4).

When the backend has a planned path (`plan_write_kv` / `plan_prefill` / `plan_decode`, as `kernels`
does), the step's metadata is validated and planned once per operator (and layout) at the first
layer that needs it, and every later layer only runs the plan: one host sync per plan instead of one
per layer and operator.
"""

import struct
from dataclasses import dataclass, field

import torch

from backends import registry
from engine.config import EngineConfig
from engine.cuda_graphs import StepGraphs
from engine.model import Decoder, ModelArgs, greedy_pairs
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


def flatten(batch: list[ScheduledSeq], page: int) -> tuple[list[int], ...]:
    """A batch's integers as Python lists: token ids, positions and slots [num_tokens], sequence lengths
    [num_seqs], query starts [num_seqs + 1] and the rows that sample (the last of a chunk that reaches
    its sequence's last token: `ScheduledSeq.samples`)."""
    ids, positions, slots, lens, starts, samples = [], [], [], [], [0], []
    for item in batch:
        seq, start = item.seq, item.seq.num_computed_tokens
        stop, table = start + item.num_tokens, seq.block_table
        ids += seq.token_ids[start:stop]
        positions += range(start, stop)
        # Slots page by page: position p of the page starting at `first` goes to table[first // P] * P
        # + p - first.
        for first in range(start - start % page, stop, page):
            base = table[first // page] * page - first
            slots += range(base + max(first, start), base + min(first + page, stop))
        lens.append(stop)
        starts.append(starts[-1] + item.num_tokens)
        if item.samples:
            samples.append(starts[-1] - 1)
    return ids, positions, slots, lens, starts, samples


class _Staging:
    """The integers of a step's inputs packed on the host into one int64 buffer, so that they reach the
    device in one copy. A copy per field cost ~5 µs of host time each, and building the fields with
    torch ops per sequence ~2 ms a decode step of 64 on the CPU (docs/engine-notes.md); `struct.pack`
    converts Python ints fastest (~7 ns each). Fields start 16-byte aligned in their final dtype, as
    the kernels' specialization prefers."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.size = 0  # elements so far

    def add(self, values, align: int) -> slice:
        """Appends `values` (a list or range of ints) at a multiple of `align` elements; returns where."""
        pad = -self.size % align
        start = self.size + pad
        self.chunks += (bytes(8 * pad), struct.pack(f"<{len(values)}q", *values))
        self.size = start + len(values)
        return slice(start, self.size)

    def add_table(self, rows: list[list[int]], align: int) -> tuple[slice, int]:
        """A block table's rows padded with page 0 to one width (>= 1); returns (where, width)."""
        width = max((len(r) for r in rows), default=0) or 1
        flat = []
        for r in rows:
            flat += r
            flat += [0] * (width - len(r))
        return self.add(flat, align), width

    def extend(self, other: "_Staging", align: int) -> slice:
        """Appends another buffer at a multiple of `align` elements; its slices count from the start."""
        start = self.add((), align).start
        self.chunks += other.chunks
        self.size += other.size
        return slice(start, self.size)

    def tensor(self) -> torch.Tensor:
        """The buffer as an int64 CPU tensor."""
        return torch.frombuffer(bytearray(b"".join(self.chunks)), dtype=torch.int64)


@dataclass(slots=True)
class LaunchedStep:
    """A forward pass enqueued by `ModelRunner.launch`. `pairs`: for a decode step whose every row
    samples greedily, the rows' `greedy_pairs` [rows, 2] on the device, to feed the next decode step."""

    runner: "ModelRunner"
    logits: torch.Tensor | None  # None: not needed (greedy rows, no logits recorded)
    greedy: torch.Tensor | None  # greedy_pairs of the sampling rows, made by a graph
    pairs: torch.Tensor | None
    ready: torch.cuda.Event | None  # `greedy` and `logits` copied to the host after it
    temperatures: list[float]
    rows: list[int]  # the batch row of each sampling row
    num_rows: int

    def samples(self) -> list[Sample | None]:
        """A Sample for every row whose chunk reaches its last token (reads the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        out: list[Sample | None] = [None] * self.num_rows
        drawn = self.runner._sample(self.logits, self.temperatures, self.greedy)
        for row, sample in zip(self.rows, drawn, strict=True):
            out[row] = sample
        return out


def _to_host(*tensors: torch.Tensor | None) -> tuple:
    """Copies of `tensors` (None stays None) in host memory, enqueued, and then the event after which
    they hold the values (None off the GPU, where they are copied now)."""
    copies = [
        None
        if t is None
        else torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=True)
        for t in tensors
    ]
    ready = None
    if any(t is not None and t.is_cuda for t in tensors):
        ready = torch.cuda.Event()
        ready.record()
    return (*copies, ready)


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
            # rotary tables then take 8 * head_dim bytes a position, a few percent of its KV.
            capacity = config.num_pages * config.page_size
            self.model = Decoder(args, capacity).init_weights(config.seed, self.device, self.dtype)
        shape = (config.num_pages, config.page_size, args.n_kv_heads, args.head_dim)
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            for _ in range(args.n_layers)
        ]
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graphs = StepGraphs(self, whole_decode=self.ops.capabilities.graphs) if graphs else None

    def prepare(self, batch: list[ScheduledSeq]):
        """Flattens a batch ordered one-query rows first, with one host-to-device copy and one cast.

        Returns (input_ids [num_tokens], positions [num_tokens], sample_rows [num_samples], metadata):
        int64 except the metadata's int32 fields; sample_rows are the rows whose chunk ends the
        sequence's tokens (`ScheduledSeq.samples`).
        """
        ids, positions, slots, lens, starts, samples = flatten(batch, self.config.page_size)
        nd = next((i for i, item in enumerate(batch) if item.num_tokens != 1), len(batch))
        # int64 fields, then the int32 ones (aligned to 2 and 4 elements: 16 bytes), cast on the device.
        wide, narrow = _Staging(), _Staging()
        at_ids, at_pos, at_slots, at_samples = (wide.add(v, 2) for v in (ids, positions, slots, samples))
        tables = [item.seq.block_table for item in batch]
        at_dt, width_d = narrow.add_table(tables[:nd], 4)
        at_dl = narrow.add(lens[:nd], 4)
        at_pt, width_p = narrow.add_table(tables[nd:], 4)
        at_pl = narrow.add(lens[nd:], 4)
        at_qsl = narrow.add([s - starts[nd] for s in starts[nd:]], 4)
        at_narrow = wide.extend(narrow, 2)
        dev = wide.tensor().to(self.device)
        small = dev[at_narrow].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=dev[at_slots],
            num_decode_tokens=nd,
            decode_block_tables=small[at_dt].view(-1, width_d),
            decode_seq_lens=small[at_dl],
            prefill_block_tables=small[at_pt].view(-1, width_p),
            prefill_seq_lens=small[at_pl],
            prefill_query_start_loc=small[at_qsl],
        )
        return dev[at_ids], dev[at_pos], dev[at_samples], meta

    def attend(self, meta: AttentionMetadata, layer: int, q, k, v, write_kv: bool = True) -> torch.Tensor:
        """write_kv (unless the caller wrote K/V already), then paged_decode on the one-query rows and
        paged_prefill on the rest."""
        k_cache, v_cache = self.kv_caches[layer]
        layout, nd = self.model.layouts[layer], meta.num_decode_tokens
        if write_kv:
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
        return self.launch(batch).samples()

    def launch(self, batch: list[ScheduledSeq], feed: tuple | None = None) -> "LaunchedStep":
        """Enqueues a forward pass over `batch`; its samples are read by the result's `samples()`.

        feed: (pairs, rows) for a decode step launched before the step whose tokens it takes was read
        (`LLM.step`): every row's input token is column 0 of `pairs` (`LaunchedStep.pairs` of that
        step, on the device) at row rows[i]. Such a step must replay a decode graph."""
        replayed = None if self.graphs is None else self.graphs.step_logits(batch, feed)
        if feed is not None and replayed is None:
            raise RuntimeError("a step fed from the device must replay a decode graph")
        pairs = None
        if replayed is not None:  # the whole step replayed as graphs
            logits, pairs = replayed
            order, ordered = range(len(batch)), batch
            sampling = [j for j, item in enumerate(batch) if item.samples]
        else:
            order = sorted(range(len(batch)), key=lambda i: batch[i].num_tokens != 1)  # stable
            ordered = [batch[i] for i in order]
            input_ids, positions, sample_rows, meta = self.prepare(ordered)
            sampling = [j for j, item in enumerate(ordered) if item.samples]
            pieces = None if self.graphs is None else self.graphs.pieces_for(len(input_ids))
            write_kv = pieces is None or not pieces.write_kv  # or the piece graphs write K/V themselves
            attend = lambda i, q, k, v: self.attend(meta, i, q, k, v, write_kv)  # noqa: E731
            if pieces is None:
                logits = self.model(input_ids, positions, attend, sample_rows)
            else:  # the layers replayed as graphs between eager attention calls
                h = pieces.run(input_ids, positions, meta.slot_mapping, attend)
                logits = self.model.logits(h[sample_rows])
        temperatures = [ordered[j].seq.params.temperature for j in sampling]
        device_pairs, ready = None, None
        decode = len(sampling) == len(batch) and all(item.num_tokens == 1 for item in batch)
        if replayed is not None and decode and not any(temperatures):
            # A decode graph's outputs are static, rewritten by the next replay, which may be enqueued
            # before this step is read: what the read takes is copied out now (a read of the device
            # itself would wait for that replay too). The next step's tokens are taken from `pairs` on
            # the device, before its replay.
            device_pairs = pairs
            pairs, logits, ready = _to_host(pairs, logits if self.config.record_logits else None)
        rows = [order[j] for j in sampling]
        return LaunchedStep(self, logits, pairs, device_pairs, ready, temperatures, rows, len(batch))

    def _sample(self, logits: torch.Tensor | None, temperatures: list[float], pairs=None) -> list[Sample]:
        """One Sample per row of logits [num_samples, vocab_size]. Greedy rows are taken together
        with one device-to-host copy for the step (a read per row was two syncs per sequence), from
        `pairs` (`greedy_pairs` of these logits, made by a graph) when given; the others draw from the
        runner's generator row by row, in order. logits may be None when every row is greedy, `pairs`
        given and no logits recorded."""
        # A copy even on the CPU: a graph step's logits are its static output, rewritten next step.
        kept = logits.to("cpu", copy=True) if self.config.record_logits else None
        out: list[Sample | None] = [None] * len(temperatures)
        greedy = [r for r, t in enumerate(temperatures) if t == 0.0]
        if greedy:
            every = len(greedy) == len(temperatures)
            if pairs is None:
                pairs = greedy_pairs(logits if every else logits[greedy])
            elif not every:
                pairs = pairs[greedy]
            for r, (token, logprob) in zip(greedy, pairs.tolist(), strict=True):
                out[r] = Sample(int(token), logprob, None if kept is None else kept[r])
        for r, temperature in enumerate(temperatures):
            if temperature != 0.0:
                logprobs = torch.log_softmax(logits[r] / temperature, dim=-1)
                token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
                out[r] = Sample(token, float(logprobs[token]), None if kept is None else kept[r])
        return out
