"""The chat controller: a UI-free conversation with one model, driven from any UI thread.

The controller owns everything a chat window needs (history, system prompt, the streaming state
machine, stop, model switching, persistence, error reporting, statistics) and runs generation
and model loading in a worker thread. A UI never calls into the model: it calls controller
methods (which return at once) and drains `controller.events` from its own thread, so the
terminal chat (`apps.chat`) and the macOS menu bar share one tested implementation.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ondevice.runtime import threads

if TYPE_CHECKING:
    from ondevice.api import Generator

HISTORY_VERSION = 1
# Room kept free for the answer when old turns must be dropped to fit the context.
MIN_ANSWER_TOKENS = 16


class ChatState(str, Enum):
    IDLE = "idle"  # ready for a message (or without a model: see `model_name`)
    LOADING = "loading"  # a model is being loaded
    GENERATING = "generating"  # an answer is streaming
    STOPPING = "stopping"  # stop was asked; the answer ends after the current round


@dataclass
class ChatEvent:
    """What a UI reacts to. kind: "state", "text" (a piece of the answer), "done" (the answer
    ended; `stats` and `stopped` set), "loaded" (a model is ready) or "error" (`text` says what)."""

    kind: str
    text: str = ""
    state: ChatState | None = None
    stats: dict[str, Any] | None = None
    stopped: bool = False


@dataclass
class Settings:
    """Generation settings a chat applies to every answer."""

    max_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    num_draft_tokens: int | None = None
    speculative: bool = True
    # further `Generator.stream` arguments (min_p, penalties, stop, chat_template_kwargs)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Live:
    """Counters of the answer being streamed, for live tokens/s and draft share."""

    tokens: int = 0
    from_draft: int = 0
    started: float = field(default_factory=time.perf_counter)

    def stats(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        return {
            "generation_tokens": self.tokens,
            "tokens_per_second": self.tokens / elapsed if elapsed > 0 else 0.0,
            "from_draft": self.from_draft / self.tokens if self.tokens else 0.0,
        }


Loader = Callable[..., "Generator"]


class ChatController:
    """A conversation with one loaded model, driven from any UI thread."""

    def __init__(
        self,
        *,
        history_path: str | os.PathLike | None = None,
        system_prompt: str | None = None,
        settings: Settings | None = None,
        loader: Loader | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.events: queue.Queue[ChatEvent] = queue.Queue()
        self.history_path = Path(history_path).expanduser() if history_path else None
        self.messages: list[dict[str, str]] = []
        self.system_prompt = system_prompt or ""
        self.model_name: str | None = None
        self.saved_model: str | None = None  # the model named in the saved history
        self.answer = ""  # text of the answer streaming now, or of the last one
        self.last_stats: dict[str, Any] | None = None
        self.error: str | None = None  # the last error, for a UI to show; cleared on success
        self._loader = loader
        self._gen: Generator | None = None
        self._state = ChatState.IDLE
        self._live: _Live | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._mutex = threading.Lock()  # guards state changes between UI and worker threads
        if self.history_path is not None:
            self._read_history(keep_system=system_prompt is not None)

    # -- state ------------------------------------------------------------------------------------

    @property
    def state(self) -> ChatState:
        return self._state

    @property
    def busy(self) -> bool:
        return self._state is not ChatState.IDLE

    def _set_state(self, state: ChatState) -> None:
        self._state = state
        self.events.put(ChatEvent("state", state=state))

    def _fail(self, message: str) -> None:
        self.error = message
        self.events.put(ChatEvent("error", text=message))

    def live_stats(self) -> dict[str, Any] | None:
        """Tokens, tokens/s and the share of tokens that came from the draft, while streaming."""
        live = self._live
        return live.stats() if live is not None and self._state is not ChatState.IDLE else None

    def drain(self) -> list[ChatEvent]:
        """All events queued so far, without waiting (for UIs that poll on a timer)."""
        out: list[ChatEvent] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self.events.get_nowait())
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the current load or answer to finish; False on timeout."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def _start(self, state: ChatState, target: Callable[[], None]) -> None:
        self._stop.clear()
        self._set_state(state)
        self._worker = threads.start(self._run_worker, "ondevice-chat", args=(target,))

    def _run_worker(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # nothing may escape a worker thread: it becomes an error
            self._fail(_describe(e))
        finally:
            with self._mutex:
                self._live = None
                self._set_state(ChatState.IDLE)

    # -- model --------------------------------------------------------------------------------------

    def load(
        self,
        model: str | os.PathLike,
        *,
        draft: str | os.PathLike | None = None,
        draft_backend: str = "auto",
        dtype: str | None = None,
        quantize: int | None = None,
        prompt_cache: str | os.PathLike | None = None,
        prompt_cache_bytes: int | None = None,
        heads: str | os.PathLike | None = None,
        wait: bool = False,
    ) -> bool:
        """Load (or switch to) a model in the background. A running answer is stopped first;
        the current model is released before the new one loads, so two never share memory."""
        self.stop(wait=True)
        with self._mutex:
            if self.busy:
                self._fail("a model is already loading; wait for it to finish.")
                return False
            self._gen, self.model_name = None, None
            gc.collect()  # give the old model's memory back before the new one arrives
            options = {"draft": draft, "draft_backend": draft_backend, "dtype": dtype}
            if quantize is not None:
                options["quantize"] = quantize
            if prompt_cache is not None:
                options["prompt_cache"] = prompt_cache
            if prompt_cache_bytes is not None:
                options["prompt_cache_bytes"] = prompt_cache_bytes
            if heads is not None:
                options["heads"] = heads
            self._start(ChatState.LOADING, lambda: self._load(model, options))
        if wait:
            self.wait()
        return True

    def _load(self, model: Any, options: dict[str, Any]) -> None:
        loader = self._loader
        if loader is None:
            import ondevice

            loader = ondevice.load
        gen = loader(model, **options)
        from ondevice.apps.serve import warm_up

        warm_up(gen)
        self._gen, self.model_name, self.error = gen, gen.model_name, None
        self.events.put(ChatEvent("loaded", text=gen.model_name))

    def limits(self) -> dict[str, int | None] | None:
        """The loaded model's two limits: `context` (the verifier's: the longest conversation
        it answers) and `draft_window` (the draft's: past it, the draft drafts from the newest
        tokens only; None without a draft)."""
        gen = self._gen
        if gen is None:
            return None
        return {"context": gen.context_length, "draft_window": gen.draft_context}

    def prompt_cache_stats(self) -> dict[str, int] | None:
        """The loaded model's prompt cache: entries, bytes, hits, misses, evictions..."""
        gen = self._gen
        return gen.prompt_cache_stats() if gen is not None else None

    # -- conversation -------------------------------------------------------------------------------

    def send(self, text: str) -> bool:
        """Start answering `text`; False (with an error event) if that is not possible now."""
        text = text.strip()
        with self._mutex:
            if not text:
                self._fail("the message is empty.")
                return False
            if self._gen is None:
                what = (
                    "a model is still loading"
                    if self._state is ChatState.LOADING
                    else "no model is loaded"
                )
                self._fail(f"{what}; choose a model first.")
                return False
            if self.busy:
                self._fail("an answer is still being written; stop it or wait.")
                return False
            self.messages.append({"role": "user", "content": text})
            self.answer, self.error = "", None
            self._live = _Live()
            self._start(ChatState.GENERATING, self._answer)
        return True

    def stop(self, wait: bool = False) -> None:
        """Stop the answer being written; what was written so far stays in the history."""
        with self._mutex:
            if self._state is ChatState.GENERATING:
                self._stop.set()
                self._set_state(ChatState.STOPPING)
        if wait and self._state is ChatState.STOPPING:
            self.wait()

    def close(self) -> None:
        """Before the app exits: stop the answer (kept in the history), wait for a load to end,
        save, and end the model's generation thread (MLX aborts a process that exits while a
        thread it knows is alive)."""
        self.stop(wait=True)
        self.wait()
        self.save()
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.close()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.stop(wait=True)
        self.messages.clear()
        self.answer, self.last_stats = "", None
        self.save()

    def set_system_prompt(self, text: str) -> None:
        self.system_prompt = text.strip()
        self.save()

    def _prompt(self, gen: Generator) -> tuple[list[dict[str, str]], int]:
        """The messages to send and the answer budget, dropping the oldest turns when the
        conversation no longer fits the context (the saved history keeps them)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        turns = list(self.messages)
        while True:
            messages = system + turns
            room = gen.context_length - gen.count_tokens(messages)
            if room >= min(MIN_ANSWER_TOKENS, self.settings.max_tokens) or len(turns) <= 1:
                break
            turns = turns[2:] if len(turns) > 2 else turns[-1:]  # drop the oldest question+answer
        if room < 1:
            from ondevice.errors import ContextLengthError

            raise ContextLengthError(
                f"the message is too long for this model: it needs {gen.context_length - room} "
                f"tokens with the system prompt, and the context holds {gen.context_length}. "
                "Shorten it."
            )
        return messages, min(self.settings.max_tokens, room)

    def _answer(self) -> None:
        gen = self._gen
        assert gen is not None and self._live is not None
        live, s = self._live, self.settings
        stopped, stats = False, None
        try:
            messages, max_tokens = self._prompt(gen)
            stream = gen.stream(
                messages,
                max_tokens=max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                seed=s.seed,
                num_draft_tokens=s.num_draft_tokens,
                speculative=s.speculative,
                **s.extra,
            )
            try:
                for chunk in stream:
                    if self._stop.is_set():
                        stopped = True
                        break
                    if chunk is None:
                        continue
                    live.tokens += len(chunk.tokens)
                    live.from_draft += len(chunk.tokens) if chunk.from_draft else 0
                    if chunk.text:
                        self.answer += chunk.text
                        self.events.put(ChatEvent("text", text=chunk.text))
                    if chunk.stats is not None:
                        stats = dict(chunk.stats)
            finally:
                stream.close()  # ends the generation at once when we broke out early
        except BaseException:
            self._close_turn()
            raise
        self._close_turn()
        self.last_stats = stats if stats is not None else {**live.stats(), "stopped": True}
        self.save()
        self.events.put(ChatEvent("done", stats=self.last_stats, stopped=stopped))

    def _close_turn(self) -> None:
        """Keep user and assistant turns alternating: a question that got no answer at all
        (stopped at once, or failed) is taken back; a partial answer is kept."""
        if self.answer:
            self.messages.append({"role": "assistant", "content": self.answer})
        elif self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    # -- persistence ----------------------------------------------------------------------------------

    def save(self) -> bool:
        """Write the history (atomically) to `history_path`; errors become an error event."""
        if self.history_path is None:
            return True
        data = {
            "version": HISTORY_VERSION,
            "model": self.model_name or self.saved_model,
            "system_prompt": self.system_prompt,
            "messages": self.messages,
        }
        try:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".history-", dir=self.history_path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
            os.replace(tmp, self.history_path)
        except OSError as e:
            with contextlib.suppress(UnboundLocalError, OSError):
                os.unlink(tmp)
            self._fail(f"could not save the chat history to {self.history_path}: {e.strerror or e}")
            return False
        return True

    def _read_history(self, keep_system: bool) -> None:
        path = self.history_path
        assert path is not None
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            messages = data["messages"]
            ok = data.get("version") == HISTORY_VERSION and all(
                isinstance(m, dict)
                and m.get("role") in ("user", "assistant")
                and isinstance(m.get("content"), str)
                for m in messages
            )
            if not ok:
                raise ValueError("unknown version or malformed messages")
        except (OSError, ValueError, KeyError, TypeError) as e:
            # Keep the unreadable file for the user, and start afresh.
            backup = path.with_name(path.name + ".unreadable")
            with contextlib.suppress(OSError):
                os.replace(path, backup)
            self._fail(f"the chat history {path} could not be read ({e}); moved it to {backup}.")
            return
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if isinstance(data.get("model"), str):
            self.saved_model = data["model"]
        if not keep_system and isinstance(data.get("system_prompt"), str):
            self.system_prompt = data["system_prompt"]


def _describe(e: BaseException) -> str:
    from ondevice.errors import OndeviceError

    if isinstance(e, OndeviceError):
        return str(e)
    return f"{type(e).__name__}: {e}"
