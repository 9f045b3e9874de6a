"""Grammar-constrained decoding with llguidance: a mask of allowed tokens per position.

A `Grammar` is compiled once per request (a JSON schema, any JSON object, a Lark grammar or a
regular expression) against the model's vocabulary; `start()` binds it to one generation. The
sampling transform (`sampling.Transform`) asks the state for the tokens allowed after a context
and sets every other logit to -inf, in the draft's distribution and the verifier's alike: the
draft proposes only allowed tokens, and speculation stays exact for the constrained law.

A context is the list of tokens generated so far plus drafted ones; the draft and the verifier
ask for the same contexts in turn (and tree nodes for sibling paths), so the state keeps one
llguidance matcher that it rolls back to the longest common prefix and advances, and caches the
masks it computed. A context that leaves the grammar (a token it does not allow, or anything
after the end-of-sequence token) has no continuation: `allowed` returns None.

Why llguidance: its wheels have no dependencies and exist for Linux x86_64 and macOS arm64
(abi3), it computes masks lazily (tens of microseconds on a 50k vocabulary, no up-front index
over the vocabulary as outlines-core builds), supports rollback, and is what llama.cpp and vLLM
use. xgrammar's wheel requires torch (and triton on Linux), which ondevice does not install.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ondevice.errors import OndeviceError

# Whitespace between JSON tokens: what models write (spaces, newlines, indentation), but bounded,
# so a model cannot fill its answer with blanks.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


class GrammarError(OndeviceError):
    """A grammar or schema that llguidance cannot compile (the message says why)."""


def _llguidance() -> Any:
    import llguidance

    return llguidance


def ll_tokenizer(tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> Any:
    """An llguidance tokenizer for a `tokenizers.Tokenizer` over `vocab` ids (the model's
    logits, padding included). llguidance reads byte-level BPE and SentencePiece tokenizers
    from their JSON; any other is described to it token by token (the bytes each id decodes
    to, special tokens apart). Costs about half a second for a 50k vocabulary: cache it."""
    llg = _llguidance()
    eos = sorted(int(t) for t in eos_ids) or None
    try:
        return llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    except ValueError:
        pass
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces = [b"" if i in special else tokenizer.decode([i]).encode() for i in range(n)]

    class _Vocabulary:  # what llguidance's TokenizerWrapper reads
        def __init__(self) -> None:
            self.tokens = pieces
            self.eos_token_id = eos[0] if eos else 0
            self.bos_token_id = None
            self.special_token_ids = sorted(special)

        def __call__(self, text: str | bytes) -> list[int]:
            return tokenizer.encode(text if isinstance(text, str) else text.decode()).ids

    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary()), n_vocab=vocab, eos_token=eos)


class Grammar:
    """A compiled grammar over one vocabulary; `start()` gives a generation's state."""

    def __init__(self, tokenizer: Any, grammar: str, vocab: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        ok, warnings_or_error = _validate(llg, tokenizer, grammar)
        if not ok:
            raise GrammarError(f"the grammar cannot be used: {warnings_or_error}")
        self.tokenizer, self.grammar = tokenizer, grammar
        self.vocab = vocab
        self.eos = np.array(sorted(eos_ids), dtype=np.int64)
        self.start().allowed(())  # a grammar no token can begin fails here, not mid-answer

    @classmethod
    def json_schema(cls, tokenizer: Any, schema: dict | bool, vocab: int, eos_ids) -> Grammar:
        """JSON valid under `schema` (True: any JSON object is `{"type": "object"}`'s)."""
        llg = _llguidance()
        try:
            text = llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_pattern": JSON_WHITESPACE}
            )
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from None
        return cls(tokenizer, text, vocab, eos_ids)

    @classmethod
    def lark(cls, tokenizer: Any, grammar: str, vocab: int, eos_ids) -> Grammar:
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_lark(grammar), vocab, eos_ids)

    @classmethod
    def gbnf(cls, tokenizer: Any, grammar: str, vocab: int, eos_ids) -> Grammar:
        """llama.cpp's GBNF (a text already in Lark syntax is taken as it is)."""
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(grammar)
        except Exception as e:  # the converter raises bare exceptions for bad input
            raise GrammarError(f"the GBNF grammar cannot be read: {e}") from None
        return cls.lark(tokenizer, lark, vocab, eos_ids)

    @classmethod
    def regex(cls, tokenizer: Any, pattern: str, vocab: int, eos_ids) -> Grammar:
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_regex(pattern), vocab, eos_ids)

    def start(self) -> GrammarState:
        return GrammarState(self)


def _validate(llg: Any, tokenizer: Any, grammar: str) -> tuple[bool, str]:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        return False, "; ".join(messages)
    return True, ""


class GrammarState:
    """A grammar during one generation: allowed tokens after any context. The last
    `cache_size` masks are kept (the verifier asks for the contexts the draft just asked for;
    a mask is one byte per token of the vocabulary)."""

    def __init__(self, grammar: Grammar, cache_size: int = 64):
        llg = _llguidance()
        self.g = grammar
        self.matcher = llg.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.consumed: list[int] = []
        self._masks: OrderedDict[tuple[int, ...], np.ndarray | None] = OrderedDict()
        self._cache_size = cache_size
        self._eos = set(int(t) for t in grammar.eos)

    def allowed(self, generated: Sequence[int]) -> np.ndarray | None:
        key = tuple(int(t) for t in generated)
        if key in self._masks:
            self._masks.move_to_end(key)
            return self._masks[key]
        mask = self._compute(key)
        self._masks[key] = mask
        if len(self._masks) > self._cache_size:
            self._masks.popitem(last=False)
        return mask

    def _compute(self, key: tuple[int, ...]) -> np.ndarray | None:
        m = self.matcher
        n = 0
        limit = min(len(self.consumed), len(key))
        while n < limit and self.consumed[n] == key[n]:
            n += 1
        if n < len(self.consumed):
            m.rollback(len(self.consumed) - n)
            del self.consumed[n:]
        for tok in key[n:]:
            if tok in self._eos or m.validate_tokens([tok]) != 1:
                return None  # the grammar ended, or this token leaves it
            m.consume_token(tok)
            self.consumed.append(tok)
        bits = np.frombuffer(m.compute_bitmask(), np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.g.vocab].astype(bool)
        if len(mask) < self.g.vocab:
            mask = np.concatenate([mask, np.zeros(self.g.vocab - len(mask), bool)])
        if mask[self.g.eos].any():  # the grammar may end here: any end-of-sequence id may
            mask[self.g.eos] = True
        elif not any(m.validate_tokens([int(t)]) == 1 for t in np.flatnonzero(mask)):
            # llguidance's mask may offer tokens it then refuses (an unknown-token id, a
            # special); with none that it takes, decoding would run to max_tokens in vain
            text = self.g.tokenizer.decode_bytes(list(key)).decode("utf-8", "replace")
            raise GrammarError(
                "no token of this model's vocabulary can continue the grammar"
                + (f" after {text!r}" if key else "")
                + ": it asks for text the vocabulary cannot write."
            )
        return mask
