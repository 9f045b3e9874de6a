"""Every Core ML engine path on Linux, through the strict stand-in (`support.coreml`): coremltools'
own Python layer over a fake native module that keeps the native layer's rules (issue 27).

Decode, chunk, state read/write, prompt-cache restore, io mode, the fallback to the MLX draft
(at load, at placement and during generation) and the once-per-package probe in a child process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from support import coreml as strict

from ondevice.api import Generator, _Pair
from ondevice.convert.coreml import convert_draft
from ondevice.models import load_model
from ondevice.runtime.coreml_engines import CoreMLDraftEngine, ReferenceDraftEngine
from ondevice.runtime.mil.package import read_description

CONTEXT, CHUNK, VOCAB = 256, 8, 96


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """A tiny endless verifier, a perturbed draft, and the draft converted in both kv modes."""
    root = tmp_path_factory.mktemp("standin")
    v = tiny.write_endless_model(root / "v", seed=0, scale=1.5, context=512)
    d = tiny.perturbed_copy(v, root / "d", noise=0.3)
    draft = load_model(d)
    weights = {k: np.array(x.astype(mx.float32)) for k, x in tree_flatten(draft.model.parameters())}
    out = {"verifier": v, "draft": d}
    for kv in ("state", "io"):
        out[kv] = root / f"draft-{kv}.mlpackage"
        convert_draft(draft.config, weights, out[kv], context=CONTEXT, chunk=CHUNK, kv=kv)
    return out


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, VOCAB, n)]


# -- the stand-in itself keeps coremltools' rules ------------------------------------------------


def test_the_stand_in_runs_coremltools_python_layer_and_native_rules(models, home, monkeypatch):
    import coremltools as ct
    from coremltools.models.utils import compile_model

    fake = strict.install(monkeypatch)
    compiled = compile_model(str(models["io"]), str(home / "x.mlmodelc"))
    model = ct.models.CompiledMLModel(
        compiled, compute_units=ct.ComputeUnit.CPU_AND_NE, function_name="decode"
    )
    shape = tuple(read_description(models["io"])["kv_cache"]["shape"])
    cache = np.zeros(shape, np.float16)
    inputs = {
        "input_ids": np.zeros((1, 1), np.int32),
        "position": np.zeros((1,), np.int32),
        "key_cache": cache,
        "value_cache": cache,
    }
    out = model.predict(inputs)
    # coremltools replaced the float16 arrays in the caller's dict (in place) by float32 copies
    assert inputs["key_cache"] is not cache and inputs["key_cache"].dtype == np.float32
    assert all(v.dtype == np.float32 for v in out.values())  # float16 outputs widened
    with pytest.raises(RuntimeError, match="value type not convertible"):
        model.predict({**inputs, "input_ids": np.zeros((1, 1), np.int64)})
    with pytest.raises(RuntimeError, match="does not match the shape"):
        model.predict({**inputs, "input_ids": np.zeros((1, 2), np.int32)})
    # states: float16 writes are refused, reads come back float32, shapes must match
    stateful = ct.models.CompiledMLModel(
        compile_model(str(models["state"]), str(home / "s.mlmodelc")),
        compute_units=ct.ComputeUnit.CPU_AND_NE,
        function_name="decode",
    )
    state = stateful.make_state()
    full = state.read_state("key_cache")
    assert full.dtype == np.float32
    with pytest.raises(RuntimeError, match="value type not convertible"):
        state.write_state("key_cache", full.astype(np.float16))
    with pytest.raises(RuntimeError, match="does not match"):
        state.write_state("key_cache", full[:, :, :3])
    state.write_state("key_cache", full + 1)
    assert (state.read_state("key_cache") == 1).all()
    assert fake.compiled and {f for _, _, f in fake.loaded} == {"decode"}


# -- the engine through it -------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["state", "io"])
def test_the_core_ml_engine_equals_the_reference_executor(models, home, monkeypatch, kv):
    """Decode and chunk calls, several feeds and a trim: the same logits as the reference run of
    the same package. (io mode: coremltools swaps the engine's float16 caches for float32 copies
    on the first predict, so the engine kept writing into arrays Core ML never saw again.)"""
    fake = strict.install(monkeypatch)
    engine, ref = CoreMLDraftEngine(models[kv]), ReferenceDraftEngine(models[kv])
    for tokens in (ids(19, 1), [7], [8], ids(3, 2)):
        np.testing.assert_array_equal(engine.feed(tokens), ref.feed(tokens))
    engine.trim(4)
    ref.trim(4)
    np.testing.assert_array_equal(engine.feed([9, 10]), ref.feed([9, 10]))
    assert {"decode", "chunk"} <= set(fake.predictions)


def test_a_prefix_is_written_back_into_the_core_ml_state(models, home, monkeypatch):
    """The prompt cache's restore writes a saved prefix into the Core ML state: the native layer
    takes int32/float32/float64 only, so a float16 write raised on every restored turn."""
    fake = strict.install(monkeypatch)
    engine, ref = CoreMLDraftEngine(models["state"]), ReferenceDraftEngine(models["state"])
    prompt = ids(21, 3)
    engine.feed(prompt)
    saved = engine.export_kv(15)
    assert all(a.dtype == np.float16 for a in saved.values())
    engine.reset()
    engine.import_kv(saved)
    ref.feed(prompt[:15])
    np.testing.assert_array_equal(engine.feed(prompt[15:]), ref.feed(prompt[15:]))
    assert fake.predictions  # (the state went through the stand-in)


def package_generator(models, kv: str = "state", backend: str = "coreml", **kw) -> Generator:
    pair = _Pair(load_model(models["verifier"]), None, models[kv], CONTEXT)
    return Generator(pair, backend, **kw)


@pytest.mark.parametrize("kv", ["state", "io"])
def test_a_20_turn_chat_hits_the_cache_on_every_turn_after_the_first(models, home, monkeypatch, kv):
    strict.install(monkeypatch)
    gen = package_generator(models, kv)
    ref = package_generator(models, kv, backend="reference", prompt_cache_bytes=0)
    assert gen.draft_backend == "coreml"
    kw = {"max_tokens": 6, "temperature": 0.0}
    history = ids(12, 4)
    for turn in range(20):
        r = gen.generate(history, **kw)
        assert r.tokens == ref.generate(history, **kw).tokens, turn
        if turn:
            assert r.stats["cached_tokens"] > 0 and r.stats["draft_cached_tokens"] > 0, turn
        assert r.stats["draft_backend"] == "coreml"
        history = history + r.tokens + ids(3, 100 + turn)


def test_a_restore_that_core_ml_refuses_prefills_the_draft_instead(models, home, monkeypatch):
    strict.install(monkeypatch)

    def refuse(self, name, value):
        raise RuntimeError("Failed to write state")

    monkeypatch.setattr(strict.FakeState, "write_state", refuse)
    gen = package_generator(models)
    ref = package_generator(models, backend="reference", prompt_cache_bytes=0)
    first = ids(20, 5)
    answer = gen.generate(first, max_tokens=6).tokens
    turn = first + answer + [9, 10]
    r = gen.generate(turn, max_tokens=6)
    assert r.tokens == ref.generate(turn, max_tokens=6).tokens
    assert r.stats["cached_tokens"] > 0 and r.stats["draft_cached_tokens"] == 0
    assert r.stats["draft_backend"] == "coreml" and r.stats["drafted"] > 0


# -- falling back to the MLX draft -----------------------------------------------------------------


def bundle_like_generator(models, **kw) -> Generator:
    """A Generator over the pair a bundle gives: the MLX draft and its package, backend auto."""
    pair = _Pair(
        load_model(models["verifier"]), load_model(models["draft"]), models["state"], CONTEXT
    )
    pair.extra.update(kw)
    return Generator(pair, "auto")


def fallback_lines(capsys) -> list[str]:
    err = capsys.readouterr().err.splitlines()
    return [line for line in err if "Core ML draft unavailable" in line]


def test_a_chunk_function_that_fails_leaves_load_working_on_the_mlx_draft(
    models, home, monkeypatch, capsys
):
    """The chunk function is predicted at start too: before, its first call came during the
    cost measurement in Generator.__init__, outside the fallback, and load failed."""
    strict.install(monkeypatch, fail="chunk")
    gen = bundle_like_generator(models)
    assert gen.draft_backend == "mlx"
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and "first prediction of chunk" in lines[0], lines
    assert gen.generate(ids(20, 6), max_tokens=5).stats["drafted"] > 0


def test_a_core_ml_failure_during_placement_falls_back(models, home, monkeypatch, capsys):
    broken = {"on": False}
    fake = strict.install(
        monkeypatch, fail=lambda f, i: RuntimeError("ANE gone") if broken["on"] else None
    )
    real_init = CoreMLDraftEngine.__init__

    def start_then_break(self, *a, **k):
        real_init(self, *a, **k)
        broken["on"] = True  # the engine started; the cost measurement's calls fail

    monkeypatch.setattr(CoreMLDraftEngine, "__init__", start_then_break)
    gen = bundle_like_generator(models)
    assert gen.draft_backend == "mlx" and gen.placement is None
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and "ANE gone" in lines[0], lines
    assert "chunk" in fake.predictions


def test_core_ml_that_wins_frees_the_mlx_draft_and_a_later_failure_switches_back(
    models, home, monkeypatch, capsys
):
    """Placement picks Core ML here (the stand-in is costed as the concurrent backend): the MLX
    draft is released; when Core ML fails during a generation, the model moves to the MLX draft
    (reloaded), the request is answered, and one line says why."""
    import weakref

    from ondevice.runtime import placement

    broken = {"on": False}
    strict.install(
        monkeypatch, fail=lambda f, i: RuntimeError("ANE gone") if broken["on"] else None
    )
    monkeypatch.setattr(
        placement, "choose", lambda v, d, **o: placement.Placement("coreml", True, 4, 1.0)
    )
    reloads = []

    def reload():
        reloads.append(1)
        return load_model(models["draft"])

    gen = bundle_like_generator(models, reload_draft=reload)
    assert gen.draft_backend == "coreml" and gen._pair.draft is None
    ref = package_generator(models, backend="reference", prompt_cache_bytes=0)
    prompt = ids(20, 7)
    assert gen.generate(prompt, max_tokens=6).tokens == ref.generate(prompt, max_tokens=6).tokens
    broken["on"] = True
    r = gen.generate(prompt + [11], max_tokens=6)
    assert r.tokens == ref.generate(prompt + [11], max_tokens=6).tokens
    assert r.stats["draft_backend"] == "mlx" and gen.draft_backend == "mlx" and reloads == [1]
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and "ANE gone" in lines[0] and "MLX draft" in lines[0], lines
    model = weakref.ref(gen.draft.model)
    assert model() is not None
    gen.generate(prompt, max_tokens=3)
    assert fallback_lines(capsys) == []  # once


# -- the once-per-package probe in a child process --------------------------------------------------


def test_the_probe_runner_reports_a_killed_a_hung_and_a_failing_child():
    from ondevice.runtime.coreml_probe import run_child

    py = [sys.executable, "-c"]
    assert run_child([*py, "print('fine')"], 30) == (None, "fine\n")
    killed, _ = run_child([*py, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], 30)
    assert killed is not None and "SIGKILL" in killed
    hung, _ = run_child([*py, "import time; time.sleep(60)"], 1)
    assert hung is not None and "did not finish within 1 s" in hung
    failed, _ = run_child([*py, "import sys; sys.exit('ondevice: Core ML load failed (boom)')"], 30)
    assert failed == "Core ML load failed (boom)"


def test_a_start_that_kills_its_process_costs_one_probe_not_every_launch(
    models, home, monkeypatch, capsys
):
    """On a Mac the draft is first started in a child process: one that dies (a Neural Engine
    compile killed by the OS) leaves load working on the MLX draft, and the cached verdict makes
    every later launch skip Core ML without probing again."""
    from ondevice.runtime import coreml_probe

    fake = strict.install(monkeypatch)
    monkeypatch.setattr(coreml_probe, "ISOLATE", True)
    children = []

    def dying_child(package):
        children.append(package)
        return [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]

    monkeypatch.setattr(coreml_probe, "child_argv", dying_child)
    for launch in range(2):
        gen = bundle_like_generator(models)
        assert gen.draft_backend == "mlx", launch
        lines = fallback_lines(capsys)
        assert len(lines) == 1 and "SIGKILL" in lines[0], lines
    assert len(children) == 1 and fake.loaded == []  # never started in-process
    assert len(list((home / "coreml-probe").iterdir())) == 1

    # a probe that passes lets the draft start in-process, and is not repeated either; where
    # the compute plan puts most of a function off the Neural Engine, the first load says so
    monkeypatch.setattr(coreml_probe, "macos_build", lambda: "15.5 24F74")  # a new macOS build
    report = '{"plan_warnings": ["chunk plans only 20% of its cost on the Neural Engine"]}'
    child = [sys.executable, "-c", f"print('compiling'); print({report!r})"]
    monkeypatch.setattr(coreml_probe, "child_argv", lambda p: child)
    capsys.readouterr()
    for launch in range(2):
        assert coreml_probe.verdict(models["state"]) is None
        warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
        assert len(warned) == (1 - launch), warned
        if not launch:
            assert "chunk plans only 20% of its cost on the Neural Engine" in warned[0]
    assert len(list((home / "coreml-probe").iterdir())) == 2


def test_the_probe_child_reports_the_compute_plan(models, home, monkeypatch, capsys):
    """The child's side, in-process: start the engine, then the plan's warnings as JSON."""
    from collections import Counter

    from ondevice.runtime import coreml_plan, coreml_probe

    strict.install(monkeypatch)
    plans = {
        "decode": coreml_plan.FunctionPlan(
            {"NeuralEngine": Counter(conv=9)}, {"NeuralEngine": 1.0}
        ),
        "chunk": coreml_plan.FunctionPlan(
            {"CPU": Counter(conv=9)}, {"CPU": 0.9, "NeuralEngine": 0.1}
        ),
    }
    monkeypatch.setattr(coreml_plan, "compute_plan", lambda path: plans)
    assert coreml_probe.main([str(models["state"])]) == 0
    assert coreml_probe.plan_warnings(capsys.readouterr().out) == [
        "chunk plans only 10% of its cost on the Neural Engine"
    ]
    strict.install(monkeypatch, fail="chunk")
    assert coreml_probe.main([str(models["state"])]) == 1
    assert "first prediction of chunk" in capsys.readouterr().err


def test_conversion_on_a_mac_checks_the_compute_plan(models, tmp_path, monkeypatch, capsys):
    from collections import Counter

    from ondevice.convert import coreml
    from ondevice.runtime import coreml_plan

    plans = {
        "decode": coreml_plan.FunctionPlan(
            {"NeuralEngine": Counter(conv=9)}, {"NeuralEngine": 1.0}
        ),
        "chunk": coreml_plan.FunctionPlan(
            {"CPU": Counter(conv=9)}, {"CPU": 0.7, "NeuralEngine": 0.3}
        ),
    }
    monkeypatch.setattr(coreml, "_core_ml_can_plan", lambda: True)
    monkeypatch.setattr(coreml_plan, "compute_plan", lambda path: plans)
    draft = load_model(models["draft"])
    weights = {k: np.array(x.astype(mx.float32)) for k, x in tree_flatten(draft.model.parameters())}
    desc = convert_draft(
        draft.config, weights, tmp_path / "d.mlpackage", context=CONTEXT, chunk=CHUNK
    )
    assert desc["neural_engine_share"] == {"decode": 1.0, "chunk": 0.3}
    err = capsys.readouterr().err
    assert "warning: chunk plans only 30% of its cost on the Neural Engine" in err
    assert "warning: decode" not in err


def test_the_package_drafts_cost_profile_key_follows_its_contents_and_the_os(
    models, tmp_path, monkeypatch
):
    """A profile measured for one package (or macOS version) must not place another: the key
    was the path alone, so a re-converted draft (another compression) reused stale costs."""
    import platform
    import shutil

    from ondevice.runtime.pass_costs import engine_key

    pkg = tmp_path / "d.mlpackage"
    shutil.copytree(models["state"], pkg)
    before = engine_key(ReferenceDraftEngine(pkg))
    assert engine_key(ReferenceDraftEngine(pkg)) == before
    shutil.rmtree(pkg)
    shutil.copytree(models["io"], pkg)  # another package at the same path
    assert engine_key(ReferenceDraftEngine(pkg)) != before
    again = engine_key(ReferenceDraftEngine(pkg))
    monkeypatch.setattr(platform, "mac_ver", lambda: ("15.5", ("", "", ""), "arm64"))
    assert engine_key(ReferenceDraftEngine(pkg)) != again


def test_a_saved_prompt_restores_the_core_ml_state(models, home, monkeypatch, tmp_path):
    """`save_prompt_cache` / `load_prompt_cache` with the Core ML draft: the saved KV goes back
    into the state through write_state (float32, as the native layer requires)."""
    strict.install(monkeypatch)
    gen = package_generator(models)
    ref = package_generator(models, backend="reference", prompt_cache_bytes=0)
    first = ids(30, 9)
    assert gen.save_prompt_cache(tmp_path / "doc.kv", first) == len(first)
    fresh = package_generator(models)
    assert fresh.load_prompt_cache(tmp_path / "doc.kv") == len(first)
    r = fresh.generate(first + [7, 8], max_tokens=8, temperature=0.8, seed=3)
    assert r.stats["draft_cached_tokens"] == len(first) and r.stats["draft_backend"] == "coreml"
    assert r.tokens == ref.generate(first + [7, 8], max_tokens=8, temperature=0.8, seed=3).tokens
