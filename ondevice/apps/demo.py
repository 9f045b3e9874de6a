"""`ondevice demo`: the main job end to end on the default pair.

Pull the default verifier, convert it with the shipped draft into a pair bundle (Core ML draft
included), stream an answer with live speed and acceptance, then compare with plain decoding.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = (
    "Explain in a few short paragraphs how a bicycle stays upright, "
    "and give three tips for a beginner learning to ride."
)
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="pull the default pair, convert it, stream an answer and compare with plain decoding",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument(
        "--pair", default=None, help="catalog pair name (default: the catalog's default)"
    )
    p.add_argument(
        "--draft-backend", default="auto", choices=["auto", "coreml", "reference", "mlx"]
    )
    p.add_argument(
        "--method",
        default="auto",
        choices=["auto", "chain", "tree", "pld", "lookahead", "cascade"],
        help="speculation method (default: auto, which picks per round among the draft, prompt "
        "lookup and plain steps by measured acceptance and cost)",
    )
    p.add_argument("--no-compare", action="store_true", help="skip the plain-decoding comparison")
    p.set_defaults(func=run)


def _maybe_preload_openblas() -> None:
    """MLX's Linux CPU wheel links a slow reference BLAS; restart once with OpenBLAS preloaded
    when Debian's libopenblas0-pthread is installed (5-10x faster matrix products)."""
    if sys.platform != "linux" or os.environ.get("ONDEVICE_NO_REEXEC"):
        return
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return
    if os.path.exists(OPENBLAS):
        env = dict(os.environ, LD_PRELOAD=OPENBLAS, ONDEVICE_NO_REEXEC="1")
        print("(restarting with OpenBLAS preloaded for faster MLX on Linux)", file=sys.stderr)
        os.execve(sys.executable, [sys.executable, "-m", "ondevice", *sys.argv[1:]], env)
    print(
        "note: MLX is using its slow reference BLAS. For 5-10x faster CPU runs install OpenBLAS "
        "(sudo apt-get install libopenblas0-pthread); `ondevice doctor` explains.",
        file=sys.stderr,
    )


def _draft_digest(draft: Path) -> str:
    """A short digest of the draft's files: a bundle converted from another draft (an older
    package version) is never reused."""
    import hashlib

    from ondevice.models.bundle import sha256_file

    h = hashlib.sha256()
    for f in sorted(draft.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return h.hexdigest()[:12]


def ensure_bundle(pair_name: str | None = None) -> str:
    """The default pair as a bundle in the cache, converting it on first use."""
    import json
    import shutil

    from ondevice.errors import OndeviceError
    from ondevice.models.bundle import is_bundle
    from ondevice.models.catalog import load_catalog
    from ondevice.models.hub import cache_dir
    from ondevice.models.pull import pull

    cat = load_catalog()
    pair = cat.pair(pair_name)
    draft = pair.draft
    if not (draft / "config.json").exists():
        raise OndeviceError(f"the shipped draft is missing at {draft}; reinstall ondevice.")
    root = cache_dir() / "bundles"
    bundle = root / f"{pair.name}-{_draft_digest(draft)}"
    if is_bundle(bundle):
        return str(bundle)
    verifier = pull(pair.verifier)
    root.mkdir(parents=True, exist_ok=True)
    max_pos = json.loads((draft / "config.json").read_text()).get("max_position_embeddings")
    context = min(2048, int(max_pos or 2048))
    print(
        f"[ondevice] converting {pair.verifier} + shipped draft into {bundle} (once)",
        file=sys.stderr,
    )
    from ondevice.convert.cli import main as convert

    code = convert(
        ["--verifier", str(verifier), "--draft", str(draft), "-o", str(bundle)]
        + ["--context", str(context)]
    )
    if code:
        raise OndeviceError("converting the default pair failed (see the messages above).")
    # bundles of this pair made from other drafts (older versions) are stale now
    same_pair = re.compile(re.escape(pair.name) + r"(-[0-9a-f]{12})?")
    for old in root.iterdir():
        if old != bundle and same_pair.fullmatch(old.name) and is_bundle(old):
            shutil.rmtree(old, ignore_errors=True)
    return str(bundle)


def run(args: argparse.Namespace) -> int:
    _maybe_preload_openblas()
    import ondevice
    from ondevice.apps.generate import format_stats

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
