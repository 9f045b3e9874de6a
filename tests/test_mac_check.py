"""`ondevice doctor --mac-check`, its Linux half: conversions with each compression, the Core ML
parts skipped with the reason off macOS (or run through the strict Core ML stand-in), the MLX
draft step and the verifier passes, all in one JSON file."""

from __future__ import annotations

import json

import pytest
from support import coreml as strict

from ondevice.apps import cli


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run_check(pair, out, *extra: str) -> dict:
    v, d = pair
    argv = ["doctor", "--mac-check", "--model", str(v), "--draft", str(d), "--out", str(out)]
    assert cli.main([*argv, *extra]) == 0
    return json.loads(out.read_text())


def test_the_linux_half_writes_one_json(pair, home, tmp_path):
    report = run_check(pair, tmp_path / "check.json", "--compressions", "none,int8")
    assert set(report["packages"]) == {"none", "int8"}
    none, int8 = report["packages"]["none"], report["packages"]["int8"]
    assert int8["size_bytes"] < none["size_bytes"] and none["lint_errors"] == []
    assert none["coreml"] == {"starts": False, "reason": report["machine"]["coreml_reason"]}
    assert "macOS" in none["coreml"]["reason"]
    assert set(report["verifier_pass_ms"]) == {"1", "2", "4", "8"}
    assert report["mlx_draft_step_ms"]["1"] > 0
    assert report["machine"]["coremltools"]


def test_the_core_ml_half_through_the_stand_in(pair, home, tmp_path, monkeypatch):
    from collections import Counter

    from ondevice.runtime import coreml_plan

    strict.install(monkeypatch)
    plan = {
        "decode": coreml_plan.FunctionPlan({"NeuralEngine": Counter(conv=4)}, {"NeuralEngine": 1.0})
    }
    monkeypatch.setattr(coreml_plan, "compute_plan", lambda path: plan)
    report = run_check(pair, tmp_path / "check.json", "--compressions", "none")
    coreml = report["packages"]["none"]["coreml"]
    assert coreml["starts"] and coreml["neural_engine_share"] == {"decode": 1.0}
    assert coreml["step_ms"]["1"] > 0 and coreml["load_seconds"] >= 0


def test_an_unknown_compression_is_refused(pair, home, tmp_path, capsys):
    v, d = pair
    argv = ["doctor", "--mac-check", "--model", str(v), "--draft", str(d)]
    assert cli.main([*argv, "--compressions", "zip"]) == 1
    assert "unknown compression 'zip'" in capsys.readouterr().err
