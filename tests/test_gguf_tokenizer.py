"""GGUF tokenizers split text as each model family's own tokenizer does.

Each family's reference is built here, independently of ondevice: a `tokenizers` Tokenizer from a
tokenizer.json-shaped dict that spells out the family's published normalizer and pre-tokenizer,
and for GPT-2, Qwen2 and Llama 3 also a pure-Python regex split with byte-level BPE. SentencePiece
vocabularies are checked against `sentencepiece` itself. Vocabularies are trained here on a small
corpus, written as GGUF metadata with the `gguf` package, and read back through ondevice.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import gguf
import pytest
import regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from ondevice.errors import ModelFormatError
from ondevice.models.gguf import read_header
from ondevice.models.gguf_tokenizer import tokenizer_from_metadata

TEXTS = [
    "Hello world! I'm here, you're there; WE'LL see. They've said DON'T, it's",
    "numbers 1 12 123 1234 12345 3.14159 1,000,000 0x7f 2024-01-15 v2.0.1",
    "你好，世界。日本語のテキストです。한국어 텍스트 中文123",
    "emoji 👍🏽 🎉 👨‍👩‍👧 ❤️ text😀text",
    "spaces:   three,     five\tone tab\t\ttwo tabs \t mixed",
    "lines\n\nblank\r\nwindows\n   indented\n\n\n",
    "def add(a, b):\n    return a + b\n\nclass Foo:\n\tpass  # comment\n",
    "const url = 'https://example.com/api/v1?id=42'; x+=1; y<=>z; a->b",
    "Ünïcödé café naïve ﬁancé ½ ℌ\u00a0nbsp zero\u200bwidth e\u0301 A\u030a Ω ｆｕｌｌ",
    "Привет мир! Γειά σου κόσμε. مرحبا بالعالم ÀÉÎ µ",
    "   leading and trailing   ",
    "'s 'T 're 'VE 'm 'll 'd ''quoted'' don't",
    "",
]
CORPUS = TEXTS * 3 + [
    "the quick brown fox jumps over the lazy dog " * 3,
    "return self.value + other.value  # add them\n" * 3,
    "1234567890 0987654321 3.14 2.71 100 200 300",
]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = ["<|fim_prefix|>"]


def train_bpe() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (all 256 byte symbols plus learned merges) and its merges."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return vocab, merges


VOCAB, MERGES = train_bpe()


def write_gguf(path: Path, model: str, **fields) -> Path:
    """A GGUF file holding only tokenizer metadata, as llama.cpp's converter writes it."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if fields.get("pre") is not None:
        w.add_tokenizer_pre(fields["pre"])
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    if "merges" in fields:
        w.add_token_merges(fields["merges"])
    if "scores" in fields:
        w.add_token_scores(fields["scores"])
    for key, add in (
        ("bos", w.add_bos_token_id),
        ("eos", w.add_eos_token_id),
        ("unk", w.add_unk_token_id),
        ("add_bos", w.add_add_bos_token),
        ("add_eos", w.add_add_eos_token),
        ("add_space_prefix", w.add_add_space_prefix),
    ):
        if key in fields:
            add(fields[key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bpe_gguf(tmp_path: Path, pre: str | None, **fields) -> Path:
    tokens = [*VOCAB, *CONTROL, *USER]
    types = [1] * len(VOCAB) + [3] * len(CONTROL) + [4] * len(USER)
    return write_gguf(
        tmp_path / f"{pre}.gguf",
        "gpt2",
        pre=pre,
        tokens=tokens,
        types=types,
        merges=MERGES,
        **fields,
    )


def load(path: Path):
    return tokenizer_from_metadata(read_header(path).metadata, str(path))


# -- the references: each family's tokenizer.json, written out -----------------------------------

BYTE_LEVEL_REGEX = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
BYTE_LEVEL_ONLY = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": False,
    "use_regex": False,
}
DIGITS = {"type": "Digits", "individual_digits": True}


def split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def seq(*p: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(p)}


QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DEEPSEEK_LETTERS = (  # the class spelled out with escapes (normalization-proof)
    "["
    "\u0041-\u005a\u0061-\u007a\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf"
    "\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-"
    "\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-"
    "\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-"
    "\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-"
    "\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2"
    "\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
    "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943"
    "]+"
)
NFC = {"type": "NFC"}
STARCODER = (None, seq(DIGITS, BYTE_LEVEL_REGEX))
FAMILIES = {  # pre name -> (normalizer, pre_tokenizer) of the family's tokenizer.json
    "gpt-2": (None, BYTE_LEVEL_REGEX),
    "phi-2": (None, BYTE_LEVEL_REGEX),
    "mpt": (NFC, BYTE_LEVEL_REGEX),
    "qwen2": (NFC, seq(split(QWEN2), BYTE_LEVEL_ONLY)),
    "llama-bpe": (None, seq(split(LLAMA3), BYTE_LEVEL_ONLY)),
    "smaug-bpe": (None, seq(split(LLAMA3), BYTE_LEVEL_ONLY)),
    "dbrx": (None, seq(split(LLAMA3), BYTE_LEVEL_ONLY)),
    "smollm": STARCODER,
    "starcoder": STARCODER,
    "refact": STARCODER,
    "command-r": (NFC, STARCODER[1]),
    "falcon": (
        None,
        seq(
            {"type": "Punctuation", "behavior": "Contiguous"},
            BYTE_LEVEL_REGEX,
            {"type": "Digits", "individual_digits": False},
            split("[0-9][0-9][0-9]"),
        ),
    ),
    "deepseek-llm": (
        None,
        seq(
            split("[\r\n]"),
            split("\\s?" + DEEPSEEK_LETTERS),
            split("\\s?[!-/:-~！-／：-～‘-‟　-。]+"),
            split("\\s+$"),
            split("[一-龥ࠀ-一가-퟿]+"),
            DIGITS,
            BYTE_LEVEL_ONLY,
        ),
    ),
    "deepseek-coder": (
        None,
        seq(
            split("[\r\n]"),
            split("\\s?\\p{L}+"),
            split("\\s?\\p{P}+"),
            split("[一-龥ࠀ-一가-퟿]+"),
            DIGITS,
            BYTE_LEVEL_ONLY,
        ),
    ),
}


def reference(family: str) -> HFTokenizer:
    normalizer, pre = FAMILIES[family]
    tokens = [*VOCAB, *CONTROL, *USER]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(VOCAB) + i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": t in CONTROL,
            }
            for i, t in enumerate(CONTROL + USER)
        ],
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": MERGES,
        },
    }
    return HFTokenizer.from_str(json.dumps(doc))


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


BYTES = _byte_symbols()
RANKS = {tuple(m.split(" ")): i for i, m in enumerate(MERGES)}
IDS = {t: i for i, t in enumerate(VOCAB)}


def python_bpe(text: str, pattern: str, nfc: bool = False) -> list[int]:
    """Regex split, byte-level symbols, then merges lowest rank first: GPT-2's algorithm."""
    if nfc:
        text = unicodedata.normalize("NFC", text)
    out = []
    for piece in regex.findall(pattern, text):
        word = [BYTES[b] for b in piece.encode()]
        while len(word) > 1:
            rank, i = min((RANKS.get(p, 1 << 30), i) for i, p in enumerate(zip(word, word[1:])))
            if rank == 1 << 30:
                break
            word[i : i + 2] = [word[i] + word[i + 1]]
        out += [IDS[w] for w in word]
    return out


# -- byte-level BPE families ---------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bpe_family_matches_its_tokenizer_json(tmp_path, family):
    tok = load(bpe_gguf(tmp_path, family))
    ref = reference(family)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids, (family, text)
        assert tok.decode(tok.encode(text)) == (
            unicodedata.normalize("NFC", text) if FAMILIES[family][0] else text
        )
    assert tok.origin == {"version": 2, "model": "gpt2", "pre": family}


@pytest.mark.parametrize(
    "family,pattern,nfc",
    [("gpt-2", GPT2, False), ("qwen2", QWEN2, True), ("llama-bpe", LLAMA3, False)],
)
def test_bpe_family_matches_a_python_regex_split(tmp_path, family, pattern, nfc):
    tok = load(bpe_gguf(tmp_path, family))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == python_bpe(text, pattern, nfc), text


def test_qwen2_split_changes_code_tokens(tmp_path):
    """The defect of issue 24: GPT-2's split is not Qwen2's on code and numbers."""
    qwen = load(bpe_gguf(tmp_path, "qwen2"))
    gpt2 = reference("gpt-2")
    differ = [t for t in TEXTS if qwen.encode(t, add_special_tokens=False) != gpt2.encode(t).ids]
    assert len(differ) >= 5


def test_special_tokens_and_flags(tmp_path):
    eos = VOCAB.index("Ċ")  # any id: the flags matter, not the text
    tok = load(bpe_gguf(tmp_path, "qwen2", bos=len(VOCAB), eos=eos, add_bos=True, add_eos=True))
    control, user = len(VOCAB) + 1, len(VOCAB) + len(CONTROL)
    ids = tok.encode("<|im_start|>hi<|fim_prefix|>x")
    assert ids[0] == len(VOCAB) and ids[-1] == eos  # add_bos, add_eos
    assert control in ids and user in ids  # neither kind is split
    text = tok.decode(ids[1:-1], skip_special_tokens=True)
    assert text == "hi<|fim_prefix|>x"  # control tokens are skipped on request, user ones kept
    plain = load(bpe_gguf(tmp_path, "gpt-2", bos=len(VOCAB), add_bos=False))
    assert plain.encode("hi")[0] != len(VOCAB)


def test_unknown_pre_tokenizer_is_named(tmp_path):
    with pytest.raises(ModelFormatError, match=r"pre-tokenizer 'tekken-9'.*supported: .*qwen2"):
        load(bpe_gguf(tmp_path, "tekken-9"))


def test_missing_pre_tokenizer_warns_which_split(tmp_path, capsys):
    tok = load(bpe_gguf(tmp_path, None))
    assert "splitting text like GPT-2" in capsys.readouterr().err
    assert tok.encode(TEXTS[0], add_special_tokens=False) == reference("gpt-2").encode(TEXTS[0]).ids


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path = write_gguf(tmp_path / "t5.gguf", "t5", tokens=["a"], types=[1])
    with pytest.raises(ModelFormatError, match=r"'t5'.*supported: gpt2, llama"):
        load(path)


# -- SentencePiece -------------------------------------------------------------------------------


def train_spm(tmp_path: Path, dummy_prefix: bool):
    import sentencepiece as spm

    prefix = tmp_path / f"spm-{dummy_prefix}"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS + ["ordinary words for the model"] * 20),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=500,
        byte_fallback=True,
        character_coverage=0.98,  # rare characters stay out: byte fallback covers them
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix,
        split_digits=True,
        user_defined_symbols=["<|user|>"],
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def spm_types(sp) -> list[int]:
    def kind(i: int) -> int:
        for test, ty in (
            (sp.is_unknown, 2),
            (sp.is_control, 3),
            (sp.is_unused, 5),
            (sp.is_byte, 6),
        ):
            if test(i):
                return ty
        return 4 if sp.id_to_piece(i) == "<|user|>" else 1

    return [kind(i) for i in range(sp.get_piece_size())]


@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_sentencepiece_matches_sentencepiece(tmp_path, dummy_prefix):
    sp = train_spm(tmp_path, dummy_prefix)
    n = sp.get_piece_size()
    path = write_gguf(
        tmp_path / "spm.gguf",
        "llama",
        tokens=[sp.id_to_piece(i) for i in range(n)],
        types=spm_types(sp),
        scores=[sp.get_score(i) for i in range(n)],
        bos=sp.bos_id(),
        eos=sp.eos_id(),
        unk=sp.unk_id(),
        add_bos=True,
        add_space_prefix=dummy_prefix,
    )
    tok = load(path)
    for text in [t for t in TEXTS if t]:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.encode(text) == [sp.bos_id(), *want]  # add_bos_token
        assert tok.decode(want) == sp.decode(want) == text
    assert any(sp.is_byte(i) for t in TEXTS for i in sp.encode(t))  # byte fallback was used
    assert tok.origin == {"version": 2, "model": "llama", "add_space_prefix": dummy_prefix}


# -- bundles -------------------------------------------------------------------------------------

DECOMPOSED = "cafe\u0301 def f(x):\n    return x"  # Qwen2's NFC changes the bytes


@pytest.fixture(scope="module")
def qwen_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny pair converted from GGUF files that name Qwen2's pre-tokenizer."""
    import tiny

    from ondevice.convert import cli

    root = tmp_path_factory.mktemp("qwen-gguf")
    verifier, _ = tiny.write_gguf(root / "v.gguf", pre="qwen2")
    draft, _ = tiny.write_gguf(root / "d.gguf", seed=1, pre="qwen2")
    out = root / "pair.bundle"
    argv = ["--verifier", str(verifier), "--draft", str(draft), "-o", str(out)]
    assert cli.main([*argv, "--context", "64", "--draft-chunk", "8", "--probe-prompts", "0"]) == 0
    return out, verifier


def make_old(bundle: Path, dest: Path) -> Path:
    """`bundle` as an ondevice before issue 24 wrote it: every tokenizer.json with GPT-2's split
    and no record of how the GGUF vocabulary was built."""
    import shutil

    from ondevice.convert.bundle import file_entries, write_manifest

    shutil.copytree(bundle, dest)
    for f in dest.rglob("tokenizer.json"):
        doc = json.loads(f.read_text())
        doc["normalizer"] = None
        doc["pre_tokenizer"] = BYTE_LEVEL_REGEX
        f.write_text(json.dumps(doc))
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["tokenizer"]["gguf"]
    manifest["files"] = file_entries(dest)
    write_manifest(dest, {k: v for k, v in manifest.items() if k != "format_version"})
    return dest


def test_bundle_from_gguf_carries_the_split(qwen_bundle, capsys):
    import ondevice
    from ondevice.convert import cli

    out, verifier = qwen_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["gguf"] == {"version": 2, "model": "gpt2", "pre": "qwen2"}
    for sub in ("tokenizer", "verifier", "draft/mlx"):
        doc = json.loads((out / sub / "tokenizer.json").read_text())
        assert doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == QWEN2, sub
    want = load(verifier).encode(DECOMPOSED)
    capsys.readouterr()
    assert ondevice.load(str(out)).tokenizer.encode(DECOMPOSED) == want
    assert "older ondevice" not in capsys.readouterr().err
    assert cli.main(["--check", str(out)]) == 0
    assert "tokenizer: current" in capsys.readouterr().out


def test_old_bundle_is_repaired_from_its_source_gguf(qwen_bundle, tmp_path, capsys):
    import ondevice
    from ondevice.convert import cli

    out, verifier = qwen_bundle
    old = make_old(out, tmp_path / "old.bundle")
    want = load(verifier).encode(DECOMPOSED)
    capsys.readouterr()
    assert cli.main(["--check", str(old)]) == 0
    report = capsys.readouterr().out
    assert "tokenizer: warning (repaired on load)" in report and "'qwen2' split" in report
    gen = ondevice.load(str(old))
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "older ondevice" in line] == [
        f"ondevice: bundle {old.resolve()}: its tokenizer was built from a GGUF file by an older "
        f"ondevice, which split text like GPT-2; using the 'qwen2' split (from its source "
        f"{verifier}). Convert the pair again to fix it on disk."
    ]
    assert gen.tokenizer.encode(DECOMPOSED) == want


def test_old_bundle_without_its_source_is_reported(qwen_bundle, tmp_path, capsys):
    import ondevice
    from ondevice.convert import cli

    out, verifier = qwen_bundle
    old = make_old(out, tmp_path / "old.bundle")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["verifier"]["source"] = str(tmp_path / "gone.gguf")
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["--check", str(old)]) == 1
    assert "tokenizer: ERROR" in capsys.readouterr().out
    ondevice.load(str(old))
    assert "keeping GPT-2's split" in capsys.readouterr().err


def test_old_tokenizer_family_from_its_vocabulary():
    """Without its source file, a Qwen2 vocabulary (its <|endoftext|> at 151643) says which."""
    from ondevice.models.gguf_tokenizer import stale_bundle_tokenizer

    vocab = {f"t{i}": i for i in range(151643)}
    vocab["<|endoftext|>"] = 151643
    tok = HFTokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    manifest = {"tokenizer": {}, "verifier": {"source": "/nowhere/qwen.gguf"}}
    fixed, line = stale_bundle_tokenizer(manifest, tok)
    assert "'qwen2' split (from its vocabulary)" in line
    assert json.loads(fixed.to_str())["normalizer"] == NFC
    manifest["tokenizer"]["gguf"] = {"version": 2, "model": "gpt2", "pre": "qwen2"}
    assert stale_bundle_tokenizer(manifest, tok) is None  # recorded as built by this version


def test_old_sentencepiece_tokenizer_is_rebuilt(tmp_path):
    """An older ondevice built SentencePiece vocabularies as a Unigram model; rebuilt from its
    own pieces and scores, the bundle's tokenizer encodes like SentencePiece."""
    from tokenizers import Regex, normalizers

    from ondevice.models.gguf_tokenizer import stale_bundle_tokenizer

    sp = train_spm(tmp_path, dummy_prefix=True)
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    old = HFTokenizer(models.Unigram(pieces, unk_id=sp.unk_id(), byte_fallback=True))
    old.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    old.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?!)"), "isolated")
    old.add_special_tokens([sp.id_to_piece(i) for i in (sp.bos_id(), sp.eos_id())])
    texts = [t for t in TEXTS if t]
    assert any(old.encode(t).ids != sp.encode(t) for t in texts)  # the old build was wrong
    manifest = {"tokenizer": {}, "verifier": {"source": str(tmp_path / "gone.gguf")}}
    fixed, line = stale_bundle_tokenizer(manifest, HFTokenizer.from_str(old.to_str()))
    assert "SentencePiece" in line
    for text in texts:
        assert fixed.encode(text).ids == sp.encode(text), text
    assert fixed.encode("</s>").ids == [sp.eos_id()]
