"""Models: configs, the MLX transformer, KV cache, weights, tokenizers, name resolution."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ondevice.errors import ModelFormatError
from ondevice.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from ondevice.models.tokenizer import Tokenizer
from ondevice.sources.hub import resolve

if TYPE_CHECKING:
    from ondevice.models.transformer import Model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LoadedModel",
    "Model",
    "ModelConfig",
    "Tokenizer",
    "load_model",
]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """`Model` on first use: it imports MLX, which `ondevice doctor` and the sizes, hub and
    config helpers must not need (an x86_64 Python on an Apple Silicon Mac has no MLX)."""
    if name == "Model":
        from ondevice.models.transformer import Model

        return Model
    raise AttributeError(f"module 'ondevice.models' has no attribute {name!r}")


@dataclass
class LoadedModel:
    model: Model
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path


def load_model(
    name: str | Path,
    *,
    dtype: str | None = None,
    quantize: int | None = None,
    dequantize: bool = False,
    product_dtype: str | None = None,
) -> LoadedModel:
    """Load a model from a local HF folder, a GGUF file, a cached name or a hub id.

    dequantize: expand quantized weights (GGUF Q4/Q8, MLX-quantized folders) to float32.
    product_dtype: with `dequantize`, the dtype of the linear layers' weights and the embedding
    instead (the CPU kernel's `bfloat16`), rounded tensor by tensor as they are read.
    """
    from ondevice.models.weights import build_model, read_safetensors_dir

    path = resolve(name)
    options = {
        "dtype": dtype,
        "quantize": quantize,
        "dequantize": dequantize,
        "product_dtype": product_dtype,
        "source": str(path),
    }
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFormatError(f"{path}: expected a .gguf file or a model folder.")
        from ondevice.models.gguf import load_gguf

        cfg, weights, tok = load_gguf(
            path, dequantize=dequantize, product_dtype=product_dtype if dequantize else None
        )
        model = build_model(cfg, weights, **options)
        return LoadedModel(model, cfg, tok, path)
    if not (path / "config.json").exists():
        raise ModelFormatError(
            f"{path}: no config.json. A model folder needs config.json, *.safetensors and "
            "tokenizer.json (a Hugging Face checkpoint), or pass a .gguf file."
        )
    cfg = ModelConfig.from_file(path / "config.json")
    _check_extra_fields(path / "config.json", cfg)
    model = build_model(cfg, read_safetensors_dir(path), **options)
    tok = Tokenizer.from_dir(path, eos_token_ids=cfg.eos_token_id)
    return LoadedModel(model, cfg, tok, path)


def _check_extra_fields(path: Path, cfg: ModelConfig) -> None:
    """Reject config features the transformer does not implement, rather than misbehave."""
    raw = json.loads(path.read_text())
    if raw.get("mlp_bias"):
        raise ModelFormatError(f"{path}: mlp_bias=true is not supported.")
    if (
        cfg.model_type == "mistral"
        and raw.get("sliding_window") not in (None, 0)
        and raw.get("sliding_window", 0) < raw.get("max_position_embeddings", 0)
    ):
        # Sliding-window attention only differs beyond the window; we cap the context there.
        cfg.max_position_embeddings = min(cfg.max_position_embeddings, int(raw["sliding_window"]))
