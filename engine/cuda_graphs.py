"""A step's launches replayed as CUDA graphs: whole decode steps, and the layers between attention calls.

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
- Any other step of at most PIECE_TOKEN_BUCKETS[-1] tokens replays `PieceGraphs` of its token bucket:
  the layers between attention calls, with attention (whose plans change with every step's metadata)
  run eagerly in between.
Graphs are captured on first use and share one memory pool (`StepGraphs`). `LLM(enforce_eager=True)`
runs every step eagerly.
"""

import functools
import struct
from collections.abc import Callable

import numpy as np
import torch

from engine.model import greedy_pairs

# Contexts below this share one bucket: a graph per power of two above it.
MIN_CONTEXT_BUCKET = 256
# Token buckets of the piece graphs: steps of 16 up to 256, of 64 up to 1024, then of 256 (a padded row
# costs GEMM time: 208 tokens padded to 256 took 0.9 ms more of the 32-layer model's 5.8, 832 to 1024
# 3.8 ms more of 16.7; a step of more tokens than the last is GPU-bound anyway). Each bucket used keeps
# its pieces' outputs, about 20 KB a token a layer of the 32-layer model (11 GB if all are used).
PIECE_TOKEN_BUCKETS = (*range(16, 256, 16), *range(256, 1024, 64), *range(1024, 2049, 256))
ALIGN = 16  # bytes: each field of the static buffer starts aligned, as the kernels' specialization prefers


def cuda_capture(forward: Callable[[], tuple[torch.Tensor, ...]], pool, plans: dict):
    """Captures `forward()` (a tuple of tensors) in a CUDA graph; returns (replay, its outputs).
    `plans` is unused here (see `rerun_capture`)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
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


class DecodeGraph:
    """The graph of decode steps of up to `batch` rows whose sequences hold at most `context` tokens."""

    def __init__(self, runner, batch: int, context: int, capture, pool):
        from engine.model_runner import AttentionMetadata  # the runner imports this module

        device, page = runner.device, runner.config.page_size
        self.batch, self.context, self.page = batch, context, page
        self.width = -(-context // page)
        # Fields of the static buffer: (name, dtype, elements). One host-to-device copy a step.
        fields = [
            ("input_ids", torch.int64, batch),
            ("positions", torch.int64, batch),
            ("slots", torch.int64, batch),
            ("seq_lens", torch.int32, batch),
            ("tables", torch.int32, batch * self.width),
        ]
        spans, size = {}, 0
        for name, dtype, n in fields:
            size += -size % ALIGN
            spans[name] = (size, dtype, n)
            size += n * dtype.itemsize
        pinned = device.type == "cuda"
        # Packed in ordinary memory, then copied whole into pinned memory for the asynchronous copy:
        # the fields' element by element writes (and `+=`'s reads) into the pinned buffer itself took
        # 0.3-0.6 ms a step on the H200's host.
        self.staging = torch.zeros(size, dtype=torch.uint8)
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned)
        self.static = torch.zeros(size, dtype=torch.uint8, device=device)
        host = self.staging.numpy()
        self.fields = {
            name: host[at : at + n * dtype.itemsize].view(np.dtype(str(dtype).removeprefix("torch.")))
            for name, (at, dtype, n) in spans.items()
        }
        self.tables = self.fields["tables"].reshape(batch, self.width)
        dev = {
            name: self.static[at : at + n * dtype.itemsize].view(dtype)
            for name, (at, dtype, n) in spans.items()
        }
        self.copied = torch.cuda.Event() if pinned else None
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        self.meta = AttentionMetadata(
            slot_mapping=dev["slots"],
            num_decode_tokens=batch,
            decode_block_tables=dev["tables"].view(batch, self.width),
            decode_seq_lens=dev["seq_lens"],
            prefill_block_tables=empty.view(0, 1),
            prefill_seq_lens=empty,
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        )
        # Held by the graph's object: a replay reads whatever memory it was captured with.
        self.rows = torch.arange(batch, device=device)
        model = runner.model
        attend = lambda i, q, k, v: runner.attend(self.meta, i, q, k, v)  # noqa: E731

        def piece(layers: range, last: bool, inputs: tuple):  # inputs: (h, cos, sin), none for the first
            h, *rope = inputs or (model.embed(dev["input_ids"]), *model.rope_rows(dev["positions"]))
            h = model.run_layers(h, rope, attend, layers)
            if not last:
                return (h, *rope)
            logits = model.logits(h[self.rows])
            return logits, greedy_pairs(logits)

        # Every row a sequence of the whole context over page 0 that writes nothing: the plans made by
        # this eager run cover any step of the bucket.
        self._write([], pad_len=context)
        model(dev["input_ids"], dev["positions"], attend, self.rows)
        if pinned:
            torch.cuda.synchronize(device)
        parts = segments(len(model.layers))
        self.replays, out = [], ()
        for j, layers in enumerate(parts):
            replay, out = capture(
                functools.partial(piece, layers, j == len(parts) - 1, out), pool, self.meta.plans
            )
            self.replays.append(replay)
        self.logits, self.pairs = out

    def _write(self, batch, pad_len: int = 1) -> None:
        """Packs the rows of `batch` (ScheduledSeq, one token each), then padding, and copies them in."""
        f, page, width, n = self.fields, self.page, self.width, len(batch)
        ids, positions, slots, tables = [], [], [], []
        for item in batch:
            seq = item.seq
            p, table = seq.num_computed_tokens, seq.block_table
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(table[p // page] * page + p % page)
            tables += table[:width]
            tables += [0] * (width - len(table))
        f["input_ids"][:n] = ids
        f["positions"][:n] = positions
        f["slots"][:n] = slots
        f["seq_lens"][:n] = positions
        f["seq_lens"][:n] += 1
        # struct converts a table's Python ints several times faster than numpy does.
        self.tables[:n] = np.frombuffer(struct.pack(f"<{len(tables)}i", *tables), np.int32).reshape(n, width)
        f["input_ids"][n:] = 0
        f["positions"][n:] = 0
        f["slots"][n:] = -1
        f["seq_lens"][n:] = pad_len
        self.tables[n:] = 0
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the pinned buffer
        self.host.copy_(self.staging)
        self.static.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def run(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits float32 [len(batch), vocab_size] of a decode step of at most `self.batch` rows, and
        their `greedy_pairs` [len(batch), 2]."""
        self._write(batch)
        for replay in self.replays:
            replay()
        return self.logits[: len(batch)], self.pairs[: len(batch)]


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


class StepGraphs:
    """A runner's graphs, captured on first use, sharing one memory pool: decode steps whole (a backend
    with the `graphs` capability), other steps of at most PIECE_TOKEN_BUCKETS[-1] tokens piece by piece.

    Sharing the pool is safe because every output of a graph that a step reads is written earlier in
    the same step: a replay may overwrite only the outputs of graphs captured after it.
    """

    def __init__(self, runner, whole_decode: bool, capture=cuda_capture):
        self.runner, self.capture, self.whole_decode = runner, capture, whole_decode
        config = runner.config
        self.batch_buckets = buckets(config.max_num_seqs)
        capacity = config.num_pages * config.page_size  # no sequence outgrows the cache
        self.context_buckets = buckets(capacity, min(MIN_CONTEXT_BUCKET, capacity))
        self.token_buckets = [t for t in PIECE_TOKEN_BUCKETS if t < config.max_num_batched_tokens] + [
            min(config.max_num_batched_tokens, PIECE_TOKEN_BUCKETS[-1])
        ]
        self.pool = torch.cuda.graph_pool_handle() if capture is cuda_capture else None
        self.decode: dict[tuple[int, int], DecodeGraph] = {}
        self.pieces: dict[int, PieceGraphs] = {}

    def decode_logits(self, batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits float32 [len(batch), vocab_size] and their `greedy_pairs` when every row of `batch` is
        one query token (graph replays), else None."""
        if not self.whole_decode or any(item.num_tokens != 1 for item in batch):
            return None
        if len(batch) > self.batch_buckets[-1]:
            return None
        longest = max(item.seq.num_computed_tokens for item in batch) + 1
        rows = next(b for b in self.batch_buckets if b >= len(batch))
        context = next(c for c in self.context_buckets if c >= longest)
        graph = self.decode.get((rows, context))
        if graph is None:
            graph = self.decode[rows, context] = DecodeGraph(
                self.runner, rows, context, self.capture, self.pool
            )
        return graph.run(batch)

    def pieces_for(self, num_tokens: int) -> PieceGraphs | None:
        """The piece graphs of the smallest token bucket that holds `num_tokens`, or None (eager)."""
        tokens = next((t for t in self.token_buckets if t >= num_tokens), None)
        if tokens is None:
            return None
        if tokens not in self.pieces:
            write_kv = self.whole_decode and "plan_write_kv" in self.runner.ops.planners
            self.pieces[tokens] = PieceGraphs(self.runner, tokens, self.capture, self.pool, write_kv)
        return self.pieces[tokens]
