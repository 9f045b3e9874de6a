"""Core ML hardening (issue 15): what a Mac user would hit first, caught on Linux.

Core ML itself cannot run here, so its failure modes are injected through the strict Core ML
stand-in (`support.coreml`: coremltools' own Python layer over a fake native module that runs the
real package with the reference executor): it fails to load, fails `make_state`, fails `predict`
or returns NaN, or the native module is missing. Numerics run the real converted package through the reference executor, in float32
and in the emulated float16-accumulate mode.
"""

from __future__ import annotations

import gc
import json
import platform
import re
import shutil
import sys
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import coreml as strict
from tiny import make_config, random_weights

from ondevice.convert import lint
from ondevice.convert.coreml import RANGE_LIMIT, convert_draft
from ondevice.convert.probe import probe_float16_range
from ondevice.errors import ConversionError, ModelFormatError, OndeviceError
from ondevice.models.config import ModelConfig
from ondevice.models.weights import build_model
from ondevice.runtime import coreml_plan
from ondevice.runtime.coreml_engines import CoreMLDraftEngine, ReferenceDraftEngine
from ondevice.runtime.engines import MLXEngine, make_draft_engine
from ondevice.runtime.mil.interpreter import ReferenceModel
from ondevice.runtime.mil.numerics import FP16_MAX

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, CHUNK = 64, 8


def qwen2(layers: int = 3, embed_scale: float = 1.0, seed: int = 1, **extra):
    """A tiny Qwen2-style draft (q/k/v biases, untied head); `embed_scale` makes the residual
    stream as large as Qwen2.5's (the embedding rows are N(0, 1), so 3,000 gives ~11,000)."""
    raw = make_config(arch="qwen2", layers=layers, tie=False, **extra)
    w = random_weights(raw, seed=seed)
    w["model.embed_tokens.weight"] *= embed_scale
    return ModelConfig.from_dict(raw), w


def mlx_model(cfg, w):
    return build_model(cfg, {k: mx.array(v) for k, v in w.items()})


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hardening")


@pytest.fixture(scope="module")
def draft(tmp):
    """(config, weights, package) of an ordinary tiny Qwen2 draft."""
    cfg, w = qwen2()
    pkg = tmp / "draft.mlpackage"
    convert_draft(cfg, w, pkg, context=CONTEXT, chunk=CHUNK)
    return cfg, w, pkg


@pytest.fixture(scope="module")
def loud(tmp):
    """A draft whose residual stream reaches ~11,000: past float16's range once squared."""
    cfg, w = qwen2(embed_scale=3000.0)
    pkg = tmp / "loud.mlpackage"
    convert_draft(cfg, w, pkg, context=CONTEXT, chunk=CHUNK)
    return cfg, w, pkg


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# -- 1. fallback to the MLX draft, and doctor says why ---------------------------------------------


@pytest.mark.parametrize(
    "fail,step",
    [
        ("load", "load"),
        ("make_state", "make_state"),
        ("predict", "first prediction"),
        ("nan", "non-finite"),
        ("native", "native module"),
    ],
)
def test_core_ml_failure_falls_back_to_the_mlx_draft(draft, home, monkeypatch, capsys, fail, step):
    cfg, w, pkg = draft
    strict.install(monkeypatch, fail=None if fail == "native" else fail)
    if fail == "native":
        monkeypatch.setitem(sys.modules, "coremltools.libcoremlpython", None)  # import fails
    model = mlx_model(cfg, w)
    engine = make_draft_engine("auto", mlx_model=model, mlpackage=pkg)
    assert isinstance(engine, MLXEngine)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and step in err[0] and "MLX draft" in err[0], err
    # the engine works
    assert engine.feed([1, 2, 3]).shape == (3, cfg.vocab_size)

    # `doctor` reports the reason
    from ondevice.apps import doctor

    monkeypatch.setattr(platform, "system", lambda: "Linux")  # doctor's own checks: this host
    report = doctor.collect()
    assert step in report["coreml"]["last_fallback"]["reason"]
    assert "last Core ML failure" in doctor.render(report)

    # an explicit request for Core ML gets the reason as a clear error instead
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    with pytest.raises(OndeviceError, match=re.escape(step)):
        make_draft_engine("coreml", mlx_model=model, mlpackage=pkg)


def test_core_ml_that_works_is_used_compiled_once(draft, home, monkeypatch, capsys):
    """No fallback when Core ML works; the package is compiled once (and cached), and each
    function is loaded from the compiled model with its function_name."""
    cfg, w, pkg = draft
    fake = strict.install(monkeypatch)
    engine = make_draft_engine("auto", mlx_model=mlx_model(cfg, w), mlpackage=pkg)
    assert isinstance(engine, CoreMLDraftEngine) and capsys.readouterr().err == ""
    assert len(fake.compiled) == 1
    compiled = fake.loaded[0][0]
    assert Path(compiled).parent == home / "compiled" and compiled.endswith(".mlmodelc")
    assert sorted(fake.loaded) == [
        (compiled, "CPU_AND_NE", "chunk"),
        (compiled, "CPU_AND_NE", "decode"),
    ]
    assert [p.name for p in (home / "compiled").iterdir()] == [Path(compiled).name]  # no temp
    tokens = [4, 9, 60, 2, 31, 77, 15, 8, 8, 50, 19]
    np.testing.assert_array_equal(engine.feed(tokens), ReferenceDraftEngine(pkg).feed(tokens))
    CoreMLDraftEngine(pkg)  # a second load reuses the compiled model
    assert len(fake.compiled) == 1 and len(fake.loaded) == 4


# -- 3. inputs outlive every predict ---------------------------------------------------------------


@pytest.mark.parametrize("kv", ["state", "io"])
def test_predict_inputs_outlive_the_call(tmp, home, monkeypatch, kv):
    """Core ML may read (and release) an input after predict returns: every input the engine
    passes must still be alive, holding what it held, until the engine's next call."""
    cfg, w = qwen2(layers=1)
    pkg = tmp / f"lifetime_{kv}.mlpackage"
    convert_draft(cfg, w, pkg, context=CONTEXT, chunk=CHUNK, kv=kv)
    fake = strict.install(monkeypatch)
    engine = CoreMLDraftEngine(pkg)
    for tokens in ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15], [16]):
        engine.feed(tokens)
        gc.collect()
        seen = fake.inputs_seen[-1]
        assert all(r() is not None for r, _ in seen.values()), "an input was freed after predict"
        for name in ("input_ids", "position"):  # (the io caches are the engine's, updated)
            np.testing.assert_array_equal(seen[name][0](), seen[name][1])


# -- 2. float16: overflow-free norms, the range probe, float16 accumulation -------------------------


def test_large_residuals_do_not_overflow_float16_accumulation(loud):
    """A residual of ~11,000 (Qwen2.5 reaches ~2,180): squared inside the norm it is far past
    float16's 65,504. With float16 accumulation the package still agrees with the MLX model."""
    cfg, w, pkg = loud
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, 24)]
    ref = np.array(mlx_model(cfg, w)(mx.array([tokens]))[0].astype(mx.float32))
    for mode in ("float32", "float16"):
        got = ReferenceDraftEngine(pkg, accumulate=mode).feed(tokens)
        assert np.isfinite(got).all(), mode
        assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.95, mode
        np.testing.assert_allclose(got, ref, atol=0.05 * np.abs(ref).max())


def test_range_probe_reports_every_norm_within_float16(loud, draft):
    cfg, _, pkg = loud
    prompt = [[int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 20)]]
    report = probe_float16_range(pkg, prompt, decode_steps=4)
    assert report.tokens == 24
    assert peak_by_type(report, "gather") > 8000  # the injected residual is seen...
    assert peak_by_type(report, "layer_norm") <= 2 * cfg.hidden_size  # ...squares stay small
    assert report.peak < RANGE_LIMIT < FP16_MAX
    # an ordinary draft, in float16 accumulation: activations small; the largest value is the
    # causal mask's -10,000 (finite, as in ml-ane-transformers)
    quiet = probe_float16_range(draft[2], prompt, decode_steps=4, accumulate="float16")
    assert quiet.peaks[0][0] == "causal_mask" and quiet.peak == 10000
    for op_type in ("layer_norm", "conv", "matmul", "softmax"):
        assert 0 < peak_by_type(quiet, op_type) < 1000, op_type


def peak_by_type(report, op_type: str) -> float:
    return max(v for _, t, v in report.peaks if t == op_type)


def test_float16_accumulate_mode_emulates_overflow(tmp):
    """The float16-accumulate mode must show what float32 hides: a sum of squares past 65,504
    (the pre-scaling norm's own reason to exist) overflows there and not in float32."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types as mil_types

    @mb.program(
        input_specs=[mb.TensorSpec((1, 64, 1, 1), dtype=mil_types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x):
        return mb.layer_norm(x=x, axes=[1], epsilon=np.float16(1e-5))

    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.macOS15,
        skip_model_load=True,
    )
    path = tmp / "norm.mlpackage"
    model.save(str(path))
    x = {"x": (np.arange(64) - 31.5).astype(np.float16).reshape(1, 64, 1, 1) * 40}
    f32 = ReferenceModel(path, probe=True)
    f16 = ReferenceModel(path, accumulate="float16", probe=True)
    a, b = f32.predict(x), f16.predict(x)
    name = next(iter(a))
    assert np.isfinite(a[name]).all() and np.abs(a[name]).max() > 1.5
    assert not (np.abs(b[name]) > 0.01).any()  # an infinite variance: the output collapses
    assert max(v for _, v in f32.magnitudes.values()) > FP16_MAX  # the probe sees it in float32
    with pytest.raises(OndeviceError, match="accumulation"):
        ReferenceModel(path, accumulate="bfloat16")


def test_float16_accumulation_agrees_with_float32(draft):
    cfg, w, pkg = draft
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, 40)]
    a = ReferenceDraftEngine(pkg).feed(tokens)
    b = ReferenceDraftEngine(pkg, accumulate="float16").feed(tokens)
    assert not np.array_equal(a, b)  # the modes differ...
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.95  # ...by float16 rounding only
    np.testing.assert_allclose(a, b, atol=0.02 * np.abs(a).max())


def test_conversion_fails_when_the_probe_finds_an_op_out_of_range(tmp):
    """A residual of ~40,000 is within float16 but too close to its edge: conversion refuses,
    leaving nothing; weights beyond float16 are refused before any work."""
    cfg, w = qwen2(layers=1, embed_scale=10000.0)
    out = tmp / "too_loud" / "draft.mlpackage"
    with pytest.raises(ConversionError, match="float16 range probe"):
        convert_draft(cfg, w, out, context=CONTEXT, chunk=CHUNK, probe_prompts=[[1, 2, 3, 4]])
    assert not out.exists() and list(out.parent.iterdir()) == []
    w["model.embed_tokens.weight"] *= 3.0
    with pytest.raises(ModelFormatError, match="beyond float16's range"):
        convert_draft(cfg, w, out, context=CONTEXT, chunk=CHUNK)
    # the probe's figures are part of a passing conversion's description
    cfg, w = qwen2(layers=1, embed_scale=100.0)
    desc = convert_draft(
        cfg, w, tmp / "ok.mlpackage", context=CONTEXT, chunk=CHUNK, probe_prompts=[[1, 2, 3]]
    )
    assert 0 < desc["float16_probe"]["peak"] < RANGE_LIMIT


# -- 5. the lint is enforced ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "context,chunk,match",
    [
        (8224, 16, "context 8224"),  # mask table 2 x 8224 wide > 16384
        (256, 48, "chunk 48"),  # chunks above 32 (Anemll#27)
    ],
)
def test_converter_refuses_options_the_neural_engine_rejects(tmp, context, chunk, match):
    cfg, w = qwen2(layers=1)
    out = tmp / f"opts_{context}_{chunk}.mlpackage"
    with pytest.raises(OndeviceError, match=match):
        convert_draft(cfg, w, out, context=context, chunk=chunk)
    assert not out.exists()


def test_converter_refuses_hidden_sizes_whose_norm_concat_is_too_wide(tmp):
    raw = make_config(arch="qwen2", hidden_size=8256, heads=2, kv_heads=1, layers=1)
    with pytest.raises(ModelFormatError, match="8192"):
        convert_draft(ModelConfig.from_dict(raw), {}, tmp / "wide.mlpackage")


def test_converter_runs_the_lint_and_refuses_its_errors(tmp, monkeypatch):
    cfg, w = qwen2(layers=1)
    seen = []

    def lint_with_error(path):
        seen.append(Path(path))
        return [lint.Finding("error", "decode", "topk", None, "not on any list")]

    monkeypatch.setattr(lint, "check_mlpackage", lint_with_error)
    out = tmp / "linted" / "draft.mlpackage"
    with pytest.raises(ConversionError, match="topk"):
        convert_draft(cfg, w, out, context=CONTEXT, chunk=CHUNK)
    assert seen and not out.exists() and list(out.parent.iterdir()) == []


def _program_package(tmp: Path, name: str, build) -> Path:
    import coremltools as ct

    model = ct.convert(
        build,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.macOS15,
        skip_model_load=True,
    )
    path = tmp / f"{name}.mlpackage"
    model.save(str(path))
    return path


def test_lint_rules_rank_state_alignment_and_tokens(tmp):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types as mil_types

    @mb.program(
        input_specs=[
            mb.TensorSpec((1, 48), dtype=mil_types.int32),
            mb.StateTensorSpec((2, 2, 40, 32), dtype=mil_types.fp16),
        ],
        opset_version=ct.target.iOS18,
    )
    def prog(input_ids, cache):
        c = mb.read_state(input=cache)
        five = mb.reshape(x=c, shape=np.array([2, 2, 2, 20, 32], np.int32))  # rank 5
        return mb.reduce_sum(x=five, axes=[4]), mb.cast(x=input_ids, dtype="fp16")

    findings = lint.check_mlpackage(_program_package(tmp, "rules", prog))
    errors = " | ".join(str(f) for f in findings if f.severity == "error")
    assert "rank 5" in errors
    assert "multiples of 32" in errors  # state length 40
    assert "48 tokens per call" in errors


def test_lint_passes_the_converted_qwen2_draft_with_a_split_head(tmp):
    """A vocabulary above 16,384 with an untied head: the head is split, everything on the
    lists; only the CPU allowlist (embedding lookup, index arithmetic) shows as warnings."""
    cfg, w = qwen2(layers=1, vocab_size=20000)
    pkg = tmp / "bigvocab.mlpackage"
    desc = convert_draft(cfg, w, pkg, context=CONTEXT, chunk=CHUNK)
    assert desc["vocab_splits"] == [10000, 10000]
    findings = lint.check_mlpackage(pkg)
    assert [f for f in findings if f.severity == "error"] == []
    assert {f.op for f in findings} == {"const", "index arithmetic"}
    assert all("embedding table" in f.message for f in findings if f.op == "const")


# -- 6. a compute plan per function ----------------------------------------------------------------


class _FakePlan:
    """MLComputePlan as coremltools builds it: only the compiled model's default function gets
    devices (the other functions' ops come back without one)."""

    def __init__(self, compiled: Path):
        from coremltools.models.utils import load_spec

        spec = load_spec(str(compiled))
        self.default = spec.description.defaultFunctionName
        prog = lint._program(compiled)

        def op(o):
            return types.SimpleNamespace(operator_name=o.op_type, fname=fname)

        functions = {}
        for fname, func in prog.functions.items():
            ops = [op(o) for o in func.operations]
            functions[fname] = types.SimpleNamespace(block=types.SimpleNamespace(operations=ops))
        program = types.SimpleNamespace(functions=functions)
        self.model_structure = types.SimpleNamespace(program=program)

    def get_compute_device_usage_for_mlprogram_operation(self, op):
        if op.fname != self.default:
            return None
        device = type(
            "MLCPUComputeDevice" if op.operator_name == "gather" else "MLNeuralEngineComputeDevice",
            (),
            {},
        )()
        return types.SimpleNamespace(preferred_compute_device=device)

    def get_estimated_cost_for_mlprogram_operation(self, op):
        return types.SimpleNamespace(weight=1.0) if op.fname == self.default else None


def test_compute_plan_covers_every_function(draft, monkeypatch):
    import coremltools.models.utils as ct_utils

    _, _, pkg = draft

    def compile_model(src, dst):
        shutil.copytree(src, dst)
        return dst

    monkeypatch.setattr(ct_utils, "compile_model", compile_model)
    plans = coreml_plan.compute_plan(pkg, load_plan=_FakePlan)
    assert set(plans) == {"decode", "chunk"}
    for fname, placement in plans.items():
        assert "unknown" not in placement.ops, fname
        assert placement.share("NeuralEngine") > 0.9, fname
        assert "NeuralEngine" in str(placement)


def test_check_warns_about_a_function_mostly_off_the_neural_engine(draft, monkeypatch, capsys):
    from collections import Counter

    from ondevice.convert import check

    _, _, pkg = draft
    plans = {
        "decode": coreml_plan.FunctionPlan(
            {"NeuralEngine": Counter(conv=9)}, {"NeuralEngine": 1.0}
        ),
        "chunk": coreml_plan.FunctionPlan(
            {"CPU": Counter(conv=9), "NeuralEngine": Counter(add=2)},
            {"CPU": 0.8, "NeuralEngine": 0.2},
        ),
    }
    monkeypatch.setattr(coreml_plan, "compute_plan", lambda path: plans)
    monkeypatch.setattr(check.sys, "platform", "darwin")
    assert check._check_draft(pkg) == 0
    out = capsys.readouterr().out
    assert "chunk: CPU 9 ops (80% of cost" in out
    assert "warning: chunk plans only 20% of its cost on the Neural Engine" in out
    assert "warning: decode" not in out


# -- 7. install truth ------------------------------------------------------------------------------


def test_requires_python_is_bounded_by_coremltools_wheels():
    """coremltools 9.0 ships wheels for CPython 3.9-3.13 (checked on PyPI); without a wheel pip
    builds an sdist whose conversion fails ("BlobWriter not loaded")."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10,<3.14"
    readme = (ROOT / "README.md").read_text()
    assert "3.10 to 3.13" in readme and "brew install python@3.12" in readme


def test_doctor_checks_coremltools_native_modules(monkeypatch, home):
    from ondevice.apps import doctor

    report = doctor.collect()
    native = report["coreml"]["native_modules"]
    assert native["libmilstoragepython"] == "ok" and native["libmodelpackage"] == "ok"
    assert native["libcoremlpython"] == ("ok" if sys.platform == "darwin" else "missing")
    assert "libmilstoragepython ok" in doctor.render(report)
    assert report["coreml"]["reason"] is None or "macOS" in report["coreml"]["reason"]

    # an install without the conversion module (an sdist build): doctor says what to do
    monkeypatch.setattr(doctor, "_native_module", lambda name: "missing")
    report = doctor.collect()
    assert any("BlobWriter not loaded" in w and "3.10-3.13" in w for w in report["warnings"])


def test_doctor_json_is_serializable(home):
    from ondevice.apps import doctor

    json.dumps(doctor.collect())


# -- on a Mac: the real drafts on the Neural Engine ---------------------------------------------


def _real_drafts() -> list:
    """The shipped draft, and (if ONDEVICE_TEST_DRAFT names one) the default pair's draft, e.g.
    the Qwen2.5-Coder-0.5B-Instruct GGUF that `ondevice pull` fetches."""
    import os

    drafts = [pytest.param(str(ROOT / "Package.resources" / "draft"), id="shipped")]
    if os.environ.get("ONDEVICE_TEST_DRAFT"):
        drafts.append(pytest.param(os.environ["ONDEVICE_TEST_DRAFT"], id="default-pair"))
    return drafts


@pytest.mark.macos
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "darwin", reason="Core ML prediction needs macOS 15+")
@pytest.mark.parametrize("source", _real_drafts())
def test_real_draft_runs_mostly_on_the_neural_engine(tmp_path, source):
    """Run on a Mac: ONDEVICE_TEST_DRAFT=/path/to/qwen-0.5b.gguf python -m pytest -q -m macos
    tests/test_coreml_hardening.py. Most of each function's estimated cost must be planned on the
    Neural Engine, and Core ML must start (no fallback) and agree with the reference executor."""
    from ondevice.convert.cli import _probe_prompts, draft_numpy_weights
    from ondevice.models import load_model

    draft = load_model(source, dequantize=True)
    pkg = tmp_path / "draft.mlpackage"
    convert_draft(
        draft.config,
        draft_numpy_weights(draft.model),
        pkg,
        context=1024,
        chunk=16,
        probe_prompts=_probe_prompts(draft.tokenizer),
    )
    plans = coreml_plan.compute_plan(pkg)
    assert set(plans) == {"decode", "chunk"}
    for fname, placement in plans.items():
        assert placement.share("NeuralEngine") > 0.5, f"{fname}: {placement}"
    prompt = _probe_prompts(draft.tokenizer)[0]
    coreml, reference = CoreMLDraftEngine(pkg), ReferenceDraftEngine(pkg)
    got, ref = coreml.feed(prompt), reference.feed(prompt)
    assert np.isfinite(got).all()
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.95
