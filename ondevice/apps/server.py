"""An OpenAI-compatible HTTP server over one loaded model (starlette on uvicorn).

One generation runs at a time: requests queue for the model in arrival order, up to
`max_queue` waiting; beyond that the server answers 429. Generation runs in `Generator.astream`'s
worker thread, so the event loop keeps serving health checks, metrics and new arrivals. A client
that goes away cancels its generation, and the next request gets the model only once the worker
has really stopped.

Every request is screened before it reaches a handler (see docs/reliability.md): a Host outside
the allow-list (DNS rebinding) gets 421, a foreign Origin (a web page driving the local server)
403, a POST that is not JSON 415, a body that does not arrive in time 408, and a prompt that
cannot fit the context is refused after tokenizing at most a bounded prefix of it. Every error,
whichever handler raised it, is mapped once (`_api_error`) to OpenAI's error shape, so a client
mistake stays a 4xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import h11
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from ondevice.apps.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ValidationError,
    chat_logprobs,
    completion_logprobs,
    error_body,
    validation_message,
)
from ondevice.apps.tool_calls import ToolCall, ToolCallStream, tool_call_grammar
from ondevice.errors import ContextLengthError, OndeviceError

if TYPE_CHECKING:
    from ondevice.api import Chunk, Generator

# A long prompt is a few hundred KB of JSON; a body far beyond that is a mistake or an attack.
DEFAULT_MAX_BODY = 4 * 1024 * 1024
FINGERPRINT = "ondevice"
# Names a loopback server answers to by default. A browser sends the name it resolved, so a page
# on attacker.example whose DNS later points at 127.0.0.1 (DNS rebinding) is refused.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Seconds a client has to send a request head, and then its body; a slow client is cut off.
DEFAULT_READ_TIMEOUT = 30.0


# -- metrics ----------------------------------------------------------------------------------


@dataclass
class Metrics:
    """Counters for /metrics, written by hand in Prometheus' text format (a dozen lines)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    generations: int = 0
    last_tps: float = 0.0

    def count_request(self, path: str, status: int) -> None:
        self.requests[(path, status)] = self.requests.get((path, status), 0) + 1

    def count_generation(self, stats: dict[str, Any]) -> None:
        self.generations += 1
        self.prompt_tokens += int(stats.get("prompt_tokens", 0))
        self.generated_tokens += int(stats.get("generation_tokens", 0))
        self.drafted += int(stats.get("drafted", 0))
        self.accepted += int(stats.get("accepted", 0))
        self.last_tps = float(stats.get("tokens_per_second", 0.0))

    def render(
        self, queue_length: int, busy: bool, prompt_cache: dict[str, int] | None = None
    ) -> str:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        requests = [
            (f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())
        ]
        metrics = [
            ("requests_total", "counter", "HTTP requests by path and status code.", requests),
            ("generations_total", "counter", "Finished generations.", self.generations),
            ("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
            ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
            ("draft_tokens_total", "counter", "Tokens proposed by the draft.", self.drafted),
            ("accepted_tokens_total", "counter", "Draft tokens accepted.", self.accepted),
            ("acceptance_rate", "gauge", "Accepted / drafted tokens since start.", rate),
            ("tokens_per_second", "gauge", "Speed of the last generation.", self.last_tps),
            ("queue_length", "gauge", "Requests waiting for the model.", queue_length),
            ("generation_active", "gauge", "1 while the model is generating.", int(busy)),
        ]
        pc = prompt_cache or {}
        metrics += [
            (f"prompt_cache_{name}", kind, help_, pc.get(key, 0))
            for name, key, kind, help_ in (
                ("hits_total", "hits", "counter", "Prompts that started from cached KV."),
                ("misses_total", "misses", "counter", "Prompts with no cached prefix."),
                ("cached_tokens_total", "cached_tokens", "counter",
                 "Prompt tokens taken from the cache instead of prefilled."),
                ("evictions_total", "evictions", "counter", "Entries dropped to stay in budget."),
                ("entries", "entries", "gauge", "Token sequences whose KV is kept."),
                ("bytes", "bytes", "gauge", "Memory held by the prompt cache."),
                ("max_bytes", "max_bytes", "gauge", "The prompt cache's budget (--prompt-cache-mb)."),
            )
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_, value in metrics:
            samples = value if isinstance(value, list) else [("", value)]
            lines += [f"# HELP ondevice_{name} {help_}", f"# TYPE ondevice_{name} {kind}"]
            # integers (counters, bytes) exactly; `g` would round them to 6 digits
            lines += [
                f"ondevice_{name}{labels} {v if isinstance(v, int) else format(v, 'g')}"
                for labels, v in samples
            ]
        return "\n".join(lines) + "\n"


# -- one generation at a time ---------------------------------------------------------------

_END = object()


class ModelSlot:
    """The model, handed to one generation at a time, with a bounded line of waiting requests."""

    def __init__(self, gen: Generator, max_queue: int, metrics: Metrics) -> None:
        self.gen = gen
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting = 0
        self.busy = False
        self._lock = asyncio.Lock()  # FIFO: waiters are served in arrival order

    def start(self, prompt: Any, options: dict[str, Any]) -> Run:
        """Queue a generation (429 if the line is full) and return its handle at once."""
        if (self.busy or self._lock.locked()) and self.waiting >= self.max_queue:
            raise APIError(
                429,
                f"The server is busy: {self.waiting} request(s) already wait for the model "
                f"(--max-queue {self.max_queue}). Retry later.",
                type="rate_limit_error",
                code="queue_full",
            )
        self.waiting += 1
        return Run(self, prompt, options)


class Run:
    """One generation: a task that waits for the model and pumps chunks into a queue.

    The pump runs in its own task, outside the request's cancel scope, so that cancelling it
    is delivered once and `astream` can wait for its worker thread to stop before the model
    is released to the next request.
    """

    def __init__(self, slot: ModelSlot, prompt: Any, options: dict[str, Any]) -> None:
        self.slot = slot
        self.queued = True  # counted in slot.waiting (ModelSlot.start counted it)
        self.chunks: asyncio.Queue[Any] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump(prompt, options))

    def _leave_queue(self) -> None:
        if self.queued:
            self.queued = False
            self.slot.waiting -= 1

    async def _pump(self, prompt: Any, options: dict[str, Any]) -> None:
        slot = self.slot
        try:
            try:
                await slot._lock.acquire()
            finally:
                self._leave_queue()
            try:
                slot.busy = True
                async for chunk in slot.gen.astream(prompt, **options):
                    self.chunks.put_nowait(chunk)
                    if chunk.stats is not None:
                        slot.metrics.count_generation(chunk.stats)
            finally:
                slot.busy = False
                slot._lock.release()
        except asyncio.CancelledError:
            pass  # the consumer left; nobody reads the queue any more
        except BaseException as e:  # handed to the consumer, who turns it into an error reply
            self.chunks.put_nowait(e)
        finally:
            self.chunks.put_nowait(_END)

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        """Chunks as they arrive, grouped: all that are waiting when the consumer looks.

        A speculative round yields several tokens at once; sending them as one write instead
        of one each saves event-loop turns and system calls per token.
        """
        while True:
            items = [await self.chunks.get()]
            while not self.chunks.empty():
                items.append(self.chunks.get_nowait())
            done = items[-1] is _END
            chunks = items[:-1] if done else items
            for item in chunks:
                if isinstance(item, BaseException):
                    raise item
            if chunks:
                yield chunks
            if done:
                return

    def cancel(self) -> None:
        # A task cancelled before its first step never runs its body, so leave the queue here.
        self._leave_queue()
        self.task.cancel()  # no effect once the generation has finished


# -- the application --------------------------------------------------------------------------


class _ClosingStream(StreamingResponse):
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


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def _error_response(e: APIError) -> JSONResponse:
    # After a body that was cut short or too large, the connection's framing is lost: close it.
    headers = {"Connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _api_error(e: BaseException) -> APIError:
    """The one mapping from an exception to the error a client sees, used by every handler.

    anyio's task groups wrap whatever escapes them in an ExceptionGroup; the error inside is the
    one that counts. A mistake in the request (OndeviceError, a body nested too deeply to
    parse) is a 4xx; only what is left is the server's fault (500).
    """
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, OndeviceError):
        return APIError(400, str(e))
    if isinstance(e, RecursionError):
        return APIError(400, "The request body is nested too deeply.")
    return APIError(500, f"Internal error: {type(e).__name__}: {e}", type="server_error")


def _is_disconnect(e: BaseException) -> bool:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return isinstance(e, ClientDisconnect)


def _hostname(value: str) -> str:
    """The host part of a Host header or an origin's netloc: '[::1]:80' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class _Screen:
    """ASGI middleware: refuses a foreign Host (421) or Origin (403) before any route runs,
    so unknown paths and /health are covered as well. A request from an allowed Origin gets
    CORS headers, and its preflight (OPTIONS) is answered here, so browser UIs on the origins
    of `--allowed-origins` can call the API."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            error = self.server._screen(headers)
            if error is not None:
                self.server.metrics.count_request("(screened)", error.status)
                await _error_response(error)(scope, receive, send)
                return
            origin = headers.get("origin")
            if origin is not None:  # allowed, or _screen would have refused it
                cors = _cors_headers(origin, headers)
                if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                    self.server.metrics.count_request("(preflight)", 204)
                    await Response(status_code=204, headers=cors)(scope, receive, send)
                    return
                send = _with_headers(send, cors)
        await self.app(scope, receive, send)


def _cors_headers(origin: str, request: Headers) -> dict[str, str]:
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": request.get(
            "access-control-request-headers", "Authorization, Content-Type"
        ),
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }


def _with_headers(send: Any, extra: dict[str, str]) -> Any:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]

    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *raw]}
        await send(message)

    return wrapped


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head.

    uvicorn arms its keep-alive timer only after a response, and any byte cancels it, so a
    client that opens a connection and sends its head slowly (or not at all) holds the
    connection forever. Here the head must be complete `read_timeout` seconds after the
    connection opens or the previous response ends; the body has its own deadline in the app.
    """

    read_timeout = DEFAULT_READ_TIMEOUT

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.read_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no complete head: nothing to answer

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm_head_timer()  # a head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


class OpenAIServer:
    """Routes, authentication, validation and response shapes around one `ModelSlot`."""

    def __init__(
        self,
        gen: Generator,
        *,
        model_id: str | None = None,
        api_key: str | None = None,
        max_queue: int = 16,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        allowed_hosts: Iterable[str] | None = LOOPBACK_HOSTS,
        allowed_origins: Iterable[str] = (),
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        chat_template_kwargs: dict[str, Any] | None = None,
        request_defaults: dict[str, Any] | None = None,
    ) -> None:
        """allowed_hosts: Host names served (None: any, for servers reached by many names);
        allowed_origins: browser origins ('http://host:port', or '*') allowed besides those
        on an allowed host. Requests without an Origin (every non-browser client) pass."""
        self.gen = gen
        self.model_id = model_id or gen.model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.allowed_origins = {o.lower().rstrip("/") for o in allowed_origins}
        self.read_timeout = read_timeout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # values for request fields a request leaves out (`ondevice serve --temp ...`)
        self.request_defaults = dict(request_defaults or {})
        self.metrics = Metrics()
        self.slot = ModelSlot(gen, max_queue, self.metrics)
        self.created = int(time.time())
        table = [
            ("/v1/chat/completions", self.chat, "POST", True),
            ("/v1/completions", self.completions, "POST", True),
            ("/v1/models", self.models, "GET", True),
            ("/v1/models/{model_id:path}", self.model, "GET", True),
            ("/health", self.health, "GET", False),  # for probes: open even with --api-key
            ("/metrics", self.prometheus, "GET", True),
        ]
        routes = [
            Route(path, self._endpoint(handler, path, auth), methods=[method])
            for path, handler, method, auth in table
        ]
        self.app = Starlette(
            routes=routes,
            middleware=[Middleware(_Screen, server=self)],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
        )
        self.app.state.server = self

    def uvicorn_config(self, host: str = "127.0.0.1", port: int = 8080, **kwargs: Any) -> Any:
        """The uvicorn configuration this server is meant to run with: a deadline for request
        heads (`TimedH11Protocol`), idle keep-alive connections closed after 5 s, and request
        heads of at most 16 KiB."""
        import uvicorn

        protocol = type("_Timed", (TimedH11Protocol,), {"read_timeout": self.read_timeout})
        kwargs.setdefault("timeout_keep_alive", 5)
        kwargs.setdefault("h11_max_incomplete_event_size", 16 * 1024)
        return uvicorn.Config(self.app, host=host, port=port, http=protocol, **kwargs)

    # -- plumbing -------------------------------------------------------------------------------

    def _endpoint(
        self, handler: Callable[[Request], Awaitable[Response]], path: str, auth: bool
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self._check_key(request)
                response = await handler(request)
            except Exception as e:
                if _is_disconnect(e):
                    response = Response(status_code=499)  # nobody is listening; for the metrics
                else:
                    response = _error_response(_api_error(e))
            self.metrics.count_request(path, response.status_code)
            return response

        return endpoint

    def _screen(self, headers: Headers) -> APIError | None:
        """A foreign Host (421) or Origin (403), or None if the request may proceed."""
        host = _hostname(headers.get("host", ""))
        if self.allowed_hosts is not None and host and host not in self.allowed_hosts:
            return APIError(
                421,
                f"Host '{host}' is not served here (allowed: {', '.join(sorted(self.allowed_hosts))}). "
                "Use one of those names, or start the server with `--allow-host NAME`.",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin):
            return APIError(
                403,
                f"Requests from the web origin '{origin}' are refused: a web page may not use "
                "this server. Allow it with `ondevice serve --allow-origin ORIGIN`.",
                code="origin_not_allowed",
            )
        return None

    def _origin_allowed(self, origin: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (sandboxed frames, file://) and anything odd
        # Pages served from a name this server answers to (a local web UI) may use it.
        hosts = self.allowed_hosts if self.allowed_hosts is not None else set(LOOPBACK_HOSTS)
        return parts.hostname in hosts

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "Missing or incorrect API key. Send it as 'Authorization: Bearer <key>' "
                "(the key given to `ondevice serve` by ONDEVICE_API_KEY or --api-key-file).",
                code="invalid_api_key",
            )

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        if status == 404:
            msg = f"Unknown path {request.url.path}. This server offers /v1/chat/completions, "
            msg += "/v1/completions, /v1/models, /health and /metrics."
        elif status == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            msg = str(exc.detail)
        response = _error_response(APIError(status, msg))
        # Unknown paths share one label, so random URLs cannot grow the metrics without bound.
        self.metrics.count_request(request.url.path if status != 404 else "(unknown)", status)
        return response

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        response = _error_response(_api_error(exc))
        self.metrics.count_request(request.url.path, response.status_code)
        return response

    async def _json_body(self, request: Request) -> Any:
        # A form or text/plain POST is what a web page can send without asking (no CORS
        # preflight); requiring JSON closes that door and catches clients that forgot it.
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(
                415,
                f"Content-Type '{ctype or '(none)'}' is not supported: send the body as JSON "
                "with 'Content-Type: application/json'.",
                code="unsupported_media_type",
            )
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        try:
            with anyio.fail_after(self.read_timeout):
                async for part in request.stream():  # also bounds bodies sent without a length
                    body += part
                    if len(body) > self.max_body_bytes:
                        raise self._too_large()
        except TimeoutError:
            raise APIError(
                408,
                f"The request body did not arrive within {self.read_timeout:g} s.",
                code="request_timeout",
            ) from None
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"The request body is not valid JSON ({e}).") from None
        except RecursionError:
            raise APIError(400, "The request body is nested too deeply.") from None
        if b"\\ud" in body.lower():  # an escaped surrogate: is any of them unpaired?
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except RecursionError:
                raise APIError(400, "The request body is nested too deeply.") from None
            except UnicodeEncodeError as e:
                raise APIError(
                    400,
                    "The request body holds an unpaired UTF-16 surrogate "
                    f"('{e.object[e.start:e.end].encode('unicode_escape').decode()}'), which is "
                    "not text. Send valid Unicode.",
                ) from None
        return data

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"The request body is larger than {self.max_body_bytes} bytes "
            "(`ondevice serve --max-body-bytes`).",
            code="request_too_large",
        )

    def _parse(self, cls: type, data: Any) -> Any:
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.")
        try:
            req = cls.model_validate(data)
        except ValidationError as e:
            message, param = validation_message(e)
            raise APIError(400, message, param=param) from None
        # One model is served: any name reaches it (as with llama.cpp's server), so a client
        # configured for another model ("gpt-4o-mini") works unchanged.
        return req

    async def _options(self, req: Any, prompt: Any, chat_template: bool) -> dict[str, Any]:
        """Generation keyword arguments; checks the prompt and max_tokens against the context."""
        context = self.gen.context_length
        where = "messages" if chat_template else "prompt"
        # the chat template's inputs besides the messages: tools, keyword arguments (the
        # server's --chat-template-args, overridden per request)
        tools = req.tool_list() if isinstance(req, ChatCompletionRequest) else None
        kwargs = {**self.chat_template_kwargs, **(getattr(req, "chat_template_kwargs", None) or {})}
        chat = {"tools": tools, "template_kwargs": kwargs or None}

        def count() -> int | None:
            texts = _prompt_texts([prompt, tools, kwargs])
            if _surely_too_long(self.gen.tokenizer, texts, context):
                return None
            return self.gen.count_tokens(prompt, chat_template=chat_template, **chat)

        try:
            n_prompt = await anyio.to_thread.run_sync(count)
        except OndeviceError as e:
            raise APIError(400, str(e), param=where) from None
        grammar, spec = None, {}
        if req.response_format is not None:
            spec = {"json_schema": req.response_format.grammar_schema()}
        if tools and req.forced_tool()[0]:  # the answer must be one call: a grammar says so
            spec = {"lark": tool_call_grammar(tools, req.forced_tool()[1])}
        if spec.get("json_schema", spec.get("lark")) is not None:
            try:  # the first grammar of a model also reads its vocabulary (~0.5 s)
                grammar = await anyio.to_thread.run_sync(lambda: self.gen.grammar(**spec))
            except OndeviceError as e:
                param = "tool_choice" if "lark" in spec else "response_format"
                raise APIError(400, str(e), param=param) from None
        if n_prompt is None:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens, and the prompt alone "
                f"has more. Shorten the prompt.",
                param=where,
                code="context_length_exceeded",
            )
        if n_prompt == 0:
            raise APIError(400, "The prompt is empty: it encodes to no tokens.", param=where)
        if n_prompt >= context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens, and the prompt alone "
                f"has {n_prompt} tokens. Shorten the prompt.",
                param=where,
                code="context_length_exceeded",
            )
        given = req.model_fields_set
        defaults = {k: v for k, v in self.request_defaults.items() if k not in given}
        if "max_completion_tokens" in given:
            defaults.pop("max_tokens", None)
        max_tokens = req.max_tokens
        if "max_tokens" in defaults:  # the server's default: as much of it as fits
            max_tokens = min(defaults.pop("max_tokens"), context - n_prompt)
        if max_tokens is None:
            max_tokens = context - n_prompt
        if n_prompt + max_tokens > context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                f"{max_tokens} for the completion). Shorten the prompt or lower max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return {
            "max_tokens": max_tokens,
            **req.sampling(),
            "logprobs": req.logprobs_count(),
            "tools": tools,
            "chat_template_kwargs": kwargs or None,
            "grammar": grammar,
            "num_draft_tokens": req.num_draft_tokens,
            "speculative": req.speculative,
            "stop": req.stop_list(),
            "chat_template": chat_template,
            **defaults,  # the server's values for fields this request left out
        }

    # -- endpoints ------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        req = self._parse(ChatCompletionRequest, await self._json_body(request))
        prompt = req.prompt()
        return await self._generate(request, req, prompt, chat=True)

    async def completions(self, request: Request) -> Response:
        req = self._parse(CompletionRequest, await self._json_body(request))
        return await self._generate(request, req, req.prompt_value(), chat=False)

    async def _generate(self, request: Request, req: Any, prompt: Any, chat: bool) -> Response:
        options = await self._options(req, prompt, chat_template=chat)
        shape = _Shape(
            chat=chat,
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            created=int(time.time()),
            model=self.model_id,
            tokenizer=self.gen.tokenizer if options.get("logprobs") is not None else None,
            tools=bool(options.get("tools")),
        )
        run = self.slot.start(prompt, options)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _ClosingStream(shape.events(run, include_usage), on_close=run.cancel)
        try:
            text, last, logprobs = await _until_disconnect(request, _collect(run))
        finally:
            run.cancel()
        return JSONResponse(shape.response(text, last, logprobs))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model_id"] != self.model_id:
            raise APIError(
                404,
                f"The model '{request.path_params['model_id']}' does not exist on this server.",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "ondevice",
            "context_length": self.gen.context_length,
            "draft_backend": self.gen.draft_backend,
        }

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_id,
                "busy": self.slot.busy,
                "queue_length": self.slot.waiting,
            }
        )

    async def prometheus(self, request: Request) -> Response:
        text = self.metrics.render(
            self.slot.waiting, self.slot.busy, self.gen.prompt_cache_stats()
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _prompt_texts(value: Any) -> list[str]:
    """Every string the chat template may render: the prompt, or each message's content, tool
    calls and names, the tools and template arguments (token ids add nothing: their number is
    known already)."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [t for item in items for t in _prompt_texts(item)]


def _surely_too_long(tokenizer: Any, texts: Sequence[str], limit: int) -> bool:
    """True if `texts` surely hold more than `limit` tokens, found without tokenizing them whole.

    Each text is tokenized by prefixes that double in length, from 4 characters per token of
    `limit`, until the count passes the limit (with a margin for the token a cut may split) or
    the text ends. The work and memory are then bounded by the limit, not by the text: a 4 MB
    prompt tokenized whole holds ~300 MB of tokenizer state before it could be refused.
    """
    bound = limit + limit // 8 + 16 + 2 * len(texts)  # a piece can gain a token or two alone
    total = 0
    for text in texts:
        n_chars = 4 * max(limit, 1)
        while True:
            n = len(tokenizer.encode(text[:n_chars], add_special_tokens=False))
            if total + n > bound:
                return True
            if n_chars >= len(text):
                total += n
                break
            n_chars *= 2
    return False


async def _collect(run: Run) -> tuple[str, Chunk, list[Any]]:
    parts: list[str] = []
    logprobs: list[Any] = []
    last: Chunk | None = None
    try:
        async for chunks in run.batches():
            parts += [c.text for c in chunks]
            logprobs += [lp for c in chunks for lp in c.logprobs or ()]
            last = chunks[-1]
    except Exception as e:
        raise _api_error(e) from None
    if last is None:
        raise APIError(500, "The generation ended without a result.", type="server_error")
    return "".join(parts), last, logprobs


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
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
class _Shape:
    """The JSON shapes of one answer: chat or text completion, whole or as SSE chunks."""

    chat: bool
    id: str
    created: int
    model: str
    tokenizer: Any = None  # set when the request asked for logprobs
    tools: bool = False  # the request offered tools: tool calls in the text become tool_calls

    def _logprobs(self, logprobs: list[Any], offset: int = 0) -> dict[str, Any] | None:
        if self.tokenizer is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, logprobs)
        return completion_logprobs(self.tokenizer, logprobs, offset)

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
        if self.tools:
            parser = ToolCallStream()
            head, _ = parser.feed(text)
            tail, _ = parser.flush()
            text, calls = head + tail, parser.calls
        finish = "tool_calls" if calls else _finish(last)
        choice = self._choice(text if text or not calls else None, finish, streamed=False)
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
            yield _sse(
                self._envelope([self._choice("", None, True, role=True)], True) | usage_field
            )
        offset = 0  # characters sent so far (completions' text_offset)
        lps: list[Any] = []
        parser = ToolCallStream() if self.tools else None
        try:
            async for chunks in run.batches():
                events = []
                text = "".join(c.text for c in chunks)
                calls: list[ToolCall] = []
                if parser is not None:
                    text, calls = parser.feed(text)
                    if chunks[-1].finish_reason is not None:
                        rest, more = parser.flush()
                        text, calls = text + rest, calls + more
                # a token may complete no text yet (half a character): its logprob waits
                lps += [lp for c in chunks for lp in c.logprobs or ()]
                if text:
                    choice = self._choice(text, None, True)
                    choice["logprobs"] = self._logprobs(lps, offset)
                    lps = []
                    offset += len(text)
                    delta = self._envelope([choice], True)
                    events.append(_sse(delta | usage_field))
                first = len(parser.calls) - len(calls) if parser is not None else 0
                for n, call in enumerate(calls, first):  # each call whole, in one delta
                    choice = self._choice(None, None, True)
                    choice["delta"]["tool_calls"] = [call.as_openai(index=n)]
                    events.append(_sse(self._envelope([choice], True) | usage_field))
                last = chunks[-1]
                if last.finish_reason is not None:
                    stats = last.stats or {}
                    finish = "tool_calls" if parser is not None and parser.calls else _finish(last)
                    final = self._envelope([self._choice(None, finish, True)], True)
                    final["ondevice"] = stats
                    events.append(_sse(final | usage_field))
                    if include_usage:
                        events.append(_sse(self._envelope([], True) | {"usage": _usage(stats)}))
                if events:
                    yield "".join(events)
        except Exception as e:
            # Headers are gone already: report the error in the stream, as OpenAI does.
            yield _sse(_api_error(e).body())
        yield _sse("[DONE]")


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


def create_app(gen: Generator, **kwargs: Any) -> Starlette:
    """A starlette app serving `gen`; keyword arguments as for `OpenAIServer`."""
    return OpenAIServer(gen, **kwargs).app


__all__ = ["DEFAULT_MAX_BODY", "OpenAIServer", "create_app", "error_body"]
