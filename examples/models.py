"""Plain PyTorch models that fxshard's examples, tests and benchmark train. Nothing here knows about fxshard."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Two linear layers with a ReLU between them."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    # GPT-2's N(0, 0.02) for every matrix, drawn after the layers' own init; False keeps torch's per-layer init
    # (reset_parameters), which a model built on the meta device reproduces bit for bit (docs/large-models.md)
    gpt2_init: bool = True


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.out = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small decoder-only transformer whose LM head shares its weight with the token embedding."""

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        config = config or GPTConfig()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        for module in self.modules() if config.gpt2_init else ():  # GPT-2's: small logits at the start
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batch(config: GPTConfig, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences and their next-token targets."""
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def pattern_batch(config: GPTConfig, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences that follow a rule a model learns in a few dozen steps (each token is three times the one
    before plus one, modulo the vocabulary, from a random first token), and their next-token targets: a task whose
    loss falls, to compare training curves on."""
    tokens = [torch.randint(0, config.vocab_size, (batch_size, 1), generator=generator)]
    for _ in range(config.block_size):
        tokens.append((tokens[-1] * 3 + 1) % config.vocab_size)
    sequence = torch.cat(tokens, 1)
    return sequence[:, :-1], sequence[:, 1:]


@dataclasses.dataclass
class LlamaConfig:
    """The shape of a Llama-style decoder, with HuggingFace's field names (a tiny one by default)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # fewer than the attention heads: grouped-query attention
    max_position_embeddings: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


class LlamaRMSNorm(nn.Module):
    """Scale by the reciprocal root mean square (no mean subtraction, no bias), computed in fp32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos and sin of the rotary angles for positions ``0..seq_len-1``.

    The inverse frequencies are a non-persistent buffer (not a parameter: nothing to shard or train, and not saved
    in the state dict, as in HuggingFace's implementation); the angles are computed per call from the positions.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**exponents, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (seq, head_dim / 2)
        angles = torch.cat((angles, angles), dim=-1)  # (seq, head_dim): the "rotate half" layout
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of ``x`` (batch, heads, seq, head_dim) by its position's angle."""
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query attention (key/value heads are shared)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # heads counted from the projections' widths (-1), which tensor parallelism divides among its ranks
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Each key/value head serves num_heads / num_kv_heads query heads (HuggingFace's repeat_kv).
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """A small Llama-style decoder (HuggingFace's module names and layout, untied LM head), written here so that
    nothing depends on ``transformers``. ``forward(input_ids, labels)`` returns the mean next-token loss; ``labels``
    are already shifted (the token after each input position), as ``gpt_batch`` makes them."""

    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        config = config or LlamaConfig()
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({config.num_key_value_heads})")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():  # Llama's initialisation: normal(0, 0.02) for every matrix
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(torch.arange(input_ids.shape[1], device=input_ids.device))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
