"""The command-line options every command shares: one list of choices, one spelling per option.

Flag names follow mlx-lm's (`--model`, `--draft-model`, `--num-draft-tokens`, `--max-tokens`,
`--temp`, `--top-p`, `--top-k`, `--min-p`, `--seed`), so a command line written for
`mlx_lm.generate` works here; ondevice's older spellings (`--verifier`, `--draft`) are kept as
aliases. `--prompt -` reads the prompt from standard input. This module stays light (no MLX
import) so `ondevice --help` starts fast; test_options checks its choices against the API's.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ondevice.errors import OndeviceError
from ondevice.proposers.registry import METHODS

if TYPE_CHECKING:
    from ondevice.api import Generator

# the same lists as runtime.engines.DRAFT_BACKENDS and load()'s dtypes (test_options checks);
# the methods are the registry's (proposers/registry.py)
DRAFT_BACKENDS = ("auto", "coreml", "reference", "mlx")
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZE_BITS = (4, 8)


def add_command(
    sub: Any, name: str, help: str, description: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """The parser of `ondevice NAME`: `help` in the list of commands, `description` atop its
    own --help."""
    return sub.add_parser(name, help=help, description=description, **kwargs)


def add_model_arguments(p: Any, *, required: bool = False) -> None:
    """--model, --draft-model, --draft-backend, --dtype, --quantize and the prompt cache's
    options: `ondevice.load`'s arguments."""
    p.add_argument(
        "--model",
        "--verifier",
        dest="model",
        required=required,
        metavar="MODEL",
        help="verifier: pair bundle, model folder, .gguf file, or catalog / Hugging Face name",
    )
    add_draft_arguments(p)
    p.add_argument(
        "--quantize", type=int, choices=QUANTIZE_BITS, help="quantize the verifier on load"
    )
    add_heads_argument(p)
    add_prompt_cache_arguments(p)


def add_heads_argument(p: Any) -> None:
    """--heads FOLDER: `ondevice.load`'s heads (method "medusa")."""
    p.add_argument(
        "--heads",
        metavar="FOLDER",
        help="heads for the verifier (from `ondevice distill --heads hydra` or `medusa`), read by "
        "--method medusa (default: those found in the cache)",
    )


def add_draft_arguments(p: Any, metavar: str = "MODEL") -> None:
    """--draft-model (alias --draft), --draft-backend and --dtype."""
    p.add_argument(
        "--draft-model",
        "--draft",
        dest="draft",
        metavar=metavar,
        help="draft model for an unbundled pair (a bundle brings its own)",
    )
    p.add_argument(
        "--draft-backend",
        default="auto",
        choices=DRAFT_BACKENDS,
        help="where the draft runs (default: auto)",
    )
    p.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: as stored)")


def add_prompt_cache_arguments(p: Any) -> None:
    """--prompt-cache FILE, --prompt-cache-mb N: `ondevice.load`'s prompt_cache options."""
    p.add_argument(
        "--prompt-cache",
        metavar="FILE",
        help="a prompt saved by `ondevice cache-prompt`: prompts that begin with it start from "
        "its KV instead of prefilling it",
    )
    p.add_argument(
        "--prompt-cache-mb",
        type=int,
        default=1024,
        metavar="N",
        help="memory for the KV of recent prompts and answers, reused by prompts that begin "
        "the same way (0: off; default: 1024)",
    )


def prompt_cache_options(args: argparse.Namespace) -> dict:
    """`ondevice.load` keyword arguments from `add_prompt_cache_arguments`' options."""
    if args.prompt_cache_mb < 0:
        raise OndeviceError(f"--prompt-cache-mb {args.prompt_cache_mb}: must be 0 or more.")
    return {"prompt_cache": args.prompt_cache, "prompt_cache_bytes": args.prompt_cache_mb << 20}


def use_default_pair(args: argparse.Namespace) -> None:
    """No --model (and no --draft): the catalog's default pair, as `ondevice demo` makes it
    (pulled and converted into a bundle on first use)."""
    if args.model:
        return
    if getattr(args, "draft", None):
        raise OndeviceError("--draft needs --model: name the verifier it drafts for.")
    from ondevice.convert.pair import ensure_bundle
    from ondevice.sources.catalog import load_catalog

    pair = load_catalog().pair()
    print(f"[ondevice] no --model: using the default pair {pair.name}", file=sys.stderr)
    args.model = ensure_bundle(pair.name)


def load_generator(args: argparse.Namespace) -> Generator:
    """`ondevice.load` with `add_model_arguments`' options."""
    import ondevice

    use_default_pair(args)
    return ondevice.load(
        args.model,
        draft=args.draft,
        draft_backend=args.draft_backend,
        dtype=args.dtype,
        quantize=args.quantize,
        heads=getattr(args, "heads", None),
        **prompt_cache_options(args),
    )


def add_sampling_arguments(p: Any, *, temp: float = 0.0, max_tokens: int = 256) -> None:
    """--max-tokens, --temp, --top-p, --top-k, --min-p, the penalties, --seed, --stop,
    --num-draft-tokens and --no-speculative: `Generator.stream`'s sampling arguments."""
    p.add_argument(
        "--max-tokens", "-m", type=int, default=max_tokens, metavar="N",
        help=f"longest answer in tokens (default: {max_tokens})",
    )  # fmt: skip
    p.add_argument(
        "--temp", type=float, default=temp, help=f"temperature, 0 = greedy (default: {temp:g})"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (default: 0, off)")
    p.add_argument(
        "--min-p", type=float, default=0.0,
        help="keep tokens at least this fraction as likely as the best (default: 0, off)",
    )  # fmt: skip
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="divide logits of tokens already in the context (default: 1, off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F")
    p.add_argument("--seed", type=int, help="sampling seed (same seed, same tokens)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument(
        "--num-draft-tokens", type=int, metavar="K", help="fixed draft length (default: adaptive)"
    )
    p.add_argument("--no-speculative", action="store_true", help="run the verifier alone")


# sampling fields whose flag is spelled otherwise (mlx-lm's --temp), and those no flag sets
# (a grammar and logit_bias are objects, logprobs a report the commands do not print)
SAMPLING_DEST = {"temperature": "temp"}
NO_SAMPLING_FLAG = ("grammar", "logit_bias", "logprobs")


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Generator.stream` keyword arguments from `add_sampling_arguments`' options: every
    sampling field (`SAMPLING_FIELDS`) that has a flag, and the rest of the generation's."""
    from ondevice.rules.sampling import SAMPLING_FIELDS

    sampling = {
        f: getattr(args, SAMPLING_DEST.get(f, f))
        for f in SAMPLING_FIELDS
        if f not in NO_SAMPLING_FLAG
    }
    return {
        "max_tokens": args.max_tokens,
        **sampling,
        "seed": args.seed,
        "stop": args.stop,
        "num_draft_tokens": args.num_draft_tokens,
        "speculative": not args.no_speculative,
    }


# serve's defaults for requests that leave a field out: flag dest -> request field
REQUEST_DEFAULTS = {
    "temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "max_tokens": "max_tokens", "num_draft_tokens": "num_draft_tokens", "seed": "seed",
}  # fmt: skip


def add_request_default_arguments(p: Any) -> None:
    """mlx_lm.server's sampling flags for `serve`: defaults for requests that do not set
    the field (a request's own value always wins)."""
    g = p.add_argument_group("defaults for requests that do not set these fields")
    g.add_argument("--max-tokens", type=int, metavar="N")
    g.add_argument("--temp", type=float, help="temperature (default: OpenAI's 1)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--num-draft-tokens", type=int, metavar="K")


def request_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Request field -> value of the `add_request_default_arguments` flags that were given."""
    return {
        f: getattr(args, d) for d, f in REQUEST_DEFAULTS.items() if getattr(args, d) is not None
    }


def add_method_arguments(p: Any, default: str = "chain") -> None:
    p.add_argument(
        "--method",
        default=default,
        choices=list(METHODS),
        help="how tokens are proposed: "
        + "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values())
        + f" (default: {default})",
    )
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap drafting with verification (default: where it is faster)",
    )


def add_chat_template_arguments(p: Any) -> None:
    p.add_argument(
        "--chat-template", metavar="FILE_OR_TEXT",
        help="a Jinja chat template (a file, or the template itself) instead of the model's",
    )  # fmt: skip
    p.add_argument(
        "--chat-template-args", "--chat-template-config", metavar="JSON", type=json_object,
        dest="chat_template_args",
        help='keyword arguments for the chat template, e.g. \'{"enable_thinking": false}\'',
    )  # fmt: skip
    p.add_argument(
        "--use-default-chat-template", action="store_true",
        help="a model without a chat template gets the default (ChatML) one (mlx-lm's flag)",
    )  # fmt: skip


def add_no_chat_template_argument(p: Any, help: str) -> None:
    """--no-chat-template (alias: mlx-lm's --ignore-chat-template)."""
    p.add_argument(
        "--no-chat-template", "--ignore-chat-template", dest="no_chat_template",
        action="store_true", help=help,
    )  # fmt: skip


def add_system_prompt_argument(p: Any) -> None:
    """--system-prompt (mlx-lm's name; alias --system): a text, or a file holding it."""
    p.add_argument(
        "--system-prompt", "--system", dest="system_prompt", metavar="TEXT_OR_FILE",
        help="system prompt, or the path of a file holding it",
    )  # fmt: skip


def read_system_prompt(value: str | None) -> str | None:
    """--system-prompt's text: the file's content when it names a file (as mlx_lm.chat)."""
    return text_or_file(value, "--system-prompt").strip() if value else value


def text_or_file(value: str, flag: str) -> str:
    """An option that takes a text or the path of a file holding it: the file's content when
    `value` names a file, else `value` itself."""
    from pathlib import Path

    path = Path(value).expanduser()
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:
        is_file = False
    if not is_file:
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OndeviceError(f"{flag} {path}: cannot read the file ({e}).") from None


def str2bool(text: str) -> bool:
    """mlx-lm's boolean option values: anything but false/f (any case) is true."""
    return text.lower() not in ("false", "f", "no", "0")


def apply_chat_template_option(
    gen: Generator, template: str | None, use_default: bool = False
) -> None:
    """Replace the model's chat template by --chat-template's (a file or the text itself);
    with --use-default-chat-template, give a model that has none the default (ChatML) one."""
    if template:
        gen.tokenizer.chat_template = text_or_file(template, "--chat-template")
    elif use_default and not gen.tokenizer.chat_template:
        from ondevice.models.tokenizer import DEFAULT_CHAT_TEMPLATE

        gen.tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE


def json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"key\": true}'")
    return value


def integers(text: str, flag: str) -> list[int]:
    """An option's comma-separated integers ("3,5" or "3, 5"); a clear error names the flag."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise OndeviceError(f"{flag} must be comma-separated integers, got {text!r}.") from None


def read_prompt(text: str) -> str:
    """The prompt option's text; `-` reads standard input (mlx-lm's convention)."""
    if text != "-":
        return text
    data = sys.stdin.read()
    if not data.strip():
        raise OndeviceError("--prompt -: standard input was empty; pipe the prompt in.")
    return data
