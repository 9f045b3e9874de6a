"""Acceptance of the two exact sampling rules side by side: keyed Leviathan vs Gumbel coupling.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/rule_acceptance.py --verifier GGUF [--draft-layers SPEC]

1. Tiny random pairs (draft = verifier + noise): accepted / drafted over seeded generations with
   the sequential decoder (the pipelined one decides identically).
2. The verifier and a draft on real text: per position, the acceptance probability of each rule
   given the two distributions at temperature 1: Leviathan accepts with sum min(p, q) exactly;
   the coupled rule accepts when the two exponential-race samples agree, estimated with shared
   noise draws.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from models_util import add_verifier_argument, load_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny  # noqa: E402

from ondevice.decoders.chain import ChainDecoder  # noqa: E402
from ondevice.models import load_model  # noqa: E402
from ondevice.rules.sampling import SamplingParams, probabilities  # noqa: E402
from ondevice.runtime.engines import MLXEngine  # noqa: E402


def tiny_pairs(runs: int) -> None:
    print("tiny pairs (vocab 96, 2 layers), temperature 1, K=3, seeded generations of 32 tokens")
    with tempfile.TemporaryDirectory() as tmp:
        v = tiny.write_model(Path(tmp) / "v", scale=2.0)
        V = MLXEngine(load_model(v).model)
        for noise in (0.02, 0.05, 0.1, 0.2):
            D = MLXEngine(load_model(tiny.perturbed_copy(v, Path(tmp) / f"d{noise}", noise)).model)
            row = []
            for rule in ("leviathan", "coupled"):
                acc = drafted = 0
                for s in range(runs):
                    prompt = [5 + s % 80, 9, 14]
                    dec = ChainDecoder(
                        V, D, SamplingParams(1.0), seed=s, num_draft_tokens=3, rule=rule
                    )
                    for _ in dec.run(prompt, 32):
                        pass
                    acc += dec.stats.accepted
                    drafted += dec.stats.drafted
                row.append(acc / drafted)
            print(f"  noise {noise:4.2f}: leviathan {row[0]:.3f}  coupled {row[1]:.3f}")


def real_pair(
    verifier: str, draft: str | None, draft_layers: str | None, positions: int, draws: int
) -> None:
    v, d, desc = load_pair(verifier, draft, draft_layers)
    tok = v.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Explain how a rainbow forms, step by step."}]
    )
    prompt = tok.encode(text, add_special_tokens=False)
    V, D = MLXEngine(v.model), MLXEngine(d)
    # the verifier's own greedy continuation gives realistic contexts
    seq = list(prompt)
    logits = V.feed(seq, last_only=True)
    for _ in range(positions):
        seq.append(int(np.argmax(logits)))
        logits = V.feed([seq[-1]], last_only=True)
    start = len(prompt) - 1
    params = SamplingParams(1.0)
    V.reset()
    D.reset()
    p = probabilities(V.feed(seq[:-1])[start:], params)
    q = probabilities(D.feed(seq[:-1])[start:], params)
    if q.shape[-1] < p.shape[-1]:  # a truncated draft vocabulary: zero probability beyond it
        q = np.pad(q, ((0, 0), (0, p.shape[-1] - q.shape[-1])))
    lev = np.minimum(p, q).sum(-1)
    rng = np.random.default_rng(0)
    coup = np.zeros(len(p))
    for _ in range(draws):
        e = rng.standard_exponential(p.shape[-1])
        coup += np.argmax(p / e, -1) == np.argmax(q / e, -1)
    coup /= draws
    print(f"{verifier} with draft {desc}, temperature 1, {len(p)} positions:")
    print(f"  per-token acceptance: leviathan {lev.mean():.3f}  coupled {coup.mean():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_verifier_argument(ap)
    ap.add_argument("--draft", default=None, help="a draft model (folder or GGUF)")
    ap.add_argument("--draft-layers", default="0-9,20-29", help="slices, ';'-separated")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--positions", type=int, default=48)
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args()
    if not args.skip_tiny:
        tiny_pairs(args.runs)
    if args.draft:
        real_pair(args.verifier, args.draft, None, args.positions, args.draws)
        return
    for spec in args.draft_layers.split(";"):
        real_pair(args.verifier, None, spec, args.positions, args.draws)


if __name__ == "__main__":
    main()
