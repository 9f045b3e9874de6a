"""Constrained decoding (JSON schema, llguidance) with speculation against constrained plain
decoding, on the 20-prompt extraction set in benchmarks/data/json_extraction.jsonl.

Each prompt is run plain (verifier alone, same grammar) and speculative, interleaved, greedy;
the two must give the same tokens (checked), and every answer must parse as JSON. Reports
tokens/s of each, the speedup, the acceptance rate and the share of answers that are valid
JSON, overall and per prompt with --verbose.

The real pair (Linux: with OpenBLAS as DESIGN.md says):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/constrained.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --max-tokens 128

A tiny random pair (host overhead only, what this script was run with here):

    .venv/bin/python benchmarks/constrained.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ondevice.apps import options

DATA = Path(__file__).parent / "data" / "json_extraction.jsonl"


def tiny_pair(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    import tiny

    v = tiny.write_model(root / "v", layers=4, hidden_size=128, vocab_size=128, scale=1.5)
    return v, tiny.perturbed_copy(v, root / "d", noise=0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_model_arguments(ap)
    ap.add_argument("--tiny", action="store_true", help="a tiny random pair (no download)")
    ap.add_argument("--prompts", type=Path, default=DATA)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=None, metavar="K")
    ap.add_argument("--method", default="chain", choices=list(options.METHODS))
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="the first N prompts")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--unconstrained", action="store_true",
                    help="the same runs without the grammar, for comparison")  # fmt: skip
    args = ap.parse_args()
    if args.tiny:
        args.model, args.draft = map(str, tiny_pair(Path(tempfile.mkdtemp())))
        args.draft_backend = "mlx"
    gen = options.load_generator(args)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    rows = rows[: args.limit]
    opts = dict(max_tokens=args.max_tokens, temperature=0.0, cache_prompt=False)
    gen.generate(rows[0]["prompt"], max_tokens=8, cache_prompt=False)  # warm-up
    plain_t = spec_t = 0.0
    tokens = drafted = accepted = valid = 0
    per_prompt = []
    for row in rows:
        g = None if args.unconstrained else gen.grammar(json_schema=row["schema"])
        plain = gen.generate(row["prompt"], grammar=g, speculative=False, **opts)
        spec = gen.generate(
            row["prompt"], grammar=g, num_draft_tokens=args.num_draft_tokens,
            method=args.method, **opts,
        )  # fmt: skip
        if spec.tokens != plain.tokens:
            raise SystemExit(f"{row['id']}: speculative tokens differ from plain decoding")
        ps, ss = plain.stats, spec.stats
        plain_t += ps["generation_tokens"] / ps["tokens_per_second"]
        spec_t += ss["generation_tokens"] / ss["tokens_per_second"]
        tokens += ss["generation_tokens"]
        drafted += ss["drafted"]
        accepted += ss["accepted"]
        try:
            json.loads(spec.text)
            valid += 1
        except json.JSONDecodeError:
            pass  # cut by --max-tokens
        per_prompt.append(
            ps["tokens_per_second"] and ss["tokens_per_second"] / ps["tokens_per_second"]
        )
        if args.verbose:
            print(f"{row['id']:>11}: {per_prompt[-1]:.2f}x  {spec.text[:70]!r}")
    print(f"model {args.model}, draft {args.draft or '(bundle)'}, {len(rows)} prompts, "
          f"{tokens} tokens, greedy, method {args.method}")  # fmt: skip
    mode = "unconstrained" if args.unconstrained else "constrained"
    print(f"{mode} plain:       {tokens / plain_t:8.1f} tokens/s")
    print(f"{mode} speculative: {tokens / spec_t:8.1f} tokens/s  "
          f"speedup {plain_t / spec_t:.2f}x (median per prompt "
          f"{statistics.median(per_prompt):.2f}x), acceptance "
          f"{accepted / max(drafted, 1):.0%}, valid JSON {valid}/{len(rows)}")  # fmt: skip


if __name__ == "__main__":
    main()
