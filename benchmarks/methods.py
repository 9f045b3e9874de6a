"""Speculative methods side by side: chain, tree, pld, lookahead, cascade (and auto) against plain
greedy decoding, per prompt category, in the same run (each prompt: plain, then every method).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/methods.py --verifier GGUF --prompts spec_bench_dev.jsonl \
        --per-category 3 --max-tokens 64 --out methods.json

Reports, per category and method: mean accepted length (tokens per verifier pass, counting the
verifier's own token) and speedup (plain seconds / method seconds over the same prompts; every
method produces the same tokens, which is checked). Prefill is excluded from both.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from models_util import add_verifier_argument

from ondevice.decoders.factory import make_decoder
from ondevice.decoders.plain import PlainGreedyDecoder
from ondevice.models import load_model
from ondevice.models.transformer import Model
from ondevice.proposers.resources import Speculation
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.engines import MLXEngine


def layer_slice(verifier: Model, n: int) -> Model:
    """A draft made of the verifier's embeddings, first `n` layers, final norm and head (the
    weights are shared, not copied)."""
    import copy

    cfg = copy.deepcopy(verifier.config)
    cfg.num_hidden_layers = n
    draft = Model(cfg)
    draft.model.embed_tokens = verifier.model.embed_tokens
    draft.model.layers = verifier.model.layers[:n]
    draft.model.norm = verifier.model.norm
    if not cfg.tie_word_embeddings:
        draft.lm_head = verifier.lm_head
    return draft


def load_prompts(path: Path, per_category: int, categories: list[str] | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seen: dict[str, int] = defaultdict(int)
    out = []
    for r in rows:
        cat = r.get("category", "?")
        if categories and cat not in categories:
            continue
        if seen[cat] < per_category:
            seen[cat] += 1
            out.append(r)
    return out


def run_one(dec, ids: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    tokens = [t for r in dec.run(ids, max_tokens) for t in r.tokens]
    total = time.perf_counter() - t0
    s = dec.stats
    return {
        "tokens": tokens,
        "seconds": total - dec.time_prefill,
        "rounds": s.rounds,
        "accepted": s.accepted,
        "drafted": s.drafted,
        "mal": (s.accepted + s.rounds) / s.rounds if s.rounds else 0.0,
        "by_method": dict(s.extra.get("rounds_by_method", {})),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_verifier_argument(ap)
    ap.add_argument("--draft", help="draft model (default: the verifier's first --draft-layers)")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--quantized", action="store_true", help="keep GGUF weights quantized")
    ap.add_argument("--prompts", type=Path, required=True, help="Spec-Bench questions (JSONL)")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--categories", help="comma-separated subset")
    ap.add_argument("--methods", default="chain,tree,pld,lookahead,cascade")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    ver = load_model(args.verifier, dequantize=not args.quantized)
    if args.draft:
        draft = load_model(args.draft, dequantize=not args.quantized).model
        draft_desc = args.draft
    else:
        draft = layer_slice(ver.model, args.draft_layers)
        draft_desc = f"verifier layers 0-{args.draft_layers - 1} (shared weights)"
    tok = ver.tokenizer
    cats = args.categories.split(",") if args.categories else None
    prompts = load_prompts(args.prompts, args.per_category, cats)
    methods = args.methods.split(",")
    params = SamplingParams()
    eos = tok.eos_token_ids
    venv, denv = MLXEngine(ver.model), MLXEngine(draft)
    print(
        f"verifier {args.verifier} ({'Q4' if args.quantized else 'dequantized fp32'}); "
        f"draft {draft_desc}; {len(prompts)} prompts; max_tokens {args.max_tokens}",
        flush=True,
    )
    # warm-up (and cost profiles, measured once per device and model and cached)
    warm = tok.encode("Hello there, how are you?")
    for m in methods:
        run_one(make_decoder(venv, denv, params, Speculation(method=m), eos_token_ids=eos), warm, 8)
    results = []
    for i, row in enumerate(prompts):
        text = tok.apply_chat_template([{"role": "user", "content": row["turns"][0]}])
        ids = tok.encode(text, add_special_tokens=False)
        rec = {
            "id": row.get("question_id"),
            "category": row.get("category"),
            "prompt_tokens": len(ids),
        }
        plain = run_one(PlainGreedyDecoder(venv, eos), ids, args.max_tokens)
        rec["plain"] = {k: v for k, v in plain.items() if k != "tokens"}
        for m in methods:
            spec = Speculation(method=m, num_draft_tokens=args.num_draft_tokens)
            dec = make_decoder(venv, denv, params, spec, eos_token_ids=eos)
            r = run_one(dec, ids, args.max_tokens)
            r["identical"] = r.pop("tokens") == plain["tokens"]
            rec[m] = r
        results.append(rec)
        line = " ".join(
            f"{m}={rec[m]['mal']:.2f}/{rec['plain']['seconds'] / rec[m]['seconds']:.2f}x"
            + ("" if rec[m]["identical"] else "!MISMATCH")
            for m in methods
        )
        print(
            f"[{i + 1}/{len(prompts)}] {rec['category']:<15} n={len(plain['tokens']):3d} "
            f"plain={len(plain['tokens']) / rec['plain']['seconds']:.1f} tok/s  {line}",
            flush=True,
        )
    summary = summarize(results, methods)
    print_table(summary, methods)
    if args.out:
        args.out.write_text(json.dumps({"draft": draft_desc, "args": vars(args) | {
            "prompts": str(args.prompts), "out": str(args.out)}, "results": results,
            "summary": summary}, indent=1))  # fmt: skip


def summarize(results: list[dict], methods: list[str]) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[r["category"]].append(r)
        groups["ALL"].append(r)
    out = {}
    for cat, rs in groups.items():
        plain = sum(r["plain"]["seconds"] for r in rs)
        out[cat] = {"prompts": len(rs)}
        for m in methods:
            acc = sum(r[m]["accepted"] for r in rs)
            rounds = sum(r[m]["rounds"] for r in rs)
            out[cat][m] = {
                "mal": (acc + rounds) / rounds if rounds else 0.0,
                "speedup": plain / sum(r[m]["seconds"] for r in rs),
                "identical": all(r[m]["identical"] for r in rs),
            }
    return out


def print_table(summary: dict, methods: list[str]) -> None:
    print(f"\n{'category':<15}{'n':>3}  " + "".join(f"{m:>18}" for m in methods))
    print(f"{'':<20}" + "".join(f"{'MAL  speedup':>18}" for _ in methods))
    for cat, row in sorted(summary.items(), key=lambda kv: (kv[0] == "ALL", kv[0])):
        cells = "".join(
            f"{row[m]['mal']:>10.2f}{row[m]['speedup']:>7.2f}x"
            + ("" if row[m]["identical"] else "!")
            for m in methods
        )
        print(f"{cat:<15}{row['prompts']:>3}  {cells}")
    print("('!' marks a method whose tokens differ from plain decoding somewhere)")


if __name__ == "__main__":
    main()
