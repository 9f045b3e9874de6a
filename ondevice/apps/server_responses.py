"""The answer's side of the OpenAI API: chat and text completion bodies, whole or as
server-sent events (with usage, logprobs and tool calls), and collecting a run's chunks while
watching for the client to leave."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from ondevice.apps.openai_schema import APIError, chat_logprobs, completion_logprobs
from ondevice.apps.reasoning import ReasoningStream
from ondevice.apps.server_http import api_error
from ondevice.apps.server_queue import Run
from ondevice.apps.tool_calls import ToolCall, ToolCallStream

if TYPE_CHECKING:
    from ondevice.api import Chunk

FINGERPRINT = "ondevice"


class ClosingStream(StreamingResponse):
    """A streaming response that always runs `on_close`, also when the client disconnects
    before the first chunk (the body generator's own `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self.headers["X-Accel-Buffering"] = "no"  # proxies: do not buffer server-sent events
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def collect(run: Run) -> tuple[str, Chunk, list[Any]]:
    parts: list[str] = []
    logprobs: list[Any] = []
    last: Chunk | None = None
    try:
        async for chunks in run.batches():
            parts += [c.text for c in chunks]
            logprobs += [lp for c in chunks for lp in c.logprobs or ()]
            last = chunks[-1]
    except Exception as e:
        raise api_error(e) from None
    if last is None:
        raise APIError(500, "The generation ended without a result.", type="server_error")
    return "".join(parts), last, logprobs


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, but give up (ClientDisconnect) if the client closes the connection."""
    result: list[Any] = []
    gone = False

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        result.append(await work)
        tg.cancel_scope.cancel()
    if gone:
        raise ClientDisconnect()
    return result[0]


@dataclass
class Shape:
    """The JSON shapes of one answer: chat or text completion, whole or as SSE chunks."""

    chat: bool
    id: str
    created: int
    model: str
    tokenizer: Any = None  # set when the request asked for logprobs
    hidden: frozenset[int] = frozenset()  # token ids left out of the text
    # the names of the tools the request offered: tool calls in the text become tool_calls
    tools: frozenset[str] = frozenset()
    max_calls: int | None = None  # 1 for parallel_tool_calls: false
    # split <think>...</think> into reasoning_content: None (no), False (if the answer opens
    # with <think>), True (the prompt opened it)
    thinking: bool | None = None

    def _parsers(self) -> tuple[ReasoningStream | None, ToolCallStream | None]:
        thoughts = ReasoningStream(self.thinking) if self.thinking is not None else None
        return thoughts, ToolCallStream(self.tools) if self.tools else None

    def _calls(self, parser: ToolCallStream | None, calls: list[ToolCall]) -> list[ToolCall]:
        """`calls` found now, but none beyond `max_calls` in the whole answer."""
        if parser is None or self.max_calls is None:
            return calls
        room = max(self.max_calls - (len(parser.calls) - len(calls)), 0)
        return calls[:room]

    def _logprobs(self, logprobs: list[Any], offset: int = 0) -> dict[str, Any] | None:
        if self.tokenizer is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, logprobs, self.hidden)
        return completion_logprobs(self.tokenizer, logprobs, offset, self.hidden)

    def _envelope(self, choices: list[dict[str, Any]], streamed: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if streamed else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
        }

    def _choice(self, text: str | None, finish: str | None, streamed: bool, role: bool = False):
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if streamed:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}

    def response(self, text: str, last: Chunk, logprobs: list[Any]) -> dict[str, Any]:
        stats = last.stats or {}
        calls: list[ToolCall] = []
        thoughts, parser = self._parsers()
        reasoning = ""
        if thoughts is not None:
            reasoning, head = thoughts.feed(text)
            more, tail = thoughts.flush()
            reasoning, text = reasoning + more, head + tail
        if parser is not None:
            head, _ = parser.feed(text)
            tail, _ = parser.flush()
            text, calls = head + tail, self._calls(parser, parser.calls)
        finish = "tool_calls" if calls else _finish(last)
        choice = self._choice(text if text or not calls else None, finish, streamed=False)
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
        if calls:
            choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
        choice["logprobs"] = self._logprobs(logprobs)
        body = self._envelope([choice], False)
        body["usage"] = _usage(stats)
        body["ondevice"] = stats
        return body

    async def events(self, run: Run, include_usage: bool) -> AsyncIterator[str]:
        usage_field = {"usage": None} if include_usage else {}
        if self.chat:  # OpenAI announces the role first, with empty content
            yield sse(self._envelope([self._choice("", None, True, role=True)], True) | usage_field)
        offset = 0  # characters sent so far (completions' text_offset)
        lps: list[Any] = []
        thoughts, parser = self._parsers()
        sent_calls = 0
        try:
            async for chunks in run.batches():
                events = []
                text = "".join(c.text for c in chunks)
                ended = chunks[-1].finish_reason is not None
                reasoning = ""
                if thoughts is not None:
                    reasoning, text = thoughts.feed(text)
                    if ended:
                        more, tail = thoughts.flush()
                        reasoning, text = reasoning + more, text + tail
                calls: list[ToolCall] = []
                if parser is not None:
                    text, calls = parser.feed(text)
                    if ended:
                        rest, more_calls = parser.flush()
                        text, calls = text + rest, calls + more_calls
                    calls = self._calls(parser, calls)
                # a token may complete no text yet (half a character): its logprob waits
                lps += [lp for c in chunks for lp in c.logprobs or ()]
                if text or reasoning:
                    choice = self._choice(text or None, None, True)
                    if reasoning:
                        choice["delta"]["reasoning_content"] = reasoning
                    choice["logprobs"] = self._logprobs(lps, offset)
                    lps = []
                    offset += len(text)
                    delta = self._envelope([choice], True)
                    events.append(sse(delta | usage_field))
                first, sent_calls = sent_calls, sent_calls + len(calls)
                for n, call in enumerate(calls, first):  # each call whole, in one delta
                    choice = self._choice(None, None, True)
                    choice["delta"]["tool_calls"] = [call.as_openai(index=n)]
                    events.append(sse(self._envelope([choice], True) | usage_field))
                last = chunks[-1]
                if last.finish_reason is not None:
                    stats = last.stats or {}
                    finish = "tool_calls" if sent_calls else _finish(last)
                    final = self._envelope([self._choice(None, finish, True)], True)
                    final["ondevice"] = stats
                    events.append(sse(final | usage_field))
                    if include_usage:
                        events.append(sse(self._envelope([], True) | {"usage": _usage(stats)}))
                if events:
                    yield "".join(events)
        except Exception as e:
            # Headers are gone already: report the error in the stream, as OpenAI does.
            yield sse(api_error(e).body())
        yield sse("[DONE]")


def _finish(chunk: Chunk) -> str:
    return "length" if chunk.finish_reason == "length" else "stop"


def _usage(stats: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(stats.get("prompt_tokens", 0)), int(stats.get("generation_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's field: prompt tokens whose KV came from the prompt cache
        "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens", 0))},
    }
