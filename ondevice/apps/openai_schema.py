"""Request bodies of the OpenAI API that the server accepts, validated with pydantic.

Types are strict (a string is not a number) and unknown fields are ignored, as OpenAI's clients
send many optional fields. Fields the runtime cannot honour (`n > 1`, log probabilities, tools)
are rejected with a clear message instead of being silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ValidationError",
    "error_body",
    "validation_message",
]

NonEmpty = Annotated[str, Field(min_length=1)]


class APIError(Exception):
    """An error the server answers with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_UNION_HINTS = {
    "prompt": "a string, a list of one string, or a list of token ids",
    "stop": "a non-empty string or a list of up to 4 non-empty strings",
    "content": 'a string or a list of text parts ({"type": "text", "text": ...})',
}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the member of a union it tried ("str", "list[int]") inside error paths."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none", "constrained-str") or "[" in part
    )


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first problem of a pydantic error as (message, param), in words a client can act on."""
    err = e.errors()[0]
    loc = list(err["loc"])
    tagged = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
    if tagged is not None:
        loc = loc[:tagged]
    param = ".".join(str(p) for p in loc) or None
    field = str(loc[-1]) if loc else ""
    if tagged is not None and field in _UNION_HINTS:
        return f"Invalid value for '{param}': expected {_UNION_HINTS[field]}.", param
    if err["type"] == "missing":
        return f"'{param}' is a required property.", param
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "model_type" and not loc:
        return "The request body must be a JSON object.", None
    return (f"Invalid value for '{param}': {msg}." if param else f"{msg}."), param


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: NonEmpty
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's default temperature is 1; clients that want greedy decoding send 0.
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    # ondevice extras: sampling and speculation settings OpenAI does not have.
    top_k: int = Field(default=0, ge=0)
    num_draft_tokens: int | None = Field(default=None, ge=1, le=64)
    speculative: bool = True

    @model_validator(mode="after")
    def _supported(self) -> _Request:
        if self.n != 1:
            raise ValueError("only n=1 is supported (one completion per request)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop) or None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def prompt(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]


class CompletionRequest(_Request):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=1)
        ]
    )
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    # OpenAI's legacy completions default to 16 tokens; keep that rather than surprise clients.
    max_tokens: int | None = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        return self

    def prompt_value(self) -> str | list[int]:
        """A string, or token ids (a batch of one is unwrapped; larger batches were rejected)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
