"""Server habits of the ecosystem: CORS for allowed origins (on the same Origin check that
refuses foreign pages), any model name when one model is served, --alias, chat template
keyword arguments per request and from the command line, a default template for models without
one. Over real HTTP with the openai client and httpx."""

from __future__ import annotations

import httpx
import pytest
import tiny
from test_server import LiveServer

import ondevice

APP = "https://app.example"
MESSAGES = [{"role": "user", "content": "hello"}]
THINK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "assistant:"
)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return ondevice.load(tiny.write_model(tmp_path_factory.mktemp("h") / "m"))


@pytest.fixture(scope="module")
def server(gen):
    with LiveServer(gen, allowed_origins=[APP], model_id="my-alias") as s:
        yield s


def test_cors_preflight_and_headers_for_allowed_origins(server):
    url = server.url + "/v1/chat/completions"
    pre = {"Origin": APP, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    r = httpx.options(url, headers=pre)
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    body = {"model": "x", "messages": MESSAGES, "max_tokens": 2}
    r = httpx.post(url, json=body, headers={"Origin": APP})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    r = httpx.get(server.url + "/v1/models", headers={"Origin": APP})
    assert r.headers["access-control-allow-origin"] == APP
    # a foreign page gets no preflight answer and no CORS headers: the Origin check refuses it
    r = httpx.options(url, headers={**pre, "Origin": "https://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # clients without an Origin (curl, SDKs) see no CORS headers
    assert "access-control-allow-origin" not in httpx.post(url, json=body).headers


def test_any_model_name_reaches_the_one_model(server):
    client = server.client()
    for name in ("gpt-4o-mini", "my-alias", "whatever"):
        # greedy: an unseeded sample could meet the end-of-text id before 3 tokens
        r = client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=3, temperature=0
        )
        assert r.model == "my-alias" and r.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["my-alias"]


def test_chat_template_kwargs_per_request_and_from_the_server(gen):
    gen.tokenizer.chat_template = THINK_TEMPLATE
    try:
        with_kw = gen.count_tokens(MESSAGES, template_kwargs={"enable_thinking": False})
        plain = gen.count_tokens(MESSAGES)
        assert with_kw > plain
        with LiveServer(gen) as s:
            r = s.client().chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=1,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )  # fmt: skip
            assert r.usage.prompt_tokens == with_kw
        with LiveServer(gen, chat_template_kwargs={"enable_thinking": False}) as s:
            c = s.client()
            r = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
            assert r.usage.prompt_tokens == with_kw
            r = c.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=1,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}},
            )  # fmt: skip
            assert r.usage.prompt_tokens == plain  # the request's value wins
    finally:
        gen.tokenizer.chat_template = tiny.CHAT_TEMPLATE


def test_a_model_without_a_template_still_chats(gen):
    gen.tokenizer.chat_template = None
    try:
        with LiveServer(gen) as s:
            r = s.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            expected = gen.tokenizer.encode("user: hello\nassistant:", add_special_tokens=False)
            assert r.usage.prompt_tokens == len(expected)
    finally:
        gen.tokenizer.chat_template = tiny.CHAT_TEMPLATE


def test_server_defaults_for_fields_a_request_leaves_out(gen):
    """`ondevice serve --temp 0 --max-tokens 3` (mlx_lm.server's flags): the defaults apply
    only where a request is silent."""
    from ondevice.apps.cli import build_parser
    from ondevice.apps.options import request_defaults

    args = build_parser().parse_args(
        ["serve", "--model", "m", "--temp", "0", "--max-tokens", "3", "--top-k", "4"]
    )
    defaults = request_defaults(args)
    assert defaults == {"temperature": 0.0, "max_tokens": 3, "top_k": 4}
    greedy = gen.generate(MESSAGES, max_tokens=3, top_k=4)
    with LiveServer(gen, request_defaults=defaults) as s:
        c = s.client()
        r = c.chat.completions.create(model="m", messages=MESSAGES)
        assert r.usage.completion_tokens == 3 and r.choices[0].message.content == greedy.text
        r = c.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=5)
        assert r.usage.completion_tokens == 5
