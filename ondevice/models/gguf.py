"""GGUF files from llama.cpp: config, tokenizer and weights without torch or transformers.

A small reader of the GGUF header gives the metadata and the tensor table, and checks every
tensor's type first, so an unsupported quantization gets a clear error naming the tensor. It is
kept rather than `gguf.GGUFReader` (whose type tables it uses): the library builds a numpy view
for every string of the vocabulary and merges, which on a 150k-token file costs seconds and
hundreds of MB where this reader takes a fraction of a second (docs/benchmarks.md, issue 24).
Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 load through `mx.load`, which keeps the
quantized ones in MLX's own affine format (group size 32; bits follow from the packed shape).
Other block formats, llama.cpp's K-quants above all (its default Q4_K_M download), are not read
by `mx.load` ("gguf_tensor_to_f16 failed"): those files are memory-mapped and expanded by the
`gguf` package's numpy kernels, then requantized to MLX's format or kept as floats.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ondevice.errors import ModelFormatError
from ondevice.models.config import ModelConfig
from ondevice.models.gguf_tokenizer import tokenizer_from_metadata
from ondevice.models.tokenizer import Tokenizer

# Read by `mx.load`, which keeps Q4_0/Q4_1/Q8_0 packed in MLX's own format.
MLX_NATIVE_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
# Expanded by the `gguf` package (its numpy kernels), then requantized with these bits unless
# the caller wants floats. llama.cpp's Q4_K_M files mix Q4_K, Q6_K and Q5_0/Q8_0.
REQUANT_BITS = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q8_0": 8,
    "Q4_K": 4,
    "Q5_K": 5,
    "Q6_K": 6,
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", *REQUANT_BITS)
# MLX group size for GGUF tensors: the block size of Q4_0..Q8_0 and the scale groups of Q4_K and
# Q5_K, so those requantize (almost) exactly; Q6_K's 16-value groups are approximated.
GROUP_SIZE = 32

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


# struct formats of GGUF's scalar value types (strings and arrays are read by _read_value)
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


def _type_name(t: int) -> str:
    """The GGML type name ("Q4_K") of a tensor type code, or "type N" for one gguf-py lacks."""
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name ("Q4_K")
    shape: tuple[int, ...]  # numpy order (GGUF stores dimensions fastest-first)
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == GGUFValueType.STRING:
        return _read_str(f)
    if vtype == GGUFValueType.ARRAY:
        item, n = _read(f, "I"), _read(f, "Q")
        if item in _SCALARS:
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt) * n
            data = f.read(size)
            if len(data) != size:
                raise EOFError
            return list(struct.unpack(f"<{n}{fmt}", data))
        return [_read_value(f, item) for _ in range(n)]
    raise ValueError(f"unknown metadata value type {vtype}")


def _tensor_nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor's data: whole blocks along the fastest dimension."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    except KeyError:
        return 0  # a type we cannot size is refused by name before anything reads its data
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows * (shape[-1] // block) * size


def read_header(path: Path) -> Header:
    """Metadata and tensor table of a GGUF file (its data is not read)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFormatError(f"{path}: not a GGUF file (bad magic number).")
            version = _read(f, "I")
            if version < 2:
                raise ModelFormatError(f"{path}: GGUF version {version} is too old (need 2 or 3).")
            n_tensors, n_kv = _read(f, "Q"), _read(f, "Q")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _read_str(f)
                meta[key] = _read_value(f, _read(f, "I"))
            tensors = []
            for _ in range(n_tensors):
                name = _read_str(f)
                n_dims = _read(f, "I")
                dims = [_read(f, "Q") for _ in range(n_dims)]
                t = _read(f, "I")
                offset = _read(f, "Q")
                type_name = _type_name(t)
                shape = tuple(reversed(dims))
                tensors.append(
                    TensorInfo(name, type_name, shape, offset, _tensor_nbytes(type_name, shape))
                )
            align = int(meta.get("general.alignment", 32))
            data_start = -(-f.tell() // align) * align
            return Header(version, meta, tensors, data_start)
    except (EOFError, ValueError, struct.error, UnicodeDecodeError):
        raise ModelFormatError(
            f"{path}: truncated or corrupt GGUF header; download it again."
        ) from None


def tensor_types(path: Path) -> dict[str, str]:
    """Name -> GGML type name of every tensor, read from the file header alone."""
    return {t.name: t.type for t in read_header(path).tensors}


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


# -- weights -------------------------------------------------------------------------------------


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's row permutation of Q/K (interleaved RoPE -> half-split RoPE).

    The permutation acts on output rows only, and quantization groups run along the input
    dimension, so packed weights, scales and biases are un-permuted alike.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(base: str) -> str | None:
    """The Hugging Face module path of a GGUF tensor base name (None: not used by the model)."""
    if base == "token_embd":
        return "model.embed_tokens"
    if base == "output_norm":
        return "model.norm"
    if base == "output":
        return "lm_head"
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _NAMES:
            return f"model.layers.{layer}.{_NAMES[part]}"
    return None  # e.g. rope_freqs: not used by the supported architectures


def _needs_unpermute(arch: str, base: str) -> str | None:
    """Which projection ("q" or "k") llama.cpp stored with rows permuted for interleaved RoPE,
    or None. stored this tensor's rows permuted for interleaved RoPE."""
    if arch in ("llama", "mistral") and base.startswith("blk."):
        part = base.split(".", 2)[2]
        return {"attn_q": "q", "attn_k": "k"}.get(part)
    return None


def load_gguf(
    path: str | Path, *, dequantize: bool = False, product_dtype: str | None = None
) -> tuple[ModelConfig, dict[str, mx.array], Tokenizer]:
    """Config, weights (Hugging Face names) and tokenizer of a llama.cpp GGUF file.

    Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 go through `mx.load`, which keeps the
    quantized ones in MLX's own format. Files with other block formats (llama.cpp's K-quants,
    Q5_0, ...) are dequantized by the `gguf` package; `dequantize=True` keeps those floats
    exactly, otherwise they are requantized to MLX's affine format (same bits, groups of 32) so
    the weights stay small where MLX runs quantized (Apple GPUs, bundles on disk).
    product_dtype: the dtype of the expanded linear weights and embedding (the CPU kernel's
    bfloat16, `weights.is_product_weight`), rounded one tensor at a time.
    """
    path = Path(path)
    source = str(path)
    header = read_header(path)
    bad = {t.name: t.type for t in header.tensors if t.type not in SUPPORTED_TYPES}
    if bad:
        name, t = next(iter(bad.items()))
        raise ModelFormatError(
            f"{source}: tensor {name!r} uses GGUF type {t}, which ondevice cannot load "
            f"(supported: {', '.join(SUPPORTED_TYPES)}; {len(bad)} tensor(s) affected). "
            "Use a file in one of those types (llama.cpp's Q4_K_M, Q8_0 or F16 downloads "
            "work), or the model's safetensors."
        )
    meta = header.metadata
    names = {t.name for t in header.tensors}
    n_vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    cfg = config_from_metadata(meta, n_vocab, "output.weight" in names, source)
    if all(t.type in MLX_NATIVE_TYPES for t in header.tensors):
        weights, quant = _load_native(path, cfg)
    else:
        weights, quant = _load_dequantized(
            path, header, cfg, requantize=not dequantize, product_dtype=product_dtype
        )
    if quant:
        common = Counter((q["group_size"], q["bits"]) for q in quant.values()).most_common(1)[0][0]
        cfg.quantization = {"group_size": common[0], "bits": common[1]}
        cfg.quantization.update(
            {p: q for p, q in quant.items() if (q["group_size"], q["bits"]) != common}
        )
    tokenizer = tokenizer_from_metadata(meta, source)
    return cfg, weights, tokenizer


def _heads(cfg: ModelConfig, which: str) -> int:
    return cfg.num_attention_heads if which == "q" else cfg.num_key_value_heads


def _load_native(
    path: Path, cfg: ModelConfig
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    """Every tensor through `mx.load`: quantized ones stay packed (bits from the packed shape)."""
    try:
        raw = mx.load(str(path))
    except Exception as e:
        raise ModelFormatError(
            f"{path}: cannot read GGUF weights ({e}); the file may be truncated."
        ) from None
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}
    for name, w in raw.items():
        base, _, kind = name.rpartition(".")  # kind: weight, scales, biases, bias
        hf = _hf_name(base)
        if hf is None:
            continue
        which = _needs_unpermute(cfg.model_type, base)
        if which:
            w = _unpermute(w, _heads(cfg, which))
        weights[f"{hf}.{kind}"] = w
        if kind == "scales":
            packed = raw[f"{base}.weight"]
            in_features = w.shape[-1] * GROUP_SIZE
            quant[hf] = {"group_size": GROUP_SIZE, "bits": packed.shape[-1] * 32 // in_features}
    return weights, quant


def _load_dequantized(
    path: Path, header: Header, cfg: ModelConfig, requantize: bool, product_dtype: str | None
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    """Every tensor read from a memory map and expanded by `gguf`'s numpy kernels (two threads:
    numpy releases the GIL in them), then optionally requantized to MLX's format."""
    from concurrent.futures import ThreadPoolExecutor

    from gguf.quants import dequantize as gguf_dequantize

    from ondevice.models.weights import (
        DTYPES,
        EXPAND_BYTES,
        is_product_weight,
        quantized_entries,
    )

    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: cannot map the GGUF file ({e}).") from None
    end = max((t.offset + t.nbytes for t in header.tensors), default=0)
    if header.data_start + end > data.size:
        raise ModelFormatError(
            f"{path}: the file ends {header.data_start + end - data.size} bytes early; it is "
            "truncated. Download it again."
        )

    def expand(t: TensorInfo) -> np.ndarray:  # numpy only: runs in the pool's threads
        raw = data[header.data_start + t.offset : header.data_start + t.offset + t.nbytes]
        if t.type == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        if t.type in ("F32", "F16"):
            return raw.view(np.float32 if t.type == "F32" else np.float16).reshape(t.shape)
        qtype = GGMLQuantizationType[t.type]
        blocks = raw.reshape(*t.shape[:-1], -1)
        if len(t.shape) != 2:
            return gguf_dequantize(blocks, qtype).reshape(t.shape)
        # a few rows at a time: `gguf`'s numpy kernels take several times their output in
        # temporaries (rows are independent, so the pieces are exact)
        out = np.empty(t.shape, np.float32)
        step = max(1, EXPAND_BYTES // (4 * t.shape[1]))
        for i in range(0, t.shape[0], step):
            out[i : i + step] = gguf_dequantize(blocks[i : i + step], qtype)
        return out

    used = [(t, hf) for t in header.tensors if (hf := _hf_name(t.name.rpartition(".")[0]))]
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        # A short window of tensors in flight bounds memory to a few expanded tensors.
        window = [pool.submit(expand, t) for t, _ in used[:3]]
        for i, (t, hf) in enumerate(used):
            if i + 3 < len(used):
                window.append(pool.submit(expand, used[i + 3][0]))
            w = mx.array(window.pop(0).result())
            base, _, kind = t.name.rpartition(".")
            which = _needs_unpermute(cfg.model_type, base)
            if which:
                w = _unpermute(w, _heads(cfg, which))
            bits = REQUANT_BITS.get(t.type)
            if requantize and bits is not None and w.ndim == 2:
                weights.update(quantized_entries(hf, w, GROUP_SIZE, bits))
                quant[hf] = {"group_size": GROUP_SIZE, "bits": bits}
            elif product_dtype and is_product_weight(f"{hf}.{kind}"):
                weights[f"{hf}.{kind}"] = w.astype(DTYPES[product_dtype])
            else:
                weights[f"{hf}.{kind}"] = w
            mx.eval(weights)  # let go of the numpy copy before the next tensor
    return weights, quant


def dequantize_all(
    weights: dict[str, mx.array], quant: dict[str, Any] | None
) -> dict[str, np.ndarray]:
    """Float32 numpy copies of all weights (quantized ones expanded), for converters."""
    from ondevice.models.weights import expand_quantized

    return {k: np.array(v) for k, v in expand_quantized(weights, quant).items()}
