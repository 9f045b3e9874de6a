"""Tools: OpenAI `tools` reach the chat template, `<tool_call>` JSON in the model's text comes
back as `tool_calls` (whole and streamed as deltas), and `tool` messages are accepted. The
round trip runs over HTTP with the `openai` client; the model's answers are canned (a decoder
that emits fixed token ids while the tiny verifier really runs), so the test decides what the
model "says"."""

from __future__ import annotations

import json

import httpx
import pytest
import tiny
from test_server import LiveServer

import ondevice
from ondevice.apps.tool_calls import ToolCallStream, parse_calls
from ondevice.decoders.chain import DecodeStats, Round

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}call {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- the parser ----------------------------------------------------------------------------------


def _split_feed(text: str, step: int, names=()) -> tuple[str, list]:
    s = ToolCallStream(names)
    content = []
    for i in range(0, len(text), step):
        c, _ = s.feed(text[i : i + step])
        content.append(c)
    c, _ = s.flush()
    return "".join(content) + c, s.calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_parser_is_independent_of_how_text_arrives(step):
    text = "Sure.<tool_call>\n" + '{"name": "a", "arguments": {"x": 1}}</tool_call> and ' + CALL
    content, calls = _split_feed(text, step)
    assert content == "Sure. and "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("get_weather", {"city": "Paris"}),
    ]


UNTAGGED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_an_untagged_call_of_an_offered_tool_is_a_call(step):
    """What Qwen2.5-Coder-1.5B-Instruct answers when offered a tool: a fenced JSON call."""
    bare = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (UNTAGGED, bare):
        content, calls = _split_feed(text, step, names={"get_weather"})
        assert content == ""
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
    # a tool nobody offered, or no tools: the text stays text, whole
    for names in ({"other"}, ()):
        assert _split_feed(UNTAGGED, step, names) == (UNTAGGED, [])
    # tagged calls still work with names given
    assert _split_feed("Ok." + CALL, step, {"get_weather"})[0] == "Ok."


def test_untagged_calls_hold_back_only_answers_that_may_be_one():
    s = ToolCallStream({"get_weather"})
    assert s.feed(" Su") == (" Su", []) and s.feed("re") == ("re", [])  # prose passes at once
    s = ToolCallStream({"get_weather"})
    assert s.feed("``") == ("", []) and s.feed("`python\nx = 1\n```") == ("", [])
    assert s.flush() == ("```python\nx = 1\n```", [])  # not a call: released whole at the end


def test_stream_parser_holds_back_only_a_possible_tag():
    s = ToolCallStream()
    assert s.feed("a <tool") == ("a ", [])
    assert s.feed("box>") == ("<toolbox>", [])  # not a tag after all: released


def test_parser_formats_and_bad_json():
    (c,) = parse_calls('{"name": "f", "parameters": {"a": 2}}')  # Llama 3.x key
    assert json.loads(c.arguments) == {"a": 2}
    assert [c.name for c in parse_calls('[{"name": "f"}, {"name": "g"}]')] == ["f", "g"]
    content, calls = _split_feed("x<tool_call>{not json}</tool_call>y", 1)
    assert (content, calls) == ("x<tool_call>{not json}</tool_call>y", [])
    content, calls = _split_feed('x<tool_call>{"name": "f", "arguments": {}}', 4)  # unclosed
    assert content == "x" and calls[0].name == "f"


# -- over HTTP -------------------------------------------------------------------------------------


class CannedDecoder:
    """Emits fixed token ids, one per round, while feeding the real verifier engine the same
    tokens, so the caches end as a real decoder leaves them."""

    def __init__(self, verifier, tokens: list[int], eos: int) -> None:
        self.verifier, self.tokens, self.eos = verifier, tokens, eos
        self.stats = DecodeStats()
        self.skip_reason: str | None = None  # why nothing was drafted (set by the caller)
        self.time_prefill = self.time_draft = self.time_verify = 0.0

    def run(self, prompt, max_tokens, resume=False):
        v = self.verifier
        v.reset()
        if len(prompt) > 1:
            v.feed(list(prompt[:-1]), last_only=True)
        seq = list(prompt)
        for i, tok in enumerate([*self.tokens, self.eos][:max_tokens]):
            v.feed([seq[-1]], last_only=True)
            seq.append(tok)
            self.stats.rounds += 1
            if tok == self.eos:
                yield Round([], [], 0, 0, "stop")
                return
            yield Round([tok], [False], 0, 0, "length" if i + 1 == max_tokens else None)

    def extra_stats(self) -> dict:
        return {}

    def draft_prefix_length(self) -> int:
        return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    v = tiny.write_model(tmp_path_factory.mktemp("tools") / "m", vocab_size=128)
    gen = ondevice.load(v)
    gen.tokenizer.chat_template = TOOL_TEMPLATE
    script: dict[str, str] = {"text": ""}

    def decoder(*args, **kwargs):
        ids = gen.tokenizer.encode(script["text"], add_special_tokens=False)
        return CannedDecoder(gen.verifier, ids, tiny.EOS_ID)

    gen._decoder = decoder
    with LiveServer(gen) as s:
        yield s, gen, script


MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def test_tool_call_round_trip(server):
    s, gen, script = server
    client = s.client()
    script["text"] = "Let me check." + CALL
    r = client.chat.completions.create(model=gen.model_name, messages=MESSAGES, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools reached the template: the prompt is longer than without them
    plain = gen.count_tokens(MESSAGES)
    assert r.usage.prompt_tokens == gen.count_tokens(MESSAGES, tools=[WEATHER]) > plain
    # the answer goes back with the call and a tool message
    follow = [*MESSAGES, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    script["text"] = "It is sunny."
    r2 = client.chat.completions.create(model=gen.model_name, messages=follow, tools=[WEATHER])
    assert r2.choices[0].message.content == "It is sunny." and not r2.choices[0].message.tool_calls
    assert r2.choices[0].finish_reason == "stop"
    rendered = gen.tokenizer.apply_chat_template(
        [MESSAGES[0],
         {"role": "assistant", "content": "Let me check.", "tool_calls": [
             {"id": call.id, "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        tools=[WEATHER],
    )  # fmt: skip
    assert 'call get_weather{"city": "Paris"}' in rendered and "sunny, 21 C" in rendered
    assert r2.usage.prompt_tokens == len(gen.tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_an_untagged_call_comes_back_as_tool_calls(server, stream):
    s, gen, script = server
    script["text"] = UNTAGGED
    kw = {"model": gen.model_name, "messages": MESSAGES, "tools": [WEATHER]}
    if not stream:
        choice = s.client().chat.completions.create(**kw).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        return
    chunks = [c for c in s.client().chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    (tc,) = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert tc.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_calls_stream_as_deltas(server):
    s, gen, script = server
    script["text"] = "Checking." + CALL + CALL.replace("Paris", "Rome")
    stream = s.client().chat.completions.create(
        model=gen.model_name, messages=MESSAGES, tools=[WEATHER], stream=True
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    assert [json.loads(calls[i]["arguments"])["city"] for i in (0, 1)] == ["Paris", "Rome"]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"] != calls[1]["id"]


def test_without_tools_the_text_stays_text(server):
    s, gen, script = server
    script["text"] = CALL
    r = s.client().chat.completions.create(model=gen.model_name, messages=MESSAGES)
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    r = s.client().chat.completions.create(
        model=gen.model_name, messages=MESSAGES, tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.content == CALL
    assert r.usage.prompt_tokens == gen.count_tokens(MESSAGES)  # no tools in the prompt


SMALL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_tool_choice_required_or_named_forces_a_valid_call(tmp_path, choice):
    """A real (tiny, random) model answers with exactly one call whose arguments follow the
    function's schema: the tool call is a grammar, applied to draft and verifier."""
    v = tiny.write_model(tmp_path / "m", vocab_size=128)
    gen = ondevice.load(v, draft=tiny.perturbed_copy(v, tmp_path / "d", noise=0.2),
                        draft_backend="mlx")  # fmt: skip
    with LiveServer(gen) as s:
        r = s.client().chat.completions.create(
            model="m", messages=MESSAGES, tools=[WEATHER, SMALL], tool_choice=choice,
            max_tokens=400, temperature=0,
        )  # fmt: skip
    choice_ = r.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_.message.content
    (call,) = choice_.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "pick"
    args = json.loads(call.function.arguments)
    if call.function.name == "pick":
        assert set(args) == {"n"} and 0 <= args["n"] <= 9
    assert r.usage.completion_tokens < 400


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {}}]},
        {"tool_choice": "auto"},
    ],
)
def test_unsupported_tool_requests_are_refused(server, extra):
    s, gen, _ = server
    body = {"model": gen.model_name, "messages": MESSAGES, **extra}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "tool" in r.json()["error"]["message"] or "tool" in (r.json()["error"]["param"] or "")
