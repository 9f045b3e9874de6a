"""Medusa heads for tiny test verifiers, written where method "medusa" finds them."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ondevice.distill.medusa import identity_heads, save_heads
from ondevice.models.transformer import Model
from ondevice.proposers.medusa import HeadsInfo, heads_cache_path, verifier_fingerprint


def write_heads(
    model: Model,
    folder: Path | None = None,
    *,
    num_heads: int = 3,
    vocab_subset: int | None = None,
    noise: float = 0.0,
    seed: int = 0,
    kind: str = "medusa",
    max_bytes: int | None = None,
) -> Path:
    """Heads for `model` in `folder` (default: the cache, where "medusa" looks without
    heads=...), of `kind` ("medusa" or "hydra"): Medusa's identity start (W = 0, b = 0), plus Gaussian `noise` on the weights.
    The identity heads guess that the next token repeats, which a tiny random model's greedy
    text often does, so they get some proposals accepted."""
    d = model.config.hidden_size
    heads = identity_heads(d, num_heads, kind)
    if noise:
        keys = iter(mx.random.split(mx.random.key(seed), 2 * num_heads))
        heads.update(
            {"heads": [{"weight": noise * mx.random.normal(h.weight.shape, key=next(keys)),
                        "bias": mx.zeros((d,))} for h in heads.heads]}
        )  # fmt: skip
    info = HeadsInfo(
        verifier_fingerprint(model), d, num_heads, vocab_subset or model.config.vocab_size,
        {"verifier": "a tiny test model"}, kind,
    )  # fmt: skip
    out = folder or heads_cache_path(model)
    save_heads(heads, info, out, max_bytes)
    return out
