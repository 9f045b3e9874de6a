"""GGUF files from llama.cpp: config, tokenizer and weights without torch or transformers.

Weights go through `mx.load`, which keeps Q4_0/Q4_1/Q8_0 tensors in MLX's own affine quantized
format (group size 32); the bits of each tensor follow from its packed shape. Before that, a small
reader of the GGUF header checks every tensor's type, so an unsupported quantization gets a clear
error naming the tensor instead of a failure deep inside `mx.load`.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ondevice.errors import ModelFormatError
from ondevice.models.config import ModelConfig
from ondevice.models.tokenizer import Tokenizer

GGML_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
}
SUPPORTED_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
GROUP_SIZE = 32  # every GGUF block format that mx.load keeps quantized uses 32-value blocks

_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}

_NAMES = {  # GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# -- header --------------------------------------------------------------------------------------


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack("<" + fmt, data)[0]


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "Q")
    return f.read(n).decode("utf-8", errors="replace")


_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == 8:
        f.seek(_read(f, "Q"), 1)
    elif vtype == 9:
        item, n = _read(f, "I"), _read(f, "Q")
        if item in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(n):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown metadata value type {vtype}")


def tensor_types(path: Path) -> dict[str, str]:
    """Name -> GGML type name of every tensor, read from the file header alone."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFormatError(f"{path}: not a GGUF file (bad magic number).")
            version = _read(f, "I")
            if version < 2:
                raise ModelFormatError(f"{path}: GGUF version {version} is too old (need 2 or 3).")
            n_tensors, n_kv = _read(f, "Q"), _read(f, "Q")
            for _ in range(n_kv):
                _read_str(f)
                _skip_value(f, _read(f, "I"))
            types = {}
            for _ in range(n_tensors):
                name = _read_str(f)
                n_dims = _read(f, "I")
                f.seek(8 * n_dims, 1)
                t = _read(f, "I")
                f.seek(8, 1)
                types[name] = GGML_TYPES.get(t, f"type {t}")
            return types
    except (EOFError, ValueError, struct.error):
        raise ModelFormatError(
            f"{path}: truncated or corrupt GGUF header; download it again."
        ) from None


# -- config and tokenizer --------------------------------------------------------------------


def _scalar(v: Any) -> Any:
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def config_from_metadata(
    meta: dict[str, Any], n_vocab: int, has_output: bool, source: str
) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ModelFormatError(
            f"{source}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(_ARCHS)}."
        )

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelFormatError(f"{source}: GGUF metadata lacks {arch}.{key}.")
        return _scalar(v)

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    d: dict[str, Any] = {
        "model_type": _ARCHS[arch],
        "vocab_size": int(_scalar(meta.get(f"{arch}.vocab_size", n_vocab))),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _scalar(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _scalar(meta.get("tokenizer.ggml.eos_token_id")),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        d["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    return ModelConfig.from_dict(d, source=source)


def tokenizer_from_metadata(meta: dict[str, Any], source: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelFormatError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens.")
    types = _scalar(meta.get("tokenizer.ggml.token_type")) or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        scores = _scalar(meta.get("tokenizer.ggml.scores")) or [0.0] * len(tokens)
        unk = int(_scalar(meta.get("tokenizer.ggml.unknown_token_id", 0)))
        tok = HFTokenizer(
            models.Unigram(
                [(t, float(s)) for t, s in zip(tokens, scores)], unk_id=unk, byte_fallback=True
            )
        )
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?!)"), "isolated")  # no splitting
    else:
        raise ModelFormatError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)."
        )
    # Control and user-defined tokens (types 3 and 4) are special: never split, skipped on request.
    specials = [t for t, ty in zip(tokens, types) if ty in (3, 4)]
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def tok_text(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(_scalar(i))] if i is not None and int(_scalar(i)) < len(tokens) else None

    eos_ids = (
        [int(_scalar(meta["tokenizer.ggml.eos_token_id"]))]
        if "tokenizer.ggml.eos_token_id" in meta
        else []
    )
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.append(int(_scalar(eot)))
    return Tokenizer(
        tok,
        eos_token_ids=eos_ids,
        bos_token=tok_text("tokenizer.ggml.bos_token_id"),
        eos_token=tok_text("tokenizer.ggml.eos_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))),
    )


# -- weights -------------------------------------------------------------------------------------


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's row permutation of Q/K (interleaved RoPE -> half-split RoPE).

    The permutation acts on output rows only, and quantization groups run along the input
    dimension, so packed weights, scales and biases are un-permuted alike.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, mx.array], Tokenizer]:
    path = Path(path)
    source = str(path)
    types = tensor_types(path)
    bad = {n: t for n, t in types.items() if t not in SUPPORTED_TYPES}
    if bad:
        name, t = next(iter(bad.items()))
        raise ModelFormatError(
            f"{source}: tensor {name!r} uses GGUF type {t}, which ondevice cannot load "
            f"(supported: {', '.join(SUPPORTED_TYPES)}; {len(bad)} tensor(s) affected). "
            "Use a Q4_0, Q4_1, Q8_0, F16 or F32 file, or the model's safetensors."
        )
    try:
        raw, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ModelFormatError(
            f"{source}: cannot read GGUF weights ({e}); the file may be truncated."
        ) from None
    n_vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    cfg = config_from_metadata(meta, n_vocab, "output.weight" in raw, source)
    arch = cfg.model_type
    weights: dict[str, mx.array] = {}
    quant: dict[str, Any] = {}
    for name, w in raw.items():
        base, _, kind = name.rpartition(".")  # kind: weight, scales, biases, bias
        if base == "token_embd":
            hf = "model.embed_tokens"
        elif base == "output_norm":
            hf = "model.norm"
        elif base == "output":
            hf = "lm_head"
        elif base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part not in _NAMES:
                continue  # e.g. rope_freqs: not used by the supported architectures
            hf = f"model.layers.{layer}.{_NAMES[part]}"
            if arch in ("llama", "mistral") and part in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
                w = _unpermute(w, heads)
        else:
            continue
        if kind == "bias" and base.startswith("blk."):
            kind = "bias"
        weights[f"{hf}.{kind}"] = w
        if kind == "scales":
            packed = raw[f"{base}.weight"]
            in_features = w.shape[-1] * GROUP_SIZE
            quant[hf] = {"group_size": GROUP_SIZE, "bits": packed.shape[-1] * 32 // in_features}
    if quant:
        common = Counter((q["group_size"], q["bits"]) for q in quant.values()).most_common(1)[0][0]
        cfg.quantization = {"group_size": common[0], "bits": common[1]}
        cfg.quantization.update(
            {p: q for p, q in quant.items() if (q["group_size"], q["bits"]) != common}
        )
    tokenizer = tokenizer_from_metadata(meta, source)
    return cfg, weights, tokenizer


def dequantize_all(weights: dict[str, mx.array], quant: dict[str, Any] | None) -> dict[str, np.ndarray]:
    """Float32 numpy copies of all weights (quantized ones expanded), for converters.

    `quant` is a config's `quantization` entry: defaults (`group_size`, `bits`) and/or per-layer
    overrides keyed by layer path. A layer is quantized when its `.scales` tensor is present."""
    quant = quant or {}
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        base, _, kind = name.rpartition(".")
        quantized = f"{base}.scales" in weights
        if quantized and kind in ("scales", "biases"):
            continue
        if quantized and kind == "weight":
            q = quant.get(base) or quant
            # float32 scales: dequantizing in float16 would round every weight (~1e-3 relative)
            scales = weights[f"{base}.scales"].astype(mx.float32)
            biases = weights[f"{base}.biases"].astype(mx.float32)
            w = mx.dequantize(w, scales, biases, q["group_size"], q["bits"])
        out[name] = np.array(w.astype(mx.float32))
    return out
