"""The Core ML draft: conversion, the numpy reference executor, lint, and the draft engines.

Every package here is converted from a tiny random checkpoint and run by the reference executor
(any OS); the macOS tests run the same checks through Core ML itself.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import write_model

from ondevice.convert import lint
from ondevice.convert.coreml import convert_draft
from ondevice.errors import ContextLengthError, ModelFormatError, OndeviceError
from ondevice.models import load_model
from ondevice.runtime import coreml_plan
from ondevice.runtime.coreml_engines import CoreMLDraftEngine, ReferenceDraftEngine
from ondevice.runtime.engines import Engine
from ondevice.runtime.mil.interpreter import ReferenceModel
from ondevice.runtime.mil.package import read_description

on_macos = pytest.mark.skipif(sys.platform != "darwin", reason="Core ML prediction needs macOS 15+")

CONTEXT = 256
CHUNK = 8


def numpy_weights(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


def convert(tmp: Path, name: str, **model_kwargs) -> tuple:
    """Write a tiny checkpoint, load it, convert it; (LoadedModel, package path, description)."""
    conv = {k: model_kwargs.pop(k) for k in ("kv", "compress", "chunk") if k in model_kwargs}
    loaded = load_model(write_model(tmp / name, **model_kwargs))
    pkg = tmp / f"{name}.mlpackage"
    desc = convert_draft(
        loaded.config,
        numpy_weights(loaded.model),
        pkg,
        context=CONTEXT,
        chunk=conv.get("chunk", CHUNK),
        kv=conv.get("kv", "state"),
        compress=conv.get("compress", "none"),
    )
    return loaded, pkg, desc


def mlx_logits(loaded, tokens: list[int]) -> np.ndarray:
    return np.array(loaded.model(mx.array([tokens]))[0].astype(mx.float32))


def greedy_sequence(loaded, prompt: list[int], steps: int) -> list[int]:
    """The MLX model's own greedy continuation (one forward pass per step, with its cache)."""
    cache = loaded.model.make_cache()
    logits = loaded.model(mx.array([prompt]), cache)[0, -1]
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(mx.argmax(logits).item()))
        logits = loaded.model(mx.array([[seq[-1]]]), cache)[0, -1]
    return seq


def assert_close(got: np.ndarray, ref: np.ndarray, rel: float = 5e-3) -> None:
    """Float16 tolerance: a small fraction of the logits' range (fp16 has 11 significant bits)."""
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got, ref, atol=rel * scale, rtol=0)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("coreml")


@pytest.fixture(scope="module")
def llama(tmp):
    """llama, untied, KV cache as state, head_dim 16 (padded to 32 in the state)."""
    return convert(tmp, "llama", arch="llama", seed=3)


# -- the converted draft matches the MLX model ---------------------------------------------------


def test_package_describes_itself(llama):
    _, pkg, desc = llama
    meta = read_description(pkg)
    assert meta["functions"]["decode"]["inputs"] == {"input_ids": [1, 1], "position": [1]}
    assert meta["functions"]["chunk"]["inputs"]["input_ids"] == [1, CHUNK]
    assert meta["kv"] == "state" and meta["context"] == CONTEXT and meta["chunk"] == CHUNK
    assert meta["kv_cache"]["shape"] == [2, 2, CONTEXT, 32]  # head_dim 16 padded to 32
    assert meta["min_deployment_target"] == "macOS15"
    assert desc["functions"] == meta["functions"] and desc["size_bytes"] > 0
    models = ReferenceModel.load_functions(pkg, ["decode", "chunk"])
    assert set(models["decode"].state_specs) == {"key_cache", "value_cache"}
    assert models["chunk"].output_names == ["logits_0"]


def test_reference_matches_mlx_over_200_greedy_steps(llama):
    loaded, pkg, _ = llama
    prompt = [5, 17, 40, 41, 9, 33, 60, 22, 8, 71, 12]
    seq = greedy_sequence(loaded, prompt, 200)
    ref = mlx_logits(loaded, seq)

    engine = ReferenceDraftEngine(pkg)
    got = [engine.feed(prompt)]  # chunked prefill
    got += [engine.feed([t])[None, 0] for t in seq[len(prompt) : -1]]  # 200 decode steps
    got = np.concatenate(got)
    assert got.shape == ref[:-1].shape
    assert_close(got, ref[:-1])
    decode_rows = slice(len(prompt) - 1, None)
    agree = np.mean(got[decode_rows].argmax(-1) == ref[:-1][decode_rows].argmax(-1))
    assert agree >= 0.99, f"greedy agreement {agree:.3f}"


def test_100_decode_steps_equal_chunked_feed(llama):
    _, pkg, _ = llama
    tokens = list(np.random.default_rng(1).integers(0, 96, 100))
    one_by_one = ReferenceDraftEngine(pkg)
    stepped = np.concatenate([one_by_one.feed([t]) for t in tokens])
    chunked = ReferenceDraftEngine(pkg)
    fed = chunked.feed(tokens)  # 12 full chunks of 8 and one padded with 4 tokens
    assert chunked.length == one_by_one.length == 100
    assert_close(fed, stepped, rel=2e-3)
    # and the padded chunk did not spoil later positions
    assert_close(chunked.feed([3, 4, 5]), one_by_one.feed([3, 4, 5]), rel=2e-3)


def test_32_decode_calls_equal_one_32_token_chunk_call(tmp, llama):
    """The functions themselves: 32 stateful decode calls == one chunk call of 32 tokens
    (the longest chunk the converter makes)."""
    loaded, _, _ = llama
    pkg = tmp / "llama_chunk32.mlpackage"
    convert_draft(loaded.config, numpy_weights(loaded.model), pkg, context=CONTEXT, chunk=32)
    models = ReferenceModel.load_functions(pkg, ["decode", "chunk"])
    ids = np.random.default_rng(6).integers(0, 96, (1, 32)).astype(np.int32)
    chunk_state, decode_state = models["chunk"].make_state(), models["decode"].make_state()
    whole = models["chunk"].predict({"input_ids": ids, "position": np.array([0])}, chunk_state)
    steps = [
        models["decode"].predict(
            {"input_ids": ids[:, i : i + 1], "position": np.array([i])}, decode_state
        )["logits_0"][0]
        for i in range(32)
    ]
    assert_close(np.concatenate(steps).astype(np.float32), whole["logits_0"][0].astype(np.float32))
    for name in ("key_cache", "value_cache"):
        np.testing.assert_allclose(
            chunk_state.read_state(name).astype(np.float32),
            decode_state.read_state(name).astype(np.float32),
            atol=2e-2,
        )


def test_reference_model_functions_share_one_state(llama):
    """The raw MLModel-like interface: decode and chunk functions over one state."""
    _, pkg, _ = llama
    models = ReferenceModel.load_functions(pkg, ["decode", "chunk"])
    state = models["decode"].make_state()
    ids = np.arange(10, 10 + CHUNK, dtype=np.int32)[None]
    chunk_out = models["chunk"].predict({"input_ids": ids, "position": np.array([0])}, state)
    assert chunk_out["logits_0"].dtype == np.float16
    assert chunk_out["logits_0"].shape == (1, CHUNK, 96)
    state2 = models["decode"].make_state()
    for i in range(CHUNK):
        step = models["decode"].predict(
            {"input_ids": ids[:, i : i + 1], "position": np.array([i], np.int32)}, state2
        )
    assert_close(
        step["logits_0"][0, 0].astype(np.float32), chunk_out["logits_0"][0, -1].astype(np.float32)
    )
    np.testing.assert_allclose(
        state.read_state("key_cache")[:, :, :CHUNK],
        state2.read_state("key_cache")[:, :, :CHUNK],
        atol=2e-2,
    )
    with pytest.raises(OndeviceError, match="stateful"):
        models["decode"].predict({"input_ids": ids[:, :1], "position": np.array([0])})
    with pytest.raises(OndeviceError, match="shape"):
        models["decode"].predict({"input_ids": ids, "position": np.array([0])}, state)
    with pytest.raises(OndeviceError, match="no function 'prefill'"):
        ReferenceModel(pkg, "prefill")


def test_trim_then_feed_equals_fresh_feed(llama):
    _, pkg, _ = llama
    rng = np.random.default_rng(2)
    first, second = list(rng.integers(0, 96, 30)), list(rng.integers(0, 96, 13))
    engine = ReferenceDraftEngine(pkg)
    assert isinstance(engine, Engine) and engine.name == "reference"
    engine.feed(first)
    engine.trim(7)
    assert engine.length == 23
    after_trim = engine.feed(second)
    fresh = ReferenceDraftEngine(pkg)
    expected = fresh.feed(first[:-7] + second)[-len(second) :]
    assert_close(after_trim, expected, rel=2e-3)
    assert_close(engine.feed([1], last_only=True), fresh.feed([1], last_only=True), rel=2e-3)
    engine.reset()
    assert engine.length == 0
    assert_close(engine.feed(first[:5]), ReferenceDraftEngine(pkg).feed(first[:5]), rel=2e-3)
    with pytest.raises(ValueError):
        engine.trim(6)


def test_context_limit_is_enforced(llama):
    _, pkg, _ = llama
    engine = ReferenceDraftEngine(pkg)
    engine.feed([1] * (CONTEXT - 3))
    assert engine.feed([2, 3, 4]).shape == (3, 96)  # the last slots: decode steps past chunk room
    with pytest.raises(ContextLengthError):
        engine.feed([5])


# -- architectures and KV modes --------------------------------------------------------------------


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "arch,tie,kv,extra",
    [
        # GGUF-style interleaved RoPE, with llama3 frequency scaling
        ("llama", True, "io", {"rope_traditional": True, "rope_scaling": LLAMA3_SCALING}),
        ("qwen2", True, "io", {}),  # q/k/v biases
        ("qwen2", False, "state", {}),
        ("qwen3", True, "state", {"heads": 2, "kv_heads": 1}),  # q/k norms, head_dim 32, no pad
        ("qwen3", False, "io", {}),
    ],
)
def test_architectures_and_kv_modes(tmp, arch, tie, kv, extra):
    loaded, pkg, desc = convert(
        tmp, f"{arch}_{tie}_{kv}", arch=arch, tie=tie, kv=kv, seed=7, **extra
    )
    assert desc["kv"] == kv
    prompt = [4, 9, 60, 2, 31, 77, 15, 8, 8, 50, 19]
    seq = greedy_sequence(loaded, prompt, 30)
    ref = mlx_logits(loaded, seq)
    engine = ReferenceDraftEngine(pkg)
    first = engine.feed(seq[:20])
    engine.feed(seq[20:23])
    engine.trim(3)  # roll back, then the same positions again one token at a time
    got = np.concatenate([first] + [engine.feed([t]) for t in seq[20:]])
    assert_close(got, ref)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.97


# -- weight compression ----------------------------------------------------------------------------

COMPRESSED_MODEL = dict(
    arch="llama", vocab_size=256, hidden_size=128, intermediate=256, heads=4, kv_heads=2, seed=11
)


@pytest.fixture(scope="module")
def uncompressed(tmp):
    return convert(tmp, "plain128", **COMPRESSED_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "compress,op,min_agreement",
    [
        ("int8", "constexpr_blockwise_shift_scale", 0.95),
        ("palettize6", "constexpr_lut_to_dense", 0.9),
        ("palettize4", "constexpr_lut_to_dense", 0.6),
    ],
)
def test_compressed_drafts_run_in_reference(tmp, uncompressed, compress, op, min_agreement, capsys):
    _, plain_pkg, plain_desc = uncompressed
    _, pkg, desc = convert(tmp, f"c_{compress}", compress=compress, **COMPRESSED_MODEL)
    assert desc["compression"] == compress
    assert desc["size_bytes"] < 0.7 * plain_desc["size_bytes"]
    ops = lint.list_ops(pkg)
    assert ops["decode"][op] > 0 and ops["chunk"][op] == ops["decode"][op]
    assert [f for f in lint.check_mlpackage(pkg) if f.severity == "error"] == []

    rng = np.random.default_rng(5)
    prompt = list(rng.integers(0, 256, 16))
    plain, packed = ReferenceDraftEngine(plain_pkg), ReferenceDraftEngine(pkg)
    a, b = [plain.feed(prompt)], [packed.feed(prompt)]
    tok = int(a[0][-1].argmax())
    for _ in range(100):  # follow the uncompressed draft's greedy path
        a.append(plain.feed([tok]))
        b.append(packed.feed([tok]))
        tok = int(a[-1][-1].argmax())
    a, b = np.concatenate(a), np.concatenate(b)
    agreement = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    with capsys.disabled():
        print(
            f"\n[{compress}] greedy agreement with the uncompressed draft: {agreement:.3f} "
            f"over {len(a)} positions; size {desc['size_bytes']} vs {plain_desc['size_bytes']} bytes"
        )
    assert agreement >= min_agreement


def test_one_copy_of_the_weights_for_both_functions(uncompressed):
    """Both functions read one copy of the weights: the package is not twice their size."""
    loaded, pkg, desc = uncompressed
    n_params = sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
    assert desc["size_bytes"] < 2.6 * n_params  # float16 is 2 bytes a weight; two copies: 4


def _weight_file_bytes(pkg: Path) -> int:
    return sum(f.stat().st_size for f in pkg.rglob("weight.bin"))


@pytest.mark.parametrize(
    "compress,bytes_per_weight",
    [("none", 2), ("int8", 1), pytest.param("palettize4", 0.5, marks=pytest.mark.slow)],
)
def test_a_tied_embedding_is_stored_once(tmp, compress, bytes_per_weight):
    """A tied model's package holds its embedding once (the LM head's pieces, which the lookup
    reads too), in both functions and compressed or not: the same weights converted as an
    untied model (a head that is a copy of the embedding) need one more V x D matrix. Both
    packages give the same logits, the MLX model's, for ids on every side of the pieces' edges
    (palettized, the untied embedding has lookup tables of its own, so only close ones)."""
    from tiny import make_config, random_weights

    from ondevice.models.config import ModelConfig
    from ondevice.models.weights import build_model

    V, D = 20000, 64  # two head pieces of 10000 rows
    raw = make_config(vocab_size=V, hidden_size=D, tie=True)
    weights = random_weights(raw, seed=5)
    untied_weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].copy()}
    tokens = [0, 9999, 10000, 19999, 5, 10001, 9998, 12345, 17, 19998]
    outputs, sizes = {}, {}
    for tie, w in ((True, weights), (False, untied_weights)):
        cfg = ModelConfig.from_dict({**raw, "tie_word_embeddings": tie})
        pkg = tmp / f"tied_{tie}_{compress}.mlpackage"
        desc = convert_draft(cfg, w, pkg, context=64, chunk=4, compress=compress)
        assert desc["vocab_splits"] == [10000, 10000]
        assert [f for f in lint.check_mlpackage(pkg) if f.severity == "error"] == []
        sizes[tie] = _weight_file_bytes(pkg)
        outputs[tie] = ReferenceDraftEngine(pkg).feed(tokens)
    assert sizes[False] - sizes[True] >= V * D * bytes_per_weight
    if compress != "palettize4":  # int8 scales are per row in the embedding and the head alike
        np.testing.assert_array_equal(outputs[True], outputs[False])
    model = build_model(ModelConfig.from_dict(raw), {k: mx.array(v) for k, v in weights.items()})
    ref = np.array(model(mx.array([tokens]))[0].astype(mx.float32))
    if compress == "none":
        assert_close(outputs[True], ref)
    assert np.mean(outputs[True].argmax(-1) == ref.argmax(-1)) >= 0.7  # palettize4: 4 bits


def test_large_vocabulary_is_split_and_lints_clean(tmp):
    """A vocabulary above 16384: LM head in pieces, compressed embedding only a lint warning."""
    from tiny import make_config, random_weights

    from ondevice.models.config import ModelConfig
    from ondevice.models.weights import build_model

    raw = make_config(vocab_size=20000, tie=False)  # untied: its own (20000, 64) table
    cfg = ModelConfig.from_dict(raw)
    weights = random_weights(raw, seed=2)
    pkg = tmp / "bigvocab.mlpackage"
    desc = convert_draft(cfg, weights, pkg, context=64, chunk=4, compress="int8")
    assert desc["vocab_splits"] == [10000, 10000] and desc["logits"] == ["logits_0", "logits_1"]
    findings = lint.check_mlpackage(pkg)
    assert [f for f in findings if f.severity == "error"] == []
    assert any("embedding table (20000, 64)" in f.message for f in findings)

    model = build_model(cfg, {k: mx.array(v) for k, v in weights.items()})
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 20000, 12)]
    got = ReferenceDraftEngine(pkg).feed(tokens)
    ref = np.array(model(mx.array([tokens]))[0].astype(mx.float32))
    assert got.shape == ref.shape == (12, 20000)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9  # int8 weights


def test_truncated_vocabulary_draft_converts_only_its_rows(tmp):
    """A draft with draft_vocab_size K (FR-Spec): the package's head has K rows, its logits
    equal the MLX draft's (which also scores only the first K ids), and speculative decoding
    through the package stays exactly the verifier's greedy output."""
    from tiny import make_config, random_weights

    from ondevice.decoders.chain import ChainDecoder
    from ondevice.decoders.factory import make_decoder
    from ondevice.models.config import ModelConfig
    from ondevice.models.weights import build_model
    from ondevice.proposers.resources import Speculation
    from ondevice.rules.sampling import SamplingParams
    from ondevice.runtime.engines import MLXEngine

    raw = make_config(tie=True)
    K = raw["vocab_size"] // 2
    weights = random_weights(raw, seed=4)
    cfg = ModelConfig.from_dict({**raw, "draft_vocab_size": K})
    pkg = tmp / "truncated.mlpackage"
    desc = convert_draft(cfg, weights, pkg, context=CONTEXT, chunk=CHUNK)
    assert desc["vocab_size"] == raw["vocab_size"] and desc["output_vocab"] == K
    assert sum(desc["vocab_splits"]) == K

    draft = build_model(cfg, {k: mx.array(v) for k, v in weights.items()})
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, raw["vocab_size"], 12)]
    got = ReferenceDraftEngine(pkg).feed(tokens)
    ref = np.array(draft(mx.array([tokens]))[0].astype(mx.float32))
    assert got.shape == ref.shape == (12, K)
    assert_close(got, ref)

    verifier = build_model(ModelConfig.from_dict(raw), {k: mx.array(v) for k, v in weights.items()})
    greedy = SamplingParams(temperature=0.0)
    plain = ChainDecoder(MLXEngine(verifier), None, greedy)
    want = [t for r in plain.run(tokens, 24) for t in r.tokens]
    for method in ("chain", "tree", "cascade"):
        spec = Speculation(method=method, num_draft_tokens=3, profile=False)
        dec = make_decoder(MLXEngine(verifier), ReferenceDraftEngine(pkg), greedy, spec)
        rounds = list(dec.run(tokens, 24))
        assert [t for r in rounds for t in r.tokens] == want, method
        assert sum(r.accepted for r in rounds) > 0, method  # the draft (= the verifier) was used


# -- lint ------------------------------------------------------------------------------------------


def test_lint_passes_the_converted_draft(llama):
    _, pkg, _ = llama
    ops = lint.list_ops(pkg)
    assert set(ops) == {"chunk", "decode"}
    for counts in ops.values():
        assert counts["conv"] == 2 * 7 + 1 and counts["read_state"] == 2 and counts["softmax"] == 2
        assert "pow" not in counts and "const" not in counts
    findings = lint.check_mlpackage(pkg)
    assert [f for f in findings if f.severity == "error"] == []
    assert all(f.severity == "warning" for f in findings)


def _bad_package(tmp: Path) -> Path:
    """A float32 program with a dynamic input dimension and an oversized channel count."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import get_new_symbol, types

    @mb.program(input_specs=[mb.TensorSpec((1, 8, 1, get_new_symbol()), dtype=types.fp32)])
    def prog(x):
        w = np.random.default_rng(0).standard_normal((20000, 8, 1, 1)).astype(np.float32)
        return mb.topk(x=mb.conv(x=x, weight=w), k=2, axis=1)[0]

    model = ct.convert(
        prog,
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT32,
        minimum_deployment_target=ct.target.macOS15,
        skip_model_load=True,
    )
    path = tmp / "bad.mlpackage"
    model.save(str(path))
    return path


def test_lint_flags_what_keeps_a_model_off_the_neural_engine(tmp):
    path = _bad_package(tmp)
    findings = lint.check_mlpackage(path)
    errors = " | ".join(str(f) for f in findings if f.severity == "error")
    assert "dynamic shape" in errors
    assert "20000 exceeds" in errors
    assert "float32" in errors
    assert any(f.op == "topk" and f.severity == "error" for f in findings)  # not on any list
    # and the reference executor names the op it cannot run
    with pytest.raises(OndeviceError, match="'topk'"):
        ReferenceModel(path)


# -- bad input -------------------------------------------------------------------------------------


def _leftovers(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(".draft-")]


def test_unsupported_architecture_leaves_nothing(tmp, llama):
    loaded, _, _ = llama
    out = tmp / "bad" / "draft.mlpackage"
    cfg = replace(loaded.config, model_type="gemma2")
    with pytest.raises(ModelFormatError, match="gemma2"):
        convert_draft(cfg, numpy_weights(loaded.model), out)
    assert not out.exists()


def test_bad_weights_and_options_are_rejected(tmp, llama):
    loaded, pkg, _ = llama
    out = tmp / "bad2" / "draft.mlpackage"
    weights = numpy_weights(loaded.model)
    missing = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ModelFormatError, match="layers.1.mlp.up_proj.weight"):
        convert_draft(loaded.config, missing, out)
    packed = dict(
        weights, **{"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 8), np.float32)}
    )
    with pytest.raises(ModelFormatError, match=r"shape \(64, 8\)"):  # e.g. still 4-bit packed
        convert_draft(loaded.config, packed, out)
    with pytest.raises(OndeviceError, match="compression"):
        convert_draft(loaded.config, weights, out, compress="palettize3")
    with pytest.raises(OndeviceError, match="already exists"):
        convert_draft(loaded.config, weights, pkg)
    assert not out.exists()


def test_failure_during_conversion_leaves_nothing(tmp, llama, monkeypatch):
    import coremltools as ct

    loaded, _, _ = llama
    parent = tmp / "bad3"
    out = parent / "draft.mlpackage"

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ct.models.MLModel, "save", broken)  # fails after the package exists
    with pytest.raises(OndeviceError, match="disk full"):
        convert_draft(loaded.config, numpy_weights(loaded.model), out)
    assert not out.exists() and _leftovers(parent) == []


def test_the_checks_read_the_package_after_the_built_model_is_freed(tmp, llama, monkeypatch):
    """The lint and the range probe load the package from disk: by then the in-memory model, its
    float16 weights and the float32 ones (made by the caller's function) are gone and freed
    memory is handed back (`memory.release`), so the phases do not hold each other's copies
    (converting the 0.5B draft peaked at 10.7 GiB with all of them held)."""
    import gc
    import weakref

    from ondevice.convert import coreml

    loaded, _, _ = llama
    built: list[weakref.ref] = []
    events: list[str] = []
    build, lint = coreml._build_model, coreml._refuse_lint_errors

    def tracked_build(*args, **kwargs):
        model = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    def tracked_lint(package):
        gc.collect()
        events.append("lint, model " + ("alive" if built[0]() is not None else "freed"))
        events.append("float32 weights " + ("alive" if expanded[0]() is not None else "freed"))
        return lint(package)

    expanded: list[weakref.ref] = []

    def weights():  # as the converter's command passes them: made inside, owned by the call
        made = numpy_weights(loaded.model)
        expanded.append(weakref.ref(made["model.norm.weight"]))
        return made

    monkeypatch.setattr(coreml, "_build_model", tracked_build)
    monkeypatch.setattr(coreml, "_refuse_lint_errors", tracked_lint)
    monkeypatch.setattr(coreml, "release", lambda collect=False: events.append("release"))
    out = tmp / "freed" / "draft.mlpackage"
    convert_draft(
        loaded.config, weights, out, context=CONTEXT, chunk=CHUNK, probe_prompts=[[5, 9, 14, 3]]
    )
    freed = ["lint, model freed", "float32 weights freed"]
    assert events == ["release", "release", *freed, "release", "release"]


def test_not_a_package(tmp):
    (tmp / "empty.mlpackage").mkdir()
    with pytest.raises(OndeviceError, match="not a .mlpackage"):
        ReferenceDraftEngine(tmp / "empty.mlpackage")


# -- the same checks through Core ML (macOS 15+) ---------------------------------------------------


@pytest.mark.macos
@on_macos
def test_coreml_engine_matches_reference(llama):
    _, pkg, _ = llama
    tokens = list(np.random.default_rng(3).integers(0, 96, 40))
    coreml, reference = CoreMLDraftEngine(pkg), ReferenceDraftEngine(pkg)
    assert coreml.name == "coreml"
    got, ref = coreml.feed(tokens), reference.feed(tokens)
    assert_close(got, ref, rel=1e-2)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.97
    coreml.trim(5)
    reference.trim(5)
    assert_close(coreml.feed(tokens[:3]), reference.feed(tokens[:3]), rel=1e-2)


@pytest.mark.macos
@on_macos
def test_coreml_matches_mlx_over_200_greedy_steps(llama):
    loaded, pkg, _ = llama
    prompt = [5, 17, 40, 41, 9, 33, 60, 22, 8, 71, 12]
    seq = greedy_sequence(loaded, prompt, 200)
    ref = mlx_logits(loaded, seq)[:-1]
    engine = CoreMLDraftEngine(pkg)
    got = np.concatenate([engine.feed(prompt)] + [engine.feed([t]) for t in seq[len(prompt) : -1]])
    assert_close(got, ref, rel=1e-2)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.99


@pytest.mark.macos
@on_macos
def test_coreml_decode_steps_equal_chunk_call(llama):
    import coremltools as ct

    _, pkg, _ = llama
    decode = ct.models.MLModel(
        str(pkg), compute_units=ct.ComputeUnit.CPU_AND_NE, function_name="decode"
    )
    chunk = ct.models.MLModel(
        str(pkg), compute_units=ct.ComputeUnit.CPU_AND_NE, function_name="chunk"
    )
    ids = np.arange(20, 20 + CHUNK, dtype=np.int32)[None]
    s1, s2 = decode.make_state(), decode.make_state()
    whole = chunk.predict({"input_ids": ids, "position": np.array([0], np.int32)}, state=s1)
    for i in range(CHUNK):
        step = decode.predict(
            {"input_ids": ids[:, i : i + 1], "position": np.array([i], np.int32)}, state=s2
        )
    assert_close(
        np.asarray(step["logits_0"], np.float32)[0, 0],
        np.asarray(whole["logits_0"], np.float32)[0, -1],
        rel=1e-2,
    )


@pytest.mark.macos
@on_macos
def test_coreml_io_mode_and_compute_plan(tmp):
    loaded, pkg, _ = convert(tmp, "mac_io", arch="qwen2", kv="io", seed=9)
    tokens = list(np.random.default_rng(4).integers(0, 96, 30))
    got = CoreMLDraftEngine(pkg).feed(tokens)
    assert_close(got, mlx_logits(loaded, tokens), rel=1e-2)
    plan = coreml_plan.compute_plan(pkg)
    assert set(plan) == {"decode", "chunk"}
    for fname, placement in plan.items():
        assert placement.share("NeuralEngine") > 0.5, f"{fname}: {placement}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_reference_gelu_needs_nothing_beyond_the_declared_dependencies(monkeypatch, dtype):
    """GELU's exact form (a draft whose MLP uses it) through the reference executor: the error
    function must not come from scipy, which only the test extras install (here blocked)."""
    import math

    from ondevice.runtime.mil import math_ops

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.special", None)
    x = np.linspace(-4, 4, 33).astype(dtype)
    got = math_ops.KERNELS["gelu"]({"mode": "EXACT"}, None)(x)
    want = [0.5 * float(v) * (1 + math.erf(float(v) / math.sqrt(2))) for v in x]
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=1e-3 if dtype == np.float16 else 1e-6, atol=1e-3)
