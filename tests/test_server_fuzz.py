"""A property-based fuzz of every endpoint over real HTTP: whatever the body (every field the
schema accepts, with wrong types, nested template arguments, logit_bias keys in any script,
integers past Python's digit limit, deep and wide JSON), method, path or header, the answer is
never a 5xx, every error has OpenAI's shape, the server still answers, and its memory (it runs
in this process) stays within 100 MB of where it started.

150 examples per test in the suite (the server in this process); the issue's goal run has
2,000 per test with the server as `ondevice serve` in its own process, so that its memory is
measured apart from hypothesis' (docs/reliability.md has the figures):
    cd /tmp && ONDEVICE_FUZZ_SERVER=process ONDEVICE_FUZZ_EXAMPLES=2000 \
        PYTHONPATH=CHECKOUT python -m pytest -q -s CHECKOUT/tests/test_server_fuzz.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import LiveServer, write_model

import ondevice
from ondevice.apps.serve import warm_up

EXAMPLES = int(os.environ.get("ONDEVICE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize="ONDEVICE_FUZZ_EXAMPLES" not in os.environ,  # the suite is reproducible
)


def _rss_mb(field: str, pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


# The server runs as `ondevice serve` in its own process, so that its memory is measured apart
# from this one's: pytest's process also holds hypothesis' examples and whatever earlier test
# modules left to the allocator (CI once saw this process grow 204 MB while the server itself,
# measured alone, grows about 2 MB). ONDEVICE_FUZZ_SERVER=thread runs it in this process instead,
# for a debugger.
IN_PROCESS = os.environ.get("ONDEVICE_FUZZ_SERVER", "process") == "thread"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # The prompt cache keeps the KV of past prompts up to its budget by design (1 GiB by
    # default); a small one, full within the first examples, keeps that out of the RSS check.
    model = write_model(tmp_path_factory.mktemp("fuzz") / "tiny")
    context = LiveServerProcess(model) if not IN_PROCESS else None
    if context is None:
        gen = ondevice.load(model, prompt_cache_bytes=8 << 20)
        warm_up(gen)
        # the default body limit: a body past it is cut off (413, the connection closed)
        context = LiveServer(gen, max_queue=2, read_timeout=5.0)
    with context as s:
        s.pid = getattr(s, "pid", "self")
        with httpx.Client(base_url=s.url, timeout=60) as client:
            s.http = client
            s.requests = 0
            if Path(f"/proc/{s.pid}/clear_refs").exists():
                Path(f"/proc/{s.pid}/clear_refs").write_text("5")  # VmHWM := current RSS
            s.rss_start = _rss_mb("VmRSS", s.pid)
            yield s


class LiveServerProcess:
    """`ondevice serve` of `model` in a subprocess, with the fuzz's settings."""

    def __init__(self, model: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = SimpleNamespace(model_id="fuzz")
        self.cmd = [sys.executable, "-m", "ondevice", "serve", "--model", str(model),
                    "--port", str(self.port), "--name", "fuzz", "--max-queue", "2",
                    "--read-timeout", "5", "--prompt-cache-mb", "8", "--log-level", "error"]  # fmt: skip

    def __enter__(self) -> LiveServerProcess:
        self.proc = subprocess.Popen(self.cmd)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("the server did not start")

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# Text with what broke the server before: lone surrogates, the template's own markers, nulls.
text = st.lists(
    st.one_of(
        st.characters(codec="utf-8"),
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        st.sampled_from(["<|im_start|>", "<|im_end|>", "{{", "{%", "\x00", "\n"]),
    ),
    max_size=40,
).map("".join)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), text
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Generation length: small, or wrong. A model that may write the whole context makes the fuzz
# slow without testing more.
max_tokens = st.one_of(st.integers(-2, 8), st.sampled_from([0, 10**9, "4", 2.5, None, True]))
numbers = st.one_of(st.floats(-3, 3), st.integers(-2, 3), st.sampled_from(["1", None, []]))


# Markers replaced in the JSON text after dumping: what `json.dumps` cannot write itself.
HUGE = {
    '"@HUGE_INT@"': "9" * 5000,  # past Python's 4300-digit limit for int()
    '"@HUGE_NEG@"': "-" + "1" * 4301,
    '"@HUGE_FLOAT@"': "1e99999",  # inf after parsing
    '"@LONG_FLOAT@"': "0." + "1" * 5000,
}
huge = st.sampled_from([m.strip('"') for m in HUGE])
scalars = st.one_of(scalars, huge)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Deep (to 60 levels) and wide (to 300 members) JSON.
deep = st.builds(
    lambda depth, leaf, as_dict: _nest(depth, leaf, as_dict),
    st.integers(1, 60), scalars, st.booleans(),
)  # fmt: skip
wide = st.one_of(
    st.lists(scalars, min_size=50, max_size=300),
    st.dictionaries(st.text(max_size=6), scalars, min_size=50, max_size=300),
)
anything = st.one_of(anything, deep, wide)


def _nest(depth: int, leaf: Any, as_dict: bool) -> Any:
    for i in range(depth):
        leaf = {f"k{i}": leaf} if as_dict else [leaf]
    return leaf


# Template arguments: free names and reserved ones (template, tokenize, messages, ...), with
# scalars, long strings and nested values.
template_name = st.one_of(
    st.sampled_from(["enable_thinking", "add_vision_id", "x", "template", "chat_template",
                     "tokenize", "messages", "add_generation_prompt", "tools", "documents",
                     "bos_token", "raise_exception", "_private", "not a name", "return_dict"]),
    st.text(max_size=10),
)  # fmt: skip
template_kwargs = st.one_of(
    st.dictionaries(
        template_name,
        st.one_of(scalars, st.text(min_size=1000, max_size=1100), anything),
        max_size=5,
    ),
    anything,
)
# logit_bias: token ids, and keys from any script that str.isdigit() may accept ('²', '①')
bias_key = st.one_of(
    st.integers(-3, 300).map(str),
    st.sampled_from(["²", "①", "٣", "𝟘", "1" * 5000, " 1", "1.0", "0x1", ""]),
    st.text(max_size=6),
)
logit_bias = st.one_of(
    st.dictionaries(bias_key, st.one_of(st.floats(-150, 150), numbers, huge), max_size=5),
    anything,
)
tool = st.one_of(
    st.fixed_dictionaries({
        "type": st.sampled_from(["function", "other"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "get_weather", ""])},
            optional={"description": text, "parameters": st.one_of(
                st.just({"type": "object", "properties": {"a": {"type": "string"}}}), anything)},
        ),
    }),
    anything,
)  # fmt: skip
tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required", "any"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": text})}
    ),
    anything,
)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": text, "schema": st.one_of(
            st.just({"type": "object", "properties": {"a": {"type": "integer"}}}), anything)})}),
    anything,
)  # fmt: skip
# Fields OpenAI defines that this server refuses when set, and some it ignores.
refused = st.sampled_from(
    ["audio", "modalities", "prediction", "web_search_options", "functions", "function_call",
     "reasoning_effort", "best_of", "store", "verbosity", "reasoning", "metadata", "service_tier"]
)  # fmt: skip


def options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"max_tokens": max_tokens},
        optional={
            "max_completion_tokens": max_tokens,
            "min_p": numbers,
            "repetition_penalty": numbers,
            "presence_penalty": numbers,
            "frequency_penalty": numbers,
            "logit_bias": logit_bias,
            "chat_template_kwargs": template_kwargs,
            "tools": st.one_of(st.lists(tool, max_size=3), anything),
            "tool_choice": tool_choice,
            "parallel_tool_calls": st.one_of(st.booleans(), anything),
            "response_format": response_format,
            "top_logprobs": st.one_of(st.integers(-1, 25), anything),
            "user": st.one_of(text, anything),
            "echo": st.one_of(st.booleans(), anything),
            "suffix": st.one_of(text, anything),
            "temperature": numbers,
            "top_p": numbers,
            "top_k": st.one_of(st.integers(-1, 50), anything),
            "seed": st.one_of(st.integers(-(2**70), 2**70), anything),
            "stop": st.one_of(text, st.lists(text, max_size=5), anything),
            "stream": st.one_of(st.booleans(), anything),
            "stream_options": st.one_of(
                st.fixed_dictionaries({"include_usage": st.booleans()}), anything
            ),
            "n": st.one_of(st.integers(-1, 3), anything),
            "num_draft_tokens": st.one_of(st.integers(-3, 70), anything),
            "speculative": st.one_of(st.booleans(), anything),
            "logprobs": anything,
            "extra": anything,
        },
    )


message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": text}
    ),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "tool", "", "USER"]),
            "content": st.one_of(
                text,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3
                ),
                anything,
            ),
        },  # fmt: skip
    ),
    anything,
)
extras = st.dictionaries(refused, anything, max_size=2)
chat_body = st.one_of(
    st.builds(lambda m, o, x: {"model": "MODEL", "messages": m, **x, **o}, st.lists(message, max_size=4), options(), extras),
    st.builds(lambda m, o: {"model": m, "messages": [{"role": "user", "content": "hi"}], **o}, anything, options()),
    anything,
)  # fmt: skip
prompt = st.one_of(
    text,
    st.lists(text, max_size=2),
    st.lists(st.integers(-5, 200), max_size=8),
    st.lists(st.lists(st.integers(-5, 200), max_size=4), max_size=2),
    anything,
)
completion_body = st.one_of(
    st.builds(lambda p, o, x: {"model": "MODEL", "prompt": p, **x, **o}, prompt, options(), extras),
    anything,
)


def _post(server: LiveServer, path: str, body: Any) -> None:
    data = json.dumps(body).replace('"MODEL"', json.dumps(server.api.model_id))
    for marker, literal in HUGE.items():
        data = data.replace(marker, literal)
    server.requests += 1
    r = server.http.post(
        path,
        content=data.encode("utf-8", "surrogatepass"),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert r.json()["choices"], r.text


@FUZZ
@given(body=chat_body)
def test_chat_never_answers_5xx(server, body):
    _post(server, "/v1/chat/completions", body)


@FUZZ
@given(body=completion_body)
def test_completions_never_answer_5xx(server, body):
    _post(server, "/v1/completions", body)


# Other endpoints, methods, paths and headers.
method = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
path = st.one_of(
    st.sampled_from(["/v1/models", "/v1/models/x", "/health", "/metrics", "/v1/chat/completions",
                     "/v1/completions", "/", "/v1", "/v1/models/%22%0A", "/v1/embeddings"]),
    st.text(alphabet="abc/%.-_09", max_size=30).map(lambda p: "/" + p),
)  # fmt: skip
# (httpx itself refuses values with whitespace at either end)
header_value = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40
).map(str.strip)
headers = st.dictionaries(
    st.sampled_from(["Content-Type", "Authorization", "Origin", "Accept", "X-Anything",
                     "Access-Control-Request-Method", "Content-Encoding"]),
    header_value, max_size=4,
)  # fmt: skip


@FUZZ
@given(method=method, path=path, headers=headers, body=st.one_of(st.none(), anything))
def test_any_method_path_and_header_never_answer_5xx(server, method, path, headers, body):
    content = None if body is None else json.dumps(body).encode("utf-8", "surrogatepass")
    server.requests += 1
    r = server.http.request(method, path, headers=headers, content=content)
    assert r.status_code < 500, (method, path, headers, r.status_code, r.text)


def test_memory_stayed_within_100_mb(server):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc")
    peak = _rss_mb("VmHWM", server.pid)
    where = "in this process" if IN_PROCESS else "in its own process"
    print(f"\nfuzz: {server.requests} requests, server {where}: RSS {server.rss_start:.1f} MB "
          f"at the start, peak {peak:.1f} MB, now {_rss_mb('VmRSS', server.pid):.1f} MB")  # fmt: skip
    assert peak - server.rss_start < 100


def test_server_still_answers_after_the_fuzz(server):
    health = server.http.get("/health").json()
    assert health["status"] == "ok" and not health["busy"] and health["queue_length"] == 0
    r = server.http.post("/v1/chat/completions", json={"model": server.api.model_id, "max_tokens": 3,
                         "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
