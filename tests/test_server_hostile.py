"""Issue 29's server findings, one test each (each fails on the server before the fix): a chat
template brought by the request, renderings bounded by what the client sent, client mistakes
that were 500s, metric labels, API keys, request heads and bodies buffered at once. Real HTTP
on loopback, a tiny model."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server import LiveServer, write_model
from test_server_reliability import _error, _rss_kb

import ondevice
from ondevice.apps.serve import warm_up

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> ondevice.Generator:
    gen = ondevice.load(write_model(tmp_path_factory.mktemp("hostile") / "tiny"))
    warm_up(gen)
    return gen


@pytest.fixture(scope="module")
def server(gen: ondevice.Generator):
    with LiveServer(gen, max_queue=2, read_timeout=2.0) as s:
        yield s


def _chat(server: LiveServer, **extra) -> dict:
    return {"model": server.api.model_id, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **extra}  # fmt: skip


def _post(server: LiveServer, body: dict | str | bytes, path: str = "/v1/chat/completions"):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=JSON, timeout=60)


# -- 1. a chat template from the request ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"template": "{{ 'ab ' * 1000000 }}"}, "'template' is reserved"),
        ({"chat_template": "{{ 'x' }}"}, "'chat_template' is reserved"),
        ({"tokenize": True}, "'tokenize' is reserved"),
        ({"messages": []}, "'messages' is reserved"),
        ({"add_generation_prompt": False}, "'add_generation_prompt' is reserved"),
        ({"documents": [{"text": "x"}]}, "'documents' is reserved"),
        ({"bos_token": "x"}, "'bos_token' is reserved"),
        ({"enable_thinking": {"a": [1, 2]}}, "enable_thinking"),
        ({"enable_thinking": ["x"] * 10}, "enable_thinking"),
        ({"note": "x" * 5000}, "note"),
        ({"n": 2**80}, "'n'"),
        ({"not an identifier": 1}, "not an identifier"),
        ({f"k{i}": 1 for i in range(40)}, "at most"),
    ],
)
def test_template_kwargs_are_short_scalars_under_free_names(server, gen, kwargs, says):
    """With the official client's extra_body, as clients send it. The first case rendered
    a 3 MB prompt from a 146-byte body (peak RSS +1.2 GB)."""
    client = server.client()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    before = _rss_kb("VmHWM")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template_kwargs": kwargs},
        )  # fmt: skip
    assert (_rss_kb("VmHWM") - before) / 1024 < 20
    err = e.value.body
    assert err["param"] == "chat_template_kwargs" and says in err["message"], err
    ok = client.chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False, "x": 1.5, "y": None}},
    )  # fmt: skip
    assert ok.usage.completion_tokens == 2


def test_a_rendering_is_bounded_by_what_the_client_sent(server, gen, monkeypatch):
    """A model template that loops over its input renders at most a multiple of the body (and
    of the template): here 100,000 copies of the message were rendered, then tokenized."""
    template = "{% for i in range(100000) %}{% for m in messages %}{{ m['content'] }}"
    template += "{% endfor %}{% endfor %}"
    monkeypatch.setattr(gen.tokenizer, "chat_template", template)
    body = {**_chat(server), "messages": [{"role": "user", "content": "ab " * 30}]}
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kb("VmHWM")
    t0 = time.monotonic()
    err = _error(_post(server, body), 400)
    assert "renders more than" in err["message"] and err["param"] == "messages"
    assert time.monotonic() - t0 < 5 and (_rss_kb("VmHWM") - before) / 1024 < 20


# -- 4. client mistakes that were 500s -------------------------------------------------------------


@pytest.mark.parametrize("where", ["max_tokens", "unknown", "nested"])
def test_an_integer_past_pythons_digit_limit_is_a_400(server, where):
    big = "9" * 5000
    if where == "max_tokens":
        body = json.dumps(_chat(server)).replace('"max_tokens": 2', f'"max_tokens": {big}')
    elif where == "unknown":
        body = json.dumps(_chat(server))[:-1] + f', "x": {big}}}'
    else:
        body = json.dumps(_chat(server))[:-1] + f', "x": [[{{"y": -{big}}}]]}}'
    err = _error(_post(server, body), 400)
    assert "too long" in err["message"]


@pytest.mark.parametrize("key", ["²", "①", "٣", "𝟘", "1" * 5000, "-1", " 1", "1.0"])
def test_logit_bias_keys_must_be_ascii_token_ids(server, key):
    err = _error(_post(server, _chat(server, logit_bias={key: 1})), 400)
    assert err["param"] == "logit_bias", err
    assert _post(server, _chat(server, logit_bias={"7": 1})).status_code == 200


# -- 5. metrics, keys, heads, bodies ---------------------------------------------------------------


def test_metric_labels_are_bounded_and_escaped(server):
    for i in range(50):
        httpx.put(server.url + f"/v1/models/x{i}")
        httpx.get(server.url + f"/nowhere/{i}")
    httpx.put(server.url + "/v1/models/a%22%7D%20ondevice_injected%201%0A")
    text = httpx.get(server.url + "/metrics").text
    assert "x17" not in text and "nowhere" not in text and "injected" not in text
    assert 'path="(unknown)",status="405"' in text and 'path="(unknown)",status="404"' in text
    from ondevice.apps.server_metrics import Metrics

    m = Metrics()  # without a list of paths (every path by name), labels are escaped
    m.count_request('/a"b\\c\nd', 404)
    assert 'path="/a\\"b\\\\c\\nd"' in m.render(0, False)


def test_a_utf8_api_key_matches_its_bytes(gen):
    with LiveServer(gen, api_key="clé-ünïcode") as s:
        url = s.url + "/v1/models"
        good = {"Authorization": "Bearer clé-ünïcode".encode()}
        assert httpx.get(url, headers=good).status_code == 200
        assert (
            httpx.get(url, headers={"Authorization": b"Bearer cl\xe9-\xfcn\xefcode"}).status_code
            == 401
        )
        assert httpx.get(url, headers={"Authorization": "Bearer x"}).status_code == 401


def test_a_key_file_readable_by_others_gets_a_warning(tmp_path, capsys):
    from ondevice.apps.cli import build_parser
    from ondevice.apps.serve import api_key

    keyfile = tmp_path / "key"
    keyfile.write_text("secret\n")
    keyfile.chmod(0o600)
    args = build_parser().parse_args(["serve", "--model", "m", "--api-key-file", str(keyfile)])
    assert api_key(args) == "secret" and capsys.readouterr().err == ""
    keyfile.chmod(0o644)
    assert api_key(args) == "secret"
    err = capsys.readouterr().err
    assert "readable by other users" in err and "chmod 600" in err


def _raw(server: LiveServer, data: bytes, wait: float = 5.0) -> bytes:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        sock.settimeout(wait)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out:
                    break
        except TimeoutError:
            pass
    return out


def test_request_heads_over_16_kib_get_431(server):
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    big = head + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"y" * 1000) for i in range(60)) + b"\r\n"
    assert len(big) > 60_000
    assert _raw(server, big).startswith(b"HTTP/1.1 431"), "a 60 KB head was served"
    small = head + b"X-Pad: " + b"y" * 8000 + b"\r\n\r\n"
    assert _raw(server, small).startswith(b"HTTP/1.1 200")


def test_bodies_read_at_once_are_bounded(gen):
    """40 clients sending 4 MiB bodies were all buffered (+131 MB); here the bytes held at once
    stay under `max_buffered_bytes`, and the rest are told to come back (503)."""
    with LiveServer(gen, max_body_bytes=64 * 1024, max_buffered_bytes=128 * 1024) as s:
        port = int(s.url.rsplit(":", 1)[1])
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += b"Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n"
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            for sock in socks:  # two bodies of 60 KB, both still arriving
                sock.sendall(head + b" " * 59_000)
            time.sleep(0.5)
            assert s.api.buffered == 118_000
            r = httpx.post(s.url + "/v1/chat/completions", json=_chat(s, note="x" * 20_000))
            assert _error(r, 503)["code"] == "too_many_bodies"
        finally:
            for sock in socks:
                sock.close()
        deadline = time.monotonic() + 5
        while s.api.buffered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.api.buffered == 0
        assert httpx.post(s.url + "/v1/chat/completions", json=_chat(s)).status_code == 200


def test_a_full_queue_answers_429_without_buffering_the_body(gen):
    """When the line is full, the body is read and dropped piece by piece (not held: 100 KB
    here where only 10 KB may be buffered), then 429; the connection stays usable."""
    with LiveServer(gen, max_queue=1, max_buffered_bytes=10 * 1024, read_timeout=2.0) as s:
        slot = s.api.slot
        slot.busy, slot.waiting = True, slot.max_queue
        try:
            body = json.dumps(_chat(s, note="x" * 100_000)).encode()
            with httpx.Client(base_url=s.url) as client:
                for _ in range(2):  # the same connection twice
                    r = client.post("/v1/chat/completions", content=body, headers=JSON)
                    assert _error(r, 429)["code"] == "queue_full"
            assert s.api.buffered == 0
        finally:
            slot.busy, slot.waiting = False, 0
