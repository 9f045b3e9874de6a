"""Core ML draft: conversion time, package size, reference-executor decode time, greedy agreement.

    OPENBLAS_NUM_THREADS=1 \\
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/coreml_draft.py /path/to/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --layers 0,1,28,29 --compress none,int8,palettize6,palettize4

Takes the given layers of a GGUF model as a draft (float32 weights from the GGUF file), converts
it with `convert_draft` for each compression, then runs the package with the reference draft
engine: a prompt, then greedy decode steps, timing each step. Agreement is the share of positions
where the package's greedy token equals the float32 MLX model's on the same sequence, and (for
compressed packages) the uncompressed package's on its own greedy path.

OPENBLAS_NUM_THREADS=1: numpy's multithreaded OpenBLAS thrashes on a loaded 2-core machine
(measured 300 vs 55 ms/token); matrix-vector products gain nothing from threads anyway.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

PROMPT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the "
    "sea, there lived an old fisherman who"
)


def dense_weights(weights: dict[str, mx.array], quant: dict | None) -> dict[str, np.ndarray]:
    """float32 numpy weights; quantized tensors expanded with their own or the default params."""
    out = {}
    for name, w in weights.items():
        base, _, kind = name.rpartition(".")
        if kind in ("scales", "biases") and f"{base}.weight" in weights:
            continue
        if f"{base}.scales" in weights:
            q = (quant or {}).get(base, quant)
            w = mx.dequantize(
                w, weights[f"{base}.scales"], weights[f"{base}.biases"], q["group_size"], q["bits"]
            )
        out[name] = np.array(w.astype(mx.float32))
    return out


def slice_layers(w: dict[str, np.ndarray], keep: list[int]) -> dict[str, np.ndarray]:
    out = {k: v for k, v in w.items() if ".layers." not in k}
    for new, old in enumerate(keep):
        prefix = f"model.layers.{old}."
        for k, v in w.items():
            if k.startswith(prefix):
                out[f"model.layers.{new}." + k[len(prefix) :]] = v
    return out


def main() -> None:
    from ondevice.convert.coreml import convert_draft
    from ondevice.models.gguf import load_gguf
    from ondevice.models.weights import build_model
    from ondevice.runtime.coreml_engines import ReferenceDraftEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--layers", default="0,1,28,29")
    ap.add_argument("--compress", default="none,int8,palettize6,palettize4")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()

    cfg, raw, tok = load_gguf(args.gguf)
    keep = [int(i) for i in args.layers.split(",")]
    weights = slice_layers(dense_weights(raw, cfg.quantization), keep)
    cfg = replace(cfg, num_hidden_layers=len(keep), quantization=None)
    model = build_model(cfg, {k: mx.array(v) for k, v in weights.items()})
    prompt = tok.encode(PROMPT)
    work = Path(tempfile.mkdtemp(prefix="coreml-bench-"))
    base = None
    try:
        for compress in args.compress.split(","):
            pkg = work / f"{compress}.mlpackage"
            t = time.perf_counter()
            desc = convert_draft(
                cfg, weights, pkg, context=args.context, chunk=args.chunk, compress=compress
            )
            convert_s = time.perf_counter() - t
            t = time.perf_counter()
            engine = ReferenceDraftEngine(pkg)
            load_s = time.perf_counter() - t
            t = time.perf_counter()
            rows = [engine.feed(prompt)]
            prefill_s = time.perf_counter() - t
            seq, step_s = list(prompt), []
            token = int(rows[0][-1].argmax())
            for _ in range(args.steps):
                seq.append(token)
                t = time.perf_counter()
                rows.append(engine.feed([token]))
                step_s.append(time.perf_counter() - t)
                token = int(rows[-1][-1].argmax())
            got = np.concatenate(rows)
            ref = np.array(model(mx.array([seq]))[0].astype(mx.float32))
            line = (
                f"{compress:10s} convert {convert_s:6.1f}s  size {desc['size_bytes'] / 1e6:6.1f} MB"
                f"  load {load_s:5.1f}s  prefill({len(prompt)}) {1000 * prefill_s:5.0f} ms"
                f"  decode median {1000 * np.median(step_s):5.1f} ms/token"
                f"  greedy vs MLX {np.mean(got.argmax(-1) == ref.argmax(-1)):.3f}"
            )
            if base is None:
                base = (seq, got)
            else:
                engine.reset()
                other = engine.feed(base[0])
                line += f"  vs uncompressed {np.mean(other.argmax(-1) == base[1].argmax(-1)):.3f}"
            print(line, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
