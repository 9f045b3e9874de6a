"""Long prompts (issue 24): acceptance and speed of a pair on prompts of several lengths, with a
plain-decoding baseline measured in the same run.

    flock /tmp/ondevice-timed.lock python benchmarks/long_prompts.py --model BUNDLE \
        [--sizes 200,1000,3000,6000] [--max-tokens 64] [--method chain] [--json out.json]

Each prompt is a chat message: the beginning of a long Python module from an installed package
(`--source`, default click's core.py), cut so the whole prompt is about the size asked for,
followed by a question about it. Per size: plain greedy decoding first (`speculative=False`),
then speculative decoding with `--method`, both with `--max-tokens` new tokens; the second run
takes the verifier's prompt KV from the prompt cache, so both pay for the verifier's prefill
once, while the draft prefills what it needs itself (its whole prompt, or its window's tail).
Speeds are decoding speeds (prefill excluded, as `stats["tokens_per_second"]`); the tokens of
the two runs are checked to be equal. Runs with whatever `ondevice` is importable, so the same
script measures two versions (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

QUESTION = "Write a short summary of what the code above does, then list its main classes."


def default_source() -> Path:
    import click

    return Path(click.__file__).parent / "core.py"


def message(gen: Any, code_tokens: list[int], n: int) -> list[dict[str, str]]:
    tok = gen.tokenizer
    code = tok.decode(code_tokens[:n])
    return [{"role": "user", "content": f"```python\n{code}\n```\n\n{QUESTION}"}]


def prompt_of_size(gen: Any, source: str, size: int) -> list[dict[str, str]]:
    """A message of about `size` tokens: the start of `source` and the question."""
    code_tokens = gen.tokenizer.encode(source)
    overhead = gen.count_tokens(message(gen, code_tokens, 0))
    if size - overhead > len(code_tokens):
        sys.exit(f"the source has {len(code_tokens)} tokens, fewer than {size} asked for")
    return message(gen, code_tokens, max(0, size - overhead))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ondevice

    t = time.perf_counter()
    gen = ondevice.load(args.model)
    print(
        f"loaded {args.model} in {time.perf_counter() - t:.1f}s: draft {gen.draft_backend}, "
        f"verifier context {gen.context_length}, "
        f"draft window {getattr(gen, 'draft_context', 'n/a')}",
        flush=True,
    )
    source = Path(args.source).read_text()
    rows = []
    for size in args.sizes:
        msgs = prompt_of_size(gen, source, size)
        opts = {"max_tokens": args.max_tokens, "temperature": 0.0}
        plain = gen.generate(msgs, speculative=False, **opts)
        spec = gen.generate(msgs, method=args.method, **opts)
        gen.clear_prompt_cache()
        s, p = spec.stats, plain.stats
        row = {
            "size": size,
            "prompt_tokens": s["prompt_tokens"],
            "new_tokens": s["generation_tokens"],
            "same_tokens": spec.tokens == plain.tokens,
            "plain_tps": p["tokens_per_second"],
            "spec_tps": s["tokens_per_second"],
            "speedup": s["tokens_per_second"] / max(p["tokens_per_second"], 1e-9),
            "drafted": s["drafted"],
            "accepted": s["accepted"],
            "acceptance": s["acceptance_rate"],
            "tokens_per_pass": s["mean_accepted_length"],
            "plain_prefill_s": p["prompt_seconds"],
            "spec_prefill_s": s["prompt_seconds"],  # verifier restored + the draft's prefill
            "draft_window": s.get("draft_window"),
            "draft_window_moves": s.get("draft_window_moves"),
            "draft_skipped": s.get("draft_skipped"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| prompt tokens | plain tok/s | speculative tok/s | speedup | acceptance | tokens/pass "
        "| drafted | draft prefill s | window moves | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        out.append(
            f"| {r['prompt_tokens']} | {r['plain_tps']:.2f} | {r['spec_tps']:.2f} | "
            f"{r['speedup']:.2f}x | {r['acceptance']:.0%} | {r['tokens_per_pass']:.2f} | "
            f"{r['drafted']} | {r['spec_prefill_s']:.1f} | {r['draft_window_moves']} | "
            f"{'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a pair bundle (e.g. `ondevice demo`'s)")
    ap.add_argument("--sizes", default="200,1000,3000,6000")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--method", default="chain")
    ap.add_argument("--source", default=None, help="a long text file (default: click/core.py)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.source = args.source or str(default_source())
    rows = run(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
