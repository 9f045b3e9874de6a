"""A reasoning model's thinking, split from its answer: `<think>...</think>` becomes OpenAI-style
`reasoning_content` (DeepSeek's, vLLM's and llama.cpp's field), also while streaming.

The split is made for models whose vocabulary has both tags (Qwen3, DeepSeek-R1 and their
kind). An answer is thinking when it starts with `<think>` (after blanks), or when the chat
template already wrote `<think>` at the end of the prompt; the thinking ends at `</think>`,
and the blanks after it are dropped. An answer that does not start so is all content.
"""

from __future__ import annotations

from ondevice.apps.tool_calls import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningStream:
    """Feed text pieces; get back (reasoning, content) as soon as each is certain."""

    def __init__(self, thinking: bool = False) -> None:
        # "start": may still open with <think>; "think"; "after": blanks after </think>; "content"
        self._state = "think" if thinking else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            head = self._buf.lstrip()
            if not head or (OPEN.startswith(head) and head != OPEN):
                return "", ""  # blanks, or a tag half written: wait
            if head.startswith(OPEN):
                self._state, self._buf = "think", head[len(OPEN) :]
            else:
                self._state = "content"
        if self._state == "think":
            i = self._buf.find(CLOSE)
            if i < 0:
                keep = partial_suffix(self._buf, CLOSE)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(CLOSE) :]
            self._state = "after"
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held at the end: an unfinished thought stays reasoning."""
        rest, self._buf = self._buf, ""
        if self._state == "think":
            return rest, ""
        return "", "" if self._state == "after" else rest
