"""Core ML draft of a real model (issue 15/19): conversion, float16 range, greedy agreement.

    OPENBLAS_NUM_THREADS=1 python benchmarks/coreml_draft_agreement.py DRAFT.gguf PROMPTS.jsonl \\
        --package OUT/draft.mlpackage --per-category 2 --tokens 64 --json OUT/agreement.json

1. Loads the draft (GGUF or folder; quantized weights expanded to float32) and, unless
   `--package` already exists, converts it with `convert_draft` exactly as `ondevice-convert`
   does (lint and float16 range probe included): conversion time and package size.
2. For each selected prompt (Spec-Bench format, `--per-category` per category, through the chat
   template), the MLX draft's own greedy continuation of `--tokens` tokens; then the package, run
   by the reference executor in each `--modes` ("float32": Core ML's documented numerics;
   "float16": float16 accumulation everywhere), is fed the prompt (chunk function) and the MLX
   tokens one at a time (decode function). Agreement: the share of those positions where the
   package's greedy token equals the MLX draft's.
3. The largest magnitude of every op's outputs and intermediates over all of it (the probe), and
   how many of the MLX draft's tokens fall inside a truncated (FR-Spec) vocabulary of the first
   16,384 / 32,768 ids: the acceptance a truncated head could keep at most.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

FP16_MAX = 65504.0


def select_prompts(path: Path, per_category: int) -> list:
    from ondevice.speedtest.prompts import read_prompts

    prompts, _ = read_prompts(path)
    taken: dict[str, int] = defaultdict(int)
    out = []
    for p in prompts:
        if taken[p.category] < per_category:
            taken[p.category] += 1
            out.append(p)
    return out


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def mlx_greedy(model, prompt: list[int], n: int) -> list[int]:
    from ondevice.runtime.engines import MLXEngine

    engine = MLXEngine(model)
    logits = engine.feed(prompt, last_only=True)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.feed([out[-1]], last_only=True)
    return out


def _arguments() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft", help="draft model: .gguf file or model folder")
    ap.add_argument("prompts", type=Path, help="Spec-Bench-format JSONL prompts")
    ap.add_argument("--package", type=Path, required=True, help=".mlpackage to use or create")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--modes", default="float32,float16")
    ap.add_argument("--max-prompt", type=int, default=512, help="cut prompts to this many tokens")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    return ap.parse_args()


def main() -> None:
    args = _arguments()

    from ondevice.convert.cli import _probe_prompts, draft_numpy_weights
    from ondevice.convert.coreml import convert_draft
    from ondevice.models import load_model

    report: dict = {"draft": str(args.draft), "package": str(args.package)}
    t = time.perf_counter()
    draft = load_model(args.draft, dequantize=True)
    report["load_seconds"] = round(time.perf_counter() - t, 1)
    cfg = draft.config
    report["config"] = {
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "vocab": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "tied": cfg.tie_word_embeddings,
    }
    print(f"loaded {args.draft} in {report['load_seconds']} s: {report['config']}", flush=True)

    if not args.package.exists():
        t = time.perf_counter()
        desc = convert_draft(
            cfg,
            draft_numpy_weights(draft.model),
            args.package,
            context=args.context,
            chunk=args.chunk,
            progress=lambda m: print(f"  {m}", flush=True),
            probe_prompts=_probe_prompts(draft.tokenizer),
        )
        report["conversion"] = {
            "seconds": round(time.perf_counter() - t, 1),
            "size_bytes": desc["size_bytes"],
            "vocab_splits": desc["vocab_splits"],
            "float16_probe": desc.get("float16_probe"),
        }
        print(f"converted: {report['conversion']}", flush=True)

    prompts = select_prompts(args.prompts, args.per_category)
    seqs = []
    t = time.perf_counter()
    for p in prompts:
        ids = encode(draft.tokenizer, p.text)[: args.max_prompt]
        seqs.append((p, ids, mlx_greedy(draft.model, ids, args.tokens)))
    report["mlx_seconds"] = round(time.perf_counter() - t, 1)
    gen = np.array([t for _, _, g in seqs for t in g])
    report["mlx_tokens_within_truncated_vocab"] = {
        str(k): round(float(np.mean(gen < k)), 4) for k in (16384, 32768)
    }
    print(f"MLX greedy for {len(seqs)} prompts in {report['mlx_seconds']} s", flush=True)

    report["modes"] = {}
    for mode in args.modes.split(","):
        report["modes"][mode] = _agreement(args.package, mode, seqs)
        print(f"[{mode}] {json.dumps(report['modes'][mode])}", flush=True)

    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _agreement(package: Path, mode: str, seqs: list) -> dict:
    """The package's greedy agreement with MLX's tokens `seqs` under accumulation `mode`, its
    decode step time and its largest activations."""
    from ondevice.runtime.coreml_engines import ReferenceDraftEngine

    engine = ReferenceDraftEngine(package, accumulate=mode, probe=True)
    per_category: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    step_s = []
    t0 = time.perf_counter()
    for p, ids, want in seqs:
        engine.reset()
        got = [int(np.argmax(engine.feed(ids, last_only=True)))]
        for tok in want[:-1]:
            t = time.perf_counter()
            logits = engine.feed([tok], last_only=True)
            step_s.append(time.perf_counter() - t)
            got.append(int(np.argmax(logits)))
        agree = sum(a == b for a, b in zip(got, want))
        per_category[p.category][0] += agree
        per_category[p.category][1] += len(want)
        print(f"  [{mode}] {p.question_id}: {agree}/{len(want)}", flush=True)
    magnitudes: dict[str, tuple[str, float]] = {}
    for model in engine.models.values():
        for name, (op_type, v) in (model.magnitudes or {}).items():
            if name not in magnitudes or not v <= magnitudes[name][1]:
                magnitudes[name] = (op_type, v)
    peaks = sorted(magnitudes.items(), key=lambda kv: -kv[1][1])
    agree = sum(a for a, _ in per_category.values())
    total = sum(n for _, n in per_category.values())
    return {
        "agreement": round(agree / total, 4),
        "positions": total,
        "per_category": {c: round(a / n, 4) for c, (a, n) in sorted(per_category.items())},
        "decode_ms_median": round(1000 * float(np.median(step_s)), 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "peak": peaks[0][1][1],
        "peak_fraction_of_fp16": round(peaks[0][1][1] / FP16_MAX, 4),
        "largest": [[n, op, v] for n, (op, v) in peaks[:8]],
    }


if __name__ == "__main__":
    main()
