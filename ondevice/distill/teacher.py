"""The verifier as a teacher: a float32 copy of it and its top-k next-token distributions.

Quantized layers are expanded to float32 once: MLX's CPU kernels for quantized matrix products
are many times slower than a BLAS float product, and the expanded weights compute the very same
function. The student starts from these float weights too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ondevice.models import Tokenizer, load_model
from ondevice.models.config import ModelConfig
from ondevice.models.transformer import Model


@dataclass
class Teacher:
    model: Model  # float32, no quantized layers
    config: ModelConfig  # the verifier's config (quantization cleared)
    tokenizer: Tokenizer
    weights: dict[str, mx.array]  # float32, Hugging Face names
    path: Path


def load_teacher(name: str | Path) -> Teacher:
    """Load a verifier (folder, GGUF, cached name) and expand it to float32."""
    from ondevice.models.weights import build_model

    loaded = load_model(name)
    weights = dequantized(loaded.model)
    cfg = copy.deepcopy(loaded.config)
    cfg.quantization = None
    model = build_model(copy.deepcopy(cfg), weights, dtype="float32", source=str(loaded.path))
    return Teacher(model, cfg, loaded.tokenizer, weights, loaded.path)


def dequantized(model: Model) -> dict[str, mx.array]:
    """Float32 copies of all of `model`'s weights, quantized layers expanded."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    quant = {
        p: (m.group_size, m.bits)
        for p, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    flat = dict(tree_flatten(model.parameters()))
    out: dict[str, mx.array] = {}
    for name, w in flat.items():
        base, _, kind = name.rpartition(".")
        if base in quant and kind in ("scales", "biases"):
            continue  # folded into the expanded weight (a layer's own `bias` is kept)
        if base in quant and kind == "weight":
            group, bits = quant[base]
            w = mx.dequantize(w, flat[f"{base}.scales"], flat[f"{base}.biases"], group, bits)
        out[name] = w.astype(mx.float32)
    mx.eval(out)
    return out


ROWS_AT_ONCE = 256  # `topk_logprobs` works on this many rows at a time (bounded temporaries)


def topk_logprobs(logits: mx.array | np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely ids (most likely first, int32) and their log-probabilities (float32),
    per row of logits (..., V), in numpy: its `exp` is vectorised where MLX's CPU `exp` is
    scalar, which made this five times faster over a generation step's 16 rows of the 1.5B's
    151,936 ids (94 against 17 ms with the sampling; docs/distill.md, "Writing the answers faster")."""
    a = np.asarray(logits.astype(mx.float32)) if isinstance(logits, mx.array) else logits
    *lead, V = a.shape
    a = a.reshape(-1, V)
    ids = np.empty((len(a), k), np.int32)
    vals = np.empty((len(a), k), np.float32)
    for i in range(0, len(a), ROWS_AT_ONCE):
        x = np.asarray(a[i : i + ROWS_AT_ONCE], np.float32)
        m = x.max(axis=1, keepdims=True)
        lse = np.log(np.exp(x - m).sum(axis=1, keepdims=True)) + m
        top = np.argpartition(x, V - k, axis=1)[:, V - k :]
        v = np.take_along_axis(x, top, axis=1)
        order = np.argsort(-v, axis=1, kind="stable")
        ids[i : i + len(x)] = np.take_along_axis(top, order, axis=1)
        vals[i : i + len(x)] = np.take_along_axis(v, order, axis=1) - lse
    return ids.reshape(*lead, k), vals.reshape(*lead, k)


def score_sequences(
    model: Model, seqs: list[np.ndarray], k: int, batch_tokens: int = 4096
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Teacher top-k (ids, logprobs) at every position of each sequence (teacher forcing).

    Sequences of similar length are batched together (right-padded; causal attention means
    padding never influences the real positions).
    """
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    i = 0
    while i < len(order):
        L = len(seqs[order[i]])
        n = max(1, batch_tokens // max(L, 1))
        group = order[i : i + n]
        L = max(len(seqs[j]) for j in group)
        x = np.zeros((len(group), L), np.int32)
        for r, j in enumerate(group):
            x[r, : len(seqs[j])] = seqs[j]
        ids_np, lp_np = topk_logprobs(model(mx.array(x)), k)
        for r, j in enumerate(group):
            n_j = len(seqs[j])
            out[j] = (ids_np[r, :n_j].astype(np.int32), lp_np[r, :n_j].astype(np.float16))
        i += len(group)
    return out  # type: ignore[return-value]
