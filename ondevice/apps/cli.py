"""`ondevice` command: one subcommand per module, each registered by a light `register()`.

Subcommand modules import their heavy dependencies (servers, plotting, training) inside their
run functions, so `ondevice --help` and `ondevice generate` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ondevice.errors import OndeviceError

# module (under ondevice.apps) -> its register(subparsers) adds one or more subcommands
COMMAND_MODULES = (
    "demo",
    "generate",
    "serve",
    "chat",
    "pull",
    "cached",
    "doctor",
    "bench",
    "distill",
    "cache_prompt",
)


def build_parser() -> argparse.ArgumentParser:
    from ondevice import __version__

    parser = argparse.ArgumentParser(
        prog="ondevice",
        description="Fast, lossless speculative decoding on Apple Silicon (and anywhere MLX runs).",
    )
    parser.add_argument("--version", action="version", version=f"ondevice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"ondevice.apps.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the list of commands
        command = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except OndeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        if (e.name or "").split(".")[0] != "mlx":
            raise
        from ondevice.runtime.mlx_check import mlx_missing

        print(f"error: {mlx_missing(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Command name -> its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


if __name__ == "__main__":
    sys.exit(main())
