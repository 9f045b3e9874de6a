"""What the server does before and around every handler: the Host and Origin screen (with CORS
for allowed browser origins), a deadline for request heads, and the one mapping from an
exception to the OpenAI-shaped error a client sees."""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import h11
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from ondevice.apps.openai_schema import APIError
from ondevice.errors import ContextLengthError, OndeviceError

if TYPE_CHECKING:
    from ondevice.apps.server import OpenAIServer

# Names a loopback server answers to by default. A browser sends the name it resolved, so a page
# on attacker.example whose DNS later points at 127.0.0.1 (DNS rebinding) is refused. Besides
# loopback: the names a container uses for its host (Docker's and Podman's), which no public DNS
# resolves, so that a web UI in a container (Open WebUI's documented setup) reaches the server.
LOOPBACK_HOSTS = (
    "127.0.0.1", "localhost", "::1", "host.docker.internal", "host.containers.internal",
)  # fmt: skip
# Schemes of app pages (not web sites) allowed as origins by default, as Ollama does: editor
# webviews, Tauri and Electron apps, local files opened by an app. A web page cannot claim them.
APP_ORIGIN_SCHEMES = ("vscode-webview", "vscode-file", "tauri", "app", "file")
# Seconds a client has to send a request head, and then its body; a slow client is cut off.
DEFAULT_READ_TIMEOUT = 30.0
# The largest request head (request line and headers) served; a longer one gets 431.
MAX_HEAD_BYTES = 16 * 1024


def error_response(e: APIError) -> JSONResponse:
    # After a body that was cut short, too large or left unread, the connection's framing is
    # lost: close it.
    unread = getattr(e, "body_unread", False)
    headers = {"Connection": "close"} if e.status in (408, 413) or unread else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def api_error(e: BaseException) -> APIError:
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


def is_disconnect(e: BaseException) -> bool:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return isinstance(e, ClientDisconnect)


def hostname(value: str) -> str:
    """The host part of a Host header or an origin's netloc: '[::1]:80' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def screen(
    headers: Headers, allowed_hosts: set[str] | None, allowed_origins: set[str]
) -> APIError | None:
    """A foreign Host (421) or Origin (403), or None if the request may proceed."""
    host = hostname(headers.get("host", ""))
    if allowed_hosts is not None and host and host not in allowed_hosts:
        return APIError(
            421,
            f"Host '{host}' is not served here (allowed: {', '.join(sorted(allowed_hosts))}). "
            "Use one of those names, or start the server with `--allow-host NAME`.",
            code="host_not_allowed",
        )
    origin = headers.get("origin")
    if origin is not None and not _origin_allowed(origin, allowed_hosts, allowed_origins):
        return APIError(
            403,
            f"Requests from the web origin '{origin}' are refused: a web page may not use "
            "this server. Allow it with `ondevice serve --allow-origin ORIGIN`.",
            code="origin_not_allowed",
        )
    return None


def _origin_allowed(origin: str, allowed_hosts: set[str] | None, allowed_origins: set[str]) -> bool:
    origin = origin.strip().lower().rstrip("/")
    if "*" in allowed_origins or origin in allowed_origins:
        return True
    parts = urlsplit(origin)
    if parts.scheme in APP_ORIGIN_SCHEMES:
        return True
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False  # "null" (sandboxed frames, file://) and anything odd
    # Pages served from a name this server answers to (a local web UI) may use it.
    hosts = allowed_hosts if allowed_hosts is not None else set(LOOPBACK_HOSTS)
    return parts.hostname in hosts


class Screen:
    """ASGI middleware: refuses a foreign Host (421) or Origin (403) before any route runs,
    so unknown paths and /health are covered as well. A request from an allowed Origin gets
    CORS headers, and its preflight (OPTIONS) is answered here, so browser UIs on the origins
    of `--allowed-origins` can call the API."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            server = self.server
            error = _head_too_large(scope) or screen(
                headers, server.allowed_hosts, server.allowed_origins
            )
            if error is not None:
                server.metrics.count_request("(screened)", error.status)
                await error_response(error)(scope, receive, send)
                return
            origin = headers.get("origin")
            if origin is not None:  # allowed, or screen() would have refused it
                cors = _cors_headers(origin, headers)
                if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                    server.metrics.count_request("(preflight)", 204)
                    await Response(status_code=204, headers=cors)(scope, receive, send)
                    return
                send = _with_headers(send, cors)
        await self.app(scope, receive, send)


def _head_too_large(scope: Any) -> APIError | None:
    """431 if the request head is over MAX_HEAD_BYTES. h11 bounds only a head that arrives
    in pieces; one sent in a single packet (up to 64 KiB) reaches the app whole."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ())
    if size <= MAX_HEAD_BYTES:
        return None
    error = APIError(
        431,
        f"The request head (line and headers) is {size} bytes; at most {MAX_HEAD_BYTES} are "
        "served. Send fewer or shorter headers.",
        code="request_header_fields_too_large",
    )
    error.body_unread = True  # type: ignore[attr-defined]
    return error


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
