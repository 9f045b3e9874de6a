"""Tokenizers from HF files or GGUF metadata, chat templates, streaming detokenization, pair checks.

A model folder is read with transformers' `AutoTokenizer` (fast tokenizers; a folder with only
SentencePiece's `tokenizer.model` is converted through `sentencepiece`), and chat templates are
rendered by its `apply_chat_template`, so tools, documents and template keyword arguments
(Qwen3's `enable_thinking`) work as they do there. A GGUF file carries its vocabulary in its
metadata: that one is built with the `tokenizers` library (gguf_tokenizer.py) and wrapped in the same
transformers class for its template. Encoding and decoding call the Rust tokenizer directly,
and streaming text comes from `tokenizers`' `DecodeStream` (linear in the answer's length).
transformers runs without torch here; its notice about that is silenced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from ondevice.errors import ModelFormatError, OndeviceError, TokenizerMismatchError


class Tokenizer:
    """Encode/decode, chat template and the special tokens that end generation."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        hf: Any = None,
        origin: dict[str, Any] | None = None,
    ) -> None:
        self._tok = tok
        # How a tokenizer built from GGUF metadata was made (gguf_tokenizer: version, model,
        # pre-tokenizer); None for a tokenizer read from files. Bundles record it.
        self.origin = origin
        self._hf = hf  # the transformers tokenizer (built on first use when None)
        self._max_token_chars: int | None = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        ids = set(eos_token_ids)
        if eos_token is not None and tok.token_to_id(eos_token) is not None:
            ids.add(tok.token_to_id(eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
            raise ModelFormatError(
                f"{path}: no tokenizer.json (or SentencePiece tokenizer.model). Save the "
                "tokenizer with transformers (`tokenizer.save_pretrained(dir)`)."
            )
        if not (path / "tokenizer.json").exists():
            _check_sentencepiece(path / "tokenizer.model")
        cfg: dict[str, Any] = {}
        tc = path / "tokenizer_config.json"
        if tc.exists():
            try:
                cfg = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise ModelFormatError(f"{tc}: not valid JSON ({e}).") from None
        try:
            hf = transformers().AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except Exception as e:  # transformers raises many kinds for a damaged folder
            _refuse_remote_code(path, cfg)
            raise ModelFormatError(
                f"{path}: the tokenizer cannot be read ({type(e).__name__}: {e})."
            ) from None
        if not hasattr(hf, "backend_tokenizer"):
            raise ModelFormatError(
                f"{path}: transformers gives a slow {type(hf).__name__} for this tokenizer; "
                "ondevice needs a fast one (install `sentencepiece` and `protobuf`, or save a "
                "tokenizer.json)."
            )
        template = hf.chat_template
        if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
            template = template.get("default") or next(iter(template.values()), None)
        return cls(
            hf.backend_tokenizer,
            eos_token_ids=eos_token_ids,
            bos_token=hf.bos_token,
            eos_token=hf.eos_token,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            hf=hf,
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False))

    def replace_backend(self, tok: HFTokenizer) -> None:
        """Use `tok` from now on (a repaired copy of the same vocabulary)."""
        self._tok, self._hf = tok, None

    # -- text <-> ids ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_text(text)
            raise
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The chat rendered as text by the model's template (or `template`): `tools` (OpenAI
        function schemas) and `kwargs` (e.g. enable_thinking=False) reach the template. A
        model without a template gets `DEFAULT_CHAT_TEMPLATE`. Inside `render_limit(...)` the
        rendering stops (OndeviceError) once its text passes the limit or the event is set."""
        from jinja2.exceptions import TemplateError

        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_ARGS))
        if reserved:
            raise OndeviceError(
                f"chat_template_kwargs: {reserved[0]!r} is reserved (an argument of the chat "
                "template function itself, or a variable it sets); rename it."
            )
        template = template or self.chat_template or DEFAULT_CHAT_TEMPLATE
        if _RENDER_LIMIT.get() is not None:
            _bound_rendering(template)
        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except TemplateError as e:  # the template refuses these messages (e.g. role order)
            raise OndeviceError(f"the model's chat template rejects these messages: {e}") from None

    def max_token_chars(self) -> int:
        """The most characters one token's text holds (so a text of n characters has at least
        n / max_token_chars() tokens); computed once."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(t) for t in vocab), default=1)
        return self._max_token_chars

    @property
    def hf(self) -> Any:
        """The transformers tokenizer over the same Rust tokenizer."""
        if self._hf is None:
            self._hf = transformers().PreTrainedTokenizerFast(
                tokenizer_object=self._tok, bos_token=self.bos_token, eos_token=self.eos_token
            )
        return self._hf

    def special_ids(self, keep: Sequence[str] = ()) -> frozenset[int]:
        """Ids of the special tokens (control tokens, e.g. <|im_start|>, <|endoftext|>), but
        those whose text is in `keep` (markers a caller reads, e.g. <tool_call>)."""
        added = self._tok.get_added_tokens_decoder()
        return frozenset(i for i, t in added.items() if t.special and t.content not in keep)

    def detokenizer(self, hidden: frozenset[int] = frozenset()) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, hidden)

    # -- pair compatibility --------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 over the id -> token table and the special tokens."""
        h = hashlib.sha256()
        for i in range(self.vocab_size):
            h.update(f"{i}\t{self._tok.id_to_token(i)}\n".encode())
        h.update(json.dumps(sorted(self.eos_token_ids)).encode())
        return h.hexdigest()


def _token_text(t: Any) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t


def _check_text(text: Any) -> None:
    """Raise OndeviceError if `text` is not a string of valid Unicode (the tokenizer's own
    TypeError does not say which)."""
    if not isinstance(text, str):
        raise OndeviceError(f"expected text (a str), got {type(text).__name__}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end]
        if "\udc80" <= bad[0] <= "\udcff":  # how Python keeps a non-UTF-8 byte (argv, file names)
            raise OndeviceError(
                f"the text holds the byte 0x{ord(bad[0]) - 0xDC00:02X} at character {e.start}, "
                "which is not UTF-8 (a command-line argument in another encoding?); pass UTF-8 text."
            ) from None
        raise OndeviceError(
            f"the text holds an unpaired surrogate ('{bad.encode('unicode_escape').decode()}' at "
            f"character {e.start}), which is not valid Unicode; pass valid text."
        ) from None


# Names a request's chat template arguments may not use: the arguments of `apply_chat_template`
# here and in transformers (`template`, `chat_template` would replace the model's template;
# `tokenize`, `return_dict` change what comes back), the variables transformers itself passes
# to the template (messages, tools, documents, the special tokens) and the template's globals.
RESERVED_TEMPLATE_ARGS = (
    "messages", "conversation", "conversations", "tools", "documents", "template",
    "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs", "self",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now", "namespace", "dict",
    "range", "lipsum", "cycler", "joiner", "tojson",
)  # fmt: skip


class RenderLimitError(OndeviceError):
    """A chat template rendered more text than `render_limit` allows, or its caller left."""


_RENDER_LIMIT: ContextVar[tuple[int, threading.Event | None] | None] = ContextVar(
    "ondevice_render_limit", default=None
)


@contextlib.contextmanager
def render_limit(max_chars: int, cancel: threading.Event | None = None) -> Iterator[None]:
    """Within this block (in this thread), chat templates rendered by `Tokenizer` stop with
    RenderLimitError once their text passes `max_chars`, or when `cancel` is set: the cost of a
    rendering is then bounded by the caller, not by the template and its inputs."""
    token = _RENDER_LIMIT.set((max_chars, cancel))
    try:
        yield
    finally:
        _RENDER_LIMIT.reset(token)


def _bounded_concat(pieces: Iterable[str]) -> str:
    """jinja's `Environment.concat` (what `Template.render` joins its output with), checking
    the limit of `render_limit` after each piece the template emits."""
    limit = _RENDER_LIMIT.get()
    if limit is None:
        return "".join(pieces)
    max_chars, cancel = limit
    out: list[str] = []
    n = 0
    for piece in pieces:
        n += len(piece)
        if n > max_chars:
            raise RenderLimitError(
                f"the chat template renders more than {max_chars} characters for this input."
            )
        if cancel is not None and cancel.is_set():
            raise RenderLimitError("the chat template's rendering was abandoned.")
        out.append(piece)
    return "".join(out)


def _bound_rendering(template: str) -> None:
    """Make transformers' compiled `template` join its output with `_bounded_concat`.

    transformers compiles each template once into its own sandboxed jinja environment (cached
    by the template's text) and renders with `Template.render`, which joins the pieces the
    template emits with `environment.concat`; that join is where a rendering can be stopped
    while it is running. Outside `render_limit` the join is the plain one."""
    from transformers.utils import chat_template_utils as ctu

    compile_ = getattr(ctu, "_compile_jinja_template", None)
    if compile_ is None:  # another transformers: the rendering stays unbounded
        return
    env = compile_(template).environment
    if env.concat is not _bounded_concat:
        env.concat = _bounded_concat


def _refuse_remote_code(path: Path, cfg: dict[str, Any]) -> None:
    """ModelFormatError if the folder's tokenizer names its own Python code (`auto_map`), which
    transformers was told not to run (`trust_remote_code=False`; left unsaid, it asks on a
    terminal and runs the code on "y"): ondevice never runs code from a model folder."""
    configs = [cfg]
    model_cfg = path / "config.json"
    if model_cfg.is_file():
        try:
            configs.append(json.loads(model_cfg.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # the model loader names a damaged config.json
    for c in configs:
        auto_map = c.get("auto_map") if isinstance(c, dict) else None
        if isinstance(auto_map, dict) and any("Tokenizer" in k for k in auto_map):
            raise ModelFormatError(
                f"{path}: the tokenizer needs custom Python code from the model folder "
                f"(auto_map {json.dumps(auto_map)[:120]}); ondevice never runs code from a model "
                "folder. Use a model whose tokenizer transformers reads without it (a "
                "tokenizer.json with tokenizer_class PreTrainedTokenizerFast)."
            )


# For models that ship no chat template: role-labelled turns (mlx-lm's server also falls back to
# plain "role: content" text for such models).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def transformers() -> Any:
    """The transformers module, imported on first use without its notice that torch is absent
    (ondevice uses only its tokenizers and chat templates)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers as tf

    return tf


class StreamingDetokenizer:
    """Turns a growing list of ids into text pieces with `tokenizers`' `DecodeStream`, which
    decodes only the last few tokens per step (linear in the answer's length; decoding the
    whole answer again per token was quadratic), keeps SentencePiece's leading spaces right
    and holds back incomplete UTF-8 sequences. Tokens in `hidden` add no text."""

    def __init__(self, tokenizer: Tokenizer, hidden: frozenset[int] = frozenset()) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._hidden = hidden
        self._ids: list[int] = []
        self.text = ""  # everything emitted so far

    def add(self, ids: Sequence[int]) -> str:
        """Append ids and return the newly completed text."""
        new = []
        for i in ids:
            if i in self._hidden:
                continue
            self._ids.append(i)
            piece = self._stream.step(self._tok._tok, i)
            if piece:
                new.append(piece)
        out = "".join(new)
        self.text += out
        return out

    def flush(self) -> str:
        """What the stream still holds back at the end (an incomplete character)."""
        text = self._tok.decode(self._ids)
        new = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += new
        return new


def check_pair(verifier: Tokenizer, draft: Tokenizer, draft_vocab: int | None = None) -> None:
    """Raise TokenizerMismatchError unless the draft can only emit ids the verifier reads alike.

    A draft vocabulary that is a prefix of the verifier's is allowed (the draft gives zero
    probability to the rest).
    """
    n = draft_vocab if draft_vocab is not None else draft.vocab_size
    n = min(n, draft.vocab_size)
    if n > verifier.vocab_size:
        raise TokenizerMismatchError(
            f"the draft's vocabulary ({n} tokens) is larger than the verifier's "
            f"({verifier.vocab_size}); the pair must share one tokenizer."
        )
    for i in range(n):
        a, b = verifier.id_to_token(i), draft.id_to_token(i)
        if a != b:
            raise TokenizerMismatchError(
                f"draft and verifier tokenizers differ at token id {i}: verifier {a!r}, "
                f"draft {b!r}. Use a draft trained for this verifier's tokenizer."
            )
    if verifier.eos_token_ids != draft.eos_token_ids and draft.eos_token_ids:
        raise TokenizerMismatchError(
            f"draft and verifier end-of-sequence tokens differ: verifier "
            f"{sorted(verifier.eos_token_ids)}, draft {sorted(draft.eos_token_ids)}."
        )


def _check_sentencepiece(model: Path) -> None:
    """Open a SentencePiece `tokenizer.model` with sentencepiece itself before transformers
    converts it, so a damaged or foreign file is named as such instead of failing deep inside
    the conversion."""
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=str(model))
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with its own text
        raise ModelFormatError(
            f"{model}: not a readable SentencePiece model ({e}); download the tokenizer again."
        ) from None
