"""Pipelined vs sequential speculative decoding, per Spec-Bench category, same run, interleaved.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/pipeline_bench.py --verifier GGUF [--draft DIR | --draft-layers SPEC]
            --prompts spec_bench_dev.jsonl [--per-category 1]
            [--max-tokens 128] [--temp 0] [--out results.json]

For every prompt (first turn, chat template) both decoders run back to back, in alternating
order, on the same engines. Besides measured tokens/s (decoding only, prefill excluded) it
reports what the cost model (`ondevice/runtime/costmodel.py`) predicts for each decoder from the
per-call costs and the acceptance measured in that very run: the sum over rounds of expected
tokens over the sum of expected round times, for the block lengths the decoder actually used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from models_util import add_verifier_argument, load_pair

from ondevice.decoders.chain import ChainDecoder
from ondevice.decoders.pipelined import PipelinedDecoder
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.costmodel import CostModel
from ondevice.runtime.engines import MLXEngine


class Recording:
    """Wraps an engine and records (tokens fed, seconds) for every call."""

    def __init__(self, engine):
        self.engine = engine
        self.name, self.vocab_size = engine.name, engine.vocab_size
        self.context_length = engine.context_length
        self.log: list[tuple[int, float]] = []

    @property
    def length(self) -> int:
        return self.engine.length

    def reset(self) -> None:
        self.engine.reset()
        self.log = []

    def feed(self, tokens, last_only=False):
        t = time.perf_counter()
        out = self.engine.feed(tokens, last_only)
        self.log.append((len(tokens), time.perf_counter() - t))
        return out

    def trim(self, n: int) -> None:
        self.engine.trim(n)


def predict(rounds, verify_calls, draft_calls, host, pipelined: bool) -> float:
    """Tokens/s the cost model expects from these measured costs and acceptances."""
    cm = CostModel(decay=1.0, prior_weight=0.0)
    for L, dt in verify_calls:
        cm.observe_verify(L, dt)
    cm.draft.value = float(np.mean(draft_calls)) if draft_calls else 0.0
    cm.draft.n = len(draft_calls)
    cm.host.value, cm.host.n = host, 1
    acc = sum(a for _, a in rounds)
    rej = sum(1 for k, a in rounds if a < k)
    alpha = min(acc / max(acc + rej, 1), 0.999)
    tokens = sum(cm.tokens_per_round(k, alpha) for k, _ in rounds)
    seconds = sum(cm.round_seconds(k, pipelined, alpha) for k, _ in rounds)
    return tokens / seconds if seconds else 0.0


def run_sequential(V, D, prompt, params, args, eos):
    rv, rd = Recording(V), Recording(D)
    dec = ChainDecoder(rv, rd, params, eos_token_ids=eos, seed=args.seed, num_draft_tokens=args.k)
    rounds, n = [], 0
    for r in dec.run(prompt, args.max_tokens):
        rounds.append((r.drafted, r.accepted))
        n += len(r.tokens)
    wall = dec._t_end - dec._t_start
    verify = [(L, dt) for L, dt in rv.log[1:]]  # the first call is the prompt
    draft = [dt for _, dt in rd.log[1:]]
    host = (wall - sum(dt for _, dt in verify) - sum(draft)) / max(len(rounds), 1)
    return {
        "tokens": n,
        "seconds": wall,
        "tps": n / wall,
        "predicted_tps": predict(rounds, verify, draft, host, False),
        "rounds": len(rounds),
        "drafted": dec.stats.drafted,
        "accepted": dec.stats.accepted,
    }


def run_pipelined(V, D, prompt, params, args, eos):
    dec = PipelinedDecoder(V, D, params, eos_token_ids=eos, seed=args.seed, num_draft_tokens=args.k)
    rounds, n = [], 0
    for r in dec.run(prompt, args.max_tokens):
        rounds.append((r.drafted, r.accepted))
        n += len(r.tokens)
    wall = dec._t_end - dec._t_start
    host = float(np.mean(dec.calls["host"])) if dec.calls["host"] else 0.0
    # drafting that the verifier waited for (drafting ahead is hidden behind its passes)
    draft = [dt for dt, ahead in dec.calls["draft"] if not ahead] or [
        dt for dt, _ in dec.calls["draft"]
    ]
    return {
        "tokens": n,
        "seconds": wall,
        "tps": n / wall,
        "predicted_tps": predict(rounds, dec.calls["verify"], draft, host, True),
        "rounds": len(rounds),
        "drafted": dec.stats.drafted,
        "accepted": dec.stats.accepted,
        **dec.extra_stats(),
    }


def _arguments() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser()
    add_verifier_argument(ap)
    ap.add_argument("--draft", default=None, help="a draft model (folder or GGUF)")
    ap.add_argument("--draft-layers", default=None, help="else a slice of the verifier's layers")
    ap.add_argument("--prompts", required=True, help="Spec-Bench questions (JSONL)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", default=None, help="comma-separated subset")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=None, help="fixed draft length for both decoders")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = _arguments()

    v, draft_model, desc = load_pair(args.verifier, args.draft, args.draft_layers)
    V, D = MLXEngine(v.model), MLXEngine(draft_model)
    tok = v.tokenizer
    eos = tok.eos_token_ids
    params = SamplingParams(args.temp)
    by_cat: dict[str, list[str]] = defaultdict(list)
    wanted = set(args.categories.split(",")) if args.categories else None
    for line in Path(args.prompts).read_text().splitlines():
        q = json.loads(line)
        if (wanted is None or q["category"] in wanted) and len(
            by_cat[q["category"]]
        ) < args.per_category:
            by_cat[q["category"]].append(q["turns"][0])
    blas = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference BLAS"
    print(
        f"verifier {args.verifier}; draft: {desc}; temp {args.temp}; {blas}; "
        f"load average at start {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    # warm-up (graph caches, allocations)
    warm = tok.encode("Hello", add_special_tokens=False)
    for fn in (run_sequential, run_pipelined):
        fn(V, D, warm, params, argparse.Namespace(max_tokens=8, seed=0, k=args.k), eos)

    results = []
    for i, (cat, texts) in enumerate(by_cat.items()):
        for j, text in enumerate(texts):
            prompt = tok.encode(
                tok.apply_chat_template([{"role": "user", "content": text}]),
                add_special_tokens=False,
            )
            order = [("sequential", run_sequential), ("pipelined", run_pipelined)]
            if (i + j) % 2:
                order.reverse()
            row = {"category": cat, "prompt_tokens": len(prompt)}
            for name, fn in order:
                row[name] = fn(V, D, prompt, params, args, eos)
            results.append(row)
            s, p = row["sequential"], row["pipelined"]
            print(
                f"{cat:15s} seq {s['tps']:6.2f} tok/s (pred {s['predicted_tps']:6.2f})  "
                f"pipe {p['tps']:6.2f} tok/s (pred {p['predicted_tps']:6.2f})  "
                f"x{p['tps'] / s['tps']:.2f}  acc {s['accepted'] / max(s['drafted'], 1):.2f}/"
                f"{p['accepted'] / max(p['drafted'], 1):.2f}  K {p['mean_draft_length']:.1f}  "
                f"overlap {p['overlap']:.2f}  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    def total(name, key):
        return sum(r[name][key] for r in results)

    seq_tps = total("sequential", "tokens") / total("sequential", "seconds")
    pipe_tps = total("pipelined", "tokens") / total("pipelined", "seconds")
    ratio_pred = [
        r[m]["tps"] / r[m]["predicted_tps"] for r in results for m in ("sequential", "pipelined")
    ]
    print(
        f"overall: sequential {seq_tps:.2f} tok/s, pipelined {pipe_tps:.2f} tok/s, "
        f"speedup x{pipe_tps / seq_tps:.2f}; mean overlap "
        f"{statistics.mean(r['pipelined']['overlap'] for r in results):.2f}; measured/predicted "
        f"median {statistics.median(ratio_pred):.2f} (min {min(ratio_pred):.2f})"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "draft": desc, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
