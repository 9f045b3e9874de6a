"""`ondevice demo`: the main job end to end on the default pair.

Pull the catalog's default pair (Qwen2.5-Coder 1.5B verifier + 0.5B draft), convert it into a
pair bundle once (Core ML draft included), stream an answer with live speed and acceptance, then
compare with plain decoding: same tokens, and the speedup.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPT = (
    "Write a Python function merge_intervals(intervals) that merges overlapping closed "
    "intervals given as (start, end) tuples and returns them sorted. Include a docstring and "
    "a short usage example."
)
DEFAULT_MAX_TOKENS = 160
DRAFT_CONTEXT = 2048  # the Core ML draft's fixed state size; chats longer than this use MLX


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


def _draft_digest(draft: Path) -> str:
    """A short digest of the draft's files: a bundle converted from another draft (an older
    package version) is never reused."""
    import hashlib

    from ondevice.sources.files import sha256_file

    h = hashlib.sha256()
    for f in sorted(draft.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return h.hexdigest()[:12]


def _bundle_key(cat: Any, pair: Any) -> str:
    """What the bundle is made of: the catalog's digests of both models (a shipped draft's own
    files), so a bundle converted from other files (an older release) is never reused."""
    import hashlib

    parts = [pair.name]
    for name in (pair.verifier, pair.draft_model):
        if name:
            entry = cat.model(name)
            parts.append(f"{name}={entry.sha256 if entry and entry.sha256 else '?'}")
    if pair.draft is not None:
        parts.append(f"draft={_draft_digest(pair.draft)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def ensure_bundle(pair_name: str | None = None) -> str:
    """The catalog pair as a bundle in the cache: pulled and converted on first use."""
    import json
    import shutil

    from ondevice.errors import OndeviceError
    from ondevice.models.bundle import is_bundle
    from ondevice.sources.catalog import load_catalog
    from ondevice.sources.hub import cache_dir
    from ondevice.sources.pull import pull

    cat = load_catalog()
    pair = cat.pair(pair_name)
    if pair.draft is not None and not (pair.draft / "config.json").exists():
        raise OndeviceError(f"the shipped draft is missing at {pair.draft}; reinstall ondevice.")
    root = cache_dir() / "bundles"
    bundle = root / f"{pair.name}-{_bundle_key(cat, pair)}"
    if is_bundle(bundle):
        return str(bundle)
    verifier = pull(pair.verifier)
    draft = pull(pair.draft_model) if pair.draft_model else pair.draft
    root.mkdir(parents=True, exist_ok=True)
    context = DRAFT_CONTEXT
    if pair.draft is not None:
        max_pos = json.loads((pair.draft / "config.json").read_text()).get(
            "max_position_embeddings"
        )
        context = min(DRAFT_CONTEXT, int(max_pos or DRAFT_CONTEXT))
    print(
        f"[ondevice] converting {pair.verifier} + {pair.draft_model or 'the shipped draft'} "
        f"into {bundle} (once)",
        file=sys.stderr,
    )
    # In a child process: whatever the conversion leaves resident (it frees each copy once
    # written, but allocators and coremltools keep some) goes with it before the demo loads
    # the bundle; in one process, before the conversion freed its copies, the peak was 16 GB.
    import subprocess

    code = subprocess.call(
        [sys.executable, "-m", "ondevice.convert.cli"]
        + ["--verifier", str(verifier), "--draft", str(draft), "-o", str(bundle)]
        + ["--context", str(context)]
    )
    if code:
        if code == 130:
            raise KeyboardInterrupt
        raise OndeviceError("converting the default pair failed (see the messages above).")
    # bundles of this pair made from other files (older versions) are stale now
    same_pair = re.compile(re.escape(pair.name) + r"(-[0-9a-f]{12})?")
    for old in root.iterdir():
        if old != bundle and same_pair.fullmatch(old.name) and is_bundle(old):
            shutil.rmtree(old, ignore_errors=True)
    return str(bundle)


def run(args: argparse.Namespace) -> int:
    import ondevice
    from ondevice.apps.formatting import format_stats

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
