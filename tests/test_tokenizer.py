"""Tokenizers through the card's libraries: transformers' AutoTokenizer and apply_chat_template
(tools, template keyword arguments, a default template), sentencepiece for a folder that ships
only tokenizer.model, and tokenizers' DecodeStream for streamed text."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import tiny

from ondevice.errors import ModelFormatError
from ondevice.models.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}[{{ m.tool_calls[0]['function']['name'] }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tiny.write_model(tmp_path_factory.mktemp("t") / "m")
    return Tokenizer.from_dir(d)


def test_chat_template_gets_tools_and_keyword_arguments(tok):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "content": "sunny"},
    ]  # fmt: skip
    text = tok.apply_chat_template(
        messages, tools=[WEATHER], template=TOOL_TEMPLATE, enable_thinking=False
    )
    assert text.startswith("<tools>get_weather;</tools>")
    assert "[get_weather]" in text and "<|im_start|>tool\nsunny" in text
    assert text.endswith("<|im_start|>assistant\n<think></think>")
    plain = tok.apply_chat_template(messages[:1], template=TOOL_TEMPLATE)
    assert "<tools>" not in plain and not plain.endswith("<think></think>")


def test_a_model_without_a_template_gets_the_default(tok):
    bare = Tokenizer(tok.hf.backend_tokenizer, eos_token_ids=tok.eos_token_ids)
    assert bare.chat_template is None
    text = bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "user: hi\nassistant:"
    assert "messages" in DEFAULT_CHAT_TEMPLATE


def test_sentencepiece_only_folder(tmp_path):
    """A folder with only SentencePiece's tokenizer.model loads (converted to a fast tokenizer
    through sentencepiece) and encodes exactly as sentencepiece does."""
    spm = pytest.importorskip("sentencepiece")
    text = ["the quick brown fox jumps over the lazy dog", "héllo wörld ünïcode"] * 50
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=buf, vocab_size=300, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                    "eos_token": "</s>", "add_bos_token": True})
    )  # fmt: skip
    t = Tokenizer.from_dir(tmp_path)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    for s in ("the lazy fox", "héllo wörld", "zebra ☃"):
        assert t.encode(s) == [sp.bos_id(), *sp.encode(s)]
        assert t.decode(t.encode(s), skip_special_tokens=True) == sp.decode(sp.encode(s))
    assert t.eos_token_ids == {sp.eos_id()}


def test_damaged_sentencepiece_model_is_named(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05not a model")
    with pytest.raises(ModelFormatError, match=r"tokenizer\.model: not a readable SentencePiece"):
        Tokenizer.from_dir(tmp_path)


def test_decode_stream_equals_whole_decode_and_never_redecodes(tok, monkeypatch):
    """Streamed pieces join to the whole decode (multi-byte characters held back until
    complete), without decoding the whole answer again per token."""
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(5, tok.vocab_size, 400)]
    whole = tok.decode(ids)
    calls = []
    monkeypatch.setattr(Tokenizer, "decode", lambda self, i, **kw: calls.append(i) or "")
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in ids]
    assert not calls  # the old detokenizer decoded everything again on every add
    monkeypatch.undo()
    assert "".join(pieces) + detok.flush() == whole


def test_decode_stream_holds_back_partial_utf8(tmp_path):
    """A byte-level tokenizer: one character split over tokens appears only once complete."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    rust = RustTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    tok = Tokenizer(rust)
    ids = tok.encode("a☃b", add_special_tokens=False)
    assert len(ids) == 5  # 'a', three bytes of the snowman, 'b'
    detok = tok.detokenizer()
    assert [detok.add([i]) for i in ids] == ["a", "", "", "☃", "b"]


def test_no_torch_notice(tmp_path):
    d = tiny.write_model(tmp_path / "m")
    code = (
        "from ondevice.models.tokenizer import Tokenizer; import sys;"
        f"t = Tokenizer.from_dir({str(d)!r});"
        "t.apply_chat_template([{'role': 'user', 'content': 'x'}])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "PyTorch" not in r.stderr + r.stdout
