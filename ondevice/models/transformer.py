"""Llama-family decoder in MLX: llama, mistral, qwen2 (q/k/v biases), qwen3 (q/k norms).

The forward pass takes explicit positions and any additive attention mask, so the same module
scores a plain chain of tokens and a token tree (one pass, per-node positions, tree mask).
Parameter names follow Hugging Face, so `mlx_lm.load` reads the weights we write.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ondevice.models.cache import KVCache, LayerCache
from ondevice.models.config import ModelConfig


def rope_wavelengths(cfg: ModelConfig) -> tuple[mx.array, float]:
    """Per-pair RoPE wavelengths (`freqs` of `mx.fast.rope`) and the position scale."""
    dims = cfg.head_dim
    freqs = cfg.rope_theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    scale = 1.0
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        scale = 1.0 / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        wavelens = 2 * math.pi * freqs
        scaled = mx.where(wavelens > old_ctx / low, freqs * factor, freqs)
        medium = (wavelens > old_ctx / high) & (wavelens < old_ctx / low)
        smooth = (old_ctx / wavelens - low) / (high - low)
        smooth_freqs = scaled / ((1 - smooth) / factor + smooth)
        freqs = mx.where(medium, smooth_freqs, scaled)
    return freqs, scale


class RoPE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dims = cfg.head_dim
        self.traditional = cfg.rope_traditional
        self._freqs, self._scale = rope_wavelengths(cfg)
        # Not a parameter, so evaluate it here: a lazy array belongs to the stream of the thread
        # that built it, and generation may run in another thread (mlx >= 0.31.2).
        mx.eval(self._freqs)

    def __call__(self, x: mx.array, offset: int, positions: mx.array | None) -> mx.array:
        # Arbitrary per-token positions (token trees: shape (L,) or (B, L)): each token becomes
        # a batch entry of one token at its own offset, so that the same kernel rotates it as a
        # pass at consecutive positions would, bit for bit (a tree pass and a plain one must
        # give the same logits: greedy tree decoding is plain decoding's).
        B, H, L, D = x.shape
        at: int | mx.array = offset
        if positions is not None:
            x = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
            at = mx.broadcast_to(positions.reshape(-1, L), (B, L)).reshape(-1).astype(mx.int32)
        out = mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=self._scale,
            offset=at,
            freqs=self._freqs,
        )
        if positions is None:
            return out
        return out.reshape(B, L, H, D).transpose(0, 2, 1, 3)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rope = RoPE(cfg)
        # scaled dot-product attention over (q, keys, values, scale, mask); the CPU kernel swaps
        # in one whose rows do not depend on the pass size (runtime/kernel.py)
        self.attend = mx.fast.scaled_dot_product_attention

    def __call__(
        self,
        x: mx.array,
        mask: mx.array | str | None,
        cache: LayerCache | None,
        positions: mx.array | None,
    ) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset, positions)
        k = self.rope(k, offset, positions)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def silu_gate(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU's gating of the MLP: silu(gate) * up."""
    return nn.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        # the CPU kernel swaps in its own, computed on its products' outputs (runtime/kernel.py)
        self.gating = silu_gate

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.gating(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, mask, cache, positions):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Block(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Model(nn.Module):
    """A causal LM. Call with token ids of shape (B, L) or (L,)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> list[Block]:
        return self.model.layers

    @property
    def head(self) -> nn.Module:
        """The output matrix's module: `lm_head`, or the embedding where the two are tied."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def make_cache(self) -> KVCache:
        return KVCache(len(self.model.layers))

    def __call__(
        self,
        tokens: mx.array,
        cache: KVCache | None = None,
        *,
        positions: mx.array | None = None,
        mask: mx.array | None = None,
        last_only: bool = False,
        hidden: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """Logits (B, L, vocab) for `tokens`, appended to `cache` if given; with `hidden`,
        (logits, the last hidden states (B, L, hidden_size) after the final norm).

        positions: per-token positions, shape (L,) or (B, L); default: the next L positions
            after the cache (a plain continuation).
        mask: additive attention mask over the new tokens, shape (L, L), or over the whole
            context, shape (L, cache_len + L) (or broadcastable with a leading (B, heads));
            default: causal.
        last_only: compute logits for the last position only (prefill needs no more).
        """
        if tokens.ndim == 1:
            tokens = tokens[None]
        h = self.model.embed_tokens(tokens)
        L = tokens.shape[1]
        prefix = cache.offset if cache is not None else 0
        # a model served by the CPU kernel passes numpy float32 rows between its modules
        # (runtime/kernel.py, "Glue"); they become MLX arrays again at the end
        dtype = h.dtype if isinstance(h, mx.array) else mx.float32
        attn_mask = _attention_mask(mask, L, prefix, dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, attn_mask, cache[i] if cache is not None else None, positions)
        h = self.model.norm(h[:, -1:] if last_only else h)
        rows = self.config.draft_vocab_size
        if rows and rows < self.config.vocab_size:
            logits = _head_rows(self.head, h, rows)
        elif self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        logits, h = as_mlx(logits), as_mlx(h)
        return (logits, h) if hidden else logits


def as_mlx(a: mx.array | np.ndarray) -> mx.array:
    """An MLX array as it is; numpy rows (a served model's, runtime/kernel.py) as MLX."""
    return a if isinstance(a, mx.array) else mx.array(a)


def norm_weights(model: Model) -> list[mx.array]:
    """The model's RMSNorm weights, final norm first: small, and changed by any fine-tune, so
    what identifies its weights cheaply (skip sets, Medusa heads)."""
    arrays = [model.model.norm.weight]
    for layer in model.layers:
        arrays += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return arrays


def _head_rows(layer: nn.Module, h: mx.array, rows: int) -> mx.array:
    """Logits for the first `rows` token ids only (a truncated-vocabulary draft): the output
    matrix's rows are independent, so slicing them (packed ones too) is exact."""
    if hasattr(layer, "first_rows"):  # the CPU kernel's (runtime/kernel.py)
        return layer.first_rows(h, rows)
    if isinstance(layer, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
        return mx.quantized_matmul(
            h,
            layer.weight[:rows],
            layer.scales[:rows],
            layer.biases[:rows],
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
        )
    return h @ layer.weight[:rows].T


def _attention_mask(mask: mx.array | None, L: int, prefix: int, dtype) -> mx.array | str | None:
    if mask is None:
        return "causal" if L > 1 else None
    mask = mask.astype(dtype)
    if mask.shape[-1] == L and prefix > 0:
        zeros = mx.zeros((*mask.shape[:-1], prefix), dtype)
        mask = mx.concatenate([zeros, mask], axis=-1)
    return mask
