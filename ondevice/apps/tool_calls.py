"""Tool calls in a model's text, turned into OpenAI `tool_calls`, also while streaming.

The supported families write a call as JSON between tags: Qwen2.5 / Qwen3 / Hermes / SmolLM2
write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (SmolLM2 may put a JSON list of
calls inside one pair of tags), and Llama 3.x style `"parameters"` is read as `"arguments"`.
`ToolCallStream` splits streamed text into content and calls: text outside the tags passes
through at once, except a tail that may still become an opening tag; a call is emitted when its
closing tag arrives. Text between tags that is not a call stays content, so nothing is lost.

Small models often leave the tags out: Qwen2.5-Coder-1.5B-Instruct, offered a tool, answers with
the call as a fenced JSON block (```json {"name": ..., "arguments": ...} ```). Given the names
of the offered tools, an answer that is only such a block (fenced or bare) naming one of them is
read as the call, as llama.cpp's Hermes parser does; while an answer may still be one (it starts
with a fence or a brace) its text is held back, and it is released as content if it is not.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
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


FENCED = re.compile(r"^```(?:json)?\s*\n(.*)\n\s*```$", re.DOTALL)
UNTAGGED_STARTS = ("```", "{", "[")


def untagged_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The calls in an answer that is only a JSON call, fenced or bare, of the tools `names`."""
    body = text.strip()
    fenced = FENCED.match(body)
    calls = parse_calls(fenced.group(1) if fenced else body)
    if not calls or any(c.name not in names for c in calls):
        return None
    return calls


class ToolCallStream:
    """Feed text pieces; get back (content, calls) as soon as each is certain. `names`: the
    offered tools' names, to read an untagged call (see the module docstring)."""

    def __init__(self, names: Collection[str] = ()) -> None:
        self._buf = ""
        self._inside = False
        self.calls: list[ToolCall] = []
        self.names = frozenset(names)
        # None: undecided whether the answer may be an untagged call; then True (held) or False
        self._untagged: bool | None = None if self.names else False
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._untagged is not False:
            self._held += text
            start = self._held.lstrip()
            if not start:
                return "", []
            if self._untagged is None:
                self._untagged = any(
                    start.startswith(s) or s.startswith(start) for s in UNTAGGED_STARTS
                )
            if self._untagged:
                return "", []  # held until the end
            text, self._held = self._held, ""
        return self._tagged(text)

    def _tagged(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = [], []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = partial_suffix(self._buf, OPEN)
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
        """At the end: an untagged call is read from the held answer; an unclosed tagged call
        is parsed if it is complete JSON, else kept as text."""
        if self._held:
            held, self._held, self._untagged = self._held, "", False
            found = untagged_calls(held, self.names)
            if found is not None:
                self.calls += found
                return "", found
            head, calls = self._tagged(held)
            tail, more = self.flush()
            return head + tail, calls + more
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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
