"""`ondevice cache-prompt`: save a long prompt's KV (verifier and draft) to a file.

`generate`, `chat` and `serve` take the file with `--prompt-cache FILE` (API:
`ondevice.load(..., prompt_cache=FILE)`): every prompt that begins with the saved tokens starts
from their KV instead of prefilling them, for long system prompts and documents.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from ondevice.apps.options import add_model_arguments, add_no_chat_template_argument

    p = sub.add_parser(
        "cache-prompt",
        help="save a long prompt's KV to a file, for --prompt-cache",
        description="Prefill a prompt (a document, a system prompt) once and save both models' "
        "KV of it; `generate`, `chat` and `serve` start from it with --prompt-cache FILE. With "
        "the chat template (default) the prompt is rendered as a conversation's beginning: "
        "the system message, then the prompt as the user's message.",
    )
    add_model_arguments(p)
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", help="the prompt text")
    text.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a text file")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system", help="a system prompt")
    system.add_argument("--system-file", metavar="PATH", help="read the system prompt from a file")
    add_no_chat_template_argument(p, "save the prompt text as it is")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="file to write")
    p.set_defaults(func=run)


def _read(path: str, option: str) -> str:
    from ondevice.errors import OndeviceError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OndeviceError(f"{option} {path}: cannot read it as UTF-8 text ({e}).") from None


def prompt_ids(gen, prompt: str | None, system: str | None, chat_template: bool) -> list[int]:  # type: ignore[no-untyped-def]
    """The tokens a conversation (or, without the template, a raw text) begins with."""
    from ondevice.errors import OndeviceError

    tok = gen.tokenizer
    if not chat_template:
        if system is not None:
            raise OndeviceError("--system needs the chat template; drop --no-chat-template.")
        return tok.encode(prompt or "")
    messages = [{"role": "system", "content": system}] if system is not None else []
    if prompt is not None:
        messages.append({"role": "user", "content": prompt})
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    return tok.encode(text, add_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    from ondevice.apps.options import load_generator
    from ondevice.errors import OndeviceError

    prompt = _read(args.prompt_file, "--prompt-file") if args.prompt_file else args.prompt
    system = _read(args.system_file, "--system-file") if args.system_file else args.system
    if prompt is None and system is None:
        raise OndeviceError(
            "nothing to save: give --prompt, --prompt-file, --system or --system-file."
        )
    out = Path(args.output)
    if not out.parent.is_dir():
        raise OndeviceError(f"-o {out}: the folder {out.parent} does not exist.")
    gen = load_generator(args)
    ids = prompt_ids(gen, prompt, system, not args.no_chat_template)
    if not ids:
        raise OndeviceError("the prompt is empty.")
    n = gen.save_prompt_cache(out, ids, chat_template=False)
    size = out.stat().st_size
    parts = "verifier and draft" if gen.draft is not None else "verifier"
    print(
        f"saved the KV of {n} prompt tokens ({parts}) to {out} ({size / 1e6:.1f} MB); "
        f"use it with --prompt-cache {out}",
        file=sys.stderr,
    )
    return 0
