"""`ondevice distill`: train a draft model for a verifier by knowledge distillation."""

from __future__ import annotations

import argparse

from ondevice.apps import options
from ondevice.errors import OndeviceError

HELP = "train a draft model (or Medusa heads) for a verifier (knowledge distillation with MLX)"
DESCRIPTION = (
    "Train a small draft that imitates VERIFIER: it starts from the verifier's embeddings, "
    "final norm and a subset of its layers, and learns the verifier's top-k next-token "
    "distributions. Without --data the verifier writes its own training conversations "
    "(Magpie). With --heads hydra or medusa, train Medusa heads instead (method 'medusa': no "
    "draft model): on the verifier's hidden states over its own chat answers (--chat-fraction of "
    "--tokens) and local text (any --data files, then the documentation and source of the "
    "installed packages), computed once. Data and checkpoints "
    "are kept in OUTPUT.work/, so --resume continues a stopped run; OUTPUT is refreshed at "
    "every checkpoint."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = options.add_command(sub, "distill", HELP, DESCRIPTION)
    p.add_argument("--verifier", required=True, help="verifier: model folder, .gguf file or name")
    p.add_argument(
        "-o", "--output", required=True, help="folder to write the draft model (or heads) to"
    )
    p.add_argument(
        "--heads",
        choices=("hydra", "medusa"),
        help="train heads on the verifier's hidden states instead of a draft model, for method "
        "'medusa': 'hydra' (each head also reads the token its guess follows: Hydra's "
        "sequential heads, the better drafts) or 'medusa' (independent heads)",
    )
    p.add_argument(
        "--num-heads", type=int, default=4, help="--heads: heads, one per token ahead (default: 4)"
    )
    p.add_argument(
        "--init",
        metavar="HEADS",
        help="--heads: start from these heads (e.g. the shipped ones, or an earlier run's "
        "output) instead of the identity, to train them on more answers",
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help=".txt files (one document each) or .jsonl files (text / messages / turns per line) "
        "instead of self-generated data",
    )
    p.add_argument(
        "--layers",
        default="4",
        help="number of draft layers (taken from the bottom and top of the verifier), or "
        "verifier layer indices such as 0,1,28,29 (default: 4)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="score only the first K token ids (FR-Spec; recorded as draft_vocab_size in "
        "config.json; default: the full vocabulary; --heads: 32768)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=100_000,
        help="self-generated training positions to build (--heads: text tokens whose states "
        "are computed; default: 100000)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--steps", type=int, default=2000, help="training steps (default: 2000)")
    p.add_argument("--minutes", type=float, help="stop training after this many minutes")
    p.add_argument(
        "--batch-size", type=int, help="rows per step (default: 8; --heads: positions, 256)"
    )
    p.add_argument(
        "--seq-len", type=int, help="tokens per row (default: 256; --heads: per piece, 512)"
    )
    p.add_argument("--lr", type=float, help="peak learning rate (default: 5e-4; --heads: 1e-3)")
    p.add_argument("--top-k", type=int, default=20, help="teacher probabilities kept per position")
    p.add_argument(
        "--gen-batch",
        type=int,
        help="conversations generated at once (default: 32; --heads: 64)",
    )
    p.add_argument(
        "--chat-fraction",
        type=float,
        default=0.75,
        help="--heads: share of --tokens that are the verifier's own chat answers, the rest "
        "documents (default: 0.75)",
    )
    p.add_argument(
        "--code-share",
        type=float,
        default=0.0,
        help="--heads: share of those answers written under a programming assistant's system "
        "prompt, which steers the conversations to code (default: 0)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=288, help="longest conversation/document piece"
    )
    p.add_argument(
        "--embed-bits",
        type=int,
        default=4,
        choices=(0, 4, 8),
        help="quantize the (frozen) embedding to this many bits, 0 = keep float (default: 4)",
    )
    p.add_argument(
        "--max-mb",
        type=float,
        default=30.0,
        help="quantize the layers (--heads: the heads) as little as fits this size in MB; "
        "0 = no limit (default: 30)",
    )
    p.add_argument("--work-dir", help="data and checkpoint folder (default: OUTPUT.work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out checks")
    p.add_argument(
        "--checkpoint-every", type=int, default=50, help="steps between checkpoints/exports"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.heads:
        return run_heads(args)
    if args.init:
        raise OndeviceError("--init starts heads from a heads folder; it needs --heads.")
    from ondevice.distill import distill

    summary = distill(
        args.verifier,
        args.output,
        layers=args.layers,
        vocab=args.vocab,
        batch_size=args.batch_size or 8,
        seq_len=args.seq_len or 256,
        learning_rate=args.lr or 5e-4,
        gen_batch=args.gen_batch or 32,
        max_tokens=args.max_tokens,
        embed_bits=args.embed_bits or None,
        max_mb=args.max_mb or None,
        **_common(args),
    )
    start = summary.get("acceptance_estimate_start")
    print(
        f"draft written to {args.output}: {summary['step']} steps in {summary['train_time_s']:.0f}s, "
        f"held-out greedy agreement {summary['acceptance_estimate']:.3f}"
        + (f" (before training {start:.3f})" if start is not None else "")
    )
    return 0


def _common(args: argparse.Namespace) -> dict:
    """The options a draft's and the heads' training share, as both functions name them."""
    return {
        "data_files": args.data,
        "tokens": args.tokens,
        "resume": args.resume,
        "steps": args.steps,
        "minutes": args.minutes,
        "top_k": args.top_k,
        "work_dir": args.work_dir,
        "seed": args.seed,
        "eval_every": args.eval_every,
        "checkpoint_every": args.checkpoint_every,
        "progress": not args.quiet,
    }


def run_heads(args: argparse.Namespace) -> int:
    from ondevice.distill.medusa import GEN_BATCH, distill_heads

    summary = distill_heads(
        args.verifier,
        args.output,
        num_heads=args.num_heads,
        kind=args.heads,
        vocab=args.vocab or 32768,
        batch_size=args.batch_size or 256,
        seq_len=args.seq_len or 512,
        learning_rate=args.lr or 1e-3,
        chat_fraction=args.chat_fraction,
        code_share=args.code_share,
        gen_batch=args.gen_batch or GEN_BATCH,
        max_tokens=args.max_tokens,
        max_mb=args.max_mb or None,
        init=args.init,
        **_common(args),
    )
    agree = " ".join(f"{a:.3f}" for a in summary["head_agreement"])
    start = summary.get("head_agreement_start")
    print(
        f"heads written to {args.output}: {summary['step']} steps in "
        f"{summary['train_time_s']:.0f}s on {summary['train_tokens']} tokens, held-out greedy "
        f"agreement per head {agree}"
        + (" (before training " + " ".join(f"{a:.3f}" for a in start) + ")" if start else "")
    )
    return 0
