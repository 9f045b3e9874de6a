"""Loading from GGUF and safetensors, clear errors on bad input, and `ondevice generate`."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import tiny

from ondevice.errors import ModelFormatError, ModelNotFoundError
from ondevice.models import load_model


def _logits(model, toks):
    return np.array(model(mx.array([toks])).astype(mx.float32))


@pytest.mark.parametrize("quant", [None, "Q8_0", "Q4_1"])
def test_gguf_matches_safetensors(tmp_path, quant):
    path, ref = tiny.write_gguf(tmp_path / "m.gguf", quant=quant, tie=False)
    st = tiny.write_model(
        tmp_path / "st", weights=ref["weights"], vocab_size=ref["config"]["vocab_size"]
    )
    a = load_model(path, dtype="float32")
    b = load_model(st)
    toks = [5, 70, 80, 90, 100, 110, 6, 7]
    np.testing.assert_allclose(_logits(a.model, toks), _logits(b.model, toks), atol=2e-4)
    if quant:  # kept quantized, with bits derived from the packed shape
        q = a.config.quantization
        assert q["group_size"] == 32 and q["bits"] == (8 if quant == "Q8_0" else 4)
        import mlx.nn as nn

        assert isinstance(a.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_gguf_tokenizer_and_template(tmp_path):
    path, _ = tiny.write_gguf(tmp_path / "m.gguf")
    tok = load_model(path).tokenizer
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert tok.id_to_token(ids[0]) == "hell"  # merges applied
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [4]  # specials never split
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(
        "<|im_start|>user"
    )
    assert tiny.EOS_ID in tok.eos_token_ids


K_QUANT_SIZES = {"hidden_size": 256, "intermediate": 512}  # K-quant rows are 256-value blocks


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_gguf_k_quants_expand_exactly_and_requantize_closely(tmp_path, quant):
    """llama.cpp's default downloads (Q4_K_M: Q4_K + Q6_K + Q5_0) load; `mx.load` refuses them."""
    path, ref = tiny.write_gguf(tmp_path / "m.gguf", quant=quant, tie=False, **K_QUANT_SIZES)
    st = tiny.write_model(
        tmp_path / "st",
        weights=ref["weights"],
        vocab_size=ref["config"]["vocab_size"],
        **K_QUANT_SIZES,
    )
    b = load_model(st)
    toks = [5, 70, 80, 90, 100, 110, 6, 7]
    expanded = load_model(path, dequantize=True)  # the CPU path: the file's values exactly
    assert expanded.config.quantization is None
    np.testing.assert_allclose(_logits(expanded.model, toks), _logits(b.model, toks), atol=2e-4)

    packed = load_model(path)  # requantized to MLX's affine format, same bits
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q5_0": 5}[quant]
    assert packed.config.quantization["bits"] == bits
    q_proj = packed.model.model.layers[0].self_attn.q_proj
    import mlx.nn as nn

    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == bits
    deq = np.array(
        mx.dequantize(q_proj.weight, q_proj.scales, q_proj.biases, q_proj.group_size, bits)
    )
    want = ref["weights"]["model.layers.0.self_attn.q_proj.weight"]
    groups = want.reshape(want.shape[0], -1, 32)
    step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)  # one quantization step per group
    err = np.abs(deq - want).reshape(groups.shape).max(-1)
    # MLX snaps each group so that zero is exact: at most one step off; float16 scale and bias
    assert (err <= step + 1e-3 * np.abs(groups).max(-1)).all()
    got = _logits(packed.model, toks)
    ref_logits = _logits(b.model, toks)
    assert np.abs(got - ref_logits).max() < 0.1 * np.abs(ref_logits).max()


def test_gguf_unsupported_quantization(tmp_path):
    path, _ = tiny.write_gguf(tmp_path / "m.gguf", quant="Q2_K", **K_QUANT_SIZES)
    with pytest.raises(ModelFormatError, match=r"Q2_K.*supported: F32, F16, BF16, Q4_0"):
        load_model(path)


def test_gguf_truncated_data_is_named(tmp_path):
    path, _ = tiny.write_gguf(tmp_path / "m.gguf", quant="Q4_K", **K_QUANT_SIZES)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelFormatError, match=r"m.gguf.*truncated"):
        load_model(path)


def test_truncated_gguf(tmp_path):
    path, _ = tiny.write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:200])
    with pytest.raises(ModelFormatError, match="m.gguf"):
        load_model(path)


def test_unsupported_model_type(tmp_path):
    path = tiny.write_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=r"gpt_neox.*llama, mistral, qwen2, qwen3"):
        load_model(path)


def test_missing_shard_is_named(tmp_path):
    path = tiny.write_model(tmp_path / "m", shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="model-00002-of-00002.safetensors"):
        load_model(path)


def test_truncated_weights_are_named(tmp_path):
    path = tiny.write_model(tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        load_model(path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = tiny.write_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=r"mlp\.\w+_proj\.weight"):
        load_model(path)


def test_hub_id_offline_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "od"))
    with pytest.raises(ModelNotFoundError, match="cannot be reached"):
        load_model("someone/some-model")


def test_a_pairs_name_where_one_model_is_wanted_says_so(tmp_path, monkeypatch):
    """The shipped catalog's default pair named where a model is wanted: which models it pairs,
    and that `ondevice.load` takes the name, not a "did you mean" naming the name itself."""
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "od"))
    monkeypatch.delenv("ONDEVICE_CATALOG", raising=False)
    with pytest.raises(ModelNotFoundError) as e:
        load_model("qwen2.5-coder-1.5b")
    msg = str(e.value)
    assert "names a pair (qwen2.5-coder-1.5b-instruct drafted by qwen2.5-coder-0.5b" in msg
    assert "ondevice.load('qwen2.5-coder-1.5b')" in msg and "Did you mean" not in msg


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        load_model(str(tmp_path / "nothing-here"))


def _cli(*args, check=True):
    r = subprocess.run(
        [sys.executable, "-m", "ondevice", *args], capture_output=True, text=True, timeout=300
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_generate_json_matches_mlx_lm_greedy(tmp_path, monkeypatch):
    import mlx_lm
    from mlx_lm.generate import generate_step

    from ondevice.runtime import kernel

    # mlx-lm computes with MLX's float32 products; the CPU kernel's bf16 ones (the default
    # where oneDNN loads) may part from them at a near tie, so the command uses MLX's too
    monkeypatch.setenv(kernel.ENV, "mlx")
    path = tiny.write_model(tmp_path / "m")
    prompt = [5, 9, 14, 3, 27]
    out = json.loads(
        _cli(
            "generate",
            "--verifier",
            str(path),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            "24",
            "--json",
        ).stdout
    )
    model, _ = mlx_lm.load(str(path))
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]
    eos = [i for i, t in enumerate(ref) if t == tiny.EOS_ID]
    expected = ref[: eos[0]] if eos else ref  # mlx_lm's generate_step does not stop at EOS
    assert out["tokens"] == expected and len(expected) >= 8
    assert set(out["stats"]) >= {
        "prompt_tokens",
        "generation_tokens",
        "tokens_per_second",
        "peak_memory_bytes",
    }
    assert out["stats"]["generation_tokens"] == len(expected) and out["stats"]["prompt_tokens"] == 5


def test_generate_streams_text_and_reports_errors(tmp_path):
    path = tiny.write_model(tmp_path / "m")
    r = _cli("generate", "--verifier", str(path), "--prompt", "hello", "--max-tokens", "8")
    assert r.stdout.strip() != "" or r.stdout == "\n"
    assert "tok/s" in r.stderr
    bad = _cli("generate", "--verifier", str(tmp_path / "nope"), "--prompt", "x", check=False)
    assert bad.returncode == 1 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_dequantize_on_load_matches_quantized(tmp_path):
    import mlx.nn as nn

    path, _ = tiny.write_gguf(tmp_path / "m.gguf", quant="Q4_1")
    q = load_model(path, dtype="float32")
    f = load_model(path, dequantize=True)
    layer = f.model.model.layers[0].mlp.up_proj
    assert type(layer) is nn.Linear and layer.weight.dtype == mx.float32
    toks = [5, 70, 80, 90]
    np.testing.assert_allclose(_logits(q.model, toks), _logits(f.model, toks), atol=1e-3)
