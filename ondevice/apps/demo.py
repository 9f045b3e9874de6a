"""`ondevice demo`: the main job end to end on the default pair.

Pull the catalog's default pair (Qwen2.5-Coder 1.5B verifier + 0.5B draft), convert it into a
pair bundle once (Core ML draft included), stream an answer with live speed and acceptance, then
compare with plain decoding: same tokens, and the speedup.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = (
    "Write a Python function merge_intervals(intervals) that merges overlapping closed "
    "intervals given as (start, end) tuples and returns them sorted. Include a docstring and "
    "a short usage example."
)
DEFAULT_MAX_TOKENS = 160


def register(sub: argparse._SubParsersAction) -> None:
    from ondevice.apps import options

    p = sub.add_parser(
        "demo",
        help="pull the default pair, convert it, stream an answer and compare with plain decoding",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument(
        "--pair", default=None, help="catalog pair name (default: the catalog's default)"
    )
    p.add_argument("--draft-backend", default="auto", choices=options.DRAFT_BACKENDS)
    p.add_argument(
        "--method",
        default="auto",
        choices=list(options.METHODS),
        help="speculation method (default: auto, which picks per round among the draft, prompt "
        "lookup and plain steps by measured acceptance and cost)",
    )
    p.add_argument("--no-compare", action="store_true", help="skip the plain-decoding comparison")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ondevice
    from ondevice.apps.formatting import format_stats
    from ondevice.convert.pair import ensure_bundle

    bundle = ensure_bundle(args.pair)
    t = time.perf_counter()
    gen = ondevice.load(bundle, draft_backend=args.draft_backend)
    print(
        f"[ondevice] loaded {bundle} in {time.perf_counter() - t:.1f}s "
        f"(draft on {gen.draft_backend})",
        file=sys.stderr,
    )
    print(f"\n>>> {args.prompt}\n")
    live = sys.stderr.isatty()
    n = accepted_chunks = 0
    t0 = time.perf_counter()
    stats: dict = {}
    tokens: list[int] = []
    for chunk in gen.stream(args.prompt, max_tokens=args.max_tokens, method=args.method):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        tokens.extend(chunk.tokens)
        n += len(chunk.tokens)
        accepted_chunks += chunk.from_draft
        if live and n and n % 8 == 0:
            rate = n / (time.perf_counter() - t0)
            sys.stderr.write(
                f"\x1b7\x1b[999;1H\x1b[2K[{rate:5.1f} tok/s, {accepted_chunks / n:4.0%} from draft]\x1b8"
            )
        if chunk.stats:
            stats = chunk.stats
    print("\n")
    print(f"speculative ({args.method}): {format_stats(stats)}", file=sys.stderr)
    if args.no_compare:
        return 0
    plain = gen.generate(args.prompt, max_tokens=args.max_tokens, speculative=False)
    same = "identical" if plain.tokens == tokens else "DIFFERENT (please report this bug)"
    speedup = stats["tokens_per_second"] / max(plain.stats["tokens_per_second"], 1e-9)
    print(
        f"plain decoding: {plain.stats['tokens_per_second']:.1f} tok/s -> speculative "
        f"{stats['tokens_per_second']:.1f} tok/s = {speedup:.2f}x, acceptance "
        f"{stats['acceptance_rate']:.0%}, {stats['mean_accepted_length']:.2f} tokens/pass, "
        f"output {same}",
        file=sys.stderr,
    )
    return 0
