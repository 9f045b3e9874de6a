"""Tokenizers from HF files or GGUF metadata, chat templates, streaming detokenization, pair checks.

Built on the `tokenizers` library and jinja2 directly: it is what transformers' fast tokenizers
use underneath, without importing transformers (slow, and it warns about torch on every start).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

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
    ) -> None:
        self._tok = tok
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
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise ModelFormatError(
                f"{path}: no tokenizer.json. ondevice needs a fast tokenizer file; "
                "re-save the tokenizer with transformers (`tokenizer.save_pretrained(dir)`)."
            )
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise ModelFormatError(f"{tj}: cannot be read as a tokenizer ({e}).") from None
        cfg: dict[str, Any] = {}
        tc = path / "tokenizer_config.json"
        if tc.exists():
            try:
                cfg = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise ModelFormatError(f"{tc}: not valid JSON ({e}).") from None
        template = cfg.get("chat_template")
        jinja = path / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(
            tok,
            eos_token_ids=eos_token_ids,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ModelFormatError(
                "this model has no chat template; pass a plain string prompt or "
                "chat_template=False (CLI: --no-chat-template)."
            )
        from jinja2.exceptions import TemplateError

        try:
            return _compile(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:  # the template refuses these messages (e.g. role order)
            raise OndeviceError(f"the model's chat template rejects these messages: {e}") from None

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)

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


_TEMPLATES: dict[str, Any] = {}


def _compile(template: str):
    """Compile a chat template the way transformers does (sandboxed jinja, same helpers)."""
    if template not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(
            x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False
        ):
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]


class StreamingDetokenizer:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences.

    It decodes the whole sequence each time (decoding is fast and in Rust): decoding pieces
    separately would lose the leading spaces that SentencePiece-style decoders strip.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self.text = ""  # everything emitted so far

    def add(self, ids: Sequence[int]) -> str:
        """Append ids and return the newly completed text."""
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""  # wait for the rest of a multi-byte character
        new, self.text = text[len(self.text) :], text
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        new = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text
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
