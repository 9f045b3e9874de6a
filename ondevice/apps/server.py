"""An OpenAI-compatible HTTP server over one loaded model (starlette on uvicorn).

One generation runs at a time: requests queue for the model in arrival order, up to
`max_queue` waiting; beyond that the server answers 429. Generation runs in `Generator.astream`'s
worker thread, so the event loop keeps serving health checks, metrics and new arrivals. A client
that goes away cancels its generation, and the next request gets the model only once the worker
has really stopped.

Every request is screened before it reaches a handler (see docs/reliability.md): a Host outside
the allow-list (DNS rebinding) gets 421, a foreign Origin (a web page driving the local server)
403, a POST that is not JSON 415, a body that does not arrive in time 408, a request head over
16 KiB 431, and a prompt that cannot fit the context is refused after tokenizing at most a
bounded prefix of it. Bodies are buffered only while the model's line has room (else 429) and
all bodies being read stay within `max_buffered_bytes` (else 503); the chat template gets only
short scalar arguments from a request, and its rendering is bounded by what the client sent
and abandoned when the client leaves. Every error,
whichever handler raised it, is mapped once (`server_http.api_error`) to OpenAI's error shape, so a client
mistake stays a 4xx.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ondevice.apps import reasoning, tool_calls
from ondevice.apps.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ValidationError,
    error_body,
    validation_message,
)
from ondevice.apps.server_http import (
    DEFAULT_READ_TIMEOUT,
    LOOPBACK_HOSTS,
    MAX_HEAD_BYTES,
    Screen,
    TimedH11Protocol,
    api_error,
    error_response,
    is_disconnect,
)
from ondevice.apps.server_metrics import Metrics
from ondevice.apps.server_queue import ModelSlot
from ondevice.apps.server_responses import ClosingStream, Shape, collect, until_disconnect
from ondevice.apps.tool_calls import tool_call_grammar
from ondevice.errors import OndeviceError
from ondevice.models.tokenizer import render_limit
from ondevice.runtime.drift import check_domain

if TYPE_CHECKING:
    from ondevice.api import Generator

# Names the kind of request ("code", "chat", ...) whose draft acceptance a generation counts
# towards; /health and /metrics compare each kind with what the bundle recorded.
DOMAIN_HEADER = "X-Ondevice-Domain"
# A long prompt is a few hundred KB of JSON; a body far beyond that is a mistake or an attack.
DEFAULT_MAX_BODY = 4 * 1024 * 1024
# Request bodies held in memory at once, over all connections: beyond it a request gets 503
# before its body is read (40 clients sending 4 MiB each would otherwise all be buffered).
DEFAULT_MAX_BUFFERED = 4 * DEFAULT_MAX_BODY


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
        max_buffered_bytes: int | None = None,
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
        self.max_buffered_bytes = max_buffered_bytes or max(DEFAULT_MAX_BUFFERED, max_body_bytes)
        self.buffered = 0  # bytes of request bodies being read now
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.allowed_origins = {o.lower().rstrip("/") for o in allowed_origins}
        self.read_timeout = read_timeout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # values for request fields a request leaves out (`ondevice serve --temp ...`)
        self.request_defaults = dict(request_defaults or {})
        tok = gen.tokenizer
        # special tokens (<|im_start|>, <|endoftext|>, ...) never reach `content`; the markers
        # the server reads (tool calls, thinking) stay
        markers = (tool_calls.OPEN, tool_calls.CLOSE, reasoning.OPEN, reasoning.CLOSE)
        self.hidden_tokens = tok.special_ids(keep=markers) - tok.eos_token_ids
        # thinking is split from the answer for vocabularies that have the tags
        self.reasoning = all(
            _token_id(tok, t) is not None for t in (reasoning.OPEN, reasoning.CLOSE)
        )
        self.metrics = Metrics()
        self.slot = ModelSlot(gen, max_queue, self.metrics)
        self.created = int(time.time())
        table = [
            ("/v1/chat/completions", self.chat, "POST", True),
            ("/v1/completions", self.completions, "POST", True),
            # without /v1, as mlx-lm's and llama.cpp's servers also answer
            ("/chat/completions", self.chat, "POST", True),
            ("/completions", self.completions, "POST", True),
            ("/v1/models", self.models, "GET", True),
            ("/v1/models/{model_id:path}", self.model, "GET", True),
            ("/health", self.health, "GET", False),  # for probes: open even with --api-key
            ("/metrics", self.prometheus, "GET", True),
        ]
        self.metrics.known_paths = {path for path, *_ in table}
        routes = [
            Route(path, self._endpoint(handler, path, auth), methods=[method])
            for path, handler, method, auth in table
        ]
        self.app = Starlette(
            routes=routes,
            middleware=[Middleware(Screen, server=self)],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
        )
        self.app.state.server = self

    def uvicorn_config(self, host: str = "127.0.0.1", port: int = 8080, **kwargs: Any) -> Any:
        """The uvicorn configuration this server is meant to run with: a deadline for request
        heads (`TimedH11Protocol`), idle keep-alive connections closed after 5 s, and request
        heads of at most 16 KiB (`MAX_HEAD_BYTES`; `Screen` answers a longer one 431)."""
        import uvicorn

        protocol = type("_Timed", (TimedH11Protocol,), {"read_timeout": self.read_timeout})
        kwargs.setdefault("timeout_keep_alive", 5)
        kwargs.setdefault("h11_max_incomplete_event_size", MAX_HEAD_BYTES)
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
                if is_disconnect(e):
                    response = Response(status_code=499)  # nobody is listening; for the metrics
                else:
                    response = error_response(api_error(e))
            self.metrics.count_request(path, response.status_code)
            return response

        return endpoint

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Header values arrive as bytes (starlette decodes them as latin-1): compare the bytes
        # the client sent with the key's UTF-8, so a non-ASCII key works.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("latin-1"), self.api_key.encode("utf-8")
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
            msg += "/v1/completions (also without /v1), /v1/models, /health and /metrics."
        elif status == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            msg = str(exc.detail)
        response = error_response(APIError(status, msg))
        # Unknown paths share one label, so random URLs cannot grow the metrics without bound.
        self.metrics.count_request(request.url.path if status != 404 else "(unknown)", status)
        return response

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        response = error_response(api_error(exc))
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
        if declared and declared.isascii() and declared.isdigit():
            if int(declared) > self.max_body_bytes:
                raise self._too_large()
        try:  # 429 before the body is buffered: it would only wait in vain
            self.slot.check_room()
        except APIError:
            await self._read_body(request, keep=False)  # drained, so the client hears the 429
            raise
        body = await self._read_body(request)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"The request body is not valid JSON ({e}).") from None
        except RecursionError:
            raise APIError(400, "The request body is nested too deeply.") from None
        except ValueError as e:  # an integer literal past Python's digit limit (4300)
            raise APIError(
                400, f"The request body holds a number that is too long ({e})."
            ) from None
        if b"\\ud" in body.lower():  # an escaped surrogate: is any of them unpaired?
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except RecursionError:
                raise APIError(400, "The request body is nested too deeply.") from None
            except UnicodeEncodeError as e:
                raise APIError(
                    400,
                    "The request body holds an unpaired UTF-16 surrogate "
                    f"('{e.object[e.start : e.end].encode('unicode_escape').decode()}'), which is "
                    "not text. Send valid Unicode.",
                ) from None
        return data

    async def _read_body(self, request: Request, keep: bool = True) -> bytearray:
        """The body, read within the deadline, at most `max_body_bytes` of it, and only while
        all bodies being read together stay within `max_buffered_bytes` (else 503). A body
        that is not kept (or not kept any more) is read to its end and dropped piece by
        piece: the client then hears the answer instead of a reset connection."""
        body = bytearray()
        n = 0
        busy: APIError | None = None
        try:
            with anyio.fail_after(self.read_timeout):
                async for part in request.stream():  # also bounds bodies sent without a length
                    n += len(part)
                    if n > self.max_body_bytes:
                        raise self._too_large()
                    if not keep or busy is not None:
                        continue
                    if self.buffered + len(part) > self.max_buffered_bytes:
                        busy = APIError(
                            503,
                            "The server is reading too many request bodies at once "
                            f"({self.max_buffered_bytes} bytes in all). Retry later.",
                            type="server_busy",
                            code="too_many_bodies",
                        )
                        self.buffered -= len(body)
                        body = bytearray()
                        continue
                    body += part
                    self.buffered += len(part)
        except TimeoutError:
            raise APIError(
                408,
                f"The request body did not arrive within {self.read_timeout:g} s.",
                code="request_timeout",
            ) from None
        finally:
            self.buffered -= len(body)
        if busy is not None:
            raise busy
        return body

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

    def _render_bound(self, prompt: Any, tools: Any, kwargs: Any) -> int:
        """The most characters the chat template may render for a request: proportional to
        what the client sent (as JSON) and the template, and never more than the context can
        hold (no token holds more than `max_token_chars` characters)."""
        tok = self.gen.tokenizer
        sent = len(json.dumps([prompt, tools, kwargs], ensure_ascii=False))
        template = len(tok.chat_template or "")
        fits = 2 * self.gen.context_length * tok.max_token_chars() + template
        return min(16 * (sent + template) + 65536, fits)

    async def _options(
        self, request: Request, req: Any, prompt: Any, chat_template: bool
    ) -> dict[str, Any]:
        """Generation keyword arguments; checks the prompt and max_tokens against the context.
        The result also holds `thinking` for `Shape` (the caller takes it out): None when no
        thinking is split, else whether the prompt already opened a <think> block."""
        tools, kwargs = self._template_inputs(req)
        n_prompt, opened = await self._count_prompt(request, prompt, chat_template, tools, kwargs)
        grammar = await self._grammar(req, tools)
        self._check_prompt(req, n_prompt, "messages" if chat_template else "prompt")
        max_tokens, defaults = self._max_tokens(req, n_prompt)
        stop = req.stop_list()
        if tools and not getattr(req, "parallel_tool_calls", True):
            # one call at most: the answer ends with the first call's closing tag
            stop = [*(stop or ()), tool_calls.CLOSE]
        return {
            "thinking": (opened if self.reasoning and chat_template else None),
            "max_tokens": max_tokens,
            **req.sampling(),
            "logprobs": req.logprobs_count(),
            "tools": tools,
            "chat_template_kwargs": kwargs or None,
            "grammar": grammar,
            "num_draft_tokens": req.num_draft_tokens,
            "speculative": req.speculative,
            "method": req.method,
            "stop": stop,
            "chat_template": chat_template,
            "cache_prompt": req.cache_prompt,
            "hide_tokens": self.hidden_tokens,
            **defaults,  # the server's values for fields this request left out
        }

    def _template_inputs(self, req: Any) -> tuple[list[dict] | None, dict[str, Any]]:
        """The chat template's inputs besides the messages: tools, keyword arguments (the
        server's --chat-template-args, overridden per request)."""
        tools = req.tool_list() if isinstance(req, ChatCompletionRequest) else None
        kwargs = {**self.chat_template_kwargs, **(getattr(req, "chat_template_kwargs", None) or {})}
        if getattr(req, "reasoning_effort", None) is not None:  # for templates that read it
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        return tools, kwargs

    async def _count_prompt(
        self, request: Request, prompt: Any, chat_template: bool, tools: Any, kwargs: dict
    ) -> tuple[int | None, bool]:
        """(the prompt's tokens, None when surely longer than the context; whether it ends
        with an opened <think>), rendered off the event loop and abandoned if the client
        leaves."""
        context = self.gen.context_length
        chat = {"tools": tools, "template_kwargs": kwargs or None}
        cancel = threading.Event()  # set when the client leaves
        opened = False  # the prompt ends with <think>: the answer starts thinking

        def count() -> int | None:
            nonlocal opened
            texts = _prompt_texts([prompt, tools, kwargs])
            if _surely_too_long(self.gen.tokenizer, texts, context):
                return None
            with render_limit(self._render_bound(prompt, tools, kwargs), cancel):
                ids = self.gen.encode_prompt(prompt, chat_template, **chat)
            if self.reasoning and chat_template:
                tail = self.gen.tokenizer.decode(ids[-4:])
                opened = tail.rstrip().endswith(reasoning.OPEN)
            return len(ids)

        async def counted() -> int | None:
            try:  # a rendering left behind stops at its next piece of output
                return await anyio.to_thread.run_sync(count, abandon_on_cancel=True)
            except OndeviceError as e:
                where = "messages" if chat_template else "prompt"
                raise APIError(400, str(e), param=where) from None
            finally:
                cancel.set()

        n_prompt = await until_disconnect(request, counted())
        return n_prompt, opened

    async def _grammar(self, req: Any, tools: Any) -> Any:
        """The grammar the request constrains its answer with (a forced tool call's, or its
        grammar / json_schema / response_format), or None."""
        constrained = req.grammar_spec()
        if tools and req.forced_tool()[0]:  # the answer must be one call: a grammar says so
            constrained = "tool_choice", {"lark": tool_call_grammar(tools, req.forced_tool()[1])}
        if constrained is None:
            return None
        param, spec = constrained
        try:  # the first grammar of a model also reads its vocabulary (~0.5 s)
            return await anyio.to_thread.run_sync(lambda: self.gen.grammar(**spec))
        except OndeviceError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    def _check_prompt(self, req: Any, n_prompt: int | None, where: str) -> None:
        """APIError 400 for an empty prompt, or one (or a num_ctx) beyond the context."""
        context = self.gen.context_length
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
        if req.num_ctx is not None and req.num_ctx > context:
            raise APIError(
                400,
                f"options.num_ctx {req.num_ctx} is more than this model's context ({context} "
                "tokens), which is fixed when it is loaded.",
                param="options.num_ctx",
            )

    def _max_tokens(self, req: Any, n_prompt: int) -> tuple[int, dict[str, Any]]:
        """(max_tokens, the server's defaults for the other fields the request left out):
        without a limit, what fits in the context; one that does not fit is an APIError."""
        context = self.gen.context_length
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
        return max_tokens, defaults

    # -- endpoints ------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        req = self._parse(ChatCompletionRequest, await self._json_body(request))
        prompt = req.prompt()
        return await self._generate(request, req, prompt, chat=True)

    async def completions(self, request: Request) -> Response:
        req = self._parse(CompletionRequest, await self._json_body(request))
        prompt = req.prompt_value()
        if req.suffix is not None:
            prompt = self._fill_in_the_middle(prompt, req.suffix)
            # the middle ends where the model writes end-of-text or another FIM marker (not
            # every GGUF file counts <|endoftext|> as an end-of-sequence token)
            req.stop = [*(req.stop_list() or ()), *FIM_ENDS]
        return await self._generate(request, req, prompt, chat=False)

    def _fill_in_the_middle(self, prompt: str | list[int], suffix: str) -> list[int]:
        """The prompt in the model's fill-in-the-middle form (prefix, suffix, then the middle
        the model writes), built from its FIM tokens; 400 if its vocabulary has none."""
        tok = self.gen.tokenizer
        for names in FIM_TOKENS:
            ids = [_token_id(tok, name) for name in names]
            if all(i is not None for i in ids):
                break
        else:
            raise APIError(
                400,
                "'suffix' (fill in the middle) needs a model trained for it, whose vocabulary "
                "has FIM tokens (such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>); this "
                "one has none. Use a code model such as Qwen2.5-Coder, or leave suffix out.",
                param="suffix",
            )
        pre, suf, mid = ids
        head = prompt if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=False)
        bos = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
        tail = tok.encode(suffix, add_special_tokens=False)
        return [*bos, pre, *head, suf, *tail, mid]  # type: ignore[list-item]

    async def _generate(self, request: Request, req: Any, prompt: Any, chat: bool) -> Response:
        options = await self._options(request, req, prompt, chat_template=chat)
        options["domain"] = _domain(request)
        thinking = options.pop("thinking")
        tools = options.get("tools") or ()
        parallel = getattr(req, "parallel_tool_calls", True)
        shape = Shape(
            chat=chat,
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            created=int(time.time()),
            model=self.model_id,
            tokenizer=self.gen.tokenizer if options.get("logprobs") is not None else None,
            hidden=self.hidden_tokens,
            tools=frozenset(t["function"]["name"] for t in tools),
            max_calls=None if parallel else 1,
            thinking=thinking,
        )
        run = self.slot.start(prompt, options)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return ClosingStream(shape.events(run, include_usage), on_close=run.cancel)
        try:
            text, last, logprobs = await until_disconnect(request, collect(run))
        finally:
            run.cancel()
        return JSONResponse(shape.response(text, last, logprobs))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        # any name reaches the one served model (as requests do); `root` names that model
        return JSONResponse(self._model_card(request.path_params["model_id"]))

    def _model_card(self, name: str | None = None) -> dict[str, Any]:
        return {
            "id": name or self.model_id,
            "root": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "ondevice",
            "context_length": self.gen.context_length,
            "draft_backend": self.gen.draft_backend,
            # past this many tokens the draft drafts from the newest ones only
            "draft_context_length": self.gen.draft_context,
        }

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_id,
                "busy": self.slot.busy,
                "queue_length": self.slot.waiting,
                "draft_acceptance": self.gen.acceptance_drift(),
            }
        )

    async def prometheus(self, request: Request) -> Response:
        text = self.metrics.render(self.slot.waiting, self.slot.busy, self.gen.prompt_cache_stats())
        text += self.gen.drift.prometheus()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _domain(request: Request) -> str | None:
    """The request's domain for the draft's acceptance (header DOMAIN_HEADER), checked."""
    value = request.headers.get(DOMAIN_HEADER)
    try:
        return check_domain(value)
    except OndeviceError as e:
        raise APIError(400, f"header {DOMAIN_HEADER}: {e}", param=DOMAIN_HEADER) from None


# Fill-in-the-middle token sets, (prefix, suffix, middle), in prefix-suffix-middle order:
# Qwen2.5-Coder's, StarCoder's, DeepSeek-Coder's.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)
# Where a filled-in middle ends: end-of-text and file markers, and any FIM marker.
FIM_ENDS = (
    "<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<file_sep>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", *(t for names in FIM_TOKENS for t in names),
)  # fmt: skip


def _token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the one token whose text is `text` (an added token), or None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None


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


def create_app(gen: Generator, **kwargs: Any) -> Starlette:
    """A starlette app serving `gen`; keyword arguments as for `OpenAIServer`."""
    return OpenAIServer(gen, **kwargs).app


__all__ = ["DEFAULT_MAX_BODY", "OpenAIServer", "create_app", "error_body"]
