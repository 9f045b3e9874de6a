"""Weights: read safetensors (sharded or not), build a model from them, quantize, save.

The saved layout (config.json + model.safetensors with Hugging Face names, MLX quantization
recorded in config.json the way mlx_lm does) is read by `mlx_lm.load` as well.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ondevice.errors import ModelFormatError
from ondevice.models.config import ModelConfig
from ondevice.models.transformer import Model

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Quantized matrices are expanded this many bytes of float32 rows at a time: MLX's CPU
# dequantize needs several times its output in temporaries (a whole 151,936-row embedding at
# once would briefly take gigabytes); rows are independent, so the pieces are exact.
EXPAND_BYTES = 64 << 20


def is_product_weight(name: str) -> bool:
    """Whether the CPU kernel keeps the tensor `name` in its own dtype: a linear layer's weight
    (the head's included) or the embedding, whose rows it looks up and widens to float32 (and
    multiplies activations by, where the head is tied to it)."""
    return name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))


def read_safetensors_dir(path: Path) -> dict[str, mx.array]:
    """All tensors of a Hugging Face directory, following `model.safetensors.index.json`."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelFormatError(f"{index}: not a valid safetensors index ({e}).") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(
            f"{path}: no *.safetensors weight files. Download the model's weights into this folder."
        )
    weights: dict[str, mx.array] = {}
    for f in files:
        if not f.exists():
            raise ModelFormatError(
                f"{f}: weight file listed in {index.name} is missing; download it again."
            )
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise ModelFormatError(
                f"{f}: cannot read weight file ({e}); it is probably truncated or corrupt. "
                "Download it again."
            ) from None
    return weights


def _quant_params(cfg: ModelConfig, path: str) -> dict[str, int] | None:
    q = cfg.quantization
    if not q:
        return None
    if path in q:
        p = q[path]
        return None if p is False else {"group_size": p["group_size"], "bits": p["bits"]}
    if "bits" in q:
        return {"group_size": q["group_size"], "bits": q["bits"]}
    return None


def quantized_entries(base: str, w: mx.array, group_size: int, bits: int) -> dict[str, mx.array]:
    """`w` in MLX's group-wise affine format as a weights file stores it: `{base}.weight`
    (packed), `{base}.scales` and `{base}.biases` (float16), what `expand_quantized` reads."""
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return {
        f"{base}.weight": q,
        f"{base}.scales": scales.astype(mx.float16),
        f"{base}.biases": biases.astype(mx.float16),
    }


def expand_quantized(
    weights: dict[str, mx.array],
    quant: dict[str, Any] | None,
    product_dtype: mx.Dtype | None = None,
    release: bool = False,
) -> dict[str, mx.array]:
    """All weights in float32, quantized layers expanded by MLX's own kernels, evaluated one
    tensor at a time (no lazy graph over the whole model, no numpy round trip).

    `quant` is a config's `quantization` entry: defaults (`group_size`, `bits`) and/or per-layer
    overrides keyed by layer path. A layer is quantized when its `.scales` tensor is present.
    product_dtype: the dtype of the linear weights and the embedding (`is_product_weight`),
    rounded from float32 one tensor at a time, so that a float32 copy of the whole model never
    exists (the CPU kernel's bfloat16). release: take each tensor out of `weights` once
    expanded, so that a lazily read file (`mx.load`) is never resident whole beside its
    expansion (the caller's dict is consumed)."""
    quant = quant or {}
    out: dict[str, mx.array] = {}
    for name in list(weights):
        if name not in weights:  # a released layer's scales or biases
            continue
        w = weights[name]
        base, _, kind = name.rpartition(".")
        quantized = f"{base}.scales" in weights
        if quantized and kind in ("scales", "biases"):
            continue
        if quantized and kind == "weight":
            q = quant.get(base) or quant
            # float32 scales: dequantizing in float16 would round every weight (~1e-3 relative)
            scales = weights[f"{base}.scales"].astype(mx.float32)
            biases = weights[f"{base}.biases"].astype(mx.float32)
            step = max(1, min(w.shape[0], EXPAND_BYTES // (4 * scales.shape[-1] * q["group_size"])))
            parts = []
            for i in range(0, w.shape[0], step):
                part = mx.dequantize(
                    w[i : i + step],
                    scales[i : i + step],
                    biases[i : i + step],
                    q["group_size"],
                    q["bits"],
                )
                parts.append(_rounded(name, part, product_dtype))
                mx.eval(parts[-1])
            w = parts[0] if len(parts) == 1 else mx.concatenate(parts)
            del parts
        out[name] = _rounded(name, w, product_dtype)
        mx.eval(out[name])
        if release:
            del w
            expanded = quantized and kind == "weight"
            for part in (name, f"{base}.scales", f"{base}.biases") if expanded else (name,):
                weights.pop(part, None)
    return out


def _rounded(name: str, w: mx.array, product_dtype: mx.Dtype | None) -> mx.array:
    w = w.astype(mx.float32)
    return w.astype(product_dtype) if product_dtype and is_product_weight(name) else w


def build_model(
    cfg: ModelConfig,
    weights: dict[str, mx.array],
    *,
    dtype: str | None = None,
    quantize: int | None = None,
    dequantize: bool = False,
    product_dtype: str | None = None,
    source: str = "weights",
) -> Model:
    """A model with `weights` loaded, checked tensor by tensor against the config.

    dequantize: expand quantized layers to float (float32 unless `dtype` says otherwise).
    product_dtype: with `dequantize`, the dtype of the linear weights and the embedding
    (`is_product_weight`; the CPU kernel's bfloat16), converted tensor by tensor; tensors
    already in it (a GGUF file's, `load_gguf`) stay so.
    """
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    keep = DTYPES[product_dtype] if product_dtype and dequantize else None

    def kept(name: str, w: mx.array) -> bool:  # a float32 (or already rounded) product weight
        return keep is not None and w.dtype in (mx.float32, keep) and is_product_weight(name)

    if dequantize and cfg.quantization:
        # `weights` is this function's own dict (filtered above): let each tensor go as expanded
        weights = expand_quantized(weights, cfg.quantization, keep, release=True)
        cfg.quantization = None
        dtype = dtype or "float32"
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    model = Model(cfg)
    if cfg.quantization:
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                (hasattr(m, "to_quantized") and f"{p}.scales" in weights and _quant_params(cfg, p))
                or False
            ),
        )
    _check_tensors(model, weights, source)
    target = DTYPES[dtype] if dtype else None
    if target is None:
        target = _compute_dtype(
            cfg,
            [
                v.dtype
                for k, v in weights.items()
                if not k.endswith(("scales", "biases")) and not (kept(k, v) and v.dtype == keep)
            ],
        )
    model.load_weights(
        [
            (
                k,
                v.astype(keep)
                if kept(k, v)
                else v.astype(target)
                if mx.issubdtype(v.dtype, mx.floating)
                else v,
            )
            for k, v in weights.items()
        ]
    )
    if quantize:
        _quantize(model, cfg, quantize)
    mx.eval(model.parameters())
    return model


def _check_tensors(model: Model, weights: dict[str, mx.array], source: str) -> None:
    """Every tensor the model expects is in `weights`, with its shape, and nothing else is."""
    expected = dict(tree_flatten(model.parameters()))
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ModelFormatError(
            f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
            "the weights do not belong to this config.json."
        )
    unexpected = [k for k in weights if k not in expected]
    if unexpected:
        raise ModelFormatError(
            f"{source}: unexpected tensor {unexpected[0]!r}; the weights do not belong to this "
            "config.json (check model_type and num_hidden_layers)."
        )
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise ModelFormatError(
                f"{source}: tensor {k!r} has shape {tuple(weights[k].shape)} but config.json "
                f"implies {tuple(v.shape)}."
            )


def _compute_dtype(cfg: ModelConfig, dtypes: list[mx.Dtype]) -> mx.Dtype:
    """The float dtype the model computes in when none is asked for: the commonest of its float
    tensors' `dtypes` (scales, biases and kept product weights left out by the caller)."""
    floats = [d for d in dtypes if mx.issubdtype(d, mx.floating)]
    target = Counter(floats).most_common(1)[0][0] if floats else mx.float16
    if target == mx.float32 and cfg.quantization and mx.default_device() != mx.cpu:
        # a quantized model whose float tensors are float32 (a GGUF file's norms): on the
        # GPU compute in float16 like mlx-lm's quantized models, not at twice the traffic
        target = mx.float16
    return target


def _quantize(model: Model, cfg: ModelConfig, bits: int) -> None:
    """Quantize the model's linear and embedding layers to `bits` (4 or 8) in place."""
    if bits not in (4, 8):
        raise ValueError("quantize must be 4 or 8 bits")
    group = 64 if cfg.hidden_size % 64 == 0 else 32
    nn.quantize(
        model,
        group_size=group,
        bits=bits,
        class_predicate=lambda p, m: (
            isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % group == 0
        ),
    )
    cfg.quantization = {"group_size": group, "bits": bits}


def quantization_config(model: Model) -> dict[str, Any] | None:
    """mlx_lm-style `quantization` entry: the commonest setting plus per-layer overrides."""
    layers = {
        p: {"group_size": m.group_size, "bits": m.bits}
        for p, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    if not layers:
        return None
    common = Counter((v["group_size"], v["bits"]) for v in layers.values()).most_common(1)[0][0]
    q: dict[str, Any] = {"group_size": common[0], "bits": common[1]}
    for p, v in layers.items():
        if (v["group_size"], v["bits"]) != common:
            q[p] = v
    # Layers left in float must say so explicitly, or mlx_lm would quantize them.
    for p, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and p not in layers:
            q[p] = False
    return q


def save_model(
    model: Model, path: str | Path, parameters: dict[str, mx.array] | None = None
) -> None:
    """Write config.json and model.safetensors (HF names), readable by ondevice and mlx_lm.
    parameters: the tensors to write (default: the model's own)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    cfg.quantization = quantization_config(model)
    d = cfg.to_hf_dict()
    (path / "config.json").write_text(json.dumps(d, indent=1))
    mx.save_safetensors(
        str(path / "model.safetensors"),
        parameters if parameters is not None else dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
