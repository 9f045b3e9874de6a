"""ChatController (history, stop, model switch, persistence, errors) with real tiny models,
the terminal chat through a pseudo-terminal, and the menu bar's Linux behaviour."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny

import ondevice
from ondevice.apps.chat_controller import ChatController, ChatEvent, ChatState, Settings
from ondevice.apps.formatting import format_stats
from ondevice.apps.installed import installed_bundles
from ondevice.sources.sizes import human_size

CONTEXT = 8192  # room for the terminal test's long answers
ROOT = Path(__file__).resolve().parents[1]


def write_model(path: Path, seed: int = 0, context: int = CONTEXT) -> Path:
    """A tiny model whose EOS logit is always 0: greedy answers run to max_tokens, so the
    tests decide when an answer ends."""
    return tiny.write_endless_model(path, seed=seed, scale=2.0, context=context)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    first = write_model(root / "first", seed=0)
    return {
        "first": first,
        "draft": tiny.perturbed_copy(first, root / "draft", noise=0.1),
        "second": write_model(root / "second", seed=5),
    }


@pytest.fixture(scope="module")
def reference(models) -> ondevice.Generator:
    """The same model as the chat's, loaded separately to compute expected answers."""
    return ondevice.load(models["first"])


def greedy(max_tokens: int = 24) -> Settings:
    return Settings(max_tokens=max_tokens, temperature=0.0)


def loaded(models, settings: Settings, **kwargs) -> ChatController:
    ctrl = ChatController(settings=settings, **kwargs)
    assert ctrl.load(models["first"], draft=models["draft"], draft_backend="mlx", wait=True)
    assert ctrl.model_name == "first" and ctrl.error is None
    ctrl.drain()
    return ctrl


def wait_for(ctrl: ChatController, kind: str, timeout: float = 60) -> ChatEvent:
    deadline = time.monotonic() + timeout
    while True:
        event = ctrl.events.get(timeout=max(deadline - time.monotonic(), 0.01))
        if event.kind == kind:
            return event


def test_load_reports_progress_as_events(models):
    ctrl = ChatController(settings=greedy())
    assert ctrl.state is ChatState.IDLE and ctrl.model_name is None
    ctrl.load(models["first"])
    assert ctrl.state is ChatState.LOADING
    assert ctrl.wait(60)
    kinds = [(e.kind, e.state) for e in ctrl.drain()]
    assert kinds == [
        ("state", ChatState.LOADING),
        ("loaded", None),
        ("state", ChatState.IDLE),
    ]
    assert ctrl.model_name == "first"


def test_history_and_system_prompt(models, reference):
    ctrl = loaded(models, greedy())
    assert ctrl.send("hello")
    assert ctrl.state is ChatState.GENERATING
    done = wait_for(ctrl, "done")
    ctrl.wait()
    first = reference.generate([{"role": "user", "content": "hello"}], max_tokens=24).text
    assert ctrl.answer == first
    assert ctrl.messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
    ]
    assert done.stats["generation_tokens"] == 24 and not done.stopped
    assert done.stats["drafted"] > 0 and ctrl.last_stats == done.stats
    assert "acceptance" in format_stats(ctrl.last_stats)

    # The second answer sees the first exchange and the system prompt.
    ctrl.set_system_prompt("be terse")
    ctrl.drain()
    assert ctrl.send("and then?")
    ctrl.wait()
    pieces = "".join(e.text for e in ctrl.drain() if e.kind == "text")
    expected = reference.generate(
        [{"role": "system", "content": "be terse"}, *ctrl.messages[:3]], max_tokens=24
    ).text
    assert pieces == ctrl.answer == expected
    assert [m["role"] for m in ctrl.messages] == ["user", "assistant"] * 2

    ctrl.reset()
    assert ctrl.messages == [] and ctrl.system_prompt == "be terse"


def test_stop_mid_stream_keeps_the_partial_answer(models, reference):
    ctrl = loaded(models, greedy(max_tokens=1500))
    assert ctrl.send("tell me everything")
    wait_for(ctrl, "text")
    ctrl.stop()
    assert ctrl.state in (ChatState.STOPPING, ChatState.IDLE)
    done = wait_for(ctrl, "done", timeout=30)
    assert ctrl.wait(30) and ctrl.state is ChatState.IDLE
    assert done.stopped and done.stats["stopped"]
    assert 0 < done.stats["generation_tokens"] < 1500
    partial = ctrl.messages[-1]
    assert partial["role"] == "assistant" and partial["content"] == ctrl.answer
    n = done.stats["generation_tokens"]
    longer = reference.generate(ctrl.messages[:1], max_tokens=n + 10).text
    assert longer.startswith(ctrl.answer) and len(ctrl.answer) < len(longer)
    # The model is free again.
    ctrl.settings.max_tokens = 8
    assert ctrl.send("ok")
    ctrl.wait()
    assert len(ctrl.messages) == 4 and ctrl.error is None


def test_live_stats_while_streaming(models):
    ctrl = loaded(models, greedy(max_tokens=1500))
    assert ctrl.live_stats() is None
    ctrl.send("go")
    wait_for(ctrl, "text")
    live = ctrl.live_stats()
    assert live is not None and live["generation_tokens"] >= 1 and 0 <= live["from_draft"] <= 1
    assert "from draft" in format_stats(live)
    ctrl.stop(wait=True)
    assert ctrl.live_stats() is None


def test_switching_models_stops_the_answer(models):
    ctrl = loaded(models, greedy(max_tokens=1500))
    ctrl.send("hello")
    wait_for(ctrl, "text")
    assert ctrl.load(models["second"], wait=True)  # stops the answer, then switches
    assert ctrl.model_name == "second" and ctrl.state is ChatState.IDLE
    kinds = [e.kind for e in ctrl.drain()]
    assert "done" in kinds and kinds.index("done") < kinds.index("loaded")
    assert ctrl.messages[-1]["role"] == "assistant"  # the stopped answer stays in the history

    ctrl.settings.max_tokens = 16
    ctrl.reset()
    ctrl.send("hello")
    ctrl.wait()
    second = ondevice.load(models["second"])
    assert ctrl.answer == second.generate("hello", max_tokens=16).text


def test_persistence_round_trip(models, tmp_path):
    path = tmp_path / "support" / "history.json"
    ctrl = loaded(models, greedy(8), history_path=path, system_prompt="you are a test")
    ctrl.send("remember me")
    ctrl.wait()
    saved = json.loads(path.read_text())
    assert saved["version"] == 1 and saved["model"] == "first"
    assert saved["messages"] == ctrl.messages and saved["system_prompt"] == "you are a test"

    again = ChatController(history_path=path)
    assert again.messages == ctrl.messages and again.system_prompt == "you are a test"
    assert again.saved_model == "first"  # the menu bar reloads it at start
    assert again.error is None
    # A system prompt given explicitly wins over the saved one.
    assert ChatController(history_path=path, system_prompt="new").system_prompt == "new"
    assert not list(path.parent.glob(".history-*"))  # no temporary files left behind


@pytest.mark.parametrize(
    "content", ["{broken", '{"version": 99, "messages": []}', '{"version": 1, "messages": [1]}']
)
def test_unreadable_history_is_an_error_state(tmp_path, content):
    path = tmp_path / "history.json"
    path.write_text(content)
    ctrl = ChatController(history_path=path)
    assert ctrl.messages == [] and "could not be read" in ctrl.error
    assert [e.kind for e in ctrl.drain()] == ["error"]
    assert (tmp_path / "history.json.unreadable").read_text() == content  # kept for the user


def test_unwritable_history_is_an_error_state(models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ctrl = loaded(models, greedy(4), history_path=blocker / "history.json")
    ctrl.send("hi")
    ctrl.wait()
    assert "could not save the chat history" in ctrl.error
    assert len(ctrl.messages) == 2  # the conversation goes on


def test_errors_become_state_not_exceptions(models, tmp_path):
    ctrl = ChatController(settings=greedy())
    assert not ctrl.send("hello")
    assert "no model is loaded" in ctrl.error

    ctrl.load(tmp_path / "no-such-model", wait=True)
    assert ctrl.state is ChatState.IDLE and ctrl.model_name is None
    assert "no such file" in ctrl.error
    assert [e.kind for e in ctrl.drain()][-2:] == ["error", "state"]

    ctrl = loaded(models, greedy())
    assert not ctrl.send("   ")
    ctrl.send("x" * (CONTEXT + 5))  # longer than the context on its own
    ctrl.wait()
    assert "too long" in ctrl.error and ctrl.messages == []
    assert ctrl.state is ChatState.IDLE

    ctrl.settings.max_tokens = 1500
    ctrl.send("hello")
    assert not ctrl.send("again")  # one answer at a time
    assert "still being written" in ctrl.error
    ctrl.stop(wait=True)


def test_long_conversations_drop_the_oldest_turns(tmp_path):
    context = 256
    model = write_model(tmp_path / "short", context=context)
    ctrl = ChatController(settings=greedy(8))
    ctrl.load(model, wait=True)
    turns = []
    for i in range(4):  # ~400 characters: more than the context
        turns += [{"role": "user", "content": f"{i} " + "a" * 50}]
        turns += [{"role": "assistant", "content": "b" * 50}]
    ctrl.messages = list(turns)
    ctrl.send("and now?")
    ctrl.wait()
    assert ctrl.error is None and len(ctrl.messages) == len(turns) + 2
    reference = ondevice.load(model)
    assert reference.count_tokens(ctrl.messages[:-1]) > context
    # Sent: the longest run of whole exchanges before the question that leaves room for the
    # answer (8 tokens here).
    sent = ctrl.messages[:-1]
    start = next(
        i for i in range(0, len(sent), 2) if reference.count_tokens(sent[i:]) + 8 <= context
    )
    assert start > 0
    kept = sent[start:]
    assert ctrl.answer == reference.generate(kept, max_tokens=8).text


def test_installed_bundles_and_formatting(tmp_path):
    assert installed_bundles(tmp_path / "none") == []
    for name, size in (("b-pair", 1500), ("a-pair", 10)):
        (tmp_path / name / "draft").mkdir(parents=True)
        (tmp_path / name / "manifest.json").write_text("{}")
        (tmp_path / name / "draft" / "w.bin").write_bytes(b"x" * size)
    (tmp_path / "not-a-bundle").mkdir()
    found = installed_bundles(tmp_path)
    assert [(b.name, b.size_bytes) for b in found] == [("a-pair", 12), ("b-pair", 1502)]
    assert [human_size(n) for n in (12, 1502, 3.2e9)] == [
        "12 B",
        "1.5 KB",
        "3.0 GB",
    ]  # binary units
    assert format_stats(None) == "no answer yet"


# -- the terminal chat, through a pseudo-terminal -------------------------------------------


class Terminal:
    """A child process on a pseudo-terminal, read until patterns appear (a tiny pexpect)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.execvpe(argv[0], argv, env)
        self.exit_code: int | None = None
        self.seen = ""  # everything read so far, with the terminal's \r\n made \n

    def expect(self, pattern: str, timeout: float = 60) -> str:
        """Read until `pattern` (a regex) matches the unread output; return that output."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                out, self.seen = self.seen[: m.end()], self.seen[m.end() :]
                return out
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; output so far:\n{self.seen}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                assert data, f"child exited while waiting for {pattern!r}:\n{self.seen}"
                self.seen += data.decode("utf-8", "replace").replace("\r\n", "\n")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exit_code = os.waitstatus_to_exitcode(status)
                return self.exit_code
            try:  # keep draining so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.05)[0]:
                    os.read(self.fd, 4096)
            except OSError:
                pass
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        if self.exit_code is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def _chat_terminal(models, n: int) -> Terminal:
    """`ondevice chat` with the tiny pair in a pseudo-terminal, greedy, n tokens per answer."""
    argv = [sys.executable, "-m", "ondevice", "chat", "--model", str(models["first"])]
    argv += ["--draft", str(models["draft"]), "--draft-backend", "mlx"]
    argv += ["--max-tokens", str(n), "--temp", "0"]
    return Terminal(argv, {**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_terminal_chat(models, reference):
    n = 1500  # long enough that Ctrl-C lands while the (fast, tiny) model is still writing
    term = _chat_terminal(models, n)
    try:
        term.expect("chatting with first")
        term.expect(">>> ")

        # A question and its streamed answer.
        term.send("hello\r")
        answer = term.expect(">>> ")
        expected = reference.generate([{"role": "user", "content": "hello"}], max_tokens=n).text
        assert expected in answer
        term.send("/stats\r")
        stats = term.expect(">>> ")
        assert f"{n} tokens" in stats and "acceptance" in stats

        term.send("/system be brief\r")
        term.expect(r"\(system prompt set\)")
        term.send("/system\r")
        term.expect("be brief")
        term.send("/reset\r")
        term.expect(r"\(conversation cleared\)")
        term.send("/nope\r")
        term.expect("unknown command")
        # Ctrl-C: see test_terminal_ctrl_c_stops_the_answer.
        term.send("/quit\r")
        assert term.wait() == 0
    finally:
        term.close()


@pytest.mark.slow
def test_terminal_ctrl_c_stops_the_answer(models, reference):
    n = 1500
    term = _chat_terminal(models, n)
    try:
        term.expect(">>> ")
        term.send("hello\r")
        term.expect(">>> ")
        expected = reference.generate([{"role": "user", "content": "hello"}], max_tokens=n).text
        # Ctrl-C stops the next answer, and the chat goes on.
        history = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": expected},
            {"role": "user", "content": "more"},
        ]
        second = reference.generate(history, max_tokens=n).text
        term.send("more\r")
        term.expect("more\n")
        term.expect(re.escape(second[:3]))
        term.send("\x03")
        stopped = second[:3] + term.expect(r"\[stopped\]")
        term.expect(">>> ")
        # The terminal echoes ^C where the key was pressed, in the middle of the answer.
        partial = stopped.replace("^C", "").removesuffix(" [stopped]")
        assert second.startswith(partial) and len(partial) < len(second)
        term.send("/stats\r")
        assert "stopped" in term.expect(">>> ")

        term.send("/quit\r")
        assert term.wait() == 0
    finally:
        term.close()


def test_chat_command_errors(tmp_path, unfetchable_default_pair, capsys):
    from ondevice.apps.cli import main

    # No --model: the catalog's default pair, which cannot be fetched here (hub only, offline).
    assert main(["chat"]) == 1
    err = capsys.readouterr().err
    assert "using the default pair p" in err and "cannot fetch m" in err
    assert main(["chat", "--model", str(tmp_path / "missing")]) == 1


# -- the menu bar on Linux --------------------------------------------------------------------


def test_menubar_refuses_to_import_off_macos():
    if sys.platform == "darwin":
        pytest.skip("this checks the message on other systems")
    with pytest.raises(ImportError, match="macOS"):
        import ondevice.apps.menubar  # noqa: F401
    r = subprocess.run(
        [sys.executable, "-c", "from ondevice.apps.menubar import main"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "ondevice chat" in r.stderr


def test_nothing_in_the_package_imports_the_menubar():
    for path in (ROOT / "ondevice").rglob("*.py"):
        if path.name != "menubar.py":
            assert "apps.menubar" not in path.read_text(), path


# -- multi-line messages and resumed conversations (issue 28, item 9) ----------------------------


def _script(*lines: str):
    it = iter(lines)

    def ask(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return ask


def test_multi_line_messages_as_in_mlx_lm_and_ollama():
    from ondevice.apps.chat import read_message

    assert read_message(_script("one \\", "two\\", "three")) == "one \ntwo\nthree"
    assert read_message(_script('"""', "def f():", "    return 1", '"""')) == (
        "def f():\n    return 1"
    )
    assert read_message(_script('"""first', "second", 'last"""')) == "first\nsecond\nlast"
    assert read_message(_script('"""all on one line"""')) == "all on one line"
    assert read_message(_script("plain")) == "plain"
    with pytest.raises(EOFError):  # the input ended inside a block
        read_message(_script('"""', "unfinished"))


def test_terminal_chat_sends_a_block_as_one_message_and_says_it_resumed(models, tmp_path):
    import io

    from ondevice.apps.chat import TerminalChat

    path = tmp_path / "history.json"
    ctrl = loaded(models, greedy(4), history_path=path)
    out = io.StringIO()
    TerminalChat(ctrl, out=out, ask=_script('"""', "line one", "line two", '"""')).loop()
    assert "(the conversation is kept in" in out.getvalue()
    assert ctrl.messages[0] == {"role": "user", "content": "line one\nline two"}
    assert [m["role"] for m in ctrl.messages] == ["user", "assistant"]

    again = loaded(models, greedy(4), history_path=path)
    out = io.StringIO()
    TerminalChat(again, out=out, ask=_script()).loop()
    assert f"(resumed 1 earlier turn from {path}; /reset starts afresh)" in out.getvalue()
