"""Install truth on a Mac, checked on Linux (issue 27): commands that need no model work where
MLX cannot be imported, and those that do say why in one line, with the hint for this platform
(an x86_64 Python on Apple Silicon gets no MLX wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

# MLX made impossible to import, and optionally the platform of an x86_64 Python on a Mac
PRELUDE = """
import sys, platform
sys.modules["mlx"] = None
sys.modules["mlx.core"] = None
if {mac!r}:
    platform.system = lambda: "Darwin"
    platform.machine = lambda: "x86_64"
    platform.mac_ver = lambda: ("15.4", ("", "", ""), "x86_64")
    import ondevice.runtime.mlx_check as m
    m.under_rosetta = lambda: True
from ondevice.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(home: Path, *args: str, mac: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "ONDEVICE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", PRELUDE.format(mac=mac), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mac", [False, True], ids=["linux", "x86_64-mac"])
def test_help_and_doctor_work_without_mlx(tmp_path, mac):
    assert run(tmp_path, "--help", mac=mac).returncode == 0
    proc = run(tmp_path, "doctor", "--json", mac=mac)
    assert proc.returncode == 0, proc.stderr
    # (faking macOS on Linux makes huggingface_hub print a line before the report)
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert report["mlx"]["available"] is False
    hint = next(w for w in report["warnings"] if w.startswith("MLX cannot be imported"))
    if mac:
        assert "x86_64 (under Rosetta on Apple Silicon)" in hint and "arm64 Python" in hint
        assert "mlx[cpu]" not in hint
        assert "arm64 Python" in report["coreml"]["reason"]  # not "no build for Python 3.N"
    else:
        assert "pip install 'mlx[cpu]>=0.31.2'" in hint
    text = run(tmp_path, "doctor", mac=mac)
    assert text.returncode == 0 and "mlx         not available" in text.stdout


def test_a_command_that_needs_mlx_says_why_in_one_line(tmp_path):
    proc = run(tmp_path, "generate", "--model", "x", "-p", "hi", mac=True)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: MLX cannot be imported"), proc.stderr
    assert "arm64 Python" in lines[0]


def test_the_api_says_why_when_mlx_is_missing(tmp_path):
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"
        "import ondevice\n"
        "try:\n    ondevice.load\nexcept ondevice.OndeviceError as e:\n    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.startswith("MLX cannot be imported"), out.stderr


def test_coremltools_9_is_required():
    """coremltools 8.3's MLState has no read_state/write_state (9.0 added them): the Neural
    Engine draft's prompt cache needs them."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "coremltools>=9.0" in deps
    readme = (ROOT / "README.md").read_text()
    assert "macOS 14 or newer" in readme and "macOS 15 or\nnewer for the Neural Engine" in readme
