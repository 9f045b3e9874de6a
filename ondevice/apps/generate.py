"""`ondevice generate`: one prompt, streamed to stdout (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from ondevice.apps.serve import add_prompt_cache_arguments

    p = sub.add_parser(
        "generate",
        help="generate text for one prompt (speculative when a draft is given)",
        description="Generate text for one prompt. Text streams to stdout; statistics go to stderr.",
    )
    src = p.add_argument_group("models")
    src.add_argument(
        "--model",
        "--verifier",
        dest="model",
        required=True,
        metavar="PATH_OR_ID",
        help="verifier: pair bundle, model folder, .gguf file, cached name or hub id",
    )
    src.add_argument("--draft", metavar="PATH_OR_ID", help="draft model (a bundle brings its own)")
    src.add_argument(
        "--draft-backend", default="auto", choices=["auto", "coreml", "reference", "mlx"]
    )
    src.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    src.add_argument("--quantize", type=int, choices=[4, 8], help="quantize the verifier on load")
    add_prompt_cache_arguments(src)
    pr = p.add_mutually_exclusive_group(required=True)
    pr.add_argument(
        "--prompt", help="prompt text (sent as a user message through the chat template)"
    )
    pr.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    g = p.add_argument_group("decoding")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument(
        "--num-draft-tokens", type=int, metavar="K", help="fixed draft length (default: adaptive)"
    )
    g.add_argument("--no-speculative", action="store_true", help="run the verifier alone")
    g.add_argument("--method", default="chain",
                   choices=["chain", "tree", "pld", "lookahead", "cascade", "auto"],
                   help="how tokens are proposed (pld and lookahead need no draft)")
    g.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap drafting with verification (default: where it is faster)")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    p.set_defaults(func=run)


def _prompt_ids(text: str) -> list[int]:
    from ondevice.errors import OndeviceError

    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise OndeviceError(
            f"--prompt-ids must be comma-separated integers, got {text!r}."
        ) from None


def run(args: argparse.Namespace) -> int:
    import ondevice
    from ondevice.apps.serve import prompt_cache_options

    prompt = args.prompt if args.prompt is not None else _prompt_ids(args.prompt_ids)
    gen = ondevice.load(
        args.model,
        args.draft,
        draft_backend=args.draft_backend,
        dtype=args.dtype,
        quantize=args.quantize,
        **prompt_cache_options(args),
    )
    kwargs = dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        num_draft_tokens=args.num_draft_tokens,
        speculative=not args.no_speculative,
        stop=args.stop,
        chat_template=not args.no_chat_template,
        method=args.method,
        pipeline=args.pipeline,
    )
    if args.json:
        r = gen.generate(prompt, **kwargs)
        print(
            json.dumps(
                {
                    "text": r.text,
                    "tokens": r.tokens,
                    "finish_reason": r.finish_reason,
                    "stats": r.stats,
                }
            )
        )
        return 0
    stats = {}
    for chunk in gen.stream(prompt, **kwargs):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.stats:
            stats = chunk.stats
    sys.stdout.write("\n")
    print(format_stats(stats), file=sys.stderr)
    return 0


def format_stats(s: dict) -> str:
    line = (
        f"{s['generation_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, "
        f"prompt {s['prompt_tokens']} tokens in {s['prompt_seconds']:.2f}s"
    )
    if s.get("cached_tokens"):
        line += f" ({s['cached_tokens']} from the prompt cache)"
    if s.get("drafted"):
        line += (
            f", acceptance {s['acceptance_rate']:.0%}, {s['mean_accepted_length']:.2f} "
            f"tokens/pass (draft: {s['draft_backend']})"
        )
    return line
