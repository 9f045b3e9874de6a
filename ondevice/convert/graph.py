"""The draft's MIL function for one sequence length, written op by op with coremltools' Builder.

What the graph does and why (BC1S layout, 1x1 convs, the pre-scaled RMSNorm, RoPE and mask
tables, the KV cache as states or as inputs) is in `ondevice.convert.coreml`'s docstring. Each
piece is a function of a `_Graph`, the context of the function being built; ops are created in
a fixed order, so the same weights always give the same program.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ondevice.convert.layout import Dims
from ondevice.models.config import ModelConfig

MASK_VALUE = -1e4  # additive mask; as in ml-ane-transformers, finite so fp16 never sees inf - inf


def cname(key: str) -> str:
    """Const names: stable, readable, and usable as keys of the compression config."""
    return "w_" + key.replace(".", "_")


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


def _i32(v) -> np.ndarray:
    return np.array(v, dtype=np.int32)


@dataclass
class _Graph:
    """The function being built: its weights, dimensions and sequence length L."""

    mb: Any  # coremltools.converters.mil.Builder
    config: ModelConfig
    w: dict[str, np.ndarray]
    dims: Dims
    L: int
    kv: str
    compressed: dict[str, tuple[str, dict[str, Any]]]
    weights: dict[str, Any] = field(default_factory=dict)  # weight key -> its (one) var


@dataclass
class _Cache:
    """The KV cache while layers are added: the chain of writes to each cache (a state's
    `read_state` and `coreml_update_state` outputs, or the io inputs), where this call's rows
    begin, and (kv="io") the new rows each layer wrote."""

    key_cache: Any
    value_cache: Any
    k_chain: Any
    v_chain: Any
    begin: Any
    new_keys: list = field(default_factory=list)
    new_values: list = field(default_factory=list)


def _weight(g: _Graph, key: str):
    """The weight's var, made once per function: every op reading it (a tied embedding's
    lookup and the LM head) reads the same constant, so the package stores it once."""
    if key not in g.weights:
        name = cname(key)
        if name in g.compressed:
            op_type, inputs = g.compressed[name]
            g.weights[key] = getattr(g.mb, op_type)(**inputs, name=name)
        else:
            g.weights[key] = g.mb.const(val=g.w[key], name=name)
    return g.weights[key]


def _embedding(g: _Graph, input_ids):
    """The rows of `input_ids` in the embedding, as (1, D, 1, L).

    An untied model gathers from its `embed` table (V, D). A tied one has no table of its own:
    it gathers from the LM head's pieces `lm_head_j` ((n_j, D, 1, 1) conv kernels, rows
    [s_j, s_j + n_j) of the embedding) and `embed_tail`, each with the ids clamped into the
    piece, and keeps each position's row from the last piece starting at or below its id. Gathers
    and selects copy values, so the rows are exactly the table's.
    """
    mb, d, L = g.mb, g.dims, g.L
    if "embed" in g.w:
        rows = mb.gather(x=_weight(g, "embed"), indices=input_ids, axis=0)  # (1, L, D)
        return mb.expand_dims(x=mb.transpose(x=rows, perm=_i32([0, 2, 1])), axes=[2])
    pieces = [f"lm_head_{j}" for j in range(len(d.vocab_splits))]
    pieces += ["embed_tail"] if "embed_tail" in g.w else []
    ids = mb.reshape(x=input_ids, shape=_i32([L]))
    ids_rows = mb.reshape(x=input_ids, shape=_i32([L, 1, 1, 1]))  # broadcasts over a row
    rows, start = None, 0
    for key in pieces:
        n = g.w[key].shape[0]
        local = ids
        if len(pieces) > 1:  # clamp into [0, n): other pieces' ids read a row the selects drop
            local = mb.minimum(
                x=mb.maximum(x=mb.sub(x=ids, y=_i32(start)), y=_i32(0)), y=_i32(n - 1)
            )
        piece_rows = mb.gather(x=_weight(g, key), indices=local, axis=0)  # (L, D, 1, 1)
        if rows is None:
            rows = piece_rows
        else:
            here = mb.greater_equal(x=ids_rows, y=_i32(start))
            rows = mb.select(cond=here, a=piece_rows, b=rows)
        start += n
    return mb.transpose(x=rows, perm=_i32([2, 1, 3, 0]))  # (1, D, 1, L)


def _conv(g: _Graph, x, weight_key: str, bias_key: str | None = None):
    kwargs: dict[str, Any] = {}
    if bias_key is not None:
        kwargs["bias"] = g.mb.const(val=g.w[bias_key], name=cname(bias_key))
    return g.mb.conv(x=x, weight=_weight(g, weight_key), **kwargs)


def _rms_norm(g: _Graph, x, weight: np.ndarray, axis: int, name: str):
    # ANEMLL: layer_norm of [x, -x] is x / rms(x); no pow. Rows are first scaled to
    # max |x| <= 1 so layer_norm's float16 squares cannot overflow (coreml's docstring).
    mb = g.mb
    n = weight.shape[0]
    both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=axis)
    peak = mb.reduce_max(x=both, axes=[axis], keep_dims=True)  # max |x| of each row
    scaled = mb.real_div(x=both, y=mb.maximum(x=peak, y=np.float16(1.0)))
    gamma = np.concatenate([weight, weight]).astype(np.float16)
    normed = mb.layer_norm(
        x=scaled, axes=[axis], gamma=gamma, epsilon=np.float16(g.dims.eps), name=name
    )
    return mb.split(x=normed, split_sizes=[n, n], axis=axis)[0]


def _heads_last(g: _Graph, x, n: int):
    """(1, n*hd, 1, L) -> (1, n, L, hd)."""
    x = g.mb.reshape(x=x, shape=_i32([1, n, g.dims.head_dim, g.L]))
    return g.mb.transpose(x=x, perm=_i32([0, 1, 3, 2]))


def _rope(g: _Graph, x, cos, sin):
    mb = g.mb
    x1, x2 = mb.split(x=x, num_splits=2, axis=-1)
    rotated = mb.concat(values=[mb.mul(x=x2, y=np.float16(-1.0)), x1], axis=-1)
    return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))


def _pad_head(g: _Graph, x):
    d = g.dims
    if d.state_head_dim == d.head_dim:
        return x
    zeros = np.zeros((1, d.kv_heads, g.L, d.state_head_dim - d.head_dim), dtype=np.float16)
    return g.mb.concat(values=[x, zeros], axis=-1)


def _write_and_read_cache(g: _Graph, cache: _Cache, i: int, k, v):
    """Write layer i's new rows at [i, :, p:p+L, :] and read the layer's keys and values back."""
    mb, d, L = g.mb, g.dims, g.L
    begin = cache.begin if i == 0 else mb.add(x=cache.begin, y=_i32([i, 0, 0, 0]))
    end = mb.add(x=cache.begin, y=_i32([i + 1, d.kv_heads, L, d.state_head_dim]))
    k_new, v_new = _pad_head(g, k), _pad_head(g, v)
    # Each update directly follows its write: coremltools' canonicalize_inplace_pattern
    # pass expects that order (interleaving the K and V writes trips it up).
    cache.k_chain = mb.slice_update(x=cache.k_chain, update=k_new, begin=begin, end=end)
    if g.kv == "state":
        cache.k_chain = mb.coreml_update_state(state=cache.key_cache, value=cache.k_chain)
    cache.v_chain = mb.slice_update(x=cache.v_chain, update=v_new, begin=begin, end=end)
    if g.kv == "state":
        cache.v_chain = mb.coreml_update_state(state=cache.value_cache, value=cache.v_chain)
    else:
        cache.new_keys.append(k_new)
        cache.new_values.append(v_new)
    layer_begin, layer_end = _i32([i, 0, 0, 0]), _i32([i + 1, d.kv_heads, d.state_len, d.head_dim])
    squeeze = [True, False, False, False]
    keys = mb.slice_by_index(
        x=cache.k_chain, begin=layer_begin, end=layer_end, squeeze_mask=squeeze
    )
    values = mb.slice_by_index(
        x=cache.v_chain, begin=layer_begin, end=layer_end, squeeze_mask=squeeze
    )
    return keys, values


def _attention(g: _Graph, i: int, x, cos, sin, mask, cache: _Cache):
    """Layer i's attention block; returns the residual stream after it."""
    mb, d, L, p = g.mb, g.dims, g.L, f"l{i}"
    H, KV, hd = d.heads, d.kv_heads, d.head_dim
    G = H // KV
    h = _rms_norm(g, x, g.w[f"{p}.in_norm"], 1, f"{p}_input_norm")
    bias = g.config.attention_bias
    q = _conv(g, h, f"{p}.q", f"{p}.bq" if bias else None)
    k = _conv(g, h, f"{p}.k", f"{p}.bk" if bias else None)
    v = _conv(g, h, f"{p}.v", f"{p}.bv" if bias else None)
    q, k, v = _heads_last(g, q, H), _heads_last(g, k, KV), _heads_last(g, v, KV)
    if g.config.qk_norm:
        q = _rms_norm(g, q, g.w[f"{p}.q_norm"], 3, f"{p}_q_norm")
        k = _rms_norm(g, k, g.w[f"{p}.k_norm"], 3, f"{p}_k_norm")
    q, k = _rope(g, q, cos, sin), _rope(g, k, cos, sin)
    keys, values = _write_and_read_cache(g, cache, i, k, v)

    # Grouped-query attention: the G query heads of a KV head become G*L query rows.
    qg = mb.reshape(x=q, shape=_i32([KV, G * L, hd]))
    scores = mb.matmul(x=qg, y=keys, transpose_y=True)  # (KV, G*L, S)
    probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
    attn = mb.matmul(x=probs, y=values)  # (KV, G*L, hd)
    attn = mb.transpose(x=mb.reshape(x=attn, shape=_i32([1, H, L, hd])), perm=_i32([0, 1, 3, 2]))
    attn = mb.reshape(x=attn, shape=_i32([1, H * hd, 1, L]))
    return mb.add(x=x, y=_conv(g, attn, f"{p}.o"), name=f"{p}_attention_residual")


def _mlp(g: _Graph, i: int, x):
    """Layer i's MLP block; returns the residual stream after it."""
    mb, p = g.mb, f"l{i}"
    h = _rms_norm(g, x, g.w[f"{p}.post_norm"], 1, f"{p}_post_attention_norm")
    gate = mb.silu(x=_conv(g, h, f"{p}.gate"))
    act = mb.mul(x=gate, y=_conv(g, h, f"{p}.up"), name=f"{p}_mlp_activation")
    return mb.add(x=x, y=_conv(g, act, f"{p}.down"), name=f"{p}_mlp_residual")


def _body(g: _Graph, tables: tuple[np.ndarray, np.ndarray], inputs: tuple) -> tuple:
    """The function's ops, from its inputs to its outputs."""
    mb, d, L = g.mb, g.dims, g.L
    input_ids, position, key_cache, value_cache = inputs
    zero = _i32([0])
    # Position-dependent slices of constant tables: RoPE rows p..p+L-1 and the mask.
    rope_begin = mb.concat(values=[position, zero], axis=0)
    cos_t, sin_t = tables
    cos = mb.slice_by_size(x=cos_t, begin=rope_begin, size=_i32([L, d.head_dim]), name="rope_cos")
    sin = mb.slice_by_size(x=sin_t, begin=rope_begin, size=_i32([L, d.head_dim]), name="rope_sin")
    mask_col = mb.sub(x=_i32([d.state_len - 1]), y=position)
    G = d.heads // d.kv_heads
    mask = mb.slice_by_size(
        x=_mask_table(L, G, d.state_len),
        begin=mb.concat(values=[zero, mask_col], axis=0),
        size=_i32([G * L, d.state_len]),
        name="causal_mask",
    )
    cache_begin = mb.concat(values=[_i32([0, 0]), position, zero], axis=0)
    if g.kv == "state":
        k_chain = mb.read_state(input=key_cache, name="read_key_cache")
        v_chain = mb.read_state(input=value_cache, name="read_value_cache")
    else:
        k_chain, v_chain = key_cache, value_cache
    cache = _Cache(key_cache, value_cache, k_chain, v_chain, cache_begin)

    x = _embedding(g, input_ids)  # (1, D, 1, L)
    for i in range(d.layers):
        x = _attention(g, i, x, cos, sin, mask, cache)
        x = _mlp(g, i, x)
    return _outputs(g, x, cache)


def _outputs(g: _Graph, x, cache: _Cache) -> tuple:
    """Final norm and the LM head's pieces (`logits_j`); with kv="io" also the new rows."""
    mb, L = g.mb, g.L
    h = _rms_norm(g, x, g.w["norm"], 1, "final_norm")
    outputs = []
    for j, n in enumerate(g.dims.vocab_splits):
        logits = _conv(g, h, f"lm_head_{j}")  # (1, n, 1, L)
        logits = mb.reshape(x=logits, shape=_i32([1, n, L]))
        outputs.append(mb.transpose(x=logits, perm=_i32([0, 2, 1]), name=f"logits_{j}"))
    if g.kv == "io":
        outputs.append(mb.concat(values=cache.new_keys, axis=0, name="new_keys"))
        outputs.append(mb.concat(values=cache.new_values, axis=0, name="new_values"))
    return tuple(outputs)


def build_function(
    config: ModelConfig,
    w: dict[str, np.ndarray],
    dims: Dims,
    L: int,
    kv: str,
    compressed: dict[str, tuple[str, dict[str, Any]]] | None = None,
):
    """The MIL function for sequence length L.

    `compressed` maps weight const names to the constexpr op (type and constant inputs) that
    replaces them, as computed once by `ondevice.convert.compression.compress_weights`.
    """
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    g = _Graph(mb, config, w, dims, L, kv, compressed or {})
    cache_shape = (dims.layers, dims.kv_heads, dims.state_len, dims.state_head_dim)
    tables = _rope_tables(config, dims.state_len)
    specs = [
        mb.TensorSpec((1, L), dtype=types.int32),
        mb.TensorSpec((1,), dtype=types.int32),
    ]
    spec_type = mb.StateTensorSpec if kv == "state" else mb.TensorSpec
    specs += [spec_type(cache_shape, dtype=types.fp16) for _ in range(2)]  # one object each

    @mb.function(input_specs=specs, opset_version=ct.target.iOS18)
    def function(input_ids, position, key_cache, value_cache):
        return _body(g, tables, (input_ids, position, key_cache, value_cache))

    return function


def convert_program(prog, convert_to: str, pass_pipeline, **options: Any):
    """coremltools' converter on a program built here, for macOS 15 (states and multifunction
    programs need it): "milinternal" runs `pass_pipeline` on it, "mlprogram" makes the model to
    save."""
    import coremltools as ct

    return ct.convert(
        prog,
        convert_to=convert_to,
        minimum_deployment_target=ct.target.macOS15,
        pass_pipeline=pass_pipeline,
        **options,
    )
