"""The OpenAI-compatible server, started on a free loopback port with a tiny model and driven
with the official `openai` client (and httpx for raw HTTP and error cases)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tiny
import uvicorn

import ondevice
from ondevice.apps.serve import warm_up
from ondevice.apps.server import OpenAIServer
from ondevice.apps.server_metrics import Metrics
from ondevice.apps.server_queue import ModelSlot

CONTEXT = 2048
LONG = 1500  # max_tokens of generations that must still be running when we interfere


def write_model(path: Path, seed: int = 0) -> Path:
    """A tiny model whose EOS logit is always 0, so greedy answers never end early: the
    tests decide when a generation ends (max_tokens, stop strings, disconnects)."""
    cfg = tiny.make_config(max_position_embeddings=CONTEXT)
    weights = tiny.random_weights(cfg, seed=seed, scale=2.0)
    weights["lm_head.weight"][tiny.EOS_ID] = 0.0
    return tiny.write_model(path, weights=weights, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> ondevice.Generator:
    root = tmp_path_factory.mktemp("pair")
    verifier = write_model(root / "tiny-verifier")
    draft = tiny.perturbed_copy(verifier, root / "tiny-draft", noise=0.1)
    gen = ondevice.load(verifier, draft=draft, draft_backend="mlx")
    warm_up(gen)  # as `ondevice serve` does before it listens
    return gen


class LiveServer:
    """uvicorn in a background thread on a socket bound to a free loopback port."""

    def __init__(self, gen: ondevice.Generator, **kwargs) -> None:
        self.api = OpenAIServer(gen, **kwargs)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = self.api.uvicorn_config(log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive()

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kwargs)

    def wait_idle(self, limit: float) -> float:
        """Seconds until the model is free and nobody waits, failing after `limit` seconds."""
        t0 = time.monotonic()
        while True:
            health = httpx.get(self.url + "/health").json()
            if not health["busy"] and health["queue_length"] == 0:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < limit, f"model still busy after {limit} s: {health}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(gen) -> Iterator[LiveServer]:
    with LiveServer(gen, max_queue=1, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def model_id(gen) -> str:
    return gen.model_name


MESSAGES = [{"role": "user", "content": "hello there"}]


def _served(server: LiveServer) -> dict:
    """`generate`'s options for the text the server sends (special tokens hidden)."""
    return {"hide_tokens": server.api.hidden_tokens}


def test_chat_completion_matches_the_api(server, gen, model_id):
    ref = gen.generate(MESSAGES, max_tokens=24, temperature=0.0, **_served(server))
    resp = server.client().chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == ref.stats["prompt_tokens"]
    assert resp.usage.completion_tokens == 24 == len(ref.tokens)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 24
    stats = resp.model_extra["ondevice"]  # acceptance statistics as an extra field
    assert stats["drafted"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    assert stats["draft_backend"] == "mlx"


def test_chat_stream_format(server, gen, model_id):
    ref = gen.generate(MESSAGES, max_tokens=20, temperature=0.0, **_served(server))
    chunks = list(
        server.client().chat.completions.create(
            model=model_id,
            messages=MESSAGES,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *content, final, usage = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content[1:] + [final])
    assert all(c.choices[0].finish_reason is None for c in content)
    assert final.choices[0].finish_reason == "length"
    assert final.model_extra["ondevice"]["generation_tokens"] == 20
    assert "".join(c.choices[0].delta.content or "" for c in content) == ref.text
    # The usage-only chunk: no choices; the others carry usage null.
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert all(c.usage is None for c in content + [final])


def test_raw_stream_ends_with_done(server, model_id):
    body = {"model": model_id, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


def test_completions_whole_and_streamed(server, gen, model_id):
    client = server.client()
    ref = gen.generate(
        "Once upon", max_tokens=12, chat_template=False, temperature=0.0, **_served(server)
    )
    resp = client.completions.create(
        model=model_id, prompt="Once upon", max_tokens=12, temperature=0
    )
    assert resp.object == "text_completion"
    assert resp.choices[0].text == ref.text and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model=model_id,
            prompt="Once upon",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, usage = chunks
    assert "".join(c.choices[0].text for c in content) == ref.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert usage.usage.completion_tokens == 12
    # Token ids as the prompt give the same answer as the text they encode.
    ids = gen.tokenizer.encode("Once upon")
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == ref.text


def test_stop_strings_cut_across_token_boundaries(server, gen, model_id):
    full = gen.generate(MESSAGES, max_tokens=40, temperature=0.0, **_served(server)).text
    # Each character is its own token here, so a 3-character stop string spans 3 tokens.
    stop = full[10:13]
    expected = full[: full.index(stop)]
    client = server.client()
    kwargs = dict(model=model_id, messages=MESSAGES, max_tokens=40, temperature=0)
    resp = client.chat.completions.create(stop=[stop, "never-seen"], **kwargs)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stop=stop, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected and stop not in text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server, model_id):
    client = server.client()
    kwargs = dict(model=model_id, messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.9)
    a = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    assert a == b


def test_extra_fields_select_plain_decoding(server, gen, model_id):
    resp = server.client().chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"speculative": False},
    )
    assert resp.model_extra["ondevice"]["drafted"] == 0
    spec = server.client().chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"num_draft_tokens": 2},
    )
    # Lossless: the same greedy answer either way.
    assert spec.choices[0].message.content == resp.choices[0].message.content


def test_models_health_metrics(server, gen, model_id):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model_id]
    assert server.client().models.retrieve(model_id).id == model_id
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == model_id
    server.client().chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in r.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    key = 'ondevice_requests_total{path="/v1/chat/completions",status="200"}'
    assert samples[key] >= 1
    assert samples["ondevice_generated_tokens_total"] >= 3
    assert 0 < samples["ondevice_acceptance_rate"] <= 1
    assert samples["ondevice_tokens_per_second"] > 0
    assert samples["ondevice_queue_length"] == 0


JSON = {"Content-Type": "application/json"}


def _post(server: LiveServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, **kwargs)


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"messages": MESSAGES}, 400, "model", None),
        ({"model": "MODEL"}, 400, "messages", None),
        ({"model": "MODEL", "messages": []}, 400, "messages", None),
        ({"model": "MODEL", "messages": "hi"}, 400, "messages", None),
        ({"model": "MODEL", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", None),
        ({"model": "MODEL", "messages": MESSAGES, "temperature": "hot"}, 400, "temperature", None),
        ({"model": "MODEL", "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens", None),
        ({"model": "MODEL", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", None),
        ({"model": "MODEL", "messages": MESSAGES, "max_tokens": "10"}, 400, "max_tokens", None),
        ({"model": "MODEL", "messages": MESSAGES, "max_tokens": 10**12}, 400, "max_tokens", "context_length_exceeded"),
        ({"model": "MODEL", "messages": MESSAGES, "stop": ["a", ""]}, 400, "stop", None),
        ({"model": "MODEL", "messages": MESSAGES, "top_p": 0}, 400, "top_p", None),
        ({"model": "MODEL", "messages": MESSAGES, "n": 2}, 400, None, None),
        ({"model": "MODEL", "messages": MESSAGES, "stream": "yes"}, 400, "stream", None),
        ({"model": "MODEL", "messages": [{"role": "user", "content": "x" * (CONTEXT + 10)}]}, 400, "messages", "context_length_exceeded"),
    ],
)  # fmt: skip
def test_bad_chat_requests(server, model_id, body, status, param, code):
    body = json.loads(json.dumps(body).replace('"MODEL"', json.dumps(model_id)))
    r = _post(server, "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param and err["code"] == code


@pytest.mark.parametrize(
    "prompt", [5, ["a", "b"], [], [1, "a"], [[1, 2], [3]], [10**9]]
)  # prompt batches are not supported, and token ids must be in the vocabulary
def test_bad_completion_prompts(server, model_id, prompt):
    r = _post(server, "/v1/completions", json={"model": model_id, "prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"


def test_malformed_bodies_and_paths(server, model_id):
    cases = [
        (_post(server, "/v1/chat/completions", content=b"{not json", headers=JSON), 400),
        (_post(server, "/v1/chat/completions", content=b"\xff\xfe", headers=JSON), 400),
        (_post(server, "/v1/chat/completions", json=[1, 2]), 400),
        (_post(server, "/v1/chat/completions", content=b"x" * (65 * 1024), headers=JSON), 413),
        (httpx.get(server.url + "/v1/chat/completions"), 405),
        (httpx.get(server.url + "/v2/nothing"), 404),
    ]
    for r, status in cases:
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    # A body over the limit without a Content-Length (chunked) is refused as well.
    def chunks():
        for _ in range(80):
            yield b" " * 1024

    r = _post(server, "/v1/chat/completions", content=chunks(), headers=JSON)
    assert r.status_code == 413

    # The openai client turns these into its exception types.
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.with_options(base_url=server.url + "/v2").models.list()
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model_id, prompt="y" * (CONTEXT + 1))
    # ... and the server is still fine.
    ok = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_api_key(gen):
    with LiveServer(gen, api_key="sekrit") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").chat.completions.create(
                model=gen.model_name, messages=MESSAGES, max_tokens=2
            )
        r = httpx.post(s.url + "/v1/chat/completions", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key
        good = s.client(api_key="sekrit")
        assert [m.id for m in good.models.list().data] == [gen.model_name]
        resp = good.chat.completions.create(model=gen.model_name, messages=MESSAGES, max_tokens=2)
        assert resp.usage.completion_tokens == 2


def _long_stream(server: LiveServer, model_id: str, stack: contextlib.ExitStack):
    body = {"model": model_id, "messages": MESSAGES, "max_tokens": LONG, "stream": True}
    body["temperature"] = 0  # greedy: this model never ends an answer by itself
    r = stack.enter_context(
        httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60)
    )
    assert r.status_code == 200
    return r


def test_queue_full_gives_429(server, model_id):
    with contextlib.ExitStack() as stack:
        running = _long_stream(server, model_id, stack)
        lines = running.iter_lines()
        first = [next(lines) for _ in range(4)]  # generating now
        _long_stream(server, model_id, stack)  # headers are back: it is queued
        health = httpx.get(server.url + "/health").json()  # the event loop is not blocked
        assert health["busy"] and health["queue_length"] == 1, (health, first)
        with pytest.raises(openai.RateLimitError) as e:
            server.client().chat.completions.create(model=model_id, messages=MESSAGES)
        assert e.value.status_code == 429
        assert e.value.body["type"] == "rate_limit_error"
        metrics = httpx.get(server.url + "/metrics").text
        assert "ondevice_queue_length 1" in metrics
        assert 'path="/v1/chat/completions",status="429"} 1' in metrics
    server.wait_idle(limit=30)  # both clients left: the queue drains and the model is free


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_generation(server, gen, model_id, stream):
    """A client that goes away stops its generation; the model is then free and intact."""
    ref = gen.generate(MESSAGES, max_tokens=30, temperature=0.0, **_served(server)).text
    body = {"model": model_id, "messages": MESSAGES, "max_tokens": LONG, "temperature": 0}
    if stream:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}
        ) as r:
            lines = r.iter_lines()
            for _ in range(10):
                next(lines)
            t0 = time.monotonic()
            for _ in range(40):
                next(lines)
            per_token = (time.monotonic() - t0) / 40
        # Leaving the `with` closed the connection.
    else:
        per_token = 1 / gen.generate(MESSAGES, max_tokens=50).stats["tokens_per_second"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)
    # Finishing would take ~LONG tokens; stopping takes one round.
    idle_after = server.wait_idle(limit=60)
    assert idle_after < LONG * per_token / 5, (idle_after, per_token)
    again = server.client().chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=30, temperature=0
    )
    assert again.choices[0].message.content == ref


def test_slot_bookkeeping_survives_early_cancellation(gen):
    """A request that leaves before its generation task first runs must leave the queue."""

    async def scenario() -> None:
        slot = ModelSlot(gen, max_queue=1, metrics=Metrics())
        options = {"max_tokens": 5, "temperature": 0.0}
        run = slot.start(MESSAGES, options)
        assert slot.waiting == 1
        run.cancel()  # before the task's first step
        await asyncio.gather(run.task, return_exceptions=True)
        assert slot.waiting == 0 and not slot.busy
        waiting = slot.start(MESSAGES, options)  # a full line would raise 429 here
        chunks = [c async for batch in waiting.batches() for c in batch]
        assert chunks[-1].stats["generation_tokens"] == 5
        assert slot.waiting == 0 and not slot.busy

    asyncio.run(scenario())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_command(tmp_path):
    """`ondevice serve` end to end in a subprocess: loads, serves, stops on Ctrl-C."""
    model = write_model(tmp_path / "served")
    port = _free_port()
    cmd = [sys.executable, "-m", "ondevice", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--name", "tiny", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not come up"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert resp.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = proc.stderr.read()
    assert "serving 'tiny' at http://127.0.0.1:" in err
    assert proc.returncode == 0, err


def test_serve_rejects_bad_options(tmp_path, unfetchable_default_pair):
    from ondevice.apps.cli import main

    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", "70000"]) == 1
    # No --model means the catalog's default pair (pulled and converted on first use: a real
    # pair, gigabytes); here one that cannot be fetched offline.
    assert main(["serve", "--port", "0"]) == 1
