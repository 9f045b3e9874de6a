"""`ondevice serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ondevice.apps.options import (
    add_chat_template_arguments,
    add_command,
    add_model_arguments,
    add_request_default_arguments,
    apply_chat_template_option,
    load_generator,
    request_defaults,
)
from ondevice.errors import OndeviceError

if TYPE_CHECKING:
    from ondevice.api import Generator

LOOPBACK = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "ONDEVICE_API_KEY"


def warm_up(gen: Generator) -> None:
    """Run a few tokens through verifier and draft in the loading thread: the first real
    request then pays no one-time setup, and arrays MLX created lazily while loading are
    materialised in the thread that owns their stream (a generation thread cannot)."""
    ids = gen.tokenizer.encode("Hello", add_special_tokens=False) or [0]
    gen.generate(ids, max_tokens=4, temperature=0.0, chat_template=False, cache_prompt=False)


DESCRIPTION = (
    "Serve one model over an OpenAI-compatible HTTP API "
    "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", "serve a model over an OpenAI-compatible HTTP API", DESCRIPTION)
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help=f"require 'Authorization: Bearer KEY' on every /v1 request, KEY read from PATH "
        f"(or set {API_KEY_ENV})",
    )
    p.add_argument(
        "--api-key",
        help=f"the key itself (visible to every local user in the process list: prefer "
        f"{API_KEY_ENV} or --api-key-file)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests for this Host name (default on loopback: 127.0.0.1, "
        "localhost, ::1 and the container host names host.docker.internal, "
        "host.containers.internal; other addresses answer any name unless this is given)",
    )
    p.add_argument(
        "--allow-origin",
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000, or '*'; repeatable or "
        "comma-separated) use the server, CORS preflights included; by default only pages on "
        "an allowed host may",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client has to send a request's head, and then its body (default: 30)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        metavar="N",
        help="requests that may wait for the model; more get 429 (default: 16)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        metavar="N",
        help="largest accepted request body (default: 4 MiB)",
    )
    p.add_argument(
        "--alias",
        "--name",
        dest="name",
        help="model id reported by /v1/models (default: the model's name); requests may name "
        "any model, since one is served",
    )
    add_chat_template_arguments(p)
    add_request_default_arguments(p)
    p.add_argument(
        "--log-level", default="info", type=str.lower, metavar="LEVEL",
        choices=("critical", "error", "warning", "info", "debug"),
        help="critical, error, warning, info or debug, any case (mlx_lm.server's INFO works; "
        "default: info)",
    )  # fmt: skip
    p.set_defaults(func=run)


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or $ONDEVICE_API_KEY (in that order), or None."""
    if args.api_key_file and args.api_key:
        raise OndeviceError("give the key once: --api-key-file or --api-key, not both.")
    if args.api_key_file:
        path = Path(args.api_key_file).expanduser()
        try:
            key = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise OndeviceError(f"--api-key-file {path}: cannot read it ({e}).") from None
        if not key:
            raise OndeviceError(f"--api-key-file {path}: the file is empty; put the key in it.")
        if os.name == "posix" and path.stat().st_mode & 0o077:
            print(
                f"warning: --api-key-file {path} is readable by other users of this machine; "
                f"make it private with `chmod 600 {path}`.",
                file=sys.stderr,
            )
        return key
    if args.api_key is not None:
        print(
            "warning: --api-key is visible to every user of this machine in the process list; "
            f"set {API_KEY_ENV} or use --api-key-file instead.",
            file=sys.stderr,
        )
        if not args.api_key.strip():
            raise OndeviceError("--api-key is empty.")
        return args.api_key.strip()
    return os.environ.get(API_KEY_ENV, "").strip() or None


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn, made before the model loads (minutes), so a busy
    port or an address this machine does not have is reported at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OndeviceError(f"--host {host}: not an address of this machine ({e}).") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OndeviceError(
                f"port {port} on {host} is in use (another server, or `ondevice serve` already "
                "running?); choose another with --port."
            ) from None
        raise OndeviceError(f"cannot listen on {host}:{port} ({e.strerror or e}).") from None
    return sock


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise OndeviceError(f"--port {args.port}: choose a port between 0 and 65535.")
    if args.max_queue < 0:
        raise OndeviceError(f"--max-queue {args.max_queue}: must be 0 or more.")
    if args.max_body_bytes < 1024:
        raise OndeviceError(f"--max-body-bytes {args.max_body_bytes}: must be at least 1024.")
    if not args.read_timeout > 0:
        raise OndeviceError(f"--read-timeout {args.read_timeout}: must be more than 0 seconds.")
    key = api_key(args)
    import uvicorn

    from ondevice.apps.server import LOOPBACK_HOSTS, OpenAIServer

    if args.host in LOOPBACK:
        hosts: tuple[str, ...] | None = (*LOOPBACK_HOSTS, *args.allow_host)
    else:  # reached by names we cannot know; --allow-host turns the check on
        hosts = (args.host, *LOOPBACK_HOSTS, *args.allow_host) if args.allow_host else None
    sock = listen_socket(args.host, args.port)  # a busy port fails now, not after the load
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    gen = load_generator(args)
    apply_chat_template_option(gen, args.chat_template, args.use_default_chat_template)
    warm_up(gen)
    server = OpenAIServer(
        gen,
        model_id=args.name,
        api_key=key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        allowed_hosts=hosts,
        allowed_origins=[o.strip() for a in args.allow_origin for o in a.split(",") if o.strip()],
        read_timeout=args.read_timeout,
        chat_template_kwargs=args.chat_template_args,
        request_defaults=request_defaults(args),
    )
    if args.host not in LOOPBACK and not key:
        print(
            f"warning: serving on {args.host} without an API key: anyone who can reach this "
            f"machine can use the model (set {API_KEY_ENV} or --api-key-file).",
            file=sys.stderr,
        )
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"serving '{server.model_id}' at http://{host}:{sock.getsockname()[1]}/v1 "
        f"(draft: {gen.draft_backend or 'none'}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    config = server.uvicorn_config(args.host, args.port, log_level=args.log_level)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
    return 0
