"""Request bodies of the OpenAI API that the server accepts, validated with pydantic.

Types are strict (a string is not a number). Every field of OpenAI's chat and completions
requests is either honoured or, when set to something the runtime cannot do (`n > 1`, audio,
`echo`), refused with a message that names it; none is silently dropped (docs/openai.md has
the table). Fields no OpenAI client sends are ignored, as OpenAI does. A null field is a field
left out. llama.cpp's and Ollama's extension fields (`grammar`, `json_schema`, `cache_prompt`,
`repeat_penalty`, `options`) are read as well: mapped onto this API's fields where the meaning
is the same, refused by name where it is not.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ondevice.models.tokenizer import RESERVED_TEMPLATE_ARGS
from ondevice.rules.sampling import SAMPLING_FIELDS

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
    "stop": "a non-empty string or a list of non-empty strings",
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


class _Strict(BaseModel):
    """A part of a request body: values of the declared types only, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    # llama.cpp's form: {"type": "json_object", "schema": {...}}
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None and self.schema_ is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a 'schema'")
        if self.type == "text" and self.schema_ is not None:
            raise ValueError("type 'text' takes no 'schema'; use 'json_object' or 'json_schema'")
        return self

    def grammar_schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema decoding is constrained to (True: any JSON object), or None."""
        if self.type == "text":
            return None
        if self.json_schema is not None:
            return self.json_schema.schema_
        return True if self.schema_ is None else self.schema_


# OpenAI request fields that this server refuses when set (the reason is sent back)
_REFUSED = {
    "audio": "this server produces text only",
    "modalities": "this server produces text only",
    "prediction": "predicted outputs are not supported (speculation needs no hint)",
    "web_search_options": "this server has no web search",
    "functions": "the deprecated 'functions' field is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; send 'tool_choice'",
    "best_of": "only one completion per request is generated",
    "store": "this server keeps no completions for later retrieval",
    "verbosity": "this server has no verbosity setting",
    "reasoning": "this server has no reasoning settings",
}


# Every optional field may be null, meaning "as if left out" (the official client sends null
# for a keyword given as None), except these, whose null has a meaning of its own (no limit).
_NULL_IS_A_VALUE = frozenset({"max_tokens", "max_completion_tokens"})
# required fields: a null there is a missing value, reported as such
_REQUIRED = frozenset({"model", "messages", "prompt"})

# Ollama's `options` object: the names it shares with this API (or with llama.cpp's), the value
# that leaves an option without effect (accepted as such), and the rest refused by name.
_OLLAMA_OPTIONS = {
    "num_predict": "max_tokens",
    **{n: n for n in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                      "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n")},
}  # fmt: skip
_OLLAMA_NO_EFFECT = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "penalize_newline": False}


def _from_extensions(data: dict[str, Any]) -> dict[str, Any]:
    """The request body with null fields left out and Ollama's `options` and llama.cpp's
    `repeat_penalty` turned into this API's fields (or refused, by name)."""
    data = {k: v for k, v in data.items() if v is not None or k in _NULL_IS_A_VALUE | _REQUIRED}
    options = data.pop("options", None)
    if options is not None:
        if not isinstance(options, dict):
            raise ValueError("'options' (Ollama's) must be an object")
        for name, value in options.items():
            if value is None:
                continue
            if name in _OLLAMA_OPTIONS:
                target = _OLLAMA_OPTIONS[name]
                if target == "max_tokens" and value in (-1, -2):  # Ollama: until the context
                    value = None
                data.setdefault(target, value)  # the request's own field wins
            elif name in _OLLAMA_NO_EFFECT and value == _OLLAMA_NO_EFFECT[name]:
                continue
            elif name == "num_ctx":
                data.setdefault("num_ctx", value)  # checked against the context by the server
            else:
                raise ValueError(f"Ollama's option 'options.{name}' is not supported")
    penalty = data.pop("repeat_penalty", None)
    last_n = data.pop("repeat_last_n", None)
    for name, value in (("repeat_penalty", penalty), ("repeat_last_n", last_n)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"'{name}' must be a number")
    if penalty is not None and penalty != 1.0 and last_n != 0:
        # llama.cpp's rule is the CTRL rule of `repetition_penalty`, but over the last
        # `repeat_last_n` tokens (default 64); -1 is the whole context, which is this rule.
        if last_n != -1:
            raise ValueError(
                "'repeat_penalty' penalises only the last 'repeat_last_n' tokens (64 unless "
                "given) in llama.cpp, a rule this server does not have: send repeat_last_n: -1 "
                "(the whole context), or 'repetition_penalty', which covers prompt and answer"
            )
        data.setdefault("repetition_penalty", penalty)
    return data


# Request fields passed to `Generator.stream` as they are: the seed and the sampling fields
# (`SamplingParams`), but those this API spells its own way (`SAMPLING_TRANSLATED`: logit_bias's
# keys are strings, a grammar comes from grammar / json_schema / response_format, logprobs from
# logprobs / top_logprobs). A new sampling field is a field of `_Request` below.
SAMPLING_TRANSLATED = ("logit_bias", "grammar", "logprobs")
_SAMPLING_FIELDS = (*(f for f in SAMPLING_FIELDS if f not in SAMPLING_TRANSLATED), "seed")


class _Request(BaseModel):
    # extra="allow": unknown fields are kept so that `_REFUSED` ones can be named
    model_config = ConfigDict(strict=True, extra="allow")

    model: NonEmpty
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's default temperature is 1; clients that want greedy decoding send 0.
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: NonEmpty | list[NonEmpty] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # token id (as a string, JSON keys are strings) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None  # accepted for the client's records; nothing depends on it
    # structured output: decoding constrained to JSON (any object, or valid under a schema)
    response_format: ResponseFormat | None = None
    # ondevice extras (also llama.cpp's / vLLM's): sampling and speculation settings
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    num_draft_tokens: int | None = Field(default=None, ge=1, le=64)
    speculative: bool = True
    method: str = "chain"  # a name in the method registry (proposers/registry.py)
    # llama.cpp's extensions: a GBNF (or Lark) grammar, a JSON schema, prompt caching
    grammar: NonEmpty | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool = True
    # Ollama's options.num_ctx: accepted when the model's context holds it
    num_ctx: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _extensions(cls, data: Any) -> Any:
        return _from_extensions(data) if isinstance(data, dict) else data

    @field_validator("method")
    @classmethod
    def _method(cls, value: str) -> str:
        from ondevice.proposers.registry import METHODS

        if value not in METHODS:
            raise ValueError(f"unknown method {value!r}; choose one of {', '.join(METHODS)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            # ASCII only: str.isdigit() also takes '²' or '①', which int() refuses
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"keys are token ids (decimal digits), got {key[:40]!r}")
        return value

    @model_validator(mode="after")
    def _supported(self) -> _Request:
        if self.n != 1:
            raise ValueError("only n=1 is supported (one completion per request)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        extra = self.model_extra or {}
        given = [n for n in ("grammar", "json_schema") if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.grammar_schema() is not None:
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"give one of {' and '.join(given)}: each constrains the answer")
        for name, why in _REFUSED.items():
            if extra.get(name) not in (None, False, [], {}) and extra.get(name) != ["text"]:
                raise ValueError(f"'{name}' is not supported: {why}")
        return self

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments of `Generator.stream` that shape the distribution."""
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()} or None
        return {**{name: getattr(self, name) for name in _SAMPLING_FIELDS}, "logit_bias": bias}

    def grammar_spec(self) -> tuple[str, dict[str, Any]] | None:
        """(the field that asked, `Generator.grammar`'s keyword arguments) of the grammar
        that constrains the answer, or None."""
        if self.grammar is not None:
            return "grammar", {"gbnf": self.grammar}
        if self.json_schema is not None:
            return "json_schema", {"json_schema": self.json_schema}
        if self.response_format is not None:
            schema = self.response_format.grammar_schema()
            return None if schema is None else ("response_format", {"json_schema": schema})
        return None

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop) or None


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: NonEmpty
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            # chat templates expect the arguments as an object (they render it with tojson)
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # passed to the chat template, which may read it (gpt-oss's does); otherwise no effect
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # keyword arguments for the chat template (vLLM's and llama.cpp's name), e.g.
    # {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise ValueError("tool_choice needs tools")
        name = self.forced_tool()[1]
        if name is not None and name not in {t.function.name for t in self.tools or ()}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        constrained = self.grammar_spec()
        if self.forced_tool()[0] and constrained is not None:
            raise ValueError("tool_choice 'required' or a named function cannot be combined "
                             f"with {constrained[0]}")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def logprobs_count(self) -> int | None:
        """`Generator.stream`'s logprobs: None (off) or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether the answer must be a tool call, the function it must call or None)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return True, choice.function.get("name", "")
        return choice == "required", None

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

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
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # OpenAI's legacy completions default to 16 tokens; keep that rather than surprise clients.
    max_tokens: int | None = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> str | list[int]:
        """A string, or token ids (a batch of one is unwrapped; larger batches were rejected)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


# What a request may pass to the chat template: a few named switches (enable_thinking=false),
# each a short scalar; a template of its own or a structure the template loops over is refused.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_STRING = 1024


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """ValueError unless `value` holds at most MAX_TEMPLATE_KWARGS scalars (strings of at most
    MAX_TEMPLATE_STRING characters, 64-bit integers, finite floats, booleans, null) under
    identifiers that the template function does not reserve (`RESERVED_TEMPLATE_ARGS`)."""
    if value is None:
        return None
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} chat template arguments are allowed")
    for key, v in value.items():
        if not key.isidentifier() or not key.isascii() or len(key) > 64 or key.startswith("_"):
            raise ValueError(f"{key[:40]!r} is not a template argument name (an identifier)")
        if key in RESERVED_TEMPLATE_ARGS:
            raise ValueError(
                f"{key!r} is reserved: it is an argument of the chat template function itself "
                "or a variable the server sets"
            )
        if isinstance(v, str):
            ok = len(v) <= MAX_TEMPLATE_STRING
        elif isinstance(v, bool) or v is None:
            ok = True
        elif isinstance(v, int):
            ok = -(2**63) <= v < 2**63
        elif isinstance(v, float):
            ok = math.isfinite(v)
        else:
            ok = False
        if not ok:
            raise ValueError(
                f"the value of {key!r} must be a string of at most {MAX_TEMPLATE_STRING} "
                "characters, a 64-bit integer, a finite number, a boolean or null"
            )
    return value


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


# -- response pieces ----------------------------------------------------------------------------


def _piece(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token])
    return text, list(text.encode("utf-8"))


def chat_logprobs(
    tokenizer: Any, logprobs: list[Any], hidden: frozenset[int] = frozenset()
) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object from `TokenLogprob`s. A token in `hidden` (left out of
    the text) is reported with empty text, so the tokens still spell the text."""
    content = []
    for lp in logprobs:
        text, raw = ("", []) if lp.token in hidden else _piece(tokenizer, lp.token)
        top = []
        for t, v in lp.top:
            tt, tb = _piece(tokenizer, t)
            top.append({"token": tt, "logprob": v, "bytes": tb})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Any, logprobs: list[Any], offset: int = 0, hidden: frozenset[int] = frozenset()
) -> dict[str, Any]:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs,
    text_offset); a token in `hidden` has empty text, as in `chat_logprobs`."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = "" if lp.token in hidden else _piece(tokenizer, lp.token)[0]
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_piece(tokenizer, t)[0]: v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
