"""A seeded decoder with Phi-3-small's attention structure, and its named sizes.

GQA, rotary position embeddings, LayerNorm (pre-norm), a GELU MLP, muP attention scale 1/head_dim,
block-sparse attention (local + vertical stride, contract §2.1) in every layer i with
(i + 1) % 2 != 0 and dense causal attention in the others. Weights come from a seed; nothing is
downloaded. The model knows nothing about pages: each layer hands q, k, v to an `attend` callable.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import reference
from engine import blas_choice, norm, norm_triton, rope_triton
from engine.rope import rope_tables, split_rotary

# Query weights are scaled up so that, with the muP scale 1/head_dim, scores are O(1) at init:
# attention then depends strongly on which keys are visible, and masking mistakes show.
QUERY_GAIN = 2.0
LOGIT_GAIN = 4.0
# On the GPU a layer's elementwise steps run as one Triton kernel each, twins of their torch forms here
# (issue 17): q, k and v out of the projection (engine/rope_triton.py, bit for bit; torch's float32
# rotary took eight launches and a fifth of the 32-layer model's 2k prefill), and each LayerNorm with
# the residual sum before it (engine/norm_triton.py). Module settings, read at each call, so that an A/B
# (reports/engine_steps.py --rows fused) turns each off.
FUSED_ROTARY = True
FUSED_NORM = True

MODEL_CONFIGS = {
    "tiny": dict(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        sparse_block_size=16,
        local_blocks=2,
        vert_stride=2,
    ),
    "phi3-small-attn": dict(
        vocab_size=8192,
        dim=4096,
        n_layers=4,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=8192,
        sparse_block_size=64,
        local_blocks=16,
        vert_stride=8,
    ),
    # Phi-3-small's depth (32 layers) with the same shapes; weights random (seeded), vocabulary small.
    "phi3-small": dict(
        vocab_size=8192,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=8192,
        sparse_block_size=64,
        local_blocks=16,
        vert_stride=8,
    ),
}


@dataclass
class ModelArgs:
    """Sizes of the decoder; `scale` and the per-layer layouts are derived."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    sparse_block_size: int
    local_blocks: int
    vert_stride: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    scale: float = field(init=False)

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self.scale = 1.0 / self.head_dim  # muP

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in MODEL_CONFIGS:
            raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_CONFIGS)}")
        return cls(**MODEL_CONFIGS[name])

    def layout(self, layer: int):
        """Block-sparse in layers with (layer + 1) % 2 != 0, dense (None) in the others."""
        if (layer + 1) % 2 == 0:
            return None
        return reference.LocalStridedLayout(self.sparse_block_size, self.local_blocks, self.vert_stride)

    def layouts(self) -> list:
        """Every layer's layout, the sparse layers sharing one object: kernels keep a layout's tile
        lists with the object, and the runner plans once per distinct layout of a step."""
        layouts = [self.layout(i) for i in range(self.n_layers)]
        shared = next((layout for layout in layouts if layout is not None), None)
        return [None if layout is None else shared for layout in layouts]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.attn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.qkv = nn.Linear(args.dim, q_size + 2 * kv_size, bias=False)
        self.out = nn.Linear(q_size, args.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.up = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def attention_inputs(self, h, rope: tuple[torch.Tensor, torch.Tensor]):
        """q [num_tokens, n_heads, head_dim] and k, v [num_tokens, n_kv_heads, head_dim] of hidden states
        h [num_tokens, dim], q and k rotated (engine/rope.py's `split_rotary`)."""
        _, x = self._norm(h, None, self.attn_norm)
        qkv = blas_choice.linear(x, self.qkv.weight, "qkv")
        split = rope_triton.split_rotary if FUSED_ROTARY and qkv.is_cuda else split_rotary
        return split(qkv, *rope, self.args.n_heads, self.args.n_kv_heads)

    def finish(self, h, o):
        """The layer's output [num_tokens, dim] from its input h and attention's o [num_tokens, n_heads,
        head_dim]."""
        attended = blas_choice.linear(o.reshape(h.shape[0], -1), self.out.weight, "out")
        h, x = self._norm(h, attended, self.mlp_norm)
        up = nn.functional.gelu(blas_choice.linear(x, self.up.weight, "up"))
        return h + blas_choice.linear(up, self.down.weight, "down")

    @staticmethod
    def _norm(x, residual, layer_norm: nn.LayerNorm):
        """(x + residual, its LayerNorm) by `add_layer_norm` (engine/norm.py)."""
        add = norm_triton.add_layer_norm if FUSED_NORM and x.is_cuda else norm.add_layer_norm
        return add(x, residual, layer_norm.weight, layer_norm.bias, layer_norm.eps)

    def forward(self, h, rope: tuple[torch.Tensor, torch.Tensor], attend: Callable):
        return self.finish(h, attend(*self.attention_inputs(h, rope)))


class Decoder(nn.Module):
    """Embedding, `n_layers` decoder layers, final LayerNorm and an untied LM head, for positions below
    `max_positions` (the rotary tables' rows)."""

    def __init__(self, args: ModelArgs, max_positions: int):
        super().__init__()
        self.args, self.max_positions = args, max_positions
        self.rope = None  # rope_tables, made by init_weights on the weights' device
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.layouts = args.layouts()

    @torch.no_grad()
    def init_weights(self, seed: int, device: torch.device, dtype: torch.dtype) -> "Decoder":
        """Seeded N(0, 1/fan_in) weights drawn on `device`, queries and logits scaled up."""
        gen = torch.Generator(device=device).manual_seed(seed)
        q_size = self.args.n_heads * self.args.head_dim
        self.to(device=device)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                std = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
        for layer in self.layers:
            layer.qkv.weight[:q_size].mul_(QUERY_GAIN * math.sqrt(self.args.head_dim))
        self.lm_head.weight.mul_(LOGIT_GAIN)
        # Plain attributes, not buffers: `to(dtype=...)` would round them to the weights' dtype.
        self.rope = rope_tables(self.max_positions, self.args.head_dim, self.args.rope_base, device)
        return self.to(dtype=dtype)

    @torch.no_grad()
    def forward(self, input_ids, positions, attend: Callable, logits_index: torch.Tensor):
        """Hidden states of all tokens; logits (float32) only at `logits_index`.

        Args:
            input_ids, positions: int64 [num_tokens], positions below `max_positions`.
            attend: `attend(layer, q, k, v) -> [num_tokens, n_heads, head_dim]`.
            logits_index: int64 [num_samples], rows whose next-token logits are wanted.
        Returns:
            float32 [num_samples, vocab_size].
        """
        h, rope = self.embed(input_ids), self.rope_rows(positions)
        h = self.run_layers(h, rope, attend, range(len(self.layers)))
        return self.logits(h[logits_index])

    @torch.no_grad()
    def run_layers(self, h, rope: tuple[torch.Tensor, torch.Tensor], attend: Callable, layers: range):
        """Hidden states [num_tokens, dim] after `layers` (consecutive indices) from their input h, with
        rope from `rope_rows` and `attend` as `forward` takes it."""
        for i in layers:
            h = self.layers[i](h, rope, lambda q, k, v, i=i: attend(i, q, k, v))
        return h

    @torch.no_grad()
    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin float32 [num_tokens, 1, head_dim] (`rope_tables`) of int64 positions
        [num_tokens], gathered once for every layer's q and k."""
        return tuple(table[positions].unsqueeze(1) for table in self.rope)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab_size] of the last layer's hidden states h [rows, dim]."""
        return self.lm_head(self.norm(h)).float()


def greedy_pairs(logits: torch.Tensor) -> torch.Tensor:
    """float64 [rows, 2]: each row's argmax token and its logprob, of logits float32 [rows, vocab_size]
    (float64 holds every token id and float32 logprob exactly)."""
    tokens = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return torch.stack((tokens.double(), logprobs.double()), dim=1)
