"""A step's launches replayed as CUDA graphs: whole decode and prefill steps, else the layers between
attention calls.

An eager step of the 32-layer model enqueues about 800 launches, 0.4 to 1 ms of host time a layer on the
H200's host, several times its kernels' time at small batches (reports/gpu/engine-steps.md). So:
- A step whose rows are all one query token (decodes) replays the graph captured for the smallest
  batch bucket that holds its rows and the smallest context bucket that holds its longest sequence,
  attention included: the host packs the step's inputs into the graph's one static buffer, copies it
  to the device once and replays. Rows past the step's own are padding: token 0 at position 0, no KV
  write (slot -1), a one-token sequence over page 0; their logits are never read. The attention plans
  are made, and the metadata validated, once, at capture, over every row at the bucket's whole
  context with a table of the bucket's width. A backend declaring the `graphs` capability
  (backends/registry.py) promises that its plans, replayed over metadata rewritten within those
  bounds, stay right; the engine builds that metadata itself (block tables from its pool), so a
  replay validates nothing.
- A step whose rows all compute two tokens or more (prefill chunks), at most PIECE_TOKEN_BUCKETS[-1] in
  all, replays the graph of its token bucket, attention included (`PrefillGraph`): its prefill plans,
  made at capture over as many sequences as the bucket can hold, each as long as the cache, are
  replanned for every step (`replan` of the `graphs` capability: their walks rewritten in place,
  their launches kept), where a plan can (`fixed_launch`: the Hopper path), while the GPU runs the
  step's lead (the embedding and layer 0's attention inputs, which read no plan: `StepGraph.LEAD`).
  A step whose items fit one round of the Hopper kernel's programs replans nothing: the lead itself
  writes its walks on the GPU (`PrefillPlan.walk_launch`, kernels/device_walk.py).
- Any other step of at most PIECE_TOKEN_BUCKETS[-1] tokens (one-token rows beside longer ones, or plans
  that cannot replan in place) replays `PieceGraphs` of its token bucket: the layers between attention
  calls, with attention run eagerly in between.
With `blas_choice.ENABLED`, the linear layers are timed at every token bucket before the first one is
taken (engine/blas_choice.py): each bucket's graphs multiply each weight through the faster BLAS library,
and a bucket that a larger one undercuts is dropped. Graphs are captured on first use and share one memory
pool (`StepGraphs`). `LLM(enforce_eager=True)` runs every step eagerly.
"""

import functools
import gc
import itertools
import struct
from collections.abc import Callable

import numpy as np
import torch

from engine import blas_choice
from engine.model import greedy_pairs

# Contexts below this share one bucket: a graph per power of two above it.
MIN_CONTEXT_BUCKET = 256
# Token buckets of the piece graphs: steps of 16 up to 256, of 64 up to 1024, then of 256 (a padded row
# costs GEMM time: 208 tokens padded to 256 took 0.9 ms more of the 32-layer model's 5.8, 832 to 1024
# 3.8 ms more of 16.7; a step of more tokens than the last is GPU-bound anyway). Each bucket used keeps
# its pieces' outputs, about 20 KB a token a layer of the 32-layer model (11 GB if all are used).
PIECE_TOKEN_BUCKETS = (*range(16, 256, 16), *range(256, 1024, 64), *range(1024, 2049, 256))
ALIGN = 16  # bytes: each field of the static buffer starts aligned, as the kernels' specialization prefers
COPY_GRAIN = 4096  # bytes: a partial copy of the static buffer takes a multiple of this (`StaticInputs.copy`)


def cuda_capture(forward: Callable[[], tuple[torch.Tensor, ...]], pool, plans: dict):
    """Captures `forward()` (a tuple of tensors) in a CUDA graph; returns (replay, its outputs).
    `plans` is unused here (see `rerun_capture`)."""
    graph = torch.cuda.CUDAGraph()
    # No garbage collection inside the capture (torch's no longer collects before it): an engine dropped
    # earlier (its runner and graphs hold each other) collected there frees pinned buffers and events,
    # whose CUDA calls invalidate the capture. On the H200, one run of tests/engine in six failed so
    # (cudaErrorStreamCaptureInvalidated), and every capture of that process after it.
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    finally:
        if enabled:
            gc.enable()
    return graph.replay, out


def rerun_capture(forward: Callable[[], tuple[torch.Tensor, ...]], pool, plans: dict):
    """The stand-in for `cuda_capture` where there is no GPU (tests): a replay runs `forward` again over
    the same plans and copies its results into the captured outputs, as a graph's replay would leave
    them. The plans' guards take the rewritten metadata, as a graph's launches do."""
    out = forward()

    def replay():
        for plan in plans.values():
            plan.guard.rebase()
        for old, new in zip(out, forward(), strict=True):
            old.copy_(new)

    return replay, out


def segments(num_layers: int) -> list[range]:
    """The layers of a decode step's graphs: 1, 2, 4, ... layers each. The GPU starts on a graph only
    once its launch has returned, about 3 µs a kernel on the H200's host (reports/gpu/engine-steps.md),
    so a small first graph starts the device early and each later one is launched while the device
    runs the one before, whose layers take longer than the launch of twice as many."""
    out, start = [], 0
    while start < num_layers:
        stop = min(2 * start + 1, num_layers)
        out.append(range(start, stop))
        start = stop
    return out


def buckets(largest: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` up to the first one that holds `largest`, that one capped at it."""
    out = [smallest]
    while out[-1] < largest:
        out.append(min(2 * out[-1], largest))
    return out


def _int_code(dtype: torch.dtype) -> str:
    """The struct code of an int64 or int32 field."""
    return "q" if dtype.itemsize == 8 else "i"


class StaticInputs:
    """A graph's integer inputs at fixed places: fields packed on the host into pinned memory (a step's
    writes follow `writable`), then copied to the device in one asynchronous copy (`copy`). Packing writes
    a field in one `struct` call (element by element, numpy's writes had taken 0.3-0.6 ms a step on the
    H200's host)."""

    def __init__(self, fields: list[tuple[str, torch.dtype, int]], device: torch.device):
        spans, size = {}, 0
        for name, dtype, n in fields:
            size += -size % ALIGN
            spans[name] = (size, dtype, n)
            size += n * dtype.itemsize
        self.spans, self.size = spans, size
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned)
        self.static = torch.zeros(size, dtype=torch.uint8, device=device)
        self.packed = host = self.host.numpy()
        # bytes -> (pinned, device) views of the buffer's first bytes, made once a size: a copy then makes
        # one torch call (each slice of a tensor was another, at several µs apiece on a slow host)
        self.prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # name -> its numpy view on the host, and its tensor view on the device
        self.fields = {
            name: host[at : at + n * dtype.itemsize].view(np.dtype(str(dtype).removeprefix("torch.")))
            for name, (at, dtype, n) in spans.items()
        }
        self.device = {
            name: self.static[at : at + n * dtype.itemsize].view(dtype)
            for name, (at, dtype, n) in spans.items()
        }
        self.copied = torch.cuda.Event() if pinned else None

    def writable(self) -> None:
        """Waits until the last copy has read the pinned buffer: a step's packing comes after this."""
        if self.copied is not None:
            self.copied.synchronize()

    def pack(self, name: str, values: list[int], start: int = 0) -> None:
        """Writes Python ints into field `name` from element `start` (struct converts them several times
        faster than numpy does)."""
        at, dtype, _ = self.spans[name]
        struct.pack_into(
            f"<{len(values)}{_int_code(dtype)}", self.packed, at + start * dtype.itemsize, *values
        )

    def packer(self, *names: str) -> Callable[..., None]:
        """A function that writes consecutive fields whole, a list of ints each, in one `struct` call."""
        layout, end = ["<"], self.spans[names[0]][0]
        for name in names:
            at, dtype, n = self.spans[name]
            layout.append(f"{at - end}x{n}{_int_code(dtype)}")
            end = at + n * dtype.itemsize
        pack, start = struct.Struct("".join(layout)).pack_into, self.spans[names[0]][0]
        return lambda *lists: pack(self.packed, start, *itertools.chain(*lists))

    def copy(self, end: str | None = None, elements: int = 0) -> None:
        """Copies the buffer to the device: whole, or up to `elements` of field `end` (its last field)."""
        size = self.size
        if end is not None:
            at, dtype, _ = self.spans[end]
            # Rounded up, so that a graph holds a few prefixes' views; the bytes past the field's elements
            # are its own unread entries (contract §4) or the alignment after it.
            size = min(size, -(-(at + elements * dtype.itemsize) // COPY_GRAIN) * COPY_GRAIN)
        prefix = self.prefixes.get(size)
        if prefix is None:
            prefix = self.prefixes[size] = (self.host[:size], self.static[:size])
        prefix[1].copy_(prefix[0], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class StepGraph:
    """A whole step's graphs (attention included), in layer segments (`segments`); the last segment also
    makes the sampled rows' logits and their `greedy_pairs`. The static inputs and the metadata are the
    subclass's (`DecodeGraph`, `PrefillGraph`): it packs the capture's batch before `_capture`, which
    plans attention over it in an eager run, then captures."""

    # With LEAD, a graph of its own comes first: the embedding and the first layer's attention inputs,
    # which need no attention plan, so the GPU runs them while the host replans (`PrefillGraph`).
    LEAD = False
    lead_walks = False  # whether the lead writes the plans' walks of a lone round (`_walk_launches`)

    def _capture(self, runner, meta, inputs: StaticInputs, logits_rows: torch.Tensor, capture, pool) -> bool:
        """Plans and compiles in an eager run, then captures unless the plans cannot be replayed
        (`_replayable`); returns whether it captured."""
        # Held by the graph's object (the metadata with its plans' buffers, the logits rows): a replay
        # reads whatever memory it was captured with.
        self.meta, self.logits_rows = meta, logits_rows
        dev, model = inputs.device, runner.model
        attend = lambda i, q, k, v: runner.attend(meta, i, q, k, v)  # noqa: E731

        def start():  # (h, cos, sin): the embedding and the rotary rows of the step's tokens
            return model.embed(dev["input_ids"]), *model.rope_rows(dev["positions"])

        @torch.no_grad()
        def lead():  # (h, cos, sin, q, k, v): `start` and the first layer's attention inputs
            for launch in walks:
                launch()
            h, *rope = start()
            return (h, *rope, *model.layers[0].attention_inputs(h, rope))

        @torch.no_grad()
        def piece(layers: range, last: bool, previous: tuple):  # previous: (h, cos, sin), none first
            h, *rope = previous[:3] or start()
            if len(previous) > 3:  # the lead's: the first layer's attention inputs are made
                h = model.layers[layers[0]].finish(h, attend(layers[0], *previous[3:]))
                layers = layers[1:]
            h = model.run_layers(h, rope, attend, layers)
            if not last:
                return (h, *rope)
            logits = model.logits(h[logits_rows])
            return logits, greedy_pairs(logits)

        model(dev["input_ids"], dev["positions"], attend, logits_rows)  # plans made, kernels compiled
        if inputs.copied is not None:
            torch.cuda.synchronize(runner.device)
        if not self._replayable(meta.plans, capture):
            return False
        walks = self._walk_launches(meta.plans, capture) if self.LEAD else []
        self.lead_walks = bool(walks)
        parts = segments(len(model.layers))
        self.replays, out = [], ()
        if self.LEAD:
            replay, out = capture(lead, pool, meta.plans)
            self.replays.append(replay)
        for j, layers in enumerate(parts):
            replay, out = capture(
                functools.partial(piece, layers, j == len(parts) - 1, out), pool, meta.plans
            )
            self.replays.append(replay)
        self.logits, self.pairs = out
        return True

    def _replayable(self, plans: dict, capture) -> bool:
        return True

    def _walk_launches(self, plans: dict, capture) -> list:
        """Launches that the lead runs first: none here."""
        return []

    def _replay(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        for replay in self.replays:
            replay()
        return self.logits[:rows], self.pairs[:rows]


class DecodeGraph(StepGraph):
    """The graph of decode steps of up to `batch` rows whose sequences hold at most `context` tokens."""

    def __init__(self, runner, batch: int, context: int, capture, pool):
        from engine.model_runner import AttentionMetadata  # the runner imports this module

        device, page = runner.device, runner.config.page_size
        self.batch, self.context, self.page = batch, context, page
        self.width = -(-context // page)
        inputs = StaticInputs(
            [
                ("input_ids", torch.int64, batch),
                ("positions", torch.int64, batch),
                ("slots", torch.int64, batch),
                ("seq_lens", torch.int32, batch),
                ("feed", torch.int64, batch),
                ("tables", torch.int32, batch * self.width),
            ],
            device,
        )
        dev = inputs.device
        self.tables = inputs.fields["tables"].reshape(batch, self.width)
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=dev["slots"],
            num_decode_tokens=batch,
            decode_block_tables=dev["tables"].view(batch, self.width),
            decode_seq_lens=dev["seq_lens"],
            prefill_block_tables=empty.view(0, 1),
            prefill_seq_lens=empty,
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        )
        self.inputs = inputs
        self.pack_rows = inputs.packer("input_ids", "positions", "slots", "seq_lens")
        # Every row a sequence of the whole context over page 0 that writes nothing: the plans made by
        # the capture's eager run cover any step of the bucket.
        self._write([], pad_len=context)
        self._capture(runner, meta, inputs, torch.arange(batch, device=device), capture, pool)

    def _write(self, batch, pad_len: int = 1, feed_rows: list[int] | None = None) -> None:
        """Packs the rows of `batch` (ScheduledSeq, one token each), then padding, and copies them in.
        With `feed_rows` (see `run`), the rows' tokens are not read on the host (not known there yet)."""
        page, width, pad = self.page, self.width, self.batch - len(batch)
        fed = feed_rows is not None
        self.inputs.writable()
        ids, positions, slots, lens, tables = [0] * len(batch) if fed else [], [], [], [], []
        for item in batch:
            seq = item.seq
            p, table = seq.num_computed_tokens, seq.block_table
            if not fed:
                ids.append(seq.token_ids[p])
            positions.append(p)
            lens.append(p + 1)
            slots.append(table[p // page] * page + p % page)
            tables += table[:width]
            tables += [0] * (width - len(table))
        # Padding rows: token 0 at position 0, no write, a sequence of pad_len over page 0.
        zeros = [0] * pad
        self.pack_rows(ids, zeros, positions, zeros, slots, [-1] * pad, lens, [pad_len] * pad)
        self.inputs.pack("tables", tables)
        self.tables[len(batch) :] = 0
        if fed:
            self.inputs.pack("feed", feed_rows)
        self.inputs.copy()

    def run(self, batch, feed: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits float32 [len(batch), vocab_size] of a decode step of at most `self.batch` rows, and
        their `greedy_pairs` [len(batch), 2]. feed: (pairs, rows), the rows' tokens taken on the device
        from column 0 of pairs [n, 2] at rows (a list, one per row of `batch`)."""
        self._write(batch, feed_rows=None if feed is None else feed[1])
        if feed is not None:
            dev, n = self.inputs.device, len(batch)
            dev["input_ids"][:n] = feed[0][:, 0].index_select(0, dev["feed"][:n])
        return self._replay(len(batch))


class PrefillGraph(StepGraph):
    """The graph of steps of at most `tokens` tokens over at most `seqs` sequences, each computing at least
    two tokens (one-token rows take `paged_decode`): the prefill plans, made at capture over `seqs`
    sequences, one of the cache's whole capacity, are replanned every step (`PrefillPlan.replan`), each
    just before the first layer segment that uses it, after the lead (`StepGraph.LEAD`), and keep their
    launches; where every plan has a `walk_launch`, the lead runs those first, and a step of a lone
    round (`PrefillPlan.lone_round`) replans nothing. Only for plans that say so (`fixed_launch`), or
    under `rerun_capture`, which runs them again; `supported` is False otherwise."""

    LEAD = True

    def __init__(self, runner, tokens: int, seqs: int, capture, pool):
        from engine.model_runner import AttentionMetadata  # the runner imports this module

        device, config = runner.device, runner.config
        self.tokens, self.seqs, self.page = tokens, seqs, config.page_size
        self.width = config.num_pages  # no sequence outgrows the cache
        inputs = StaticInputs(
            [
                ("input_ids", torch.int64, tokens),
                ("positions", torch.int64, tokens),
                ("slots", torch.int64, tokens),
                ("logits_rows", torch.int64, seqs),
                ("seq_lens", torch.int32, seqs),
                ("query_start_loc", torch.int32, seqs + 1),
                ("tables", torch.int32, seqs * self.width),  # last: a step copies its rows only
            ],
            device,
        )
        self.inputs, dev = inputs, inputs.device
        meta = AttentionMetadata(
            slot_mapping=dev["slots"],
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_block_tables=dev["tables"].view(seqs, self.width),
            prefill_seq_lens=dev["seq_lens"],
            prefill_query_start_loc=dev["query_start_loc"],
        )
        # The capture's batch: the tokens shared out over as many sequences, the first as long as the cache
        # (the plans then cover any batch of as many sequences and tokens, each up to that long), the
        # others no longer than their queries (the capture's eager run attends less); all over page 0,
        # nothing written (slots -1).
        f, capacity = inputs.fields, self.width * self.page
        share = [tokens // seqs + (b < tokens % seqs) for b in range(seqs)]
        f["input_ids"][:], f["positions"][:], f["slots"][:] = 0, 0, -1
        f["logits_rows"][:] = 0
        f["seq_lens"][:] = share
        f["seq_lens"][0] = capacity
        f["query_start_loc"][:] = np.cumsum([0, *share])
        f["tables"][:] = 0
        inputs.copy()
        self.pack_tokens = inputs.packer("input_ids", "positions", "slots", "logits_rows")
        self.pack_seqs = inputs.packer("seq_lens", "query_start_loc")
        self.supported = max(share) <= capacity and self._capture(
            runner, meta, inputs, dev["logits_rows"], capture, pool
        )
        # Each segment's prefill plans first used there, replanned just before its replay: the GPU runs the
        # lead (no plan) while the host replans the first layer's layout's plan, and the first segment
        # (layer 0, the sparse layout's plan) while it replans the dense layout's.
        layouts, seen = runner.model.layouts, set()
        self.segment_plans = [[]] if self.supported and self.LEAD else []
        for layers in segments(len(layouts)) if self.supported else []:
            keys = {("prefill", id(layouts[i])) for i in layers} & meta.plans.keys()
            self.segment_plans.append([meta.plans[key] for key in sorted(keys - seen)])
            seen |= keys

    def _replayable(self, plans: dict, capture) -> bool:
        return capture is rerun_capture or all(
            plan.fixed_launch for key, plan in plans.items() if key[0] == "prefill"
        )

    def _walk_launches(self, plans: dict, capture) -> list:
        """Each prefill plan's `walk_launch`, where every plan has one and the step is captured on a GPU:
        the lead then writes a lone round's walks on the device, and such a step needs no replan. Each is
        run once before the capture (which compiles it; the capture's batch takes more than a round of
        items, or the walk the plan already holds)."""
        prefill = [plan for key, plan in plans.items() if key[0] == "prefill"]
        launches = [getattr(plan, "walk_launch", lambda: None)() for plan in prefill]
        if capture is rerun_capture or not prefill or None in launches:
            return []
        for launch in launches:
            launch()
        self.walked = prefill
        return launches

    def run(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits float32 [samples, vocab_size] of the rows of `batch` (ScheduledSeq, at most `seqs`, at
        least two tokens each, at most `tokens` in all) that sample (`ScheduledSeq.samples`), in order,
        and their `greedy_pairs` [samples, 2]."""
        from engine.model_runner import flatten  # the runner imports this module

        ids, positions, slots, lens, starts, samples = flatten(batch, self.page)
        pad, rows = [0] * (self.tokens - starts[-1]), self.seqs - len(batch)
        self.inputs.writable()
        # Rows past the step's: valid tokens at position 0 that write nothing; sequences never read.
        self.pack_tokens(
            ids, pad, positions, pad, slots, [-1] * len(pad), samples, [0] * (self.seqs - len(samples))
        )
        self.pack_seqs(lens, [0] * rows, starts, starts[-1:] * rows)
        # Each table row at its place; entries past a sequence's pages are never read (contract §4).
        for b, item in enumerate(batch):
            self.inputs.pack("tables", item.seq.block_table, b * self.width)
        self.inputs.copy("tables", (len(batch) - 1) * self.width + len(batch[-1].seq.block_table))
        # A lone round's walks are the lead's to write; any other batch's, each plan's replan's, just
        # before the first segment that reads it, while the GPU runs the segments before.
        lone = self.lead_walks and all(plan.lone_round(lens, starts) for plan in self.walked)
        for replay, plans in zip(self.replays, self.segment_plans, strict=True):
            for plan in [] if lone else plans:
                plan.replan(lens, starts)
            replay()
        return self.logits[: len(samples)], self.pairs[: len(samples)]


class PieceGraphs:
    """The model between its attention calls, captured for `tokens` rows: piece 0 embeds and makes layer
    0's attention inputs, piece i finishes layer i - 1 and makes layer i's, the last finishes the last
    layer. Attention runs eagerly between the pieces: its plans change with every step's metadata.
    With `write_kv` (a backend with the `graphs` capability), each piece also writes its layer's K/V
    through a write plan over a static slot mapping (padding rows -1: no write).

    Rows past a step's own keep what earlier steps left there (valid token ids and positions, finite
    attention outputs): every op of a piece works row by row, so they never reach a step's rows.
    """

    @torch.no_grad()
    def __init__(self, runner, tokens: int, capture, pool, write_kv: bool):
        model, args, device = runner.model, runner.args, runner.device
        layers, caches = model.layers, runner.kv_caches
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.o = torch.zeros(tokens, args.n_heads, args.head_dim, dtype=runner.dtype, device=device)
        self.plans = {}

        def inputs(i, h, rope):  # layer i's attention inputs, its K/V written when the graph does that
            q, k, v = layers[i].attention_inputs(h, rope)
            if write_kv:
                if not self.plans:  # planned over the static slots, before any capture
                    self.plans["write_kv"] = runner.ops.planners["plan_write_kv"](
                        k, v, *caches[i], self.slots
                    )
                self.plans["write_kv"].run(k, v, *caches[i])
            return q, k, v

        def first():
            h, rope = model.embed(self.ids), model.rope_rows(self.positions)
            return (h, *rope, *inputs(0, h, rope))

        def middle(i, h, cos, sin):  # finishes layer i - 1, then layer i's attention inputs
            h = layers[i - 1].finish(h, self.o)
            return (h, *inputs(i, h, (cos, sin)))

        self.write_kv = write_kv
        self.replays, self.outputs = [], []
        for i in range(len(layers) + 1):
            if i == 0:
                piece = first
            elif i < len(layers):
                piece = functools.partial(middle, i, self.outputs[-1][0], *self.outputs[0][1:3])
            else:
                piece = functools.partial(lambda h: (layers[-1].finish(h, self.o),), self.outputs[-1][0])
            piece()  # eager first: lazy initialization (cuBLAS handles, workspaces) stays out of the graph
            replay, out = capture(piece, pool, self.plans)
            self.replays.append(replay)
            self.outputs.append(out)

    @torch.no_grad()
    def run(self, input_ids, positions, slot_mapping, attend: Callable) -> torch.Tensor:
        """The last layer's hidden states [num_tokens, dim] of a step's int64 input_ids, positions and
        slot_mapping [num_tokens] (on the device); `attend(layer, q, k, v)` as `Decoder.forward` takes
        it, writing K/V itself unless the graphs do."""
        n = input_ids.shape[0]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if self.write_kv:
            self.slots.fill_(-1)
            self.slots[:n].copy_(slot_mapping)
        for i, replay in enumerate(self.replays[:-1]):
            replay()
            q, k, v = self.outputs[i][-3:]
            self.o[:n].copy_(attend(i, q[:n], k[:n], v[:n]))
        self.replays[-1]()
        return self.outputs[-1][0][:n]


def linear_timer(runner) -> Callable[[int], dict[str, dict[str, float]]]:
    """`timer(rows)`: `blas_choice.time_linears` over the runner's layers, through real captures."""
    return functools.partial(blas_choice.time_linears, runner.model.layers, capture=cuda_capture)


class StepGraphs:
    """A runner's graphs, captured on first use, sharing one memory pool: decode steps whole (a backend
    with the `graphs` capability), other steps of at most PIECE_TOKEN_BUCKETS[-1] tokens piece by piece.

    Sharing the pool is safe because every output of a graph that a step reads is written earlier in
    the same step: a replay may overwrite only the outputs of graphs captured after it.
    """

    def __init__(
        self, runner, whole_decode: bool, capture=cuda_capture, whole_prefill: bool | None = None, timer=None
    ):
        self.runner, self.capture, self.whole_decode = runner, capture, whole_decode
        # Prefill steps whole needs plans that replan in place (the `graphs` capability's prefill part).
        self.whole_prefill = whole_decode if whole_prefill is None else whole_prefill
        config = runner.config
        self.batch_buckets = buckets(config.max_num_seqs)
        capacity = config.num_pages * config.page_size  # no sequence outgrows the cache
        self.context_buckets = buckets(capacity, min(MIN_CONTEXT_BUCKET, capacity))
        largest = min(config.max_num_batched_tokens, PIECE_TOKEN_BUCKETS[-1])
        self.token_buckets = [t for t in PIECE_TOKEN_BUCKETS if t < largest] + [largest]
        self.pool = torch.cuda.graph_pool_handle() if capture is cuda_capture else None
        # `timer(rows)` times the linear layers at `rows` rows (`blas_choice.time_linears`, under real
        # captures); before the first token bucket is taken, its times choose each bucket's libraries
        # and drop the buckets that a larger one undercuts (`blas_choice.calibrate`). The default timer's
        # choices are made once a process for the model's shape (`blas_choice.calibrated`); a given
        # timer's, for these graphs.
        self.shape_key = None
        if timer is None and capture is cuda_capture and blas_choice.ENABLED:
            timer, self.shape_key = linear_timer(runner), blas_choice.shape_key(runner.model.layers)
        self.timer, self.choices = timer, None
        self.decode: dict[tuple[int, int], DecodeGraph] = {}
        self.prefill: dict[int, PrefillGraph] = {}
        self.pieces: dict[int, PieceGraphs] = {}

    def step_logits(self, batch, feed: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits float32 [samples, vocab_size] of the rows of `batch` that sample
        (`ScheduledSeq.samples`), in order, and their `greedy_pairs`, when a whole-step graph takes the
        step (every row one query token, or every row at least two), else None. feed: a decode step's
        tokens on the device (`DecodeGraph.run`)."""
        decode = [item.num_tokens == 1 for item in batch]
        if all(decode):
            replayed = self._decode(batch, feed)
            if replayed is None:
                return None
            sampling = [j for j, item in enumerate(batch) if item.samples]
            logits, pairs = replayed
            return (logits, pairs) if len(sampling) == len(batch) else (logits[sampling], pairs[sampling])
        return None if any(decode) or feed is not None else self._prefill(batch)

    def _decode(self, batch, feed):
        if not self.whole_decode or len(batch) > self.batch_buckets[-1]:
            return None
        longest = max(item.seq.num_computed_tokens for item in batch) + 1
        rows = next(b for b in self.batch_buckets if b >= len(batch))
        context = next(c for c in self.context_buckets if c >= longest)
        graph = self.decode.get((rows, context))
        if graph is None:
            graph = self.decode[rows, context] = DecodeGraph(
                self.runner, rows, context, self.capture, self.pool
            )
        return graph.run(batch, feed)

    def _prefill(self, batch):
        tokens = self._bucket(sum(item.num_tokens for item in batch))
        if not self.whole_prefill or tokens is None:
            return None
        graph = self.prefill.get(tokens)
        if graph is None:
            seqs = min(self.runner.config.max_num_seqs, tokens // 2)  # each row computes two tokens or more
            with blas_choice.choosing(self.choices.get(tokens, {})):
                graph = PrefillGraph(self.runner, tokens, seqs, self.capture, self.pool)
            self.prefill[tokens] = graph
        return graph.run(batch) if graph.supported and len(batch) <= graph.seqs else None

    def _bucket(self, num_tokens: int) -> int | None:
        if self.choices is None:
            self.choices = {}
            if self.timer is not None:
                calibrate = blas_choice.calibrate
                if self.shape_key is not None:
                    calibrate = functools.partial(blas_choice.calibrated, self.shape_key)
                self.token_buckets, self.choices = calibrate(self.token_buckets, self.timer)
        return next((t for t in self.token_buckets if t >= num_tokens), None)

    def pieces_for(self, num_tokens: int) -> PieceGraphs | None:
        """The piece graphs of the smallest token bucket that holds `num_tokens`, or None (eager)."""
        tokens = self._bucket(num_tokens)
        if tokens is None:
            return None
        if tokens not in self.pieces:
            write_kv = self.whole_decode and "plan_write_kv" in self.runner.ops.planners
            with blas_choice.choosing(self.choices.get(tokens, {})):
                self.pieces[tokens] = PieceGraphs(self.runner, tokens, self.capture, self.pool, write_kv)
        return self.pieces[tokens]
