"""Tool calls in a model's text, turned into OpenAI `tool_calls`, also while streaming.

The supported families write a call as JSON between tags: Qwen2.5 / Qwen3 / Hermes / SmolLM2
write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (SmolLM2 may put a JSON list of
calls inside one pair of tags), and Llama 3.x style `"parameters"` is read as `"arguments"`.
`ToolCallStream` splits streamed text into content and calls: text outside the tags passes
through at once, except a tail that may still become an opening tag; a call is emitted when its
closing tag arrives. Text between tags that is not a call stays content, so nothing is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def parse_calls(body: str) -> list[ToolCall] | None:
    """The calls in the JSON between a pair of tags, or None if it is not one."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # already JSON text
            text = args
        else:
            text = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(item["name"], text))
    return calls


class ToolCallStream:
    """Feed text pieces; get back (content, calls) as soon as each is certain."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = [], []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE) :]
                self._inside = False
                found = parse_calls(body.strip())
                if found is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls += found
        self.calls += calls
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end: an unclosed call is parsed if it is complete JSON, else kept as text."""
        rest, self._buf = self._buf, ""
        if not self._inside:
            return rest, []
        self._inside = False
        found = parse_calls(rest.strip())
        if found is None:
            return OPEN + rest, []
        self.calls += found
        return "", found


# Whitespace inside a forced call's JSON: what models write on one line, bounded.
TOOL_WHITESPACE = r"[\x20\x0A]{0,2}"


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for exactly one call in the `<tool_call>` format,
    of the function `name` or of any of `tools`, its arguments valid under the function's
    parameters schema: how `tool_choice` "required" or a named function is honoured."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    rules = []
    for i, f in enumerate(functions):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_pattern": TOOL_WHITESPACE},
        }
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    return f'start: "{OPEN}\\n" ({calls}) "\\n{CLOSE}"\n' + "\n".join(rules)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
