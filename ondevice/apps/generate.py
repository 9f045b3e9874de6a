"""`ondevice generate`: one prompt, streamed to stdout (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys

from ondevice.apps import options
from ondevice.apps.formatting import format_stats
from ondevice.errors import OndeviceError

HELP = "generate text for one prompt (speculative when a draft is given)"
DESCRIPTION = (
    "Generate text for one prompt. Text streams to stdout; statistics go to "
    "stderr. Flags follow mlx_lm.generate's names."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = options.add_command(sub, "generate", HELP, DESCRIPTION)
    options.add_model_arguments(p.add_argument_group("models"))
    pr = p.add_mutually_exclusive_group(required=True)
    pr.add_argument(
        "--prompt",
        "-p",
        help="prompt text, sent as a user message through the chat template ('-': read stdin)",
    )
    pr.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    options.add_system_prompt_argument(p)
    g = p.add_argument_group("decoding")
    options.add_sampling_arguments(g)
    options.add_method_arguments(g)
    options.add_no_chat_template_argument(g, "send the prompt as raw text")
    options.add_chat_template_arguments(g)
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    p.add_argument(
        "--verbose", type=options.str2bool, nargs="?", const=True, default=True,
        metavar="BOOL", help="print statistics after the answer ('--verbose False': the answer "
        "only, as mlx_lm.generate; default: True)",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    system = options.read_system_prompt(args.system_prompt)
    if args.prompt is not None:
        prompt = options.read_prompt(args.prompt)
        if system and not args.no_chat_template:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        elif system:
            raise OndeviceError("--system-prompt needs the chat template; drop --no-chat-template.")
    elif system:
        raise OndeviceError("--system-prompt goes with --prompt, not --prompt-ids.")
    else:
        prompt = options.integers(args.prompt_ids, "--prompt-ids")
    gen = options.load_generator(args)
    options.apply_chat_template_option(gen, args.chat_template, args.use_default_chat_template)
    kwargs = dict(
        **options.sampling_options(args),
        chat_template=not args.no_chat_template,
        chat_template_kwargs=args.chat_template_args,
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
    if args.verbose:
        print(format_stats(stats), file=sys.stderr)
    return 0
