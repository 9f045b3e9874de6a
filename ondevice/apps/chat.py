"""`ondevice chat`: a read-answer loop in the terminal over a `ChatController`."""

from __future__ import annotations

import argparse
import contextlib
import queue
import signal
import sys
from collections.abc import Callable

from ondevice.apps.chat_controller import ChatController, ChatState, Settings
from ondevice.apps.formatting import format_limits, format_prompt_cache, format_stats

HELP = """commands:
  /reset         forget the conversation
  /stats         statistics of the last answer and of the prompt cache
  /system TEXT   set the system prompt (/system alone shows it)
  /help          this list
  /quit          leave (or Ctrl-D)
A message of several lines: end a line with \\ to go on with the next, or put it between
lines of \"\"\" (as in ollama). Ctrl-C stops an answer without leaving the chat."""
BLOCK = '"""'


def register(sub: argparse._SubParsersAction) -> None:
    from ondevice.apps import options

    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Chat with a model in the terminal.\n\n" + HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_model_arguments(p)
    options.add_system_prompt_argument(p)
    options.add_sampling_arguments(p, temp=0.7, max_tokens=512)
    options.add_chat_template_arguments(p)
    p.add_argument("--history", metavar="PATH", help="keep the conversation in this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ondevice.apps import options
    from ondevice.errors import OndeviceError

    if args.max_tokens < 1:
        raise OndeviceError(f"--max-tokens {args.max_tokens}: must be at least 1.")
    sampling = options.sampling_options(args)
    core = {f: sampling.pop(f) for f in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                          "num_draft_tokens", "speculative")}  # fmt: skip
    sampling["chat_template_kwargs"] = args.chat_template_args
    settings = Settings(**core, extra=sampling)
    system = options.read_system_prompt(args.system_prompt)
    ctrl = ChatController(history_path=args.history, system_prompt=system, settings=settings)
    for event in ctrl.drain():
        if event.kind == "error":
            print(f"warning: {event.text}", file=sys.stderr)
    options.use_default_pair(args)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    ctrl.load(
        args.model,
        draft=args.draft,
        draft_backend=args.draft_backend,
        dtype=args.dtype,
        quantize=args.quantize,
        heads=args.heads,
        **options.prompt_cache_options(args),
    )
    ctrl.wait()
    if ctrl.model_name is None:
        raise OndeviceError(ctrl.error or "the model could not be loaded.")
    options.apply_chat_template_option(
        ctrl._gen, args.chat_template, args.use_default_chat_template
    )
    ctrl.drain()
    # Ctrl-C is how an answer is stopped: make it raise KeyboardInterrupt even when the chat was
    # started from a context that ignores SIGINT (a background job of a script inherits SIG_IGN,
    # and Python then installs no handler of its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return TerminalChat(ctrl).loop()


def read_message(ask: Callable[[str], str] = input) -> str:
    """One message from the user: a line; or, when lines end in a backslash, those lines and
    the next; or every line between a line that starts with \"\"\" and one that ends with it.
    Raises EOFError at the end of input, KeyboardInterrupt on Ctrl-C (the message is dropped)."""
    line = ask(">>> ")
    if line.lstrip().startswith(BLOCK):
        first = line.lstrip()[len(BLOCK) :]
        if first.rstrip().endswith(BLOCK):  # \"\"\"one line\"\"\"
            return first.rstrip()[: -len(BLOCK)]
        lines = [first] if first.strip() else []
        while not (line := ask("... ")).rstrip().endswith(BLOCK):
            lines.append(line)
        lines.append(line.rstrip()[: -len(BLOCK)])
        return "\n".join(lines).strip("\n")
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = ask("... ")
    return "\n".join([*lines, line])


class TerminalChat:
    """The read-answer loop over a ChatController."""

    def __init__(self, ctrl: ChatController, out=None, ask=input) -> None:  # type: ignore[no-untyped-def]
        self.ctrl = ctrl
        self.out = out or sys.stdout
        self.ask = ask

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def loop(self) -> int:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        self.say(f"chatting with {self.ctrl.model_name}. /help for commands, Ctrl-D to leave.")
        self.say_history()
        while True:
            try:
                line = read_message(self.ask)
            except EOFError:
                self.say()
                return 0
            except KeyboardInterrupt:
                self.say("\n(Ctrl-C stops an answer; /quit or Ctrl-D leaves)")
                continue
            if not line.strip():
                continue
            if line.startswith("/"):
                if self.command(line.strip()) == "quit":
                    return 0
                continue
            if self.ctrl.send(line):
                self.stream_answer()
            else:
                self.show_errors()

    def say_history(self) -> None:
        """Where the conversation is kept, and what of it was resumed from there."""
        ctrl, path = self.ctrl, self.ctrl.history_path
        if path is None:
            return
        turns = sum(m["role"] == "user" for m in ctrl.messages)
        if not turns:
            self.say(f"(the conversation is kept in {path})")
            return
        was = ctrl.saved_model
        other = f", held with {was}" if was and was != ctrl.model_name else ""
        self.say(
            f"(resumed {turns} earlier turn{'s' if turns != 1 else ''} from {path}{other}; "
            "/reset starts afresh)"
        )

    def command(self, line: str) -> str | None:
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit", "/bye"):
            return "quit"
        if name == "/reset":
            self.ctrl.reset()
            self.say("(conversation cleared)")
        elif name == "/stats":
            self.say(format_stats(self.ctrl.last_stats))
            self.say(format_limits(self.ctrl.limits()))
            self.say(format_prompt_cache(self.ctrl.prompt_cache_stats()))
        elif name == "/system":
            if rest.strip():
                self.ctrl.set_system_prompt(rest)
                self.say("(system prompt set)")
            else:
                self.say(self.ctrl.system_prompt or "(no system prompt)")
        elif name in ("/help", "/?"):
            self.say(HELP)
        else:
            self.say(f"unknown command {name}; /help lists them")
        self.show_errors()
        return None

    def show_errors(self) -> None:
        for event in self.ctrl.drain():
            if event.kind == "error":
                self.say(f"error: {event.text}")

    def stream_answer(self) -> None:
        """Print the answer as it streams; Ctrl-C stops it and keeps the chat going."""
        while True:
            try:
                event = self.ctrl.events.get(timeout=0.1)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                self.ctrl.stop()
                continue
            try:
                if event.kind == "text":
                    self.say(event.text, end="")
                elif event.kind == "error":
                    self.say(f"\nerror: {event.text}")
                elif event.kind == "done":
                    self.say(" [stopped]" if event.stopped else "")
                elif event.kind == "state" and event.state is ChatState.IDLE:
                    self.show_errors()
                    return
            except KeyboardInterrupt:
                self.ctrl.stop()
