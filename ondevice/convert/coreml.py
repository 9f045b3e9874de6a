"""The draft model as a Core ML ML Program, built with coremltools' MIL builder from numpy weights.

No torch and no tracing: every op is written here with `coremltools.converters.mil.Builder`, so
the graph is exactly the one described below, and conversion runs on Linux (only prediction
needs macOS). The package holds two functions over the same weights and the same KV cache:

* `decode`: one token (the drafting loop), and
* `chunk`: `chunk` tokens at once (prefill, and catching up after the verifier accepted several
  tokens). A partly filled last chunk is padded; padding only writes cache slots beyond the last
  real token, which later calls overwrite before any query can see them.

Both take `input_ids` (int32, shape (1, L)) and `position` (int32, shape (1,): the position of
the first token) and return float16 logits for every input position, split into pieces
`logits_0 ... logits_{n-1}` of shape (1, L, V_i) that concatenate along the last axis.

Neural Engine rules followed, and where they come from:

* Fixed shapes everywhere (ANE compiles static shapes only; both ml-ane-transformers and ANEMLL
  export one fixed-shape model per sequence length). Prefill and decode are two functions of one
  multifunction program (iOS 18 / macOS 15); identical constants of the two functions get one
  `weight_id`, so the package stores every weight once, as `coremltools.utils.save_multifunction`
  would, without its save/reload/compare round trip (5x faster here).
* Hidden states in the (batch, channels, 1, sequence) "BC1S" layout and every projection a 1x1
  `conv` (ml-ane-transformers, principle 1 "picking the right data format"; ANEMLL uses Conv2d
  for q/k/v/MLP and the LM head).
* No dimension above 16384: the LM head is split along the vocabulary into equal 1x1 convs of at
  most 16384 outputs, each returned as its own output, as ANEMLL's `lm_head8_*` / `lm_head16_*`
  do (concatenating them in the model would recreate the oversized tensor). The embedding table
  is larger than that too; its `gather` runs on the CPU, as the ml-ane-transformers README notes
  for embedding lookups.
* RMSNorm without `pow`: ANEMLL's trick of normalising `concat([x, -x])` with `layer_norm` (the
  mean of that is exactly 0, so layer norm divides by the root mean square) and keeping the first
  half. `layer_norm` is a native ANE op. It squares its input inside, in float16 on the Neural
  Engine, and residual streams are large (the shipped SmolLM2 draft reaches ~1,470 before its
  final norm, Qwen2.5 ~2,180 from its third layer; 2,180^2 is 73x float16's 65,504), so each row
  is first divided by max(1, its largest magnitude): RMSNorm is invariant to that scale up to eps
  (whose weight grows by the scale^2, at most ~1e-3 relative for hidden sizes < 1,000 and eps
  1e-6), and the squares stay <= 1.
* RoPE from precomputed cos/sin tables (ANEMLL's `cos_cached` / `sin_cached`), sliced at the
  position with `slice_by_size`; the causal mask is also a slice of a precomputed table, so no
  comparison or `range` ops run per call. GGUF weights laid out for interleaved ("traditional")
  RoPE are permuted here to the half-split layout, which leaves q.k products unchanged.
* KV cache as two Core ML states, `key_cache` and `value_cache`, each (layers, kv_heads, S, d),
  S the context rounded up to a multiple of 32 and d the head dimension rounded up to a multiple
  of 32 (zero padded), following the stateful KV-cache pattern of Apple's "On Device Llama 3.1
  with Core ML" article and ANEMLL's unified cache. Each layer writes its new rows with
  `slice_update` + `coreml_update_state` and reads its slice back from that update's output,
  exactly the chain coremltools' torch frontend emits for in-place cache writes. (A second
  `read_state` of the same state is merged with the first by the default passes, so the graph
  never reads a state twice.) With kv="io" the caches are plain inputs instead and the function
  returns the new rows (`new_keys`, `new_values`, (layers, kv_heads, L, d)) for the caller to
  store: the fallback for systems where stateful models do not compile for the Neural Engine.
* The attention scale is folded into the query projection (or the qwen3 query norm), saving a
  multiply per layer; grouped-query attention is a reshape of the queries, not a repeat of K/V.

Weight compression runs coremltools.optimize.coreml's graph passes (`palettize_weights` with an
`OpPalettizerConfig`, `linear_quantize_weights` with an `OpLinearQuantizerConfig`) in the
conversion pipeline: palettize4/palettize6 (k-means lookup tables per group of output channels,
the granularity Apple recommends for LLM weights since iOS 18) and int8 (per-channel symmetric
linear quantization). Only the projection, LM-head and embedding matrices are compressed; RoPE
and mask tables and norm weights stay float16. Groups are sized so each k-means problem has at
least 10,000 weights: coremltools then uses its exact, deterministic 1-D k-means (kmeans1d), so
both functions get identical tables and share them.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.convert.probe import RangeReport, probe_float16_range
from ondevice.errors import ConversionError, ModelFormatError, OndeviceError
from ondevice.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from ondevice.runtime.mil.numerics import FP16_MAX
from ondevice.runtime.mil.package import FORMAT_VERSION, METADATA_KEY

MAX_DIM = 16384  # the Neural Engine's largest tensor dimension
STATE_ALIGN = 32  # state dimensions are padded to multiples of this
MASK_VALUE = -1e4  # additive mask; as in ml-ane-transformers, finite so fp16 never sees inf - inf
COMPRESSIONS = ("none", "palettize4", "palettize6", "int8")
KV_MODES = ("state", "io")
KMEANS1D_MIN_WEIGHTS = 10_000  # coremltools uses kmeans1d (exact, fast) from this size on
MAX_PALETTES = 16  # lookup tables per matrix: k-means time grows with their number
MIN_DEPLOYMENT = "macOS15"  # states and multifunction packages need macOS 15 / iOS 18
# Longest chunk: sequence lengths above 32 are outside what is reported to work on the ANE for
# stateful LLM functions (github.com/Anemll/Anemll/issues/27); ANEMLL's default batch is 64 for
# prefill only, and its KV-cache models stay at <= 32 per call.
MAX_CHUNK = 32
# The causal-mask table is 2 * state_len wide, the norm's concat 2 * hidden: both must fit MAX_DIM.
MAX_CONTEXT = MAX_DIM // 2
MAX_HIDDEN = MAX_DIM // 2
# The float16 range probe fails a conversion above a quarter of float16's range: headroom for
# prompts longer or stranger than the probe's.
RANGE_LIMIT = FP16_MAX / 4


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class _Dims:
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


# -- weights -------------------------------------------------------------------------------------


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


def _check_config(config: ModelConfig) -> None:
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


def _prepare_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
    out["embed"] = _get(weights, "model.embed_tokens.weight", (config.vocab_size, d)).astype(
        np.float16
    )
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
        head = out["embed"]
    else:
        head = _get(weights, "lm_head.weight", (config.vocab_size, d)).astype(np.float16)
    start = 0
    for j, n in enumerate(_vocab_splits(_output_rows(config))):
        out[f"lm_head_{j}"] = head[start : start + n].reshape(n, d, 1, 1)
        start += n
    return out


def _rope_tables(config: ModelConfig, state_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of shape (state_len, head_dim) for half-split RoPE, from the MLX model's freqs."""
    from ondevice.models.transformer import rope_wavelengths

    freqs, scale = rope_wavelengths(config)
    freqs = np.array(freqs, dtype=np.float64)
    theta = np.arange(state_len, dtype=np.float64)[:, None] * scale / freqs[None]
    theta = np.concatenate([theta, theta], axis=1)
    return np.cos(theta).astype(np.float16), np.sin(theta).astype(np.float16)


def _mask_table(rows: int, groups: int, state_len: int) -> np.ndarray:
    """Causal-mask table: slicing columns [S-1-p, 2S-1-p) gives the mask for positions p.. p+rows-1.

    Row g*rows + i (one copy per query head of a KV group) has 0 at columns <= S-1+i, so in the
    slice column j is visible exactly when j <= p + i.
    """
    s = state_len
    cols = np.arange(2 * s)[None, :]
    i = np.arange(rows)[:, None]
    base = np.where(cols <= s - 1 + i, 0.0, MASK_VALUE).astype(np.float16)
    return np.tile(base, (groups, 1))


# -- graph ---------------------------------------------------------------------------------------


def _build_function(
    config: ModelConfig,
    w: dict[str, np.ndarray],
    dims: _Dims,
    L: int,
    kv: str,
    compressed: dict[str, tuple[str, dict[str, Any]]] | None = None,
):
    """The MIL function for sequence length L.

    `compressed` maps weight const names to the constexpr op (type and constant inputs) that
    replaces them, as computed once by `_compress_weights`.
    """
    compressed = compressed or {}
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    H, KV, hd = dims.heads, dims.kv_heads, dims.head_dim
    hds, S, NL = dims.state_head_dim, dims.state_len, dims.layers
    G = H // KV
    cache_shape = (NL, KV, S, hds)
    cos_t, sin_t = _rope_tables(config, S)
    specs = [
        mb.TensorSpec((1, L), dtype=types.int32),
        mb.TensorSpec((1,), dtype=types.int32),
    ]
    spec_type = mb.StateTensorSpec if kv == "state" else mb.TensorSpec
    specs += [spec_type(cache_shape, dtype=types.fp16) for _ in range(2)]  # one object each

    def i32(v) -> np.ndarray:
        return np.array(v, dtype=np.int32)

    def rms_norm(x, weight: np.ndarray, axis: int, name: str):
        # ANEMLL: layer_norm of [x, -x] is x / rms(x); no pow. Rows are first scaled to
        # max |x| <= 1 so layer_norm's float16 squares cannot overflow (module docstring).
        n = weight.shape[0]
        both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=axis)
        peak = mb.reduce_max(x=both, axes=[axis], keep_dims=True)  # max |x| of each row
        scaled = mb.real_div(x=both, y=mb.maximum(x=peak, y=np.float16(1.0)))
        gamma = np.concatenate([weight, weight]).astype(np.float16)
        normed = mb.layer_norm(
            x=scaled, axes=[axis], gamma=gamma, epsilon=np.float16(dims.eps), name=name
        )
        return mb.split(x=normed, split_sizes=[n, n], axis=axis)[0]

    def weight(key: str):
        name = _cname(key)
        if name in compressed:
            op_type, inputs = compressed[name]
            return getattr(mb, op_type)(**inputs, name=name)
        return mb.const(val=w[key], name=name)

    def conv(x, weight_key: str, bias_key: str | None = None):
        kwargs: dict[str, Any] = {}
        if bias_key is not None:
            kwargs["bias"] = mb.const(val=w[bias_key], name=_cname(bias_key))
        return mb.conv(x=x, weight=weight(weight_key), **kwargs)

    def heads_last(x, n: int):
        """(1, n*hd, 1, L) -> (1, n, L, hd)."""
        x = mb.reshape(x=x, shape=i32([1, n, hd, L]))
        return mb.transpose(x=x, perm=i32([0, 1, 3, 2]))

    def rope(x, cos, sin):
        x1, x2 = mb.split(x=x, num_splits=2, axis=-1)
        rotated = mb.concat(values=[mb.mul(x=x2, y=np.float16(-1.0)), x1], axis=-1)
        return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))

    def pad_head(x):
        if hds == hd:
            return x
        zeros = np.zeros((1, KV, L, hds - hd), dtype=np.float16)
        return mb.concat(values=[x, zeros], axis=-1)

    def body(input_ids, position, key_cache, value_cache):
        zero = i32([0])
        # Position-dependent slices of constant tables: RoPE rows p..p+L-1 and the mask.
        rope_begin = mb.concat(values=[position, zero], axis=0)
        cos = mb.slice_by_size(x=cos_t, begin=rope_begin, size=i32([L, hd]), name="rope_cos")
        sin = mb.slice_by_size(x=sin_t, begin=rope_begin, size=i32([L, hd]), name="rope_sin")
        mask_col = mb.sub(x=i32([S - 1]), y=position)
        mask = mb.slice_by_size(
            x=_mask_table(L, G, S),
            begin=mb.concat(values=[zero, mask_col], axis=0),
            size=i32([G * L, S]),
            name="causal_mask",
        )
        cache_begin = mb.concat(values=[i32([0, 0]), position, zero], axis=0)

        if kv == "state":
            k_chain = mb.read_state(input=key_cache, name="read_key_cache")
            v_chain = mb.read_state(input=value_cache, name="read_value_cache")
        else:
            k_chain, v_chain = key_cache, value_cache
        new_keys, new_values = [], []

        emb = mb.gather(x=weight("embed"), indices=input_ids, axis=0)
        x = mb.expand_dims(x=mb.transpose(x=emb, perm=i32([0, 2, 1])), axes=[2])  # (1, D, 1, L)

        for i in range(NL):
            p = f"l{i}"
            h = rms_norm(x, w[f"{p}.in_norm"], 1, f"{p}_input_norm")
            bias = config.attention_bias
            q = conv(h, f"{p}.q", f"{p}.bq" if bias else None)
            k = conv(h, f"{p}.k", f"{p}.bk" if bias else None)
            v = conv(h, f"{p}.v", f"{p}.bv" if bias else None)
            q, k, v = heads_last(q, H), heads_last(k, KV), heads_last(v, KV)
            if config.qk_norm:
                q = rms_norm(q, w[f"{p}.q_norm"], 3, f"{p}_q_norm")
                k = rms_norm(k, w[f"{p}.k_norm"], 3, f"{p}_k_norm")
            q, k = rope(q, cos, sin), rope(k, cos, sin)

            # Write this layer's new rows at [layer i, :, p:p+L, :] and read the layer back.
            begin = cache_begin if i == 0 else mb.add(x=cache_begin, y=i32([i, 0, 0, 0]))
            end = mb.add(x=cache_begin, y=i32([i + 1, KV, L, hds]))
            k_new, v_new = pad_head(k), pad_head(v)
            # Each update directly follows its write: coremltools' canonicalize_inplace_pattern
            # pass expects that order (interleaving the K and V writes trips it up).
            k_chain = mb.slice_update(x=k_chain, update=k_new, begin=begin, end=end)
            if kv == "state":
                k_chain = mb.coreml_update_state(state=key_cache, value=k_chain)
            v_chain = mb.slice_update(x=v_chain, update=v_new, begin=begin, end=end)
            if kv == "state":
                v_chain = mb.coreml_update_state(state=value_cache, value=v_chain)
            else:
                new_keys.append(k_new)
                new_values.append(v_new)
            layer_begin, layer_end = i32([i, 0, 0, 0]), i32([i + 1, KV, S, hd])
            squeeze = [True, False, False, False]
            keys = mb.slice_by_index(
                x=k_chain, begin=layer_begin, end=layer_end, squeeze_mask=squeeze
            )
            values = mb.slice_by_index(
                x=v_chain, begin=layer_begin, end=layer_end, squeeze_mask=squeeze
            )

            # Grouped-query attention: the G query heads of a KV head become G*L query rows.
            qg = mb.reshape(x=q, shape=i32([KV, G * L, hd]))
            scores = mb.matmul(x=qg, y=keys, transpose_y=True)  # (KV, G*L, S)
            probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
            attn = mb.matmul(x=probs, y=values)  # (KV, G*L, hd)
            attn = mb.transpose(
                x=mb.reshape(x=attn, shape=i32([1, H, L, hd])), perm=i32([0, 1, 3, 2])
            )
            attn = mb.reshape(x=attn, shape=i32([1, H * hd, 1, L]))
            x = mb.add(x=x, y=conv(attn, f"{p}.o"), name=f"{p}_attention_residual")

            h = rms_norm(x, w[f"{p}.post_norm"], 1, f"{p}_post_attention_norm")
            gate = mb.silu(x=conv(h, f"{p}.gate"))
            act = mb.mul(x=gate, y=conv(h, f"{p}.up"), name=f"{p}_mlp_activation")
            x = mb.add(x=x, y=conv(act, f"{p}.down"), name=f"{p}_mlp_residual")

        h = rms_norm(x, w["norm"], 1, "final_norm")
        outputs = []
        for j, n in enumerate(dims.vocab_splits):
            logits = conv(h, f"lm_head_{j}")  # (1, n, 1, L)
            logits = mb.reshape(x=logits, shape=i32([1, n, L]))
            outputs.append(mb.transpose(x=logits, perm=i32([0, 2, 1]), name=f"logits_{j}"))
        if kv == "io":
            outputs.append(mb.concat(values=new_keys, axis=0, name="new_keys"))
            outputs.append(mb.concat(values=new_values, axis=0, name="new_values"))
        return tuple(outputs)

    @mb.function(input_specs=specs, opset_version=ct.target.iOS18)
    def function(input_ids, position, key_cache, value_cache):
        return body(input_ids, position, key_cache, value_cache)

    return function


# The graph above is already float16 and fused the way we want it, so instead of coremltools'
# 95-pass default pipeline (which re-validates the whole program after each pass and dominated
# conversion time) we run only the passes that change something here: int16 gather indices and
# their negative-index guard (Core ML's own choice for embedding lookups), the canonical order of
# state updates that Core ML expects, and clean-up.
_PASSES = (
    "common::const_elimination",
    "common::add_int16_cast",
    "common::guard_negative_gather_indices",
    "common::cast_optimization",
    "common::const_elimination",
    "common::canonicalize_inplace_pattern",
    "common::prefer_state_in_downstream",
    "common::const_deduplication",
    "common::dead_code_elimination",
    "common::dedup_op_and_var_names",
)


def _pass_pipeline():
    import coremltools as ct

    pipeline = ct.PassPipeline.EMPTY
    for name in _PASSES:
        pipeline.append_pass(name)
    return pipeline


def _share_constants(prog) -> None:
    """Give identical constants of different functions one `weight_id`: stored once on export.

    This is what `coremltools.utils.save_multifunction` does after reloading saved functions
    (comparing every pair of weights with `allclose`); keying by content hash is the same
    result in a fraction of the time. Small constants (lookup tables) are shared too: Apple's
    pass notes that leaving them unshared can unshare the palettized indices after compilation.
    """
    groups: dict[tuple, list] = {}
    for fname, func in prog.functions.items():
        for op in func.operations:
            if op.op_type != "const":
                continue
            val = op.outputs[0].val
            if not isinstance(val, np.ndarray) or val.size == 0:
                continue
            digest = hashlib.blake2b(np.ascontiguousarray(val).data, digest_size=16).hexdigest()
            groups.setdefault((val.dtype.str, val.shape, digest), []).append((fname, op))
    for i, members in enumerate(groups.values()):
        if len({fname for fname, _ in members}) > 1:
            for _, op in members:
                op.weight_id = f"shared_{i}"


def _cname(key: str) -> str:
    """Const names: stable, readable, and usable as keys of the compression config."""
    return "w_" + key.replace(".", "_")


# -- compression ---------------------------------------------------------------------------------


def _compressible(w: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Const name -> shape of the matrices we compress: embedding, projections, LM head."""
    keys = ["embed"] + [
        k
        for k in w
        if k.startswith("lm_head_")
        or (k.startswith("l") and k.split(".")[-1] in ("q", "k", "v", "o", "gate", "up", "down"))
    ]
    return {_cname(k): w[k].shape for k in keys}


def _compression_config(compress: str, w: dict[str, np.ndarray]):
    """Per-weight coremltools OptimizationConfig, or None for compress="none"."""
    import coremltools.optimize.coreml as cto

    if compress == "none":
        return None
    configs = {}
    for name, shape in _compressible(w).items():
        out_ch, per_channel = shape[0], int(np.prod(shape[1:]))
        if compress == "int8":
            configs[name] = cto.OpLinearQuantizerConfig(
                mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=1
            )
            continue
        group = _palette_group(out_ch, per_channel)
        if group is None:
            continue  # too small for the exact k-means; stays float16 (tiny models only)
        configs[name] = cto.OpPalettizerConfig(
            mode="kmeans",
            nbits=4 if compress == "palettize4" else 6,
            granularity="per_grouped_channel",
            group_size=group,
            channel_axis=0,
            weight_threshold=1,
        )
    return cto.OptimizationConfig(op_name_configs=configs)


def _palette_group(out_channels: int, per_channel: int) -> int | None:
    """Channels per lookup table: a power of two >= 16 dividing out_channels, with at most
    MAX_PALETTES tables per matrix and at least 10k weights per table (else None)."""
    g = 16
    while g <= out_channels:
        enough = g * per_channel >= KMEANS1D_MIN_WEIGHTS and out_channels // g <= MAX_PALETTES
        if out_channels % g == 0 and enough:
            return g
        g *= 2
    if out_channels * per_channel >= KMEANS1D_MIN_WEIGHTS:
        return out_channels
    return None


def _compress_weights(
    config: ModelConfig, w: dict[str, np.ndarray], dims: _Dims, kv: str, compress: str
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Compress every compressible weight once, with coremltools' own compression pass.

    The pass runs on the decode function alone; the constexpr ops it creates (lookup table and
    indices, or int8 data and scales) are then rebuilt verbatim in both functions, so k-means
    runs once per weight and the two functions hold identical, shareable constants.
    """
    import coremltools as ct
    from coremltools.converters.mil.mil import Program

    name = "compression::" + (
        "linear_quantize_weights" if compress == "int8" else "palettize_weights"
    )
    pipeline = ct.PassPipeline.EMPTY
    pipeline.append_pass(name)
    pipeline.set_options(name, {"config": _compression_config(compress, w)})
    prog = Program()
    prog.add_function("main", _build_function(config, w, dims, 1, kv))
    prog = ct.convert(
        prog,
        convert_to="milinternal",
        minimum_deployment_target=ct.target.macOS15,
        pass_pipeline=pipeline,
    )
    names = sorted(_compressible(w), key=len, reverse=True)
    recipes: dict[str, tuple[str, dict[str, Any]]] = {}
    for op in prog.functions["main"].operations:
        if not op.op_type.startswith("constexpr_"):
            continue
        original = next((n for n in names if op.name.startswith(n + "_")), None)
        if original is None or not all(v.val is not None for v in op.inputs.values()):
            continue  # only rebuild ops made from our named weights with constant inputs
        recipes[original] = (op.op_type, {k: v.val for k, v in op.inputs.items()})
    return recipes


# -- the package ---------------------------------------------------------------------------------


def _describe(dims: _Dims, context: int, chunk: int, kv: str, compress: str, cfg: ModelConfig):
    cache = [dims.layers, dims.kv_heads, dims.state_len, dims.state_head_dim]
    functions: dict[str, Any] = {}
    for name, L in (("decode", 1), ("chunk", chunk)):
        inputs: dict[str, list[int]] = {"input_ids": [1, L], "position": [1]}
        outputs = {f"logits_{j}": [1, L, n] for j, n in enumerate(dims.vocab_splits)}
        states: dict[str, list[int]] = {}
        if kv == "state":
            states = {"key_cache": cache, "value_cache": cache}
        else:
            inputs.update({"key_cache": cache, "value_cache": cache})
            outputs.update(
                {
                    "new_keys": [dims.layers, dims.kv_heads, L, dims.state_head_dim],
                    "new_values": [dims.layers, dims.kv_heads, L, dims.state_head_dim],
                }
            )
        functions[name] = {
            "tokens": L,
            "inputs": inputs,
            "outputs": outputs,
            "states": states,
        }
    return {
        "format": "ondevice-coreml-draft",
        "format_version": FORMAT_VERSION,
        "model_type": cfg.model_type,
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "num_layers": dims.layers,
        "context": context,
        "state_length": dims.state_len,
        "chunk": chunk,
        "kv": kv,
        "compression": compress,
        "dtype": "float16",
        "min_deployment_target": MIN_DEPLOYMENT,
        "default_function": "decode",
        "functions": functions,
        "output_vocab": sum(dims.vocab_splits),  # < vocab_size for a truncated draft
        "logits": [f"logits_{j}" for j in range(len(dims.vocab_splits))],
        "vocab_splits": list(dims.vocab_splits),
        "kv_cache": {
            "names": ["key_cache", "value_cache"],
            "shape": cache,
            "head_dim": dims.head_dim,
            "dtype": "float16",
        },
    }


def _refuse_lint_errors(package: Path) -> None:
    from ondevice.convert.lint import check_mlpackage

    errors = [f for f in check_mlpackage(package) if f.severity == "error"]
    if errors:
        listed = "; ".join(str(f) for f in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ConversionError(
            f"the converted draft breaks Neural Engine rules: {listed}{more}. Nothing was "
            "written; choose a smaller --context/--draft-chunk or another draft."
        )


def _refuse_out_of_range(report: RangeReport) -> None:
    over = report.over(RANGE_LIMIT)
    if over:
        worst = ", ".join(f"{n} ({t}) {v:,.0f}" for n, t, v in over[:5])
        raise ConversionError(
            f"float16 range probe: {len(over)} op(s) of the draft exceed {RANGE_LIMIT:,.0f} "
            f"(a quarter of float16's 65,504) on real prompts: {worst}. On the Neural Engine "
            "they would overflow or come close; nothing was written. This draft needs a graph "
            "change (e.g. scaling that op's inputs) before it can run in float16."
        )


def convert_draft(
    config: ModelConfig,
    weights: dict[str, np.ndarray],
    out: Path,
    *,
    context: int = 1024,
    chunk: int = 16,
    compress: str = "none",
    kv: str = "state",
    progress: Callable[[str], None] | None = None,
    probe_prompts: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Write the draft as a multifunction `.mlpackage` at `out`; return its description.

    `weights`: float32 numpy arrays with Hugging Face names (`lm_head.weight` absent when tied).
    Before the package is moved into place it must pass the Neural Engine lint
    (`ondevice.convert.lint`) and, given `probe_prompts` (token ids of real prompts), the float16
    range probe: no op of the reference-executed package may exceed RANGE_LIMIT on them. Either
    failure raises ConversionError and leaves nothing at `out`.
    The description (functions with their input/output/state shapes, context, chunk, kv mode,
    compression, vocabulary, deployment target) is also stored in the package's user-defined
    metadata under "ondevice.draft", where the draft engines read it.
    """
    import coremltools as ct
    from coremltools.converters.mil.mil import Program

    say = progress or (lambda _msg: None)
    out = Path(out)
    if compress not in COMPRESSIONS:
        raise OndeviceError(
            f"unknown compression {compress!r}; choose one of {', '.join(COMPRESSIONS)}."
        )
    if kv not in KV_MODES:
        raise OndeviceError(f"unknown kv mode {kv!r}; choose one of {', '.join(KV_MODES)}.")
    check_options(context, chunk)
    if out.exists():
        raise OndeviceError(f"{out} already exists; remove it or choose another path.")
    _check_config(config)

    t0 = time.perf_counter()
    say("preparing weights")
    w = _prepare_weights(config, weights)
    dims = _Dims(
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
    description = _describe(dims, context, chunk, kv, compress, config)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".draft-", dir=out.parent))
    try:
        compressed = None
        if compress != "none":
            say(f"compressing weights ({compress}; k-means takes a while for palettization)")
            compressed = _compress_weights(config, w, dims, kv, compress)
        prog = Program()
        for name, L in (("decode", 1), ("chunk", chunk)):
            say(f"building function {name} ({L} token{'s' if L > 1 else ''})")
            prog.add_function(name, _build_function(config, w, dims, L, kv, compressed))
        prog.default_function_name = "decode"
        prog.export_as_multifunction = True
        say("optimizing")
        prog = ct.convert(
            prog,
            convert_to="milinternal",
            minimum_deployment_target=ct.target.macOS15,
            compute_precision=ct.precision.FLOAT16,
            pass_pipeline=_pass_pipeline(),
        )
        _share_constants(prog)
        say("writing the package (weights shared by both functions)")
        model = ct.convert(
            prog,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.macOS15,
            pass_pipeline=ct.PassPipeline.EMPTY,
            skip_model_load=True,
        )
        model.author = "ondevice"
        model.short_description = (
            f"{config.model_type} draft for speculative decoding: decode (1 token) and chunk "
            f"({chunk} tokens) functions, context {context}, KV cache as {kv}."
        )
        model.user_defined_metadata[METADATA_KEY] = json.dumps(description)
        final = work / "draft.mlpackage"
        model.save(str(final))
        say("Neural Engine lint")
        _refuse_lint_errors(final)
        if probe_prompts:
            say(f"float16 range probe on {len(probe_prompts)} prompts (reference executor)")
            t_probe = time.perf_counter()
            report = probe_float16_range(final, probe_prompts)
            _refuse_out_of_range(report)
            description["float16_probe"] = {
                "seconds": round(time.perf_counter() - t_probe, 1),
                "tokens": report.tokens,
                "peak": report.peak,
                "limit": RANGE_LIMIT,
                "largest": [[n, t, v] for n, t, v in report.peaks[:5]],
            }
            say(f"largest float16 magnitude {report.peak:,.0f} (limit {RANGE_LIMIT:,.0f})")
        final.rename(out)
    except OndeviceError:
        raise
    except Exception as e:
        raise OndeviceError(
            f"Core ML conversion of the draft failed ({type(e).__name__}: {e}); nothing was "
            f"written to {out}."
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    description["size_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    description["conversion_seconds"] = round(time.perf_counter() - t0, 2)
    say(f"wrote {out} in {description['conversion_seconds']:.1f}s")
    return description
