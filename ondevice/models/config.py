"""One configuration dataclass for every supported checkpoint (HF config.json or GGUF metadata)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ondevice.errors import ModelFormatError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Field names follow Hugging Face's `config.json` so that a config written by `to_hf_dict`
    is read back by `transformers` and `mlx_lm` alike.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: biases on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on queries and keys per head
    # GGUF files from llama.cpp store Q/K permuted for interleaved ("traditional") RoPE.
    rope_traditional: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    quantization: dict[str, Any] | None = field(default=None, repr=False)
    # FR-Spec drafts score only token ids 0..draft_vocab_size-1 (the rest get probability 0)
    draft_vocab_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"{source}: model_type {model_type!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            if eos is None:
                eos = []
            elif isinstance(eos, int):
                eos = [eos]
            cfg = cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=d.get("rope_scaling"),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                rope_traditional=bool(d.get("rope_traditional", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=[int(e) for e in eos],
                quantization=d.get("quantization"),
                draft_vocab_size=d.get("draft_vocab_size"),
            )
        except KeyError as e:
            raise ModelFormatError(f"{source}: missing required field {e.args[0]!r}.") from None
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{source}: invalid value ({e}).") from None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelFormatError(
                f"{source}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})."
            )
        rs = cfg.rope_scaling
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in ("llama3", "linear", "default", None):
                raise ModelFormatError(
                    f"{source}: rope_scaling type {kind!r} is not supported "
                    "(supported: llama3, linear)."
                )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"{path}: file not found.") from None
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{path}: not valid JSON ({e}).") from None
        return cls.from_dict(data, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers and mlx_lm read."""
        d = asdict(self)
        d.pop("qk_norm")
        if not d["rope_traditional"]:
            d.pop("rope_traditional")
        if d["quantization"] is None:
            d.pop("quantization")
        if d["draft_vocab_size"] is None:
            d.pop("draft_vocab_size")
        if d["rope_scaling"] is None:
            d.pop("rope_scaling")
        eos = d["eos_token_id"]
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        d["architectures"] = [
            {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
            }[self.model_type]
        ]
        return d
