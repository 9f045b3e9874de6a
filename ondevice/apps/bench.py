"""`ondevice bench`: measure speculative decoding against plain decoding (and mlx-lm) on
Spec-Bench-format prompts; write JSON and a PNG chart, print a table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ondevice.apps import options
from ondevice.proposers.registry import METHODS

HELP = "benchmark speculative decoding against plain decoding (and mlx-lm)"
DESCRIPTION = (
    "Run every decoding method on Spec-Bench-format prompts, interleaved with "
    "plain decoding, and report tokens/s, speedup, acceptance and memory per category."
)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    p = options.add_command(sub, "bench", HELP, DESCRIPTION)
    src = p.add_argument_group("models (default: the catalog's default pair)")
    who = src.add_mutually_exclusive_group()
    who.add_argument("--model", metavar="BUNDLE", help="a pair bundle (or any model with --draft)")
    who.add_argument("--verifier", metavar="PATH_OR_ID", help="verifier model")
    options.add_draft_arguments(src, metavar="PATH_OR_ID")
    options.add_heads_argument(src)
    pr = p.add_argument_group("prompts")
    pr.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help="Spec-Bench-format JSONL (question_id, category, turns); default: built-in set",
    )
    pr.add_argument(
        "--turn", type=int, default=1, metavar="N", help="send each entry's N-th turn (default 1)"
    )
    pr.add_argument(
        "--per-category", type=int, metavar="N", help="first N prompts of each category"
    )
    pr.add_argument("--categories", type=_csv, metavar="A,B", help="only these categories")
    g = p.add_argument_group("decoding")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="default: 128")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--methods",
        type=_csv,
        default=["chain"],
        metavar="M,...",
        help="methods besides plain (always run): "
        + ", ".join(METHODS)
        + " (default: chain), or pipeline (the chain with drafting overlapped with verification)",
    )
    g.add_argument("--num-draft-tokens", type=int, metavar="K", help="fixed K (default: adaptive)")
    g.add_argument(
        "--peers",
        type=_csv,
        default=[],
        metavar="mlx-lm",
        help="also run these implementations on the same weights (mlx-lm)",
    )
    g.add_argument(
        "--peer-draft-tokens",
        default="",
        metavar="K,...",
        help="run mlx-lm's speculative decoding once per fixed K (e.g. 2,3,5; mlx-lm's default "
        "is 3) instead of once at ondevice's mean K",
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run each prompt's methods N times in alternating order and keep each run's "
        "median repeat (default 1; 3 or more where runs differ by less than the machine's "
        "noise)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        default=Path("ondevice-bench.json"),
        metavar="FILE.json",
        help="results: per-prompt records, aggregates, machine (default: %(default)s)",
    )
    out.add_argument("--plot", type=Path, metavar="FILE.png", help="default: --out with .png")
    out.add_argument("--no-plot", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    from ondevice.errors import OndeviceError

    if args.max_tokens < 1:
        raise OndeviceError(f"--max-tokens must be 1 or more, got {args.max_tokens}.")
    if args.temp < 0:
        raise OndeviceError(f"--temp must be >= 0, got {args.temp}.")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise OndeviceError(f"--num-draft-tokens must be 1 or more, got {args.num_draft_tokens}.")
    if args.repeats < 1:
        raise OndeviceError(f"--repeats must be 1 or more, got {args.repeats}.")
    args.peer_draft_tokens = options.integers(args.peer_draft_tokens, "--peer-draft-tokens")
    if any(k < 1 for k in args.peer_draft_tokens):
        raise OndeviceError(f"--peer-draft-tokens must be 1 or more, got {args.peer_draft_tokens}.")
    if args.peer_draft_tokens and "mlx-lm" not in args.peers:
        raise OndeviceError("--peer-draft-tokens needs --peers mlx-lm.")
    unknown = [x for x in args.peers if x != "mlx-lm"]
    if unknown:
        raise OndeviceError(f"unknown peer {unknown[0]!r}; the known peer is mlx-lm.")
    for f in (args.out, args.plot):
        if f is not None and f.parent.exists() and not f.parent.is_dir():
            raise OndeviceError(f"{f}: {f.parent} is not a directory.")


def _models(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.model or args.verifier:
        return args.model or args.verifier, args.draft
    from ondevice.sources.catalog import load_catalog
    from ondevice.sources.pull import pull

    pair = load_catalog().pair()  # fetched on first use, like ondevice demo
    shipped = str(pair.draft) if pair.draft is not None and pair.draft.exists() else None
    draft = args.draft or (str(pull(pair.draft_model)) if pair.draft_model else shipped)
    return str(pull(pair.verifier)), draft


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    from ondevice.speedtest import (
        BenchOptions,
        builtin_prompts_path,
        read_prompts,
        run_bench,
        select,
    )
    from ondevice.speedtest.plot import plot
    from ondevice.speedtest.report import write_json

    # Read the prompts before loading models: a typo in the file should fail in a second.
    prompts_file = Path(args.prompts) if args.prompts else builtin_prompts_path()
    prompts, skipped = read_prompts(prompts_file, args.turn)
    prompts = select(prompts, args.per_category, args.categories)
    if skipped:
        print(
            f"note: {skipped} entries have fewer than {args.turn} turns; skipped.", file=sys.stderr
        )

    import ondevice

    verifier, draft = _models(args)
    # no prompt cache: each method must prefill its prompts, as the peers do
    gen = ondevice.load(
        verifier,
        draft,
        draft_backend=args.draft_backend,
        dtype=args.dtype,
        prompt_cache_bytes=0,
        heads=args.heads,
    )
    options = BenchOptions(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        seed=args.seed,
        methods=tuple(args.methods),
        num_draft_tokens=args.num_draft_tokens,
        peers=tuple(dict.fromkeys(args.peers)),
        peer_draft_tokens=tuple(args.peer_draft_tokens),
        warmup=not args.no_warmup,
        repeats=args.repeats,
    )
    settings = {
        "prompts_file": str(prompts_file),
        "turn": args.turn,
        "per_category": args.per_category,
        "categories": args.categories,
        "verifier": str(verifier),
        "draft": draft,
        "draft_backend": args.draft_backend,
        "argv": sys.argv,
    }
    results = run_bench(gen, prompts, options, settings, progress=not args.quiet)
    write_json(args.out, results)
    print(table(results))
    best = results["summary"].get("mlx_lm_spec_best")
    if best:
        ratios = ", ".join(
            f"{m} {r:.2f}x" for m, r in results["summary"]["over_mlx_lm_spec_best"].items()
        )
        print(f"\nagainst mlx-lm's best speculative run ({best}): {ratios}")
    written = [str(args.out)]
    if not args.no_plot:
        png = args.plot or args.out.with_suffix(".png")
        plot(results, png)
        written.append(str(png))
    code = _report_mismatches(results["mismatches"])
    print(f"\nwrote {', '.join(written)}", file=sys.stderr)
    return code


def _report_mismatches(bad: list[dict]) -> int:
    """A correctness canary: greedy speculative output must equal plain decoding. Prints the
    outputs that differ; ondevice's own methods breaking the lossless contract fail the command
    (exit 1), a peer's do not."""
    if bad:
        print(
            f"\nGREEDY MISMATCH: {len(bad)} outputs differ from their reference decoding "
            "(see 'mismatches' in the JSON):",
            file=sys.stderr,
        )
        for b in bad[:10]:
            print(
                f"  {b['method']} vs {b['reference']}: {b['category']}/{b['question_id']} "
                f"from token {b['first_mismatch']}",
                file=sys.stderr,
            )
    return 1 if any(not b["method"].startswith("mlx-lm") for b in bad) else 0


def table(results: dict) -> str:
    from ondevice.speedtest.report import table as _table

    return _table(results)
