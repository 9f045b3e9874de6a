"""A daily user's small things (issue 28, item 9): `ondevice list / show / rm` for what the
cache holds, "did you mean" for a mistyped name, and coremltools' progress bars kept out of
`ondevice-convert`'s output unless --verbose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tiny

from ondevice.apps.cli import main
from ondevice.convert import cli as convert_cli
from ondevice.errors import did_you_mean


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cached-pair")
    v = tiny.write_model(root / "v", layers=1)
    return v, tiny.perturbed_copy(v, root / "d", noise=0.1)


def _convert(pair: tuple[Path, Path], out: Path, *extra: str) -> int:
    argv = ["--verifier", str(pair[0]), "--draft", str(pair[1]), "-o", str(out), "--context",
            "64", "--draft-chunk", "8", "--probe-prompts", "0", "--acceptance-tokens", "8"]  # fmt: skip
    return convert_cli.main([*argv, *extra])


@pytest.fixture(scope="module")
def bundle(pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cached-bundle") / "tiny-pair"
    assert _convert(pair, out) == 0
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch, bundle) -> Path:
    """A cache with a pulled GGUF, a hub folder and a converted bundle."""
    home = tmp_path / "home"
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    gguf = home / "models" / "qwen2.5-coder-0.5b-instruct"
    gguf.mkdir(parents=True)
    (gguf / "model.gguf").write_bytes(b"\0" * 2048)
    hub = home / "models" / "owner--tiny"
    hub.mkdir()
    (hub / "config.json").write_text("{}")
    (home / "models" / ".partial-123").mkdir()  # an interrupted pull: not listed
    shutil.copytree(bundle, home / "bundles" / "tiny-pair")
    return home


def test_list_shows_kinds_sizes_and_paths(cache, capsys):
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"qwen2.5-coder-0.5b-instruct", "owner/tiny", "tiny-pair"}
    assert rows["qwen2.5-coder-0.5b-instruct"]["kind"] == "gguf"
    assert rows["qwen2.5-coder-0.5b-instruct"]["size_bytes"] == 2048
    assert rows["owner/tiny"]["kind"] == "folder"
    assert rows["tiny-pair"]["kind"] == "bundle"
    assert rows["tiny-pair"]["path"] == str(cache / "bundles" / "tiny-pair")
    assert main(["ls"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "KIND", "SIZE", "PATH"] and len(table) == 4


def test_show_a_bundle_and_a_catalog_model(cache, capsys):
    assert main(["show", "tiny-pair", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "bundle" and shown["context"] == 64
    assert "manifest.json" in shown["files"]
    assert set(shown["acceptance"]) >= {"code", "chat", "math"}
    assert main(["show", "qwen2.5-coder-0.5b-instruct"]) == 0
    out = capsys.readouterr().out
    assert "Qwen2.5-Coder-0.5B-Instruct" in out and "model.gguf" in out
    assert main(["show", "owner--tiny"]) == 0  # the folder's spelling works too


def test_rm_deletes_and_a_near_miss_suggests_the_name(cache, capsys):
    assert main(["rm", "tiny-pair", "qwen2.5-coder-0.5b-instruct"]) == 0
    out = capsys.readouterr().out
    assert "deleted bundle tiny-pair" in out and "deleted gguf" in out
    assert not (cache / "bundles" / "tiny-pair").exists()
    assert (cache / "models" / "owner--tiny").exists()
    # a near miss deletes nothing and names the close one
    assert main(["rm", "owner/tiny", "owner/tiyn"]) == 1
    assert "Did you mean 'owner/tiny'?" in capsys.readouterr().err
    assert (cache / "models" / "owner--tiny").exists()


def test_did_you_mean_for_model_names(cache, capsys):
    assert did_you_mean("qwen2.5-coder-1.5b-instrct", ["qwen2.5-coder-1.5b-instruct", "x"]) == (
        " Did you mean 'qwen2.5-coder-1.5b-instruct'?"
    )
    assert did_you_mean("zzz", ["qwen2.5-coder-1.5b-instruct"]) == ""
    # a model argument: the catalog's and the cache's names
    assert main(["generate", "--model", "qwen2.5-coder-0.5b-instruc", "--prompt", "x"]) == 1
    assert "Did you mean 'qwen2.5-coder-0.5b-instruct'" in capsys.readouterr().err
    # a pull of a name the catalog does not have
    assert main(["pull", "qwen2.5-coder-7b-instrct"]) == 1
    assert "Did you mean 'qwen2.5-coder-7b-instruct'" in capsys.readouterr().err


def test_convert_hides_coremltools_progress_bars_unless_verbose(pair, tmp_path, capsys):
    assert _convert(pair, tmp_path / "quiet") == 0
    err = capsys.readouterr().err
    assert "Running MIL" not in err and "converting draft to Core ML" in err
    assert _convert(pair, tmp_path / "loud", "--verbose") == 0
    assert "Running MIL" in capsys.readouterr().err


def test_serve_reports_a_busy_port_before_loading_the_model(pair, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(pair[0]), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port" in err
    assert "loading" not in err  # nothing was loaded


def test_the_recorded_acceptance_is_what_a_load_of_the_bundle_measures(bundle):
    """On a CPU the conversion measures the pair's acceptance with the models as
    `ondevice.load` serves the bundle (dequantized, products through the CPU kernel where it
    serves), not with the models as read (MLX's quantized CPU products ran for over 20 minutes
    for the default pair): the record is what later runs' acceptance is judged against."""
    import ondevice
    from ondevice.convert.acceptance import domain_prompts, measure
    from ondevice.runtime import kernel

    gen = ondevice.load(bundle, draft_backend="mlx")
    verifier, draft = gen._pair.verifier, gen._pair.draft
    assert kernel.serves(verifier.model) == kernel.serves(draft.model) == kernel.available()
    recorded = json.loads((bundle / "manifest.json").read_text())["acceptance"]["domains"]
    again = measure(
        verifier.model,
        draft.model,
        domain_prompts(verifier.tokenizer),
        8,
        eos_token_ids=sorted(verifier.tokenizer.eos_token_ids),
    )["domains"]
    assert again == recorded


def test_the_conversion_measures_acceptance_with_served_models(pair, tmp_path, monkeypatch):
    from ondevice.convert import acceptance
    from ondevice.runtime import kernel

    seen = []
    measure = acceptance.measure

    def spy(verifier, draft, *args, **kwargs):
        seen.append((kernel.serves(verifier), kernel.serves(draft)))
        return measure(verifier, draft, *args, **kwargs)

    monkeypatch.setattr(acceptance, "measure", spy)
    assert _convert(pair, tmp_path / "served") == 0
    assert seen == [(kernel.available(), kernel.available())]
