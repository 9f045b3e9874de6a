"""Tokenizers from GGUF metadata, split the way each model's own `tokenizer.json` splits text.

A GGUF file names its vocabulary's kind in `tokenizer.ggml.model` (`gpt2`: byte-level BPE with
merges; `llama`: SentencePiece pieces with scores) and, for BPE, the pre-tokenizer in
`tokenizer.ggml.pre` (llama.cpp's name for the model family's split: `qwen2`, `llama-bpe`, ...).
The split decides which merges can apply, so the same vocabulary split another way gives token
sequences the model never saw in training. `PRE_TOKENIZERS` holds, per name, the normalizer
and pre-tokenizer of that family's Hugging Face `tokenizer.json` (in its JSON shape, so a
bundle's saved tokenizer can be repaired with the same entries). A name not in the table is an
error that names it; a file without the key (written before llama.cpp recorded it) gets GPT-2's
split with a warning, as llama.cpp does.

SentencePiece vocabularies become a BPE model whose merges are ranked by the merged piece's
score (what SentencePiece's BPE and llama.cpp do: the best-scoring adjacent pair merges first),
with byte fallback, `▁` for spaces and the `add_space_prefix` flag. Control tokens (type 3) are
special added tokens, user-defined ones (type 4) plain added tokens: neither is ever split. The
`add_bos_token`/`add_eos_token` flags become the post-processor's template.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from ondevice.errors import ModelFormatError
from ondevice.models.tokenizer import Tokenizer

# Bumped whenever a GGUF file's tokenizer is built differently; bundles record it in their
# manifest (`tokenizer.gguf.version`), so one built by an older ondevice is recognised.
VERSION = 2

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# -- pre-tokenizers, in tokenizer.json's shape ---------------------------------------------------

_CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"
GPT2_REGEX = rf"{_CONTRACTIONS}| ?\p{{L}}+| ?\p{{N}}+| ?[^\s\p{{L}}\p{{N}}]+|\s+(?!\S)|\s+"
# Qwen2's and Llama 3's splits: case-insensitive contractions, a letter run may take one leading
# non-letter, digits alone (Qwen2) or in threes (Llama 3), newlines kept with punctuation.
_TIKTOKEN_STYLE = (
    rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|{{digits}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = _TIKTOKEN_STYLE.replace("{digits}", r"\p{N}")
LLAMA3_REGEX = _TIKTOKEN_STYLE.replace("{digits}", r"\p{N}{1,3}")
# DeepSeek LLM's letters: its tokenizer.json lists these code point ranges (cased letters of
# Latin, Greek, Cyrillic, Armenian, ...) rather than \p{L}. Written as numbers, because several
# (U+1F7D, U+1FBE, U+2126, U+212A...) are changed by Unicode normalization in editors.
_DEEPSEEK_LETTER_RANGES = (
    "0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF "
    "0370-0373 0376 0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 "
    "048A-052F 0531-0556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 "
    "1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D "
    "1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 "
    "1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 212A-212D 212F-2134 2139 "
    "213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2 2CF3 A640-A66D "
    "A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A "
    "10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943 "
)
_DEEPSEEK_LETTERS = "".join(
    "-".join(chr(int(c, 16)) for c in r.split("-")) for r in _DEEPSEEK_LETTER_RANGES.split()
)
_CJK = "[一-龥ࠀ-一가-퟿]+"


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _sequence(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(parts)}


_DIGITS = {"type": "Digits", "individual_digits": True}
_NFC = {"type": "NFC"}


@dataclass(frozen=True)
class Split:
    """A family's text split: tokenizer.json's `normalizer` and `pre_tokenizer` entries."""

    pre_tokenizer: dict[str, Any]
    normalizer: dict[str, Any] | None = None


_GPT2 = Split(_byte_level(use_regex=True))
_LLAMA3 = Split(_sequence(_split(LLAMA3_REGEX), _byte_level(use_regex=False)))
_STARCODER = Split(_sequence(_DIGITS, _byte_level(use_regex=True)))

PRE_TOKENIZERS: dict[str, Split] = {
    # GPT-2's byte-level regex, and the families whose tokenizer.json uses it unchanged.
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "olmo": _GPT2,
    "mpt": Split(_byte_level(use_regex=True), _NFC),  # GPT-NeoX's tokenizer: NFC first
    "qwen2": Split(_sequence(_split(QWEN2_REGEX), _byte_level(use_regex=False)), _NFC),
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,  # Smaug: Llama 3's tokenizer
    "dbrx": _LLAMA3,  # tiktoken's cl100k split, which Llama 3 took
    # Digits one by one, then GPT-2's regex.
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "smollm": _STARCODER,
    "command-r": Split(_STARCODER.pre_tokenizer, _NFC),
    "falcon": Split(
        _sequence(
            {"type": "Punctuation", "behavior": "Contiguous"},
            _byte_level(use_regex=True),
            {"type": "Digits", "individual_digits": False},
            _split("[0-9][0-9][0-9]"),
        )
    ),
    "deepseek-llm": Split(
        _sequence(
            _split("[\r\n]"),
            _split(rf"\s?[{_DEEPSEEK_LETTERS}]+"),
            _split("\\s?[!-/:-~！-／：-～‘-‟　-。]+"),
            _split(r"\s+$"),
            _split(_CJK),
            _DIGITS,
            _byte_level(use_regex=False),
        )
    ),
    "deepseek-coder": Split(
        _sequence(
            _split("[\r\n]"),
            _split(r"\s?\p{L}+"),
            _split(r"\s?\p{P}+"),
            _split(_CJK),
            _DIGITS,
            _byte_level(use_regex=False),
        )
    ),
}
_BYTE_DECODER = {
    "type": "ByteLevel",
    "add_prefix_space": True,
    "trim_offsets": True,
    "use_regex": True,
}
_BYTE_POST = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": False,
    "use_regex": True,
}


def split_for(pre: str | None, source: str) -> tuple[str, Split]:
    """The name and split of a BPE vocabulary's pre-tokenizer; a missing name (files written
    before llama.cpp recorded it, or "default") falls back to GPT-2's split with a warning."""
    if pre in PRE_TOKENIZERS:
        return pre, PRE_TOKENIZERS[pre]
    if pre in (None, "default"):
        what = "names no pre-tokenizer" if pre is None else "names the 'default' pre-tokenizer"
        _note(
            f"{source}: the GGUF file {what} (tokenizer.ggml.pre); splitting text like GPT-2. "
            "If the model was trained with another split, use a GGUF made by a newer llama.cpp."
        )
        return "gpt-2", _GPT2
    raise ModelFormatError(
        f"{source}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported, so this "
        f"file's text cannot be split as its model expects; supported: "
        f"{', '.join(sorted(PRE_TOKENIZERS))}. Load the model's Hugging Face folder instead."
    )


def _note(text: str) -> None:
    print(f"ondevice: {text}", file=sys.stderr, flush=True)


# -- building ------------------------------------------------------------------------------------


def _post_processor(
    tokens: Sequence[str], bos: int | None, eos: int | None, byte_level: bool
) -> dict[str, Any] | None:
    """ByteLevel offsets (BPE) and the BOS/EOS template from the add_bos/add_eos flags."""
    steps = [_BYTE_POST] if byte_level else []
    single: list[dict[str, Any]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict[str, Any]] = [*single, {"Sequence": {"id": "B", "type_id": 1}}]
    specials = {}
    for i, at_end in ((bos, False), (eos, True)):
        if i is None:
            continue
        entry = {"SpecialToken": {"id": tokens[i], "type_id": 0}}
        single = [*single, entry] if at_end else [entry, *single]
        pair = [*pair, entry] if at_end else [entry, *pair]
        specials[tokens[i]] = {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
    if specials:
        steps.append(
            {
                "type": "TemplateProcessing",
                "single": single,
                "pair": pair,
                "special_tokens": specials,
            }
        )
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else {"type": "Sequence", "processors": steps}


def _spm_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scored pieces: every way to make a normal piece
    from two pieces, the best-scoring result first (ties: lower id first)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, UNUSED, USER_DEFINED)}
    ranked = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            if piece[:k] in vocab and piece[k:] in vocab:
                ranked.append((-scores[i], i, piece[:k], piece[k:]))
    ranked.sort()
    return [(a, b) for _, _, a, b in ranked]


def _json_tokenizer(normalizer: Any, pre: Any, post: Any, decoder: Any) -> HFTokenizer:
    """A tokenizer with these tokenizer.json parts and an empty model (set by the caller)."""
    return HFTokenizer.from_str(
        json.dumps(
            {
                "version": "1.0",
                "truncation": None,
                "padding": None,
                "added_tokens": [],
                "normalizer": normalizer,
                "pre_tokenizer": pre,
                "post_processor": post,
                "decoder": decoder,
                "model": {"type": "BPE", "vocab": {}, "merges": []},
            }
        )
    )


def tokenizer_from_metadata(meta: dict[str, Any], source: str) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (see the module docstring).

    meta: the file's metadata (`read_header(path).metadata`); source: the file's name, for
    errors."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelFormatError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens.")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelFormatError(
            f"{source}: GGUF metadata lists {len(tokens)} tokens but {len(types)} token types; "
            "the file is corrupt. Download it again."
        )

    def token_id(key: str) -> int | None:
        i = meta.get(key)
        if i is None:
            return None
        i = int(i)
        return i if 0 <= i < len(tokens) else None

    bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    post_bos, post_eos = (bos if add_bos else None), (eos if add_eos else None)
    origin: dict[str, Any] = {"version": VERSION, "model": kind}
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens, source, origin, post_bos, post_eos)
    elif kind == "llama":
        unk = token_id("tokenizer.ggml.unknown_token_id")
        tok = _sentencepiece_bpe(meta, tokens, types, unk, origin, post_bos, post_eos)
    else:
        raise ModelFormatError(
            f"{source}: GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported "
            "(supported: gpt2, llama)."
        )
    # Never split: control tokens (special: skipped on request), user-defined and unknown ones.
    tok.add_tokens(
        [
            AddedToken(t, special=ty != USER_DEFINED, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (CONTROL, USER_DEFINED, UNKNOWN)
        ]
    )
    eos_ids = [eos] if eos is not None else []
    eot = token_id("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.append(eot)
    return Tokenizer(
        tok,
        eos_token_ids=eos_ids,
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        origin=origin,
    )


def _byte_level_bpe(
    meta: dict[str, Any],
    tokens: list[str],
    source: str,
    origin: dict[str, Any],
    post_bos: int | None,
    post_eos: int | None,
) -> HFTokenizer:
    """`tokenizer.ggml.model = gpt2`: byte-level BPE with the split `tokenizer.ggml.pre` names
    (recorded in `origin`)."""
    name, split = split_for(meta.get("tokenizer.ggml.pre"), source)
    origin["pre"] = name
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = _json_tokenizer(
        split.normalizer,
        split.pre_tokenizer,
        _post_processor(tokens, post_bos, post_eos, byte_level=True),
        _BYTE_DECODER,
    )
    tok.model = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False)
    return tok


def _sentencepiece_bpe(
    meta: dict[str, Any],
    tokens: list[str],
    types: list[int],
    unk: int | None,
    origin: dict[str, Any],
    post_bos: int | None,
    post_eos: int | None,
) -> HFTokenizer:
    """`tokenizer.ggml.model = llama`: a SentencePiece vocabulary as BPE with merges ranked by
    the pieces' scores, byte fallback, the `▁` space and `add_space_prefix` (in `origin`)."""
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    origin["add_space_prefix"] = space_prefix
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    normalizer = (
        {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]}
        if space_prefix
        else replace
    )
    decoder = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if space_prefix:
        decoder.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    tok = _json_tokenizer(
        normalizer,
        None,
        _post_processor(tokens, post_bos, post_eos, byte_level=False),
        {"type": "Sequence", "decoders": decoder},
    )
    tok.model = models.BPE(
        {t: i for i, t in enumerate(tokens)},
        _spm_merges(tokens, scores, types),
        unk_token=tokens[unk] if unk is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    return tok


# -- bundles made before this module ----------------------------------------------------------------

# The pre-tokenizer every GGUF byte-level vocabulary got before VERSION 2 (GPT-2's split).
_OLD_BPE_SPLIT = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
_OLD = "its tokenizer was built from a GGUF file by an older ondevice, which split text like GPT-2"
# Vocabularies that say which family they are: (id, token) -> pre-tokenizer name.
_KNOWN_VOCABULARIES = {
    (151643, "<|endoftext|>"): "qwen2",
    (128000, "<|begin_of_text|>"): "llama-bpe",
}


def _family(tok: HFTokenizer) -> str | None:
    for (i, text), pre in _KNOWN_VOCABULARIES.items():
        if tok.id_to_token(i) == text:
            return pre
    if tok.get_vocab_size() == 49152 and tok.id_to_token(1) == "<|im_start|>":
        return "smollm"  # SmolLM/SmolLM2
    return None


def _source_gguf(source: Any) -> Path | None:
    """The GGUF file a bundle was converted from, if it is still on this machine."""
    from ondevice.sources.hub import cache_dir

    if not isinstance(source, str) or not source:
        return None
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    cached = cache_dir() / "models" / source.replace("/", "--")  # a name `ondevice pull` cached
    ggufs = sorted(cached.glob("*.gguf")) if cached.is_dir() else []
    return ggufs[0] if len(ggufs) == 1 else None


def _old_spm(doc: dict[str, Any]) -> bool:
    """What an older ondevice wrote for a SentencePiece GGUF vocabulary: a Unigram model over
    the scored pieces (SentencePiece's BPE merges differently) behind a no-op split."""
    pre = doc.get("pre_tokenizer") or {}
    return doc.get("model", {}).get("type") == "Unigram" and pre.get("type") == "Split"


def _rebuilt_spm(doc: dict[str, Any], meta: dict[str, Any] | None) -> HFTokenizer:
    """The SentencePiece tokenizer of an old bundle's Unigram pieces and scores, with the
    source file's add_space_prefix flag when known (older ondevice always prepended)."""
    model = doc["model"]
    tokens = [piece for piece, _ in model["vocab"]]
    added = {t["content"]: t["special"] for t in doc.get("added_tokens", [])}

    def kind(i: int, piece: str) -> int:
        if i == model.get("unk_id"):
            return UNKNOWN
        if piece in added:
            return CONTROL if added[piece] else USER_DEFINED
        return BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", piece) else NORMAL

    types = [kind(i, t) for i, t in enumerate(tokens)]
    synthetic = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [score for _, score in model["vocab"]],
        "tokenizer.ggml.unknown_token_id": model.get("unk_id"),
        "tokenizer.ggml.add_bos_token": False,  # the bundle's tokenizer_config.json says
        "tokenizer.ggml.add_space_prefix": (meta or {}).get(
            "tokenizer.ggml.add_space_prefix", True
        ),
    }
    return tokenizer_from_metadata(synthetic, "bundle")._tok


def stale_bundle_tokenizer(
    manifest: dict[str, Any], tok: HFTokenizer
) -> tuple[HFTokenizer | None, str] | None:
    """Whether a bundle's saved tokenizer was built from a GGUF file by an ondevice before this
    module (GPT-2's split for every byte-level vocabulary, a Unigram model for SentencePiece
    ones). None: it is current, or came from a Hugging Face tokenizer.json. Otherwise (the
    tokenizer to use instead, or None when that cannot be told; the line that says so)."""
    record = manifest.get("tokenizer", {}).get("gguf")
    if isinstance(record, dict) and record.get("version", 0) >= VERSION:
        return None
    doc = json.loads(tok.to_str())
    spm = _old_spm(doc)
    if not spm and (
        doc.get("normalizer") is not None or doc.get("pre_tokenizer") != _OLD_BPE_SPLIT
    ):
        return None  # not what an older ondevice wrote for a GGUF vocabulary
    source = manifest.get("verifier", {}).get("source")
    gguf_file = _source_gguf(source)
    meta = None
    if gguf_file is not None:
        from ondevice.models.gguf import read_header

        meta = read_header(gguf_file).metadata
    if spm:
        return _rebuilt_spm(doc, meta), (
            "its tokenizer was built from a SentencePiece GGUF vocabulary by an older ondevice, "
            "which merged pieces another way; using SentencePiece's merges. Convert the pair "
            "again to fix it on disk."
        )
    if meta is not None:
        pre = meta.get("tokenizer.ggml.pre")
        how = f"from its source {gguf_file}"
    elif (pre := _family(tok)) is not None:
        how = "from its vocabulary"
    elif str(source).lower().endswith(".gguf"):
        return None, (
            f"{_OLD}, and its model's split cannot be told ({source} is gone, the vocabulary is "
            "not one ondevice recognises); keeping GPT-2's split. Convert the pair again."
        )
    else:
        return None  # a Hugging Face tokenizer that uses GPT-2's split
    if pre in (None, "default", "gpt-2", "phi-2", "olmo"):
        return None  # GPT-2's split is what this ondevice uses for it too
    if pre not in PRE_TOKENIZERS:
        return None, f"{_OLD}, and its model's split {pre!r} is not supported; keeping GPT-2's."
    doc["normalizer"] = PRE_TOKENIZERS[pre].normalizer
    doc["pre_tokenizer"] = PRE_TOKENIZERS[pre].pre_tokenizer
    return HFTokenizer.from_str(json.dumps(doc)), (
        f"{_OLD}; using the {pre!r} split ({how}). Convert the pair again to fix it on disk."
    )


def repair_bundle_tokenizers(
    manifest: dict[str, Any], tokenizers: Sequence[Tokenizer], bundle: str
) -> bool:
    """Replace a bundle's stale GGUF-built tokenizers (the verifier's, the draft's) by what this
    ondevice builds for their vocabulary, saying so in one line on stderr; True if they were
    stale (see `stale_bundle_tokenizer`, which the first tokenizer decides)."""
    found = stale_bundle_tokenizer(manifest, tokenizers[0]._tok)
    if found is None:
        return False
    fixed, line = found
    if fixed is not None:
        for t in tokenizers:
            t.replace_backend(HFTokenizer.from_str(fixed.to_str()))
    _note(f"bundle {bundle}: {line}")
    return True
