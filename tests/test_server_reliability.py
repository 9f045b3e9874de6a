"""Issue 16's server findings, one test each (each fails on the server before the fix): memory
before the queue, client errors answered with 500, cross-site requests and DNS rebinding, slow
clients, and the API key kept off the command line. Real HTTP on loopback, a tiny model."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import CONTEXT, LiveServer, write_model

import ondevice
from ondevice.apps.serve import warm_up
from ondevice.apps.server import _surely_too_long
from ondevice.errors import OndeviceError

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> ondevice.Generator:
    root = tmp_path_factory.mktemp("pair")
    gen = ondevice.load(write_model(root / "tiny"))
    warm_up(gen)
    return gen


@pytest.fixture(scope="module")
def server(gen: ondevice.Generator):
    with LiveServer(gen, max_queue=2, max_body_bytes=5 * 1024 * 1024, read_timeout=1.0) as s:
        yield s


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _chat(server: LiveServer, content: str, **extra) -> dict:
    return {"model": server.api.model_id, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **extra}  # fmt: skip


# -- 1. memory before the queue ------------------------------------------------------------------


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("where", ["messages", "prompt", "tools"])
def test_a_4mb_prompt_is_refused_before_it_is_tokenized(server, gen, monkeypatch, where):
    """The server runs in this process: its peak RSS (VmHWM, reset first) while answering a
    4 MB prompt stays under 50 MB above where it started. Tokenized whole, this character-level
    model's 4M tokens took ~1.6 GB before the 400."""
    text = "ab " * (4_000_000 // 3)
    path = "/v1/completions" if where == "prompt" else "/v1/chat/completions"
    if where == "messages":
        body = json.dumps(_chat(server, text)).encode()
    elif where == "prompt":
        body = json.dumps({"model": server.api.model_id, "prompt": text, "max_tokens": 2}).encode()
    else:  # tool descriptions are rendered into the prompt too
        template = "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        monkeypatch.setattr(gen.tokenizer, "chat_template", template)
        tool = {
            "type": "function",
            "function": {"name": "f", "description": text, "parameters": {}},
        }
        body = json.dumps(_chat(server, "hi", tools=[tool])).encode()
    with httpx.Client(timeout=60) as client:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        before = _rss_kb("VmHWM")
        r = client.post(server.url + path, content=body, headers=JSON)
        peak = _rss_kb("VmHWM")
    err = _error(r, 400)
    assert err["code"] == "context_length_exceeded" and f"{CONTEXT} tokens" in err["message"]
    assert (peak - before) / 1024 < 50, f"RSS rose {(peak - before) / 1024:.0f} MB"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab c\n<|>", max_size=400), limit=st.integers(1, 64))
def test_the_early_length_check_never_refuses_what_fits(gen, text, limit):
    if _surely_too_long(gen.tokenizer, [text], limit):
        assert len(gen.tokenizer.encode(text, add_special_tokens=False)) > limit


# -- 2. client errors are 4xx in OpenAI's shape --------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_lone_surrogate_is_a_400(server, path):
    if path == "/v1/chat/completions":
        body = json.dumps(_chat(server, "hi \ud800 there"))  # json escapes it as \ud800
    else:
        body = json.dumps({"model": server.api.model_id, "prompt": "x\udfff", "max_tokens": 2})
    err = _error(httpx.post(server.url + path, content=body, headers=JSON), 400)
    assert "surrogate" in err["message"]
    # A valid pair of escaped surrogates is an emoji, and fine.
    ok = json.dumps(_chat(server, "smile \U0001f600"))
    assert "\\ud83d" in ok
    assert httpx.post(server.url + path, content=ok, headers=JSON).status_code != 500


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_nesting_is_a_400(server, depth):
    for body in ("[" * depth + "]" * depth, '{"model": ' + "[" * depth + "]" * depth + "}"):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=JSON)
        assert "nested too deeply" in _error(r, 400)["message"]


def test_a_chat_template_that_raises_is_a_400(server, gen, monkeypatch):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('start with user') }}"
    template += "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    monkeypatch.setattr(gen.tokenizer, "chat_template", template)
    body = {"model": server.api.model_id, "max_tokens": 2,
            "messages": [{"role": "assistant", "content": "hi"}]}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert "start with user" in _error(r, 400)["message"]
    with pytest.raises(OndeviceError, match="start with user"):
        gen.generate(body["messages"], max_tokens=2)


@pytest.mark.parametrize("prompt", ["", [""]])
def test_empty_completion_prompt_is_a_400(server, prompt):
    body = {"model": server.api.model_id, "prompt": prompt, "max_tokens": 2}
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream})
        assert _error(r, 400)["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_errors_during_generation_keep_their_status(server, gen, monkeypatch, stream):
    """An OndeviceError raised while generating crossed anyio's task group as an
    ExceptionGroup and reached the client as a 500."""

    def failing(*args, **kwargs):
        raise OndeviceError("the generation refused these options")
        yield  # a generator, as `stream` is

    monkeypatch.setattr(gen, "stream", failing)
    body = _chat(server, "hello", stream=stream)
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    if not stream:
        err = _error(r, 400)
    else:  # headers were sent: the error comes in the stream, as OpenAI's does
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
        err = events[-1]["error"]
    assert err["message"] == "the generation refused these options"
    assert err["type"] == "invalid_request_error"


# -- 3. cross-site requests and DNS rebinding ----------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/health", "/v1/models", "/nowhere"])
def test_foreign_host_is_refused(server, path):
    method = "POST" if "chat" in path else "GET"
    body = _chat(server, "hi") if method == "POST" else None
    r = httpx.request(method, server.url + path, json=body, headers={"Host": "attacker.example"})
    assert _error(r, 421)["code"] == "host_not_allowed"
    for host in ("localhost", "127.0.0.1:1234", "[::1]:8080"):
        r = httpx.request(method, server.url + path, json=body, headers={"Host": host})
        assert r.status_code != 421, (host, r.text)


def test_foreign_origin_and_non_json_posts_are_refused(server):
    url = server.url + "/v1/chat/completions"
    body = json.dumps(_chat(server, "hi"))
    # What a web page can send without a CORS preflight: text/plain and form posts.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = httpx.post(url, content=body, headers={"Content-Type": ctype})
        assert _error(r, 415)["code"] == "unsupported_media_type"
        r = httpx.post(
            url, content=body, headers={"Content-Type": ctype, "Origin": "https://evil.example"}
        )
        assert _error(r, 403)["code"] == "origin_not_allowed"
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
        r = httpx.post(url, content=body, headers={**JSON, "Origin": origin})
        assert _error(r, 403)["code"] == "origin_not_allowed", origin
    assert httpx.post(url, content=body, headers={}).status_code == 415  # no type at all
    # A page on the machine itself (a local web UI), and clients that send no Origin, are fine.
    for headers in ({**JSON, "Origin": "http://localhost:5173"}, JSON):
        assert httpx.post(url, content=body, headers=headers).status_code == 200
    assert (
        httpx.post(
            url, content=body, headers={"Content-Type": "application/json; charset=utf-8"}
        ).status_code
        == 200
    )


def test_allow_lists_can_be_widened(gen):
    with LiveServer(gen, allowed_hosts=None, allowed_origins=["https://app.example"]) as s:
        body = _chat(s, "hi")
        r = httpx.post(s.url + "/v1/chat/completions", json=body,
                       headers={"Host": "my-mac.local", "Origin": "https://app.example"})  # fmt: skip
        assert r.status_code == 200, r.text
        r = httpx.post(
            s.url + "/v1/chat/completions", json=body, headers={"Origin": "https://other.example"}
        )
        assert r.status_code == 403


# -- 8. slow clients -------------------------------------------------------------------------------


def _closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes `sock` (and what it sent), failing after `limit`."""
    sock.settimeout(limit)
    t0, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {limit} s; it sent {data!r}")
    return time.monotonic() - t0, data


def test_a_silent_or_slow_client_is_cut_off(server):
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:  # says nothing at all
        waited, _ = _closed_after(sock, 5)
    assert waited < 3
    with socket.create_connection(("127.0.0.1", port)) as sock:  # a head, one line at a time
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        with pytest.raises(OSError):  # the server closes while we still write
            for i in range(40):
                sock.sendall(f"X-Slow-{i}: y\r\n".encode())
                time.sleep(0.1)
        assert time.monotonic() - t0 < 3
    with socket.create_connection(("127.0.0.1", port)) as sock:  # a body that never completes
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        sock.sendall(head.encode() + b'{"model": ')
        waited, data = _closed_after(sock, 5)
    assert waited < 3 and data.startswith(b"HTTP/1.1 408"), data[:200]
    assert httpx.get(server.url + "/health").status_code == 200


# -- 9. the API key off the command line ---------------------------------------------------------


def _serve_args(*argv: str):
    from ondevice.apps.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "m", *argv])


def test_api_key_from_environment_or_file(tmp_path, monkeypatch, capsys):
    from ondevice.apps.serve import API_KEY_ENV, api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(_serve_args()) == "from-env"
    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\n")
    keyfile.chmod(0o600)  # private: no warning (issue 29)
    assert api_key(_serve_args("--api-key-file", str(keyfile))) == "from-file"
    assert capsys.readouterr().err == ""
    assert api_key(_serve_args("--api-key", "on-argv")) == "on-argv"
    assert "process list" in capsys.readouterr().err  # still accepted, with a warning
    for argv, message in [
        (("--api-key-file", str(tmp_path / "missing")), "cannot read"),
        (("--api-key-file", str(keyfile), "--api-key", "x"), "not both"),
    ]:
        with pytest.raises(OndeviceError, match=message):
            api_key(_serve_args(*argv))
    keyfile.write_text("\n")
    with pytest.raises(OndeviceError, match="empty"):
        api_key(_serve_args("--api-key-file", str(keyfile)))
