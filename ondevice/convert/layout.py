"""The draft's shapes and weights as the Core ML graph uses them, and the Neural Engine limits
they are checked against before any work (the reasons are in `ondevice.convert.coreml`).

`Dims` are the graph's dimensions (state length and head dimension padded to `STATE_ALIGN`, the
LM head split into `vocab_splits` of at most `MAX_DIM` rows); `prepare_weights` turns Hugging
Face-named float32 weights into float16 conv kernels, with interleaved-RoPE rows permuted to the
half-split layout and the attention scale folded into the queries. A tied embedding is stored
once: as the LM head's pieces `lm_head_j` (plus `embed_tail`, the rows a truncated head lacks),
which the graph's embedding lookup reads too; only an untied model has an `embed` table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ondevice.errors import ModelFormatError, OndeviceError
from ondevice.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from ondevice.runtime.mil.numerics import FP16_MAX

MAX_DIM = 16384  # the Neural Engine's largest tensor dimension
STATE_ALIGN = 32  # state dimensions are padded to multiples of this
# Longest chunk: sequence lengths above 32 are outside what is reported to work on the ANE for
# stateful LLM functions (github.com/Anemll/Anemll/issues/27); ANEMLL's default batch is 64 for
# prefill only, and its KV-cache models stay at <= 32 per call.
MAX_CHUNK = 32
# The causal-mask table is 2 * state_len wide, the norm's concat 2 * hidden: both must fit MAX_DIM.
MAX_CONTEXT = MAX_DIM // 2
MAX_HIDDEN = MAX_DIM // 2


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    state_head_dim: int  # head_dim rounded up to STATE_ALIGN
    state_len: int  # context rounded up to STATE_ALIGN
    vocab: int
    vocab_splits: list[int]
    eps: float

    @classmethod
    def of(cls, config: ModelConfig, context: int) -> Dims:
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            state_head_dim=_round_up(config.head_dim, STATE_ALIGN),
            state_len=_round_up(context, STATE_ALIGN),
            vocab=config.vocab_size,
            vocab_splits=_vocab_splits(_output_rows(config)),
            eps=float(config.rms_norm_eps),
        )


def _vocab_splits(vocab: int) -> list[int]:
    """Near-equal pieces of at most MAX_DIM rows (ANEMLL splits its LM head the same way)."""
    n = math.ceil(vocab / MAX_DIM)
    base, extra = divmod(vocab, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _output_rows(config: ModelConfig) -> int:
    """Rows of the LM head to convert: a truncated-vocabulary draft (FR-Spec,
    `draft_vocab_size` K) scores only ids 0..K-1, so the head is cut to K rows (3x less work for
    K = 16384 of 49152); its logits are then K wide and the runtime gives the rest probability 0."""
    k = config.draft_vocab_size
    return k if k and k < config.vocab_size else config.vocab_size


def check_config(config: ModelConfig) -> None:
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"cannot convert model_type {config.model_type!r} to Core ML; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    if config.head_dim % 2:
        raise ModelFormatError(f"head_dim {config.head_dim} is odd; RoPE needs an even head_dim.")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ModelFormatError(
            f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})."
        )
    if config.hidden_size > MAX_HIDDEN or config.intermediate_size > MAX_DIM:
        raise ModelFormatError(
            f"hidden_size {config.hidden_size} / intermediate_size {config.intermediate_size} "
            f"exceed the Neural Engine's limits ({MAX_HIDDEN}: the norm concatenates two copies "
            f"of the hidden state; {MAX_DIM}); this model is too large for a draft."
        )


def check_options(context: int, chunk: int) -> None:
    """The context and chunk the Neural Engine takes; checked before any model is loaded."""
    if not 2 <= chunk <= MAX_CHUNK:
        raise OndeviceError(
            f"chunk {chunk} is out of range; use 2..{MAX_CHUNK} tokens (16 is typical): longer "
            "chunks are not reported to run on the Neural Engine (Anemll issue 27)."
        )
    if not chunk <= context <= MAX_CONTEXT:
        raise OndeviceError(
            f"context {context} is out of range; use {chunk}..{MAX_CONTEXT} tokens: the causal "
            f"mask table is twice the context wide and the Neural Engine's limit is {MAX_DIM}."
        )


def _get(weights: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in weights:
        raise ModelFormatError(f"draft weights lack {name!r}; the checkpoint is incomplete.")
    w = np.asarray(weights[name])
    if w.shape != shape:
        raise ModelFormatError(
            f"draft weight {name!r} has shape {tuple(w.shape)}, expected {shape} from the config."
        )
    if not np.isfinite(w).all():
        raise ModelFormatError(f"draft weight {name!r} contains NaN or infinite values.")
    peak = float(np.abs(w).max()) if w.size else 0.0
    if peak > FP16_MAX:
        raise ModelFormatError(
            f"draft weight {name!r} has values up to {peak:,.0f}, beyond float16's range "
            f"({FP16_MAX:,.0f}); the Core ML draft stores float16 weights."
        )
    return w.astype(np.float32)


def _half_split_order(head_dim: int) -> np.ndarray:
    """Row order turning interleaved RoPE pairs (2i, 2i+1) into half-split pairs (i, i + d/2)."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def prepare_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """fp16 weights in the layout the graph uses (conv kernels, permuted and pre-scaled rows)."""
    d, hd = config.hidden_size, config.head_dim
    nh, nkv, inter = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    )
    scale = hd**-0.5
    order = _half_split_order(hd) if config.rope_traditional else None

    def heads_rows(w: np.ndarray, n: int) -> np.ndarray:
        if order is None:
            return w
        return w.reshape(n, hd, *w.shape[1:])[:, order].reshape(w.shape)

    def conv(w: np.ndarray) -> np.ndarray:
        return w.reshape(*w.shape, 1, 1).astype(np.float16)

    out: dict[str, np.ndarray] = {}
    embed = _get(weights, "model.embed_tokens.weight", (config.vocab_size, d)).astype(np.float16)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        q = heads_rows(_get(weights, p + "self_attn.q_proj.weight", (nh * hd, d)), nh)
        k = heads_rows(_get(weights, p + "self_attn.k_proj.weight", (nkv * hd, d)), nkv)
        v = _get(weights, p + "self_attn.v_proj.weight", (nkv * hd, d))
        if config.attention_bias:
            bq = heads_rows(_get(weights, p + "self_attn.q_proj.bias", (nh * hd,)), nh)
            bk = heads_rows(_get(weights, p + "self_attn.k_proj.bias", (nkv * hd,)), nkv)
            bv = _get(weights, p + "self_attn.v_proj.bias", (nkv * hd,))
        if config.qk_norm:
            qn = _get(weights, p + "self_attn.q_norm.weight", (hd,))
            kn = _get(weights, p + "self_attn.k_norm.weight", (hd,))
            if order is not None:
                qn, kn = qn[order], kn[order]
            out[f"l{i}.q_norm"] = (qn * scale).astype(np.float16)  # scale after the norm
            out[f"l{i}.k_norm"] = kn.astype(np.float16)
        else:
            q = q * scale
            if config.attention_bias:
                bq = bq * scale
        out[f"l{i}.q"], out[f"l{i}.k"], out[f"l{i}.v"] = conv(q), conv(k), conv(v)
        if config.attention_bias:
            out[f"l{i}.bq"] = bq.astype(np.float16)
            out[f"l{i}.bk"] = bk.astype(np.float16)
            out[f"l{i}.bv"] = bv.astype(np.float16)
        out[f"l{i}.o"] = conv(_get(weights, p + "self_attn.o_proj.weight", (d, nh * hd)))
        out[f"l{i}.gate"] = conv(_get(weights, p + "mlp.gate_proj.weight", (inter, d)))
        out[f"l{i}.up"] = conv(_get(weights, p + "mlp.up_proj.weight", (inter, d)))
        out[f"l{i}.down"] = conv(_get(weights, p + "mlp.down_proj.weight", (d, inter)))
        out[f"l{i}.in_norm"] = _get(weights, p + "input_layernorm.weight", (d,)).astype(np.float16)
        out[f"l{i}.post_norm"] = _get(weights, p + "post_attention_layernorm.weight", (d,)).astype(
            np.float16
        )
    out["norm"] = _get(weights, "model.norm.weight", (d,)).astype(np.float16)
    if config.tie_word_embeddings:
        head = embed
    else:
        out["embed"] = embed
        head = _get(weights, "lm_head.weight", (config.vocab_size, d)).astype(np.float16)
    start = 0
    for j, n in enumerate(_vocab_splits(_output_rows(config))):
        out[f"lm_head_{j}"] = head[start : start + n].reshape(n, d, 1, 1)
        start += n
    if config.tie_word_embeddings and start < config.vocab_size:
        out["embed_tail"] = embed[start:].reshape(-1, d, 1, 1)  # rows a truncated head lacks
    return out
