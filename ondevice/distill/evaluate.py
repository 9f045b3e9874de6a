"""How well a draft predicts its verifier's greedy continuations (the acceptance it will get).

With greedy decoding, speculative decoding accepts drafted tokens exactly as long as they equal
the verifier's greedy tokens, and while they do, the draft's next guess is the one it makes on the
verifier's own sequence. So teacher-forced agreement along the verifier's greedy continuation
determines every round: a round starting at position p accepts the run of matches from p (at
most k), then the verifier adds one token of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ondevice.models.transformer import Model


@dataclass
class Agreement:
    matches: np.ndarray  # (n,) bool: draft argmax == verifier greedy token, teacher-forced

    @property
    def rate(self) -> float:
        return float(self.matches.mean()) if len(self.matches) else 0.0

    def speculative(self, k: int) -> tuple[int, int, int]:
        """(rounds, drafted, accepted) of greedy speculative decoding with k drafts per round."""
        m, n = self.matches, len(self.matches)
        p = rounds = drafted = accepted = 0
        while p < n:
            run = 0
            while run < k and p + run < n and m[p + run]:
                run += 1
            rounds += 1
            drafted += min(k, n - p)
            accepted += run
            p += run + 1
        return rounds, drafted, accepted


def greedy_continuation(model: Model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """The model's greedy continuation of `prompt` (at most n tokens, stops after an eos)."""
    cache = model.make_cache()
    logits = model(mx.array(prompt)[None], cache)[:, -1]
    out: list[int] = []
    for _ in range(n):
        t = int(mx.argmax(logits, axis=-1).item())
        out.append(t)
        if t in eos:
            break
        logits = model(mx.array([[t]]), cache)[:, -1]
    return out


def draft_agreement(
    draft: Model, prompt: list[int], continuation: list[int], vocab: int | None = None
) -> Agreement:
    """Teacher-forced: does the draft's argmax after prompt + continuation[:i] equal continuation[i]?"""
    seq = mx.array(prompt + continuation[:-1])[None]
    logits = draft(seq)[0, len(prompt) - 1 :]
    if vocab is not None:
        logits = logits[:, :vocab]
    guess = np.array(mx.argmax(logits, axis=-1))
    return Agreement(guess == np.array(continuation))


def main(argv: list[str] | None = None) -> int:
    """python -m ondevice.distill.evaluate --verifier V --draft D --prompts FILE.jsonl"""
    import argparse
    import json
    import time
    from collections import defaultdict
    from pathlib import Path

    from ondevice.distill.export import draft_vocab_size
    from ondevice.distill.teacher import load_teacher

    ap = argparse.ArgumentParser(prog="python -m ondevice.distill.evaluate")
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="Spec-Bench style JSONL (category, turns)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--out", help="write the per-category numbers as JSON here")
    ap.add_argument(
        "--cache", help="JSON file keeping the verifier's greedy continuations between runs"
    )
    args = ap.parse_args(argv)

    teacher = load_teacher(args.verifier)
    tok = teacher.tokenizer
    cache: dict[str, list[int]] = {}
    if args.cache and Path(args.cache).exists():
        cache = json.loads(Path(args.cache).read_text())
    rows: dict[str, list[dict]] = defaultdict(list)
    for line in open(args.prompts):
        r = json.loads(line)
        if len(rows[r["category"]]) < args.per_category:
            rows[r["category"]].append(r)
    t0 = time.time()
    pairs: dict[str, list[tuple[list[int], list[int]]]] = defaultdict(list)
    for cat, rs in rows.items():
        for r in rs:
            prompt = tok.encode(
                tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}])
            )
            key = f"{r['question_id']}:{args.max_tokens}"
            if key not in cache:
                eos = set(tok.eos_token_ids)
                cache[key] = greedy_continuation(teacher.model, prompt, args.max_tokens, eos)
                if args.cache:
                    Path(args.cache).write_text(json.dumps(cache))
            pairs[cat].append((prompt, cache[key]))
        print(f"{cat:16s} verifier continuations ready ({time.time() - t0:.0f}s)", flush=True)
    # Expanded to float32 like the teacher: the same function, and MLX's CPU kernels for
    # quantized products are slow.
    draft = load_teacher(args.draft).model
    vocab = draft_vocab_size(args.draft)
    per_cat: dict[str, np.ndarray] = {}
    for cat, ps in pairs.items():
        ms = [draft_agreement(draft, prompt, cont, vocab).matches for prompt, cont in ps]
        per_cat[cat] = np.concatenate(ms)
        print(
            f"{cat:16s} agreement {per_cat[cat].mean():.3f} ({time.time() - t0:.0f}s)", flush=True
        )
    result: dict = {"categories": {}, "draft_vocab_size": vocab}
    for cat, m in [*per_cat.items(), ("overall", np.concatenate(list(per_cat.values())))]:
        entry = {"positions": int(len(m)), "agreement": round(float(m.mean()), 4)}
        for k in args.k:
            rounds, drafted, accepted = Agreement(m).speculative(k)
            entry[f"k{k}"] = {
                "acceptance_rate": round(accepted / max(drafted, 1), 4),
                "mean_accepted_length": round((accepted + rounds) / max(rounds, 1), 4),
            }
        result["categories" if cat != "overall" else "overall"] = (
            {**result["categories"], cat: entry} if cat != "overall" else entry
        )
    print(json.dumps(result["overall"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
