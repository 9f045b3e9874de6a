import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    """The suite never writes into the user's own cache (cost profiles, skip sets, probe
    verdicts): unless the caller chose an ONDEVICE_HOME, it gets a fresh one for the run."""
    if "ONDEVICE_HOME" not in os.environ:
        os.environ["ONDEVICE_HOME"] = tempfile.mkdtemp(prefix="ondevice-tests-home-")


@pytest.fixture
def unfetchable_default_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A catalog whose default pair cannot be fetched here (hub only, offline): commands run
    without --model take the default pair, which must fail clearly, never download gigabytes."""
    catalog = {
        "format": 2,
        "default_model": "m",
        "default_pair": "p",
        "models": {"m": {"sources": [{"kind": "hub", "repo": "example/m"}]}},
        "pairs": {"p": {"verifier": "m", "draft_model": "m"}},
    }
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    monkeypatch.setenv("ONDEVICE_CATALOG", str(tmp_path / "catalog.json"))
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return "p"


@pytest.fixture
def draft_as_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernel serves the draft as it serves the verifier (by default it may round an MLX
    draft to int8: runtime/kernel.py, `draft_choice`), for tests that draft with the verifier
    itself and expect every draft accepted."""
    from ondevice.runtime import kernel

    monkeypatch.setenv(kernel.ENV, kernel.choice())


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny verifier and a perturbed copy of it as its draft (test files may define their own)."""
    import tiny

    d = tmp_path_factory.mktemp("pair")
    v = tiny.write_model(d / "v", layers=2, scale=1.5)
    dr = tiny.perturbed_copy(v, d / "d", noise=0.5)
    return v, dr


@pytest.fixture(scope="module")
def gen(pair: tuple[Path, Path]):
    """`ondevice.load` of `pair`, shared by a test module."""
    import ondevice

    return ondevice.load(*pair)
