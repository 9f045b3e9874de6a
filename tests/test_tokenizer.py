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


# -- issue 29: no code from a model folder, bounded renderings -------------------------------------


def test_no_code_from_a_model_folder_runs_whatever_the_terminal_answers(tmp_path):
    """A tokenizer folder with `auto_map` naming its own Python class: transformers asked on
    the terminal whether to run it, and "y" ran it. Now it is refused with a clear error."""
    folder = tmp_path / "tok"
    tiny.write_tokenizer(folder, 100)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(
        tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "code-ran"
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    code = (
        "import sys\nfrom ondevice.models.tokenizer import Tokenizer\n"
        "try:\n    Tokenizer.from_dir(sys.argv[1])\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    for answer in ("y\n", "yes\n", "\n"):
        run = subprocess.run(
            [sys.executable, "-c", code, str(folder)],
            input=answer, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert not marker.exists(), run.stdout + run.stderr
        assert "ModelFormatError" in run.stdout and "custom Python code" in run.stdout, run.stdout


def test_template_arguments_cannot_replace_the_template_or_its_own_arguments(tok):
    from ondevice.errors import OndeviceError

    msgs = [{"role": "user", "content": "hi"}]
    for name in ("tokenize", "messages", "documents", "bos_token", "chat_template"):
        with pytest.raises(OndeviceError, match=f"'{name}' is reserved"):
            tok.apply_chat_template(msgs, **{name: "x"})


def test_a_rendering_stops_at_its_limit_and_when_abandoned(tok):
    import threading

    from ondevice.models.tokenizer import RenderLimitError, render_limit

    msgs = [{"role": "user", "content": "hi"}]
    template = "{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}"
    assert len(tok.apply_chat_template(msgs, template=template)) == 200000  # no limit outside
    with render_limit(1000), pytest.raises(RenderLimitError, match="more than 1000 characters"):
        tok.apply_chat_template(msgs, template=template)
    gone = threading.Event()
    gone.set()
    with render_limit(10**9, gone), pytest.raises(RenderLimitError, match="abandoned"):
        tok.apply_chat_template(msgs, template=template)
    assert tok.apply_chat_template(msgs, template=template) == "hi" * 100000


def test_reserved_names_cover_transformers_own_arguments():
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils

    from ondevice.models.tokenizer import RESERVED_TEMPLATE_ARGS

    for fn in (
        PreTrainedTokenizerBase.apply_chat_template,
        chat_template_utils.render_jinja_template,
    ):
        params = set(inspect.signature(fn).parameters) - {"self", "kwargs"}
        assert params <= {*RESERVED_TEMPLATE_ARGS, "conversations"}, params - set(
            RESERVED_TEMPLATE_ARGS
        )
