"""The server as the tools people already use drive it (issue 28): Continue's fill-in-the-middle
autocomplete, Open WebUI in Docker, LangChain's reasoning_effort, the official client with None
values, llama.cpp's and Ollama's extension fields, reasoning models' <think> answers. Replayed
requests go over real HTTP (httpx), the rest through the official `openai` client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tiny
from test_server import CONTEXT, MESSAGES, LiveServer, write_model
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

import ondevice
from ondevice.apps.reasoning import ReasoningStream
from ondevice.apps.serve import warm_up

# Qwen2.5-Coder's FIM and control tokens, special as a GGUF file marks them, and Qwen3's
# thinking tags, which its tokenizer.json does not mark special.
EXTRA = [
    "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|endoftext|>",
    "<|repo_name|>", "<|file_sep|>", "<think>", "</think>",
]  # fmt: skip
# A ChatML template that reads `reasoning_effort`, and opens the thinking when asked to
# (as templates of thinking-only models do).
TEMPLATE = (
    "{% if reasoning_effort %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if open_thinking %}<think>\n{% endif %}{% endif %}"
)


# room for every printable character (braces too), then made-up tokens that `EXTRA` replaces
VOCAB = 112


def write_coder_model(path: Path) -> Path:
    """`test_server.write_model`'s endless tiny model, with `VOCAB` tokens."""
    cfg = tiny.make_config(max_position_embeddings=CONTEXT, vocab_size=VOCAB)
    weights = tiny.random_weights(cfg, seed=0, scale=2.0)
    weights["lm_head.weight"][tiny.EOS_ID] = 0.0
    tiny.write_model(path, weights=weights, max_position_embeddings=CONTEXT, vocab_size=VOCAB)
    return coder_tokenizer(path)


def coder_tokenizer(path: Path) -> Path:
    """Replace the tokenizer of the tiny model in `path`: its last made-up tokens become
    `EXTRA`, and its template `TEMPLATE`."""
    toks = tiny.vocabulary(VOCAB)
    assert "~" in toks[: -len(EXTRA)]  # every printable character stays
    toks[-len(EXTRA) :] = EXTRA
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in tiny.SPECIALS + EXTRA[:-2]]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA[-2:]])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def coder(tmp_path_factory) -> ondevice.Generator:
    root = tmp_path_factory.mktemp("coder")
    verifier = write_coder_model(root / "coder")
    draft = tiny.perturbed_copy(verifier, root / "draft", noise=0.1)
    coder_tokenizer(draft)  # the same vocabulary (perturbed_copy wrote the plain one)
    gen = ondevice.load(verifier, draft=draft, draft_backend="mlx")
    warm_up(gen)
    return gen


@pytest.fixture(scope="module")
def server(coder) -> Iterator[LiveServer]:
    with LiveServer(coder) as s:
        yield s


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Iterator[LiveServer]:
    """A model without FIM or thinking tokens (tests/tiny.py's vocabulary)."""
    gen = ondevice.load(write_model(tmp_path_factory.mktemp("plain") / "plain"), draft=None)
    with LiveServer(gen) as s:
        yield s


def tid(gen: ondevice.Generator, text: str) -> int:
    (i,) = gen.tokenizer.encode(text, add_special_tokens=False)
    return i


def _post(server: LiveServer, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def _sse(r: httpx.Response) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text
    return [json.loads(ln) for ln in lines[:-1]]


def _error(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# -- 1. Continue's autocomplete: FIM template, a long stop list, `suffix` --------------------

QWEN_FIM_STOPS = [  # Continue's Qwen2.5-Coder template, then its own multi-line stops
    "<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>",
    "/src/", "#- coding: utf-8", "```", "\ndef", "\nclass",
]  # fmt: skip


def test_continue_fim_autocomplete_replayed(server, coder):
    """Continue's request to /v1/completions for Qwen2.5-Coder: its FIM template rendered
    into the prompt and 14 stop strings, streamed."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    body = {
        "model": "qwen2.5-coder-1.5b",
        "prompt": f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
        "max_tokens": 24,
        "temperature": 0.01,
        "stop": QWEN_FIM_STOPS,
        "stream": True,
    }
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    events = _sse(r)
    text = "".join(e["choices"][0]["text"] for e in events)
    ids = [tid(coder, "<|fim_prefix|>"), *coder.tokenizer.encode(prefix, False)]
    ids += [tid(coder, "<|fim_suffix|>"), *coder.tokenizer.encode(suffix, False)]
    ids += [tid(coder, "<|fim_middle|>")]
    assert events[-1]["ondevice"]["prompt_tokens"] == len(ids)  # the markers are tokens
    assert "<|" not in text
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_suffix_is_filled_in_the_middle(server, coder):
    client = server.client()
    resp = client.completions.create(
        model="any", prompt="def f(", suffix="):\n    pass\n", max_tokens=8, temperature=0
    )
    ids = [tid(coder, "<|fim_prefix|>"), *coder.tokenizer.encode("def f(", False)]
    ids += [tid(coder, "<|fim_suffix|>"), *coder.tokenizer.encode("):\n    pass\n", False)]
    ids += [tid(coder, "<|fim_middle|>")]
    ref = coder.generate(
        ids, chat_template=False, max_tokens=8, temperature=0.0,
        hide_tokens=server.api.hidden_tokens,
    )  # fmt: skip
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].text == ref.text


def test_a_filled_in_middle_ends_at_end_of_text(server, coder):
    """<|endoftext|> is not this model's EOS (as in some GGUF files): a FIM answer still
    ends there."""
    bias = {str(tid(coder, "<|endoftext|>")): 100}
    body = {"model": "m", "prompt": "x", "max_tokens": 6, "temperature": 0, "logit_bias": bias}
    plain = _post(server, "/v1/completions", body).json()
    assert plain["choices"][0]["finish_reason"] == "length"  # without suffix: no FIM stops
    fim = _post(server, "/v1/completions", {**body, "suffix": "y"}).json()
    assert fim["choices"][0]["finish_reason"] == "stop"
    assert fim["usage"]["completion_tokens"] == 1 and fim["choices"][0]["text"] == ""


def test_suffix_without_fim_tokens_is_a_400_naming_it(plain):
    r = _post(plain, "/v1/completions", {"model": "m", "prompt": "def f(", "suffix": ")"})
    assert "FIM" in _error(r, "suffix")


def test_special_tokens_never_reach_content_but_still_stop(server, coder):
    """A control token the model writes (not EOS) is not shown; as a stop string it stops."""
    file_sep = tid(coder, "<|file_sep|>")
    body = {"model": "m", "prompt": "x = ", "max_tokens": 6, "temperature": 0}
    body["logit_bias"] = {str(file_sep): 100}  # every token is <|file_sep|>
    r = _post(server, "/v1/completions", body)
    assert r.json()["choices"][0] == {
        **r.json()["choices"][0],
        "text": "",
        "finish_reason": "length",
    }
    assert r.json()["usage"]["completion_tokens"] == 6
    lp = _post(server, "/v1/completions", {**body, "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [""] * 6 and lp["text_offset"] == [0] * 6  # they spell the text
    r = _post(server, "/v1/completions", {**body, "stop": QWEN_FIM_STOPS})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 1
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    chat["logit_bias"] = {str(tid(coder, "<|im_start|>")): 100}
    events = _sse(_post(server, "/v1/chat/completions", {**chat, "stream": True}))
    assert all("<|" not in e["choices"][0]["delta"].get("content", "") for e in events)


# -- 2. null on nullable fields means "left out" ---------------------------------------------


def test_none_values_from_the_official_client(server):
    client = server.client()
    nones = dict(
        temperature=None, top_p=None, n=None, stream=None, presence_penalty=None,
        frequency_penalty=None, stop=None, logit_bias=None, logprobs=None, top_logprobs=None,
        response_format=None, tools=None, tool_choice=None, parallel_tool_calls=None,
        reasoning_effort=None, user=None, stream_options=None, metadata=None,
        service_tier=None, store=None,
    )  # fmt: skip
    extra = {"top_k": None, "min_p": None, "repetition_penalty": None, "seed": 11}
    with_nones = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, extra_body=extra, **nones
    )
    without = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, extra_body={"seed": 11}
    )
    assert with_nones.choices[0].message.content == without.choices[0].message.content
    done = client.completions.create(
        model="m", prompt="ab", max_tokens=5, seed=3, temperature=None, top_p=None,
        suffix=None, echo=None, best_of=None, n=None, stop=None, stream=None,
    )  # fmt: skip
    assert done.usage.completion_tokens == 5
    # a required field stays required
    r = _post(server, "/v1/chat/completions", {"model": "m", "messages": None})
    _error(r, "messages")


# -- 3. Docker and app front ends; foreign hosts and origins still refused ---------------------


def test_open_webui_in_docker_reaches_the_server(server):
    """Open WebUI in a container: the model list and a streamed chat, Host host.docker.internal
    (Podman: host.containers.internal)."""
    port = server.url.rsplit(":", 1)[1]
    for name in ("host.docker.internal", "host.containers.internal"):
        headers = {"Host": f"{name}:{port}", "Authorization": "Bearer unused"}
        models = httpx.get(server.url + "/v1/models", headers=headers)
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        body = {"model": model, "messages": MESSAGES, "stream": True, "max_tokens": 4}
        events = _sse(_post(server, "/v1/chat/completions", body, headers=headers))
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    r = httpx.get(server.url + "/v1/models", headers={"Host": "evil.example"})
    assert r.status_code == 421


@pytest.mark.parametrize(
    "origin",
    [
        "vscode-webview://1a2b3c",
        "vscode-file://vscode-app",
        "tauri://localhost",
        "app://obsidian.md",
        "file://",
    ],
)
def test_app_origins_are_allowed(server, origin):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": origin})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "chrome-extension://abc"])
def test_foreign_origins_are_still_refused(server, origin):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": origin})
    assert r.status_code == 403


# -- 4. llama.cpp's and Ollama's extension fields ---------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "y"]}},
    "required": ["a"],
    "additionalProperties": False,
}


def _chat(server: LiveServer, **fields) -> httpx.Response:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **fields}
    return _post(server, "/v1/chat/completions", body)


def _content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_gbnf_grammar_is_honoured(server):
    gbnf = 'root ::= answer "." \nanswer ::= "yes" | "no"'
    assert _content(_chat(server, grammar=gbnf)) in ("yes.", "no.")
    assert _content(_chat(server, grammar='start: "ok"')) == "ok"  # Lark is taken too
    assert "grammar" in _error(_chat(server, grammar="root ::= ("), "grammar")


@pytest.mark.parametrize(
    "fields",
    [
        {"json_schema": SCHEMA},
        {"response_format": {"type": "json_object", "schema": SCHEMA}},
        {"response_format": {"type": "json_schema", "schema": SCHEMA}},
    ],
)
def test_llama_cpp_json_schema_forms_are_constrained(server, fields):
    assert json.loads(_content(_chat(server, **fields)))["a"] in ("x", "y")


def test_two_constraints_are_refused(server):
    r = _chat(server, grammar='root ::= "a"', json_schema=SCHEMA)
    assert "grammar and json_schema" in _error(r, None)


def test_repeat_penalty_maps_only_when_it_is_the_same_rule(server):
    same = _content(_chat(server, repetition_penalty=1.3))
    assert _content(_chat(server, repeat_penalty=1.3, repeat_last_n=-1)) == same
    assert _content(_chat(server, repeat_penalty=1.0)) == _content(_chat(server))
    assert "repeat_last_n" in _error(_chat(server, repeat_penalty=1.3), None)
    assert "repeat_last_n" in _error(_chat(server, options={"repeat_penalty": 1.3}), None)


def test_cache_prompt_is_honoured(server):
    long = [{"role": "user", "content": "the same long question " * 4}]
    _chat(server, messages=long, max_tokens=2)
    reused = _chat(server, messages=long, max_tokens=2).json()["usage"]
    fresh = _chat(server, messages=long, max_tokens=2, cache_prompt=False).json()["usage"]
    assert reused["prompt_tokens_details"]["cached_tokens"] > 0
    assert fresh["prompt_tokens_details"]["cached_tokens"] == 0


def test_ollama_options(server, coder):
    body = {"model": "m", "messages": MESSAGES, "temperature": None}
    body["options"] = {"num_predict": 5, "temperature": 0, "seed": 1}
    r = _post(server, "/v1/chat/completions", body)
    assert r.json()["usage"]["completion_tokens"] == 5, r.text
    # the request's own field wins over options
    r = _chat(server, max_tokens=3, options={"num_predict": 5, "mirostat": 0, "num_ctx": 512})
    assert r.json()["usage"]["completion_tokens"] == 3
    assert "options.num_gpu" in _error(_chat(server, options={"num_gpu": 1}), None)
    too_big = coder.context_length + 1
    _error(_chat(server, options={"num_ctx": too_big}), "options.num_ctx")


def test_a_grammar_the_vocabulary_cannot_write_fails_fast(server):
    t0 = time.monotonic()
    r = _chat(server, grammar='root ::= "\u00e9t\u00e9"', max_tokens=1000)
    assert "vocabulary" in _error(r, "grammar")
    # ... also when the dead end comes after a few tokens: an error, not 1000 tokens
    r = _chat(server, grammar='root ::= "ab" "\u00e9"', max_tokens=1000)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 20


# -- 5. routes clients probe ------------------------------------------------------------------


def test_routes_without_v1_and_any_model_name(server):
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert chat.usage.completion_tokens == 3
    assert (
        client.completions.create(model="m", prompt="ab", max_tokens=2).usage.completion_tokens == 2
    )
    card = server.client().models.retrieve("gpt-4o-mini")
    assert card.id == "gpt-4o-mini"
    assert card.model_extra["root"] == server.api.model_id


# -- 6. reasoning models --------------------------------------------------------------------


def test_reasoning_content_is_split_whole_and_streamed(server):
    grammar = 'start: "<think>\\nab\\n</think>\\n\\ncd"'
    whole = _chat(server, grammar=grammar).json()["choices"][0]["message"]
    assert (whole["reasoning_content"], whole["content"]) == ("\nab\n", "cd")
    events = _sse(_post(server, "/v1/chat/completions", {
        "model": "m", "messages": MESSAGES, "max_tokens": 40, "grammar": grammar, "stream": True,
    }))  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nab\n"
    assert "".join(d.get("content") or "" for d in deltas) == "cd"
    # a template that opened the thinking: the answer starts inside it
    opened = _chat(
        server, grammar='start: "xy</think>z"', chat_template_kwargs={"open_thinking": True}
    )
    message = opened.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("xy", "z")
    # an answer that does not think is all content
    assert (
        "reasoning_content"
        not in _chat(server, grammar='start: "plain"').json()["choices"][0]["message"]
    )


@pytest.mark.parametrize(
    ("text", "opened", "split"),
    [
        ("<think>\nplan\n</think>\n\nanswer", False, ("\nplan\n", "answer")),
        ("  <think>a</think>b</think>", False, ("a", "b</think>")),
        ("plan</think> answer", True, ("plan", "answer")),
        ("no thinking <think>here</think>", False, ("", "no thinking <think>here</think>")),
        ("<thin", False, ("", "<thin")),
        ("<think>cut short", False, ("cut short", "")),
    ],
)
def test_reasoning_stream_splits_alike_however_the_text_arrives(text, opened, split):
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            stream = ReasoningStream(opened)
            parts = [stream.feed(p) for p in pieces] + [stream.flush()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == split


def test_no_split_for_a_model_without_thinking_tags(plain):
    message = _chat(plain, grammar='start: "<think>a</think>b"').json()["choices"][0]["message"]
    assert message["content"] == "<think>a</think>b" and "reasoning_content" not in message


def test_reasoning_effort_as_langchain_sends_it(server):
    """LangChain's ChatOpenAI(reasoning_effort="low") request, replayed: accepted, and passed
    to a template that reads it."""
    body = {"messages": MESSAGES, "model": "m", "stream": False, "n": 1, "temperature": 0.7}
    body["max_tokens"] = 2
    base = _post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    r = _post(server, "/v1/chat/completions", {**body, "reasoning_effort": "low"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == base + len("effort=low\n")
    _error(
        _post(server, "/v1/chat/completions", {**body, "reasoning_effort": "max"}),
        "reasoning_effort",
    )


# -- 9. tool calls, the port ----------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("f", "g")
]
TWO_CALLS = (
    'start: "<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": {}}\\n</tool_call>\\n'
    '<tool_call>\\n{\\"name\\": \\"g\\", \\"arguments\\": {}}\\n</tool_call>"'
)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gives_one_call(server, stream):
    client = server.client()
    common = dict(model="m", messages=MESSAGES, max_tokens=300, tools=TOOLS, temperature=0)
    common["extra_body"] = {"grammar": TWO_CALLS}
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        if stream:
            calls = [
                c
                for chunk in client.chat.completions.create(
                    stream=True, parallel_tool_calls=parallel, **common
                )
                for c in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
            ]
        else:
            resp = client.chat.completions.create(parallel_tool_calls=parallel, **common)
            calls = resp.choices[0].message.tool_calls
            assert resp.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in calls] == names


def test_special_ids_keep_the_markers_the_server_reads(coder):
    """A GGUF vocabulary marks <tool_call> and <think> special (user-defined tokens): the
    server's hidden set leaves them in the text; the thinking tags here are not special."""
    ids = {tid(coder, t) for t in EXTRA}
    think = {tid(coder, "<think>"), tid(coder, "</think>")}
    assert coder.tokenizer.special_ids() & ids == ids - think
    kept = coder.tokenizer.special_ids(keep=["<|fim_pad|>"])
    assert tid(coder, "<|fim_pad|>") not in kept and tid(coder, "<|file_sep|>") in kept


def test_seed_gives_the_same_tokens_for_the_same_settings(server):
    """docs/openai.md's statement about `seed`: the same settings, the same tokens, with the
    prompt cache on or off."""
    for k in (3, 6):
        texts = {
            _content(_chat(server, temperature=1.0, seed=7, num_draft_tokens=k, **extra))
            for extra in ({}, {}, {"cache_prompt": False})
        }
        assert len(texts) == 1


def test_serve_finds_a_busy_port_before_loading(tmp_path):
    model = write_model(tmp_path / "m")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "ondevice",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
        ]
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr
    assert "loading" not in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - t0 < 60
