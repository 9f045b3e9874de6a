"""`ondevice doctor`: sections, JSON, cached models, and the reference-BLAS warning on Linux.

The BLAS checks run the command in a fresh process, since which library serves MLX is decided
when the process starts (`ondevice.runtime.blas`, on `import ondevice`).
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


def run_doctor(home: Path, *args: str, blas: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ONDEVICE_BLAS")}
    env["ONDEVICE_HOME"] = str(home)
    if blas:
        env["ONDEVICE_BLAS"] = blas
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
def test_json_warns_about_reference_blas_when_asked_for(home: Path) -> None:
    report = json.loads(run_doctor(home, "--json", blas="reference").stdout)
    assert report["blas"]["kind"] == "reference"
    assert "mlx_cpu" in report["blas"]["library"]
    blas_warnings = [w for w in report["warnings"] if "reference BLAS" in w]
    assert len(blas_warnings) == 1
    assert "unset ONDEVICE_BLAS" in blas_warnings[0]


@linux_only
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the mkl wheel is x86_64 only")
def test_the_install_brings_a_fast_blas_that_serves_mlx(home: Path) -> None:
    """A fresh install on Linux x86_64 multiplies with MKL from the wheel, nothing preloaded."""
    report = json.loads(run_doctor(home, "--json").stdout)
    assert report["blas"]["kind"] == "mkl", report["blas"]
    assert not [w for w in report["warnings"] if "BLAS" in w]


@linux_only
@pytest.mark.skipif(not Path(OPENBLAS).exists(), reason="libopenblas0-pthread not installed")
def test_openblas_on_request(home: Path) -> None:
    report = json.loads(run_doctor(home, "--json", blas="openblas").stdout)
    assert report["blas"]["kind"] == "openblas"
    assert "openblas" in report["blas"]["library"]
    assert report["blas"]["override"] == "openblas"
    assert not [w for w in report["warnings"] if "BLAS" in w]


def test_fix_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONDEVICE_BLAS", raising=False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert "pip install mkl" in doctor.blas_fix()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert "sudo apt-get install libopenblas0-pthread" in doctor.blas_fix()
    monkeypatch.setenv("ONDEVICE_BLAS", "reference")
    assert "unset ONDEVICE_BLAS" in doctor.blas_fix()


def test_human_sizes() -> None:
    assert doctor.human(512) == "512 B"
    assert doctor.human(3000) == "2.9 KB"
    assert doctor.human(98362432) == "93.8 MB"
