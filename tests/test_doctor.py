"""`ondevice doctor`: sections, JSON, cached models, and the reference-BLAS warning on Linux.

The BLAS checks run the command in a fresh process, with and without OpenBLAS preloaded, since
which library serves MLX is decided when the process starts.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ondevice.apps import doctor

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
linux_only = pytest.mark.skipif(
    platform.system() != "Linux", reason="BLAS preloading is Linux-only"
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A cache with one model of known size and one interrupted pull."""
    home = tmp_path / "home"
    model = home / "models" / "some-model"
    model.mkdir(parents=True)
    (model / "weights.gguf").write_bytes(b"x" * 3000)
    (home / "models" / ".other.abc123").mkdir()
    return home


def run_doctor(home: Path, *args: str, preload: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["ONDEVICE_HOME"] = str(home)
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, "-m", "ondevice", "doctor", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_text_report_has_every_section(home: Path) -> None:
    out = run_doctor(home).stdout
    for section in ("platform", "python", "ondevice", "mlx", "core ml", "coremltools", "blas"):
        assert f"\n  {section} " in out
    assert f"cache       {home}" in out
    assert "some-model" in out and "2.9 KB" in out
    assert ".other.abc123" in out and "interrupted pull" in out


@linux_only
def test_json_warns_about_reference_blas_without_preload(home: Path) -> None:
    report = json.loads(run_doctor(home, "--json").stdout)
    assert report["python"]["version"] == platform.python_version()
    assert report["mlx"]["available"] and report["mlx"]["default_device"] == "cpu"
    assert report["coreml"]["prediction_available"] is False
    assert report["blas"]["kind"] == "reference"
    assert "mlx_cpu" in report["blas"]["library"]
    [model] = report["cache"]["models"]
    assert model["name"] == "some-model" and model["size_bytes"] == 3000
    blas_warnings = [w for w in report["warnings"] if "reference BLAS" in w]
    assert len(blas_warnings) == 1
    if Path(OPENBLAS).exists():
        assert f"LD_PRELOAD={OPENBLAS}" in blas_warnings[0]
    else:
        assert "apt-get install libopenblas0-pthread" in blas_warnings[0]


@linux_only
@pytest.mark.skipif(not Path(OPENBLAS).exists(), reason="libopenblas0-pthread not installed")
def test_json_with_openblas_preloaded_has_no_warning(home: Path) -> None:
    report = json.loads(run_doctor(home, "--json", preload=OPENBLAS).stdout)
    assert report["blas"]["kind"] == "openblas"
    assert "openblas" in report["blas"]["library"]
    assert not [w for w in report["warnings"] if "BLAS" in w]


@linux_only
def test_fix_names_apt_package_when_openblas_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("LD_PRELOAD"):
        pytest.skip("this process already preloads a BLAS")
    monkeypatch.setattr(doctor, "find_openblas", lambda: None)
    warnings: list[str] = []
    info = doctor._blas(warnings)
    assert info["kind"] == "reference"
    assert "sudo apt-get install libopenblas0-pthread" in info["fix"]
    assert "LD_PRELOAD=/usr/lib/" in info["fix"] and len(warnings) == 1


def test_human_sizes() -> None:
    assert doctor.human(512) == "512 B"
    assert doctor.human(3000) == "2.9 KB"
    assert doctor.human(98362432) == "93.8 MB"
