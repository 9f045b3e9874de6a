"""Tiny random checkpoints written to a temporary directory, in Hugging Face layout.

Everything a test loads is made here: `config.json`, safetensors weights and a character-level
`tokenizer.json` (with a ChatML chat template), so no test touches a model hub.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCH_DEFAULTS = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {},
}


def vocabulary(vocab_size: int) -> list[str]:
    """`vocab_size` tokens: the specials, then single characters, then made-up pairs."""
    chars = list(string.ascii_lowercase + " .,!?\n" + string.ascii_uppercase + string.digits)
    chars += [c for c in string.punctuation if c not in chars]
    toks = SPECIALS + chars
    i = 0
    while len(toks) < vocab_size:
        a, b = chars[i % 26], chars[(i // 26) % 26]
        toks.append(a + b + "_")  # never produced by encode, decodes to itself
        i += 1
    return toks[:vocab_size]


def write_tokenizer(path: Path, vocab_size: int, eos_id: int = EOS_ID) -> None:
    toks = vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_start\|>|<\|im_end\|>|."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in SPECIALS if t in toks])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": toks[eos_id],
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": False,
            }
        )
    )


# The sizes of a tiny model, each of which `make_config` takes as a keyword.
SIZES = dict(vocab_size=96, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def make_config(arch: str = "llama", tie: bool = False, eos_id: int = EOS_ID, **extra: Any) -> dict:
    """config.json of a tiny model: `SIZES`, where a keyword of the same name overrides one, and
    any other keyword as a key of its own (e.g. max_position_embeddings)."""
    size = {k: extra.pop(k, default) for k, default in SIZES.items()}
    cfg = {
        "model_type": arch,
        "vocab_size": size["vocab_size"],
        "hidden_size": size["hidden_size"],
        "intermediate_size": size["intermediate"],
        "num_hidden_layers": size["layers"],
        "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"],
        "head_dim": size["hidden_size"] // size["heads"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    cfg.update(ARCH_DEFAULTS[arch])
    cfg.update(extra)
    return cfg


def random_weights(cfg: dict, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random fp32 weights with HF names; `scale` sharpens the output distribution."""
    rng = np.random.default_rng(seed)
    d, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def lin(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) * scale / np.sqrt(i)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, d)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, d)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, d)
        w[p + "self_attn.o_proj.weight"] = lin(d, nh * hd)
        if cfg.get("attention_bias"):
            for n, o in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = (0.1 * rng.standard_normal(o)).astype(
                    np.float32
                )
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = lin(inter, d)
        w[p + "mlp.up_proj.weight"] = lin(inter, d)
        w[p + "mlp.down_proj.weight"] = lin(d, inter)
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
    w["model.norm.weight"] = norm(d)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(v, d) * 4.0
    return w


def write_model(
    path: Path | str,
    seed: int = 0,
    shards: int = 1,
    weights: dict[str, np.ndarray] | None = None,
    scale: float = 1.0,
    **config_kwargs,
) -> Path:
    """Write a tiny checkpoint (config, safetensors, tokenizer) to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = make_config(**config_kwargs)
    w = weights if weights is not None else random_weights(cfg, seed, scale)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    names = sorted(w)
    if shards == 1:
        save_file(w, str(path / "model.safetensors"))
    else:
        index = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: w[n] for n in names[s::shards]}
            save_file(part, str(path / fname))
            index.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    write_tokenizer(path, cfg["vocab_size"], cfg["eos_token_id"])
    return path


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A draft that resembles the verifier in `src`: the same weights plus Gaussian noise."""
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(seed)
    w = {
        k: (v + noise * v.std() * rng.standard_normal(v.shape)).astype(np.float32)
        for k, v in w.items()
    }
    cfg_kwargs = {
        "arch": cfg["model_type"],
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "layers": cfg["num_hidden_layers"],
        "heads": cfg["num_attention_heads"],
        "kv_heads": cfg["num_key_value_heads"],
        "intermediate": cfg["intermediate_size"],
        "tie": cfg["tie_word_embeddings"],
        "eos_id": cfg["eos_token_id"],
    }
    return write_model(dst, weights=w, **cfg_kwargs)


def write_endless_model(path: Path, seed: int = 0, scale: float = 1.5, context: int = 512) -> Path:
    """A tiny model whose EOS logit is always 0: greedy answers run to max_tokens, so the caller
    decides when an answer ends."""
    cfg = make_config(max_position_embeddings=context)
    weights = random_weights(cfg, seed=seed, scale=scale)
    weights["lm_head.weight"][EOS_ID] = 0.0
    return write_model(path, weights=weights, max_position_embeddings=context)


# A model of 16 tokens and one layer: the exact law of two generated tokens is a 16 x 16 table.
SMALL_VOCAB = dict(vocab_size=16, hidden_size=32, heads=2, kv_heads=1, intermediate=64, layers=1)


def write_small_vocab_pair(root: Path) -> tuple[Path, Path]:
    """A `SMALL_VOCAB` verifier and a noisy draft of it, for the distribution tests."""
    verifier = write_model(root / "v", scale=0.6, **SMALL_VOCAB)
    return verifier, perturbed_copy(verifier, root / "d", noise=0.8)


# -- GGUF ------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (half-split RoPE -> interleaved)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary (gpt2 style): specials, the 256 byte symbols, a few merges."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "o Ġ", "he ll"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def write_gguf(
    path: Path, seed: int = 0, quant: str | None = None, pre: str = "gpt-2", **config_kwargs
) -> tuple[Path, dict]:
    """A tiny llama GGUF as llama.cpp writes it (Q/K permuted). Returns (path, reference weights):
    the HF-layout float32 weights the GGUF encodes (after quantization round-trip if `quant`)."""
    import gguf

    tokens, merges, types = gguf_vocabulary()
    cfg = make_config(vocab_size=len(tokens), **config_kwargs)
    w = random_weights(cfg, seed)
    qtype = gguf.GGMLQuantizationType[quant] if quant else None
    rng = np.random.default_rng(seed + 1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_chat_template(CHAT_TEMPLATE)
    reference = {}
    for name, arr in w.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"
        data = arr
        if ".attn_q." in gname:
            data = _llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif ".attn_k." in gname:
            data = _llama_cpp_permute(arr, cfg["num_key_value_heads"])
        if qtype is not None and arr.ndim == 2:
            if quant in K_QUANT_SCALE_BYTES:
                packed = random_k_quant(rng, data.shape, quant)
            else:
                packed = gguf.quants.quantize(data, qtype)
            writer.add_tensor(gname, packed, raw_dtype=qtype)
            back = gguf.quants.dequantize(packed, qtype).astype(np.float32)
            if ".attn_q." in gname or ".attn_k." in gname:
                heads = (
                    cfg["num_attention_heads"]
                    if ".attn_q." in gname
                    else cfg["num_key_value_heads"]
                )
                rows = back.shape[0]
                back = (
                    back.reshape(heads, rows // heads // 2, 2, -1)
                    .swapaxes(1, 2)
                    .reshape(back.shape)
                )
            reference[name] = back
        else:
            writer.add_tensor(gname, data)
            reference[name] = arr
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {"config": cfg, "weights": reference}


# Where each K-quant block keeps its float16 super-block scales: (d offset, dmin offset or None).
K_QUANT_SCALE_BYTES = {"Q2_K": (80, 82), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}


def random_k_quant(rng: np.random.Generator, shape: tuple[int, int], quant: str) -> np.ndarray:
    """Random blocks of a llama.cpp K-quant for a (rows, cols) weight: gguf-py can read K-quants
    but not write them. Every byte is random except the float16 super-block scales, which are
    set small so the weights have the magnitude of real ones (~0.05)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d_at, dmin_at = K_QUANT_SCALE_BYTES[quant]
    d = np.full(blocks.shape[:2], 2e-4 if quant != "Q6_K" else 3e-5, np.float16)
    blocks[..., d_at : d_at + 2] = d[..., None].view(np.uint8)
    if dmin_at is not None:
        blocks[..., dmin_at : dmin_at + 2] = (d * 4)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)
