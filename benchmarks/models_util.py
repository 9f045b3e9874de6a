"""Shared by the pipeline benchmarks: the verifier and a draft made of a subset of its layers."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from ondevice.models import LoadedModel, load_model
from ondevice.models.gguf import load_gguf
from ondevice.models.weights import build_model


def add_verifier_argument(ap: argparse.ArgumentParser) -> None:
    """--verifier, required: a model file of this machine is no default (the figures in
    docs/benchmarks.md name the one they used)."""
    ap.add_argument("--verifier", required=True, help="the verifier: a GGUF file or model folder")


def layer_slice(gguf: str | Path, layers: list[int]):
    """A draft with the verifier's embeddings, final norm and the given layers (self-speculative
    layer skipping); weights stay in the GGUF's quantized format."""
    cfg, weights, _ = load_gguf(gguf)
    cfg = copy.deepcopy(cfg)
    keep = {}
    for name, w in weights.items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in layers:
                continue
            name = name.replace(f"model.layers.{i}.", f"model.layers.{layers.index(i)}.", 1)
        keep[name] = w
    if cfg.quantization:
        q = dict(cfg.quantization)
        for k in list(q):
            if k.startswith("model.layers."):
                i = int(k.split(".")[2])
                v = q.pop(k)
                if i in layers:
                    q[k.replace(f"model.layers.{i}.", f"model.layers.{layers.index(i)}.", 1)] = v
        cfg.quantization = q
    cfg.num_hidden_layers = len(layers)
    return build_model(cfg, keep, source=f"{gguf} layers {layers}")


def parse_layers(spec: str, n: int) -> list[int]:
    """'0-3,28,29' -> [0, 1, 2, 3, 28, 29]."""
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    if any(not 0 <= i < n for i in out) or sorted(set(out)) != out:
        raise SystemExit(f"--draft-layers must be increasing layer indices in 0..{n - 1}")
    return out


def load_pair(verifier: str, draft: str | None, draft_layers: str | None):
    """(LoadedModel verifier, draft Model, description of the draft). Quantized weights are
    expanded where MLX runs on the CPU, as `ondevice.load` does."""
    import mlx.core as mx

    dq = mx.default_device() == mx.cpu
    v: LoadedModel = load_model(verifier, dequantize=dq)
    if draft:
        return v, load_model(draft, dequantize=dq).model, draft
    spec = draft_layers or "0-3"
    layers = parse_layers(spec, v.config.num_hidden_layers)
    return v, layer_slice(verifier, layers), f"verifier layers {spec}"
