"""The MLX transformer against mlx_lm, the KV cache, and loading from safetensors and GGUF."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny

from ondevice.models import load_model

ARCHS = [("llama", False), ("mistral", False), ("qwen2", False), ("qwen3", True), ("llama", True)]


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


@pytest.mark.parametrize("arch,tie", ARCHS)
def test_logits_match_mlx_lm(tmp_path, arch, tie):
    import mlx_lm

    path = tiny.write_model(tmp_path / arch, arch=arch, tie=tie, layers=3)
    ours = load_model(path).model
    ref, _ = mlx_lm.load(str(path))
    toks = mx.array([[5, 9, 14, 3, 27, 40, 8, 11, 60, 2]])
    np.testing.assert_allclose(_np(ours(toks)), _np(ref(toks)), atol=1e-4)

    # token by token with both caches
    from mlx_lm.models.cache import make_prompt_cache

    ref_cache, our_cache = make_prompt_cache(ref), ours.make_cache()
    for i in range(toks.shape[1]):
        a = ours(toks[:, i : i + 1], our_cache)
        b = ref(toks[:, i : i + 1], cache=ref_cache)
        np.testing.assert_allclose(_np(a), _np(b), atol=1e-4)


def test_llama3_rope_scaling_matches_mlx_lm(tmp_path):
    import mlx_lm

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = tiny.write_model(tmp_path / "l3", rope_scaling=scaling, rope_theta=500000.0)
    ours = load_model(path).model
    ref, _ = mlx_lm.load(str(path))
    toks = mx.array([list(range(5, 85))])  # long enough to cross the scaled wavelengths
    np.testing.assert_allclose(_np(ours(toks)), _np(ref(toks)), atol=1e-4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.write_model(tmp_path_factory.mktemp("m") / "m", arch="qwen3", layers=2)
    return load_model(path).model


def test_cached_decoding_equals_full_forward(model):
    toks = mx.array([[4, 8, 15, 16, 23, 42, 7, 9]])
    full = model(toks)
    cache = model.make_cache()
    first = model(toks[:, :3], cache)  # a chunk, then single tokens
    rest = [model(toks[:, i : i + 1], cache) for i in range(3, 8)]
    np.testing.assert_allclose(_np(mx.concatenate([first, *rest], 1)), _np(full), atol=1e-5)


def test_trim_is_rollback(model):
    toks = mx.array([[4, 8, 15, 16, 23, 42]])
    cache = model.make_cache()
    model(toks, cache)
    cache.trim(3)
    assert cache.offset == 3
    out = model(mx.array([[30, 31]]), cache)
    fresh = model(mx.array([[4, 8, 15, 30, 31]]))
    np.testing.assert_allclose(_np(out), _np(fresh[:, 3:]), atol=1e-5)


def test_keep_subset_equals_fresh_forward(model):
    """Keep the accepted path of a token tree: the cache is as if only that path was appended."""
    prefix = [4, 8, 15]
    cache = model.make_cache()
    model(mx.array([prefix]), cache)
    # tree nodes (token@position, parent): 16@3 (root), 23@3 (root), 42@4 (<-16), 7@4 (<-23), 9@5 (<-7)
    tokens = [16, 23, 42, 7, 9]
    positions = mx.array([3, 3, 4, 4, 5])
    visible = np.array(
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [0, 1, 0, 1, 1]], bool
    )
    mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
    model(mx.array([tokens]), cache, positions=positions, mask=mask)
    cache.keep(len(tokens), [1, 3, 4])  # the path 23 -> 7 -> 9
    assert cache.offset == len(prefix) + 3
    out = model(mx.array([[50]]), cache)
    fresh = model(mx.array([prefix + [23, 7, 9, 50]]))
    np.testing.assert_allclose(_np(out[:, -1]), _np(fresh[:, -1]), atol=1e-4)
    with pytest.raises(ValueError):
        cache.keep(2, [1, 0])


def test_explicit_positions_and_mask(model):
    """A tree-shaped pass (two branches sharing a root) equals each path run alone."""
    prefix = [4, 8, 15]
    cache = model.make_cache()
    model(mx.array([prefix]), cache)
    # nodes: 0 root(16) ; 1 child of root (23) ; 2 other child of root (42)
    tokens = mx.array([[16, 23, 42]])
    positions = mx.array([3, 4, 4])
    visible = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
    out = model(tokens, cache, positions=positions, mask=mask)
    a = model(mx.array([prefix + [16, 23]]))
    b = model(mx.array([prefix + [16, 42]]))
    np.testing.assert_allclose(_np(out[0, 1]), _np(a[0, -1]), atol=1e-4)
    np.testing.assert_allclose(_np(out[0, 2]), _np(b[0, -1]), atol=1e-4)
    np.testing.assert_allclose(_np(out[0, 0]), _np(a[0, -2]), atol=1e-4)


def test_explicit_consecutive_positions_rotate_exactly_as_the_offset_does(model):
    """A tree pass gives its tokens explicit positions; along a chain they must rotate bit for
    bit as a plain pass does (greedy tree decoding is plain decoding's, even where rounding of
    a later quantized product would turn a last-bit difference into another token)."""
    prefix = [4, 8, 15]
    for L, batch in ((1, 1), (5, 1), (4, 2)):
        toks = mx.array(np.random.default_rng(L).integers(3, 90, (batch, L)))
        outs = []
        for explicit in (False, True):
            cache = model.make_cache()
            model(mx.array([prefix] * batch), cache)
            positions = mx.arange(3, 3 + L)
            if batch > 1:
                positions = mx.broadcast_to(positions, (batch, L))
            causal = mx.array(np.where(np.tri(L, dtype=bool), 0.0, -np.inf).astype(np.float32))
            kw = {"positions": positions, "mask": causal} if explicit else {}
            outs.append(_np(model(toks, cache, **kw)))
        assert np.array_equal(outs[0], outs[1]), (L, batch)


def test_batch_dimension(model):
    toks = mx.array([[4, 8, 15, 16], [23, 42, 7, 9]])
    both = model(toks)
    np.testing.assert_allclose(_np(both[1]), _np(model(toks[1:])[0]), atol=1e-5)


def test_sharded_checkpoint_loads_like_single(tmp_path):
    one = tiny.write_model(tmp_path / "one", seed=3)
    many = tiny.write_model(tmp_path / "many", seed=3, shards=3)
    toks = mx.array([[5, 6, 7]])
    np.testing.assert_array_equal(
        _np(load_model(one).model(toks)), _np(load_model(many).model(toks))
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_choice(tmp_path, dtype):
    lm = load_model(tiny.write_model(tmp_path / "m"), dtype=dtype)
    assert lm.model.model.embed_tokens.weight.dtype == getattr(mx, dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_on_load_and_save_roundtrip_with_mlx_lm(tmp_path, bits):
    import mlx_lm

    from ondevice.models.weights import save_model

    lm = load_model(
        tiny.write_model(tmp_path / "m", hidden_size=64, intermediate=128), quantize=bits
    )
    toks = mx.array([[5, 6, 7, 8]])
    ours = lm.model(toks)
    save_model(lm.model, tmp_path / "q")
    lm.tokenizer.save(tmp_path / "q")
    ref, _ = mlx_lm.load(str(tmp_path / "q"))
    np.testing.assert_allclose(_np(ref(toks)), _np(ours), atol=1e-4)
    again = load_model(tmp_path / "q").model
    np.testing.assert_allclose(_np(again(toks)), _np(ours), atol=1e-5)


def test_tokenizer_and_chat_template(tmp_path):
    lm = load_model(tiny.write_model(tmp_path / "m"))
    tok = lm.tokenizer
    assert tok.decode(tok.encode("hello world")) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.EOS_ID in tok.eos_token_ids
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in tok.encode("abc d")]
    assert "".join(pieces) + detok.flush() == "abc d"


@pytest.mark.parametrize("quantize", [None, 8])
def test_truncated_draft_vocabulary_scores_the_first_rows(tmp_path, quantize):
    path = tiny.write_model(tmp_path / "m", tie=True, hidden_size=64)
    full = load_model(path, quantize=quantize).model
    cfg = json.loads((path / "config.json").read_text())
    cfg["draft_vocab_size"] = 40
    (path / "config.json").write_text(json.dumps(cfg))
    cut = load_model(path, quantize=quantize).model
    toks = mx.array([[5, 6, 7]])
    a, b = _np(full(toks)), _np(cut(toks))
    assert b.shape[-1] == 40
    np.testing.assert_allclose(b, a[..., :40], atol=1e-4)


@pytest.mark.parametrize("first", ["mlx", "numpy"])
def test_a_cache_fed_numpy_keeps_numpy_buffers_and_the_same_positions(first):
    """A model served by the CPU kernel feeds its cache numpy keys (runtime/kernel.py, "Glue"):
    the cache then holds numpy buffers, converting MLX ones once, and appends, trims, keeps a
    subset and hands out its prefix (as MLX) exactly as an MLX cache does."""
    from ondevice.models.cache import KVCache

    r = np.random.default_rng(0)
    chunks = [r.standard_normal((1, 2, n, 4)).astype(np.float32) for n in (3, 300, 5)]
    ours, ref = KVCache(1), KVCache(1)
    for i, c in enumerate(chunks):
        numpy = (i % 2 == 0) == (first == "numpy")
        k, v = ours[0].update_and_fetch(c if numpy else mx.array(c), -c if numpy else mx.array(-c))
        assert isinstance(k, np.ndarray) == numpy and isinstance(ours[0].keys, np.ndarray) == numpy
        want_k, want_v = ref[0].update_and_fetch(mx.array(c), mx.array(-c))
        np.testing.assert_array_equal(np.array(k), np.array(want_k))
        np.testing.assert_array_equal(np.array(v), np.array(want_v))
    for cache in (ours, ref):
        cache.keep(5, [0, 2, 3])
        cache.trim(1)
    assert ours.offset == ref.offset == 3 + 300 + 2
    for (k, v), (wk, wv) in zip(ours.prefix(ours.offset), ref.prefix(ref.offset)):
        assert isinstance(k, mx.array)
        np.testing.assert_array_equal(np.array(k), np.array(wk))
        np.testing.assert_array_equal(np.array(v), np.array(wv))
    assert ours.nbytes == ref.nbytes > 0
    assert all(isinstance(a, mx.array) for a in ours.state)  # what mx.eval may be given
