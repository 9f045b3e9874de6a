"""Pair bundles: `ondevice-convert` end to end on a tiny pair, `--check`, the run-time reader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tiny import perturbed_copy, write_model

from ondevice.convert import cli
from ondevice.errors import BundleError
from ondevice.models.bundle import FORMAT_VERSION, is_bundle, open_bundle, read_manifest
from ondevice.sources.files import sha256_file

CONTEXT, CHUNK = 64, 8


def _convert(verifier: Path, draft: Path, out: Path, *extra: str) -> int:
    return cli.main(
        [
            "--verifier", str(verifier), "--draft", str(draft), "-o", str(out),
            "--context", str(CONTEXT), "--draft-chunk", str(CHUNK), *extra,
        ]
    )  # fmt: skip


def _leftovers(parent: Path, name: str) -> list[Path]:
    """Anything the converter may have left: OUT itself or its staging directories."""
    return [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    verifier = write_model(root / "verifier", seed=0)
    draft = perturbed_copy(verifier, root / "draft", noise=0.1)
    return verifier, draft


@pytest.fixture(scope="module")
def bundle_dir(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "tiny.bundle"
    assert _convert(*pair, out) == 0
    return out


# -- a good conversion ---------------------------------------------------------------------------


def test_each_model_as_loaded_is_freed_once_written(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier as loaded is gone once written (the draft's conversion needs memory), the
    draft once converted (the acceptance phase loads both from the bundle as they will be
    served): the default pair's conversion peaked at 12.5 GiB holding every copy."""
    import gc
    import weakref

    loaded: list[weakref.ref] = []
    load_pair, served = cli._load_pair, cli._served_as_loaded

    def tracked_load(*args):  # noqa: ANN002, ANN202
        models = load_pair(*args)
        loaded.extend(weakref.ref(m.model) for m in models)
        return models

    alive: list[list[bool]] = []  # (verifier, draft) as loaded, at each phase below

    def when(phase):  # noqa: ANN001, ANN202
        def tracked(*args):  # noqa: ANN002, ANN202
            gc.collect()
            alive.append([r() is not None for r in loaded])
            return phase(*args)

        return tracked

    monkeypatch.setattr(cli, "_load_pair", tracked_load)
    monkeypatch.setattr(cli, "_convert_draft", when(cli._convert_draft))
    monkeypatch.setattr(cli, "_served_as_loaded", when(served))
    assert _convert(*pair, tmp_path / "b") == 0
    # the draft's conversion holds the draft only, the acceptance phase neither
    assert alive == [[False, True], [False, False]]
    assert read_manifest(tmp_path / "b")["acceptance"]["domains"]


def test_layout_and_manifest(bundle_dir: Path, pair: tuple[Path, Path]) -> None:
    for rel in ("manifest.json", "verifier/config.json", "verifier/model.safetensors",
                "verifier/tokenizer.json", "draft/mlx/model.safetensors",
                "draft/mlx/tokenizer.json", "tokenizer/tokenizer.json"):  # fmt: skip
        assert (bundle_dir / rel).is_file(), rel
    assert (bundle_dir / "draft" / "draft.mlpackage" / "Manifest.json").is_file()
    assert _leftovers(bundle_dir.parent, bundle_dir.name) == [bundle_dir]

    m = json.loads((bundle_dir / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION
    assert m["created_by"].startswith("ondevice-convert")
    assert m["context_length"] == CONTEXT
    assert m["verifier"]["source"] == str(pair[0]) and m["draft"]["source"] == str(pair[1])
    assert m["verifier"]["config"]["hidden_size"] == 64
    assert m["draft"]["coreml"] and m["draft"]["functions"]

    from ondevice.models import load_model

    tok = load_model(pair[0]).tokenizer
    assert m["tokenizer"]["fingerprint"] == tok.fingerprint()

    on_disk = sorted(
        p.relative_to(bundle_dir).as_posix()
        for p in bundle_dir.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    assert sorted(m["files"]) == on_disk  # every file, the .mlpackage's insides included
    assert any(f.startswith("draft/draft.mlpackage/") and "weight" in f for f in m["files"])
    for rel, entry in m["files"].items():
        assert entry["sha256"] == sha256_file(bundle_dir / rel), rel
        assert entry["size"] == (bundle_dir / rel).stat().st_size, rel


def test_open_bundle(bundle_dir: Path) -> None:
    assert is_bundle(bundle_dir) and not is_bundle(bundle_dir / "verifier")
    b = open_bundle(bundle_dir, verify=True)
    assert b.verifier_dir == bundle_dir.resolve() / "verifier"
    assert b.draft_mlx_dir == bundle_dir.resolve() / "draft" / "mlx"
    assert b.mlpackage == bundle_dir.resolve() / "draft" / "draft.mlpackage"
    assert b.tokenizer_dir == bundle_dir.resolve() / "tokenizer"
    assert b.context_length == CONTEXT and b.eos_token_ids == [2]
    assert b.manifest["format_version"] == FORMAT_VERSION

    from ondevice.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(b.tokenizer_dir, eos_token_ids=b.eos_token_ids)
    assert tok.fingerprint() == b.manifest["tokenizer"]["fingerprint"]


def test_mlx_lm_reads_both_models(bundle_dir: Path, pair: tuple[Path, Path]) -> None:
    import mlx.core as mx
    import mlx_lm

    from ondevice.models import load_model

    tokens = mx.array([[3, 10, 20, 30, 40]])
    for sub, src in (("verifier", pair[0]), ("draft/mlx", pair[1])):
        model, tok = mlx_lm.load(str(bundle_dir / sub))
        assert tok.encode("hello there") == load_model(src).tokenizer.encode("hello there")
        ours = load_model(src).model(tokens, None)
        theirs = model(tokens)
        np.testing.assert_allclose(np.array(theirs), np.array(ours), atol=1e-4, rtol=1e-4)


def test_mlpackage_runs_in_reference_executor(bundle_dir: Path) -> None:
    """The saved draft, run by the numpy executor through the functions the manifest lists,
    predicts like the bundle's MLX draft copy."""
    _predicts_like_the_mlx_draft(bundle_dir)


def test_a_draft_with_layers_left_out(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """`--draft-drop-layers`: the bundle's draft (MLX and Core ML alike) is the draft without
    those layers, renumbered, and the manifest says which; a bad list is refused up front."""
    import mlx.core as mx

    from ondevice.models import load_model
    from ondevice.proposers.layer_skip import LayerSkipView

    out = tmp_path / "pruned.bundle"
    assert _convert(*pair, out, "--draft-drop-layers", "1", "--acceptance-tokens", "0") == 0
    b = open_bundle(out)
    draft = b.manifest["draft"]
    full = load_model(pair[1]).model
    n = full.config.num_hidden_layers
    assert draft["dropped_layers"] == [1] and draft["config"]["num_hidden_layers"] == n - 1
    tokens = mx.array([[3, 10, 20, 30, 40, 7]])
    want = LayerSkipView(full, [i for i in range(n) if i != 1])(tokens, None)
    got = load_model(b.draft_mlx_dir).model(tokens, None)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    assert not np.allclose(np.array(got), np.array(full(tokens, None)), atol=1e-2)
    _predicts_like_the_mlx_draft(out)
    for bad in ("7,1", "x", ",".join(map(str, range(n)))):
        assert _convert(*pair, tmp_path / "b", "--draft-drop-layers", bad) == 1
        assert _leftovers(tmp_path, "b") == []


def _predicts_like_the_mlx_draft(bundle_dir: Path) -> None:
    import mlx.core as mx

    from ondevice.models import load_model
    from ondevice.runtime.mil.interpreter import ReferenceModel

    b = open_bundle(bundle_dir)
    desc = b.manifest["draft"]["coreml"]
    assert set(b.draft_functions) == {"decode", "chunk"}
    assert b.draft_functions["chunk"]["tokens"] == CHUNK
    fns = ReferenceModel.load_functions(b.mlpackage, list(b.draft_functions))
    tokens = [3, 10, 20, 30, 40, 7, 50, 60, 70, 80, 11]
    want = np.array(load_model(b.draft_mlx_dir).model(mx.array([tokens]), None)[0], np.float32)

    def logits(out: dict) -> np.ndarray:
        return np.concatenate([out[n] for n in desc["logits"]], axis=-1)[0].astype(np.float32)

    # one chunk call (CHUNK tokens), then the rest through 1-token decode calls, one shared state
    state = fns["decode"].make_state()
    got = [logits(fns["chunk"].predict(
        {"input_ids": np.array([tokens[:CHUNK]], np.int32), "position": np.array([0], np.int32)},
        state=state,
    ))]  # fmt: skip
    for pos in range(CHUNK, len(tokens)):
        inputs = {"input_ids": np.array([[tokens[pos]]], np.int32), "position": np.array([pos])}
        got.append(logits(fns["decode"].predict(inputs, state=state)))
    got_all = np.concatenate(got)
    assert got_all.shape == want.shape
    np.testing.assert_array_equal(got_all.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got_all, want, atol=0.05 * np.abs(want).max())


def test_check_passes_then_fails_on_a_flipped_byte(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b"
    assert _convert(*pair, out) == 0
    capsys.readouterr()
    assert cli.main(["--check", str(out)]) == 0
    report = capsys.readouterr().out
    assert "OK" in report and "function" in report

    weights = out / "verifier" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cli.main(["--check", str(out)]) != 0
    assert "verifier/model.safetensors" in capsys.readouterr().out
    with pytest.raises(BundleError, match="model.safetensors"):
        open_bundle(out, verify=True)


def test_check_fails_on_a_missing_file_and_on_lint_errors(
    bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import shutil

    from ondevice.convert import lint

    out = tmp_path / "copy"
    shutil.copytree(bundle_dir, out)
    real = lint.check_mlpackage
    monkeypatch.setattr(
        lint,
        "check_mlpackage",
        lambda p: [
            *real(p),
            lint.Finding(
                severity="error",
                function="decode",
                op="conv",
                tensor=None,
                message="float32 weights",
            ),
        ],
    )
    assert cli.main(["--check", str(out)]) == 1
    assert "ERROR [decode conv] float32 weights" in capsys.readouterr().out
    monkeypatch.undo()

    (out / "tokenizer" / "tokenizer_config.json").unlink()
    assert cli.main(["--check", str(out)]) == 1
    assert "tokenizer/tokenizer_config.json: missing" in capsys.readouterr().out


def test_check_fails_on_a_corrupted_mlpackage_weight(
    bundle_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(bundle_dir, out)
    blob = next(p for p in (out / "draft" / "draft.mlpackage").rglob("*.bin"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))
    assert cli.main(["--check", str(out)]) == 1
    assert "sha256" in capsys.readouterr().out


def test_force_replaces_only_when_complete(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "b"
    out.mkdir()
    (out / "old.txt").write_text("previous bundle")
    assert _convert(*pair, out) == 1  # refused without --force
    assert (out / "old.txt").exists()

    from ondevice.convert import coreml

    def boom(*a: object, **k: object) -> dict:
        raise RuntimeError("converter crashed")

    monkeypatch.setattr(coreml, "convert_draft", boom)
    with pytest.raises(RuntimeError):
        _convert(*pair, out, "--force")
    assert (out / "old.txt").exists()  # old bundle untouched by the failed run
    assert _leftovers(tmp_path, "b") == [out]
    monkeypatch.undo()

    assert _convert(*pair, out, "--force") == 0
    assert not (out / "old.txt").exists() and is_bundle(out)
    assert _leftovers(tmp_path, "b") == [out]


def test_quantized_draft_weights_are_expanded(pair: tuple[Path, Path]) -> None:
    """A quantized draft (as from GGUF) reaches Core ML as the float weights it computes with."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ondevice.models import load_model
    from ondevice.models.config import ModelConfig
    from ondevice.models.weights import build_model

    q = load_model(pair[1], quantize=4)
    weights = cli.draft_numpy_weights(q.model)
    plain = load_model(pair[1])
    assert set(weights) == set(dict(tree_flatten(plain.model.parameters())))
    assert all(w.dtype == np.float32 for w in weights.values())
    cfg = ModelConfig.from_file(pair[1] / "config.json")
    rebuilt = build_model(cfg, {k: mx.array(v) for k, v in weights.items()})
    tokens = mx.array([[3, 10, 20, 30]])
    np.testing.assert_allclose(
        np.array(rebuilt(tokens, None)), np.array(q.model(tokens, None)), atol=2e-4, rtol=1e-4
    )


# -- failures leave nothing behind ---------------------------------------------------------------


@pytest.mark.parametrize("exc", [RuntimeError("converter crashed"), KeyboardInterrupt()])
def test_failure_mid_conversion_leaves_nothing(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    from ondevice.convert import coreml

    reached = []

    def crash(config, weights, out: Path, **kwargs) -> dict:  # noqa: ANN001
        out.mkdir(parents=True)
        (out / "partial").write_bytes(b"x" * 100)
        reached.append(out)
        raise exc

    monkeypatch.setattr(coreml, "convert_draft", crash)
    out = tmp_path / "b"
    if isinstance(exc, KeyboardInterrupt):
        assert _convert(*pair, out) == 130
    else:
        with pytest.raises(RuntimeError, match="converter crashed"):
            _convert(*pair, out)
    assert reached and not reached[0].exists()  # the staging directory was really written...
    assert _leftovers(tmp_path, "b") == []  # ...and removed


def test_unsupported_architecture(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = write_model(tmp_path / "odd", seed=2)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (odd / "config.json").write_text(json.dumps(cfg))
    assert _convert(pair[0], odd, tmp_path / "b") == 1
    err = capsys.readouterr().err
    assert "gpt_neox" in err and "not supported" in err
    assert _leftovers(tmp_path, "b") == []


def test_mismatched_tokenizers(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_model(tmp_path / "other", seed=3)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (10, 11)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(tj))
    assert _convert(pair[0], other, tmp_path / "b") == 1
    err = capsys.readouterr().err
    assert "token id 10" in err
    assert _leftovers(tmp_path, "b") == []


def test_existing_out_is_refused(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b"
    out.mkdir()
    assert _convert(*pair, out) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err
    assert list(out.iterdir()) == [] and _leftovers(tmp_path, "b") == [out]


def test_missing_input_path(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _convert(tmp_path / "nowhere", pair[1], tmp_path / "b") == 1
    assert "nowhere" in capsys.readouterr().err
    assert _leftovers(tmp_path, "b") == []


def test_bad_options(pair: tuple[Path, Path], tmp_path: Path) -> None:
    assert _convert(*pair, tmp_path / "b", "--draft-chunk", "100") == 1  # chunk > context
    with pytest.raises(SystemExit):
        cli.main(["--verifier", str(pair[0]), "-o", str(tmp_path / "b")])  # no --draft
    assert _leftovers(tmp_path, "b") == []


# -- the run-time reader on broken bundles ------------------------------------------------------


def test_open_bundle_errors(bundle_dir: Path, tmp_path: Path) -> None:
    import shutil

    with pytest.raises(BundleError, match="manifest.json"):
        open_bundle(tmp_path)
    b = tmp_path / "b"
    shutil.copytree(bundle_dir, b)
    m = json.loads((b / "manifest.json").read_text())

    (b / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(BundleError, match="format_version 99"):
        open_bundle(b)
    with pytest.raises(BundleError, match="format_version 99"):
        read_manifest(b)
    assert cli.main(["--check", str(b)]) == 1

    (b / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        open_bundle(b)

    (b / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(b / "draft" / "mlx")
    with pytest.raises(BundleError, match="draft/mlx"):
        open_bundle(b)
    with pytest.raises(BundleError, match="missing"):
        open_bundle(b, verify=True)


# -- issue 16: corrupt bundles are not used, the manifest is not trusted -------------------------


def _copy(bundle_dir: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(bundle_dir, dest)
    return dest


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(root: Path, edit) -> None:  # noqa: ANN001
    m = json.loads((root / "manifest.json").read_text())
    edit(m)
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("flip", "verifier/model.safetensors"),
        ("checksum", "tokenizer/tokenizer.json"),
        ("delete", "tokenizer/tokenizer.json"),
        ("truncate", "draft/mlx/model.safetensors"),
    ],
)
def test_load_refuses_a_damaged_bundle(
    bundle_dir: Path, tmp_path: Path, damage: str, named: str
) -> None:
    """`ondevice.load` checks a bundle before using it (it loaded and generated from each of
    these before), and names the damaged file."""
    import ondevice

    b = _copy(bundle_dir, tmp_path / "b")
    f = b / named
    if damage == "flip":
        _flip_byte(f, f.stat().st_size // 2)
    elif damage == "checksum":
        _edit_manifest(b, lambda m: m["files"][named].update(sha256="0" * 64))
    elif damage == "delete":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(BundleError, match=named):
        ondevice.load(b)
    assert cli.main(["--check", str(b)]) == 1


def test_the_quick_check_samples_large_files(tmp_path: Path) -> None:
    """A large file is checked by a sample of its blocks on every load (first and last block
    included); `verify="full"` and `--check` read every byte."""
    from ondevice.convert.bundle import file_entries, write_manifest
    from ondevice.models.bundle import SAMPLE_BLOCK

    root = tmp_path / "b"
    for d in ("verifier", "draft/mlx", "tokenizer"):
        (root / d).mkdir(parents=True)
    big = root / "verifier" / "model.safetensors"
    big.write_bytes(np.random.default_rng(0).bytes(3 * 1024 * 1024))
    files = file_entries(root)
    assert "sample_sha256" in files["verifier/model.safetensors"]
    write_manifest(root, {"context_length": 8, "tokenizer": {}, "verifier": {}, "draft": {},
                          "files": files})  # fmt: skip
    open_bundle(root)
    for offset, sampled in ((0, True), (big.stat().st_size - 1, True), (SAMPLE_BLOCK + 10, False)):
        _flip_byte(big, offset)
        if sampled:
            with pytest.raises(BundleError, match="model.safetensors: sampled sha256"):
                open_bundle(root)
        else:
            open_bundle(root)  # between samples: only the full check sees it
        with pytest.raises(BundleError, match="model.safetensors: sha256"):
            open_bundle(root, verify="full")
        _flip_byte(big, offset)  # repaired
    open_bundle(root, verify="full")


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m.update(context_length="abc"), "context_length"),
        (lambda m: m.update(context_length=True), "context_length"),
        (lambda m: m.update(files=[1, 2]), "files"),
        (lambda m: m.update(draft=None), "draft"),
        (lambda m: m.update(tokenizer="t"), "tokenizer"),
        (lambda m: m["tokenizer"].update(eos_token_ids="2"), "tokenizer.eos_token_ids"),
        (lambda m: m["draft"].update(functions=[1]), "draft.functions"),
        (lambda m: m["files"].update({"x": {"size": "1", "sha256": "0" * 64}}), "files.x.size"),
        (lambda m: m["files"].update({"x": {"size": 1, "sha256": 5}}), "files.x.sha256"),
        (lambda m: m["files"].update({"x": 3}), "files.x"),
        (lambda m: m["files"].update({"../../../../etc/passwd": {"size": 1, "sha256": "0" * 64}}),
         "files.../../../../etc/passwd"),
        (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "sha256": "0" * 64}}), "files./etc/passwd"),
        (lambda m: m["verifier"].update(path="/etc"), "verifier.path"),
        (lambda m: m["draft"].update(mlx="draft/../../.."), "draft.mlx"),
        (lambda m: m["tokenizer"].update(path=7), "tokenizer.path"),
    ],
)  # fmt: skip
def test_a_bad_manifest_is_refused_by_field(
    bundle_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit,
    field: str,  # noqa: ANN001
) -> None:
    b = _copy(bundle_dir, tmp_path / "b")
    _edit_manifest(b, edit)
    for verify in (False, True):
        with pytest.raises(BundleError, match=f"'{re.escape(field)}'"):
            open_bundle(b, verify=verify)
    capsys.readouterr()
    assert cli.main(["--check", str(b)]) == 1  # one line, no traceback, nothing hashed outside
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and "Traceback" not in err


def test_a_symlink_out_of_the_bundle_is_refused(bundle_dir: Path, tmp_path: Path) -> None:
    import shutil

    b = _copy(bundle_dir, tmp_path / "b")
    outside = tmp_path / "elsewhere"
    shutil.move(b / "tokenizer", outside)
    (b / "tokenizer").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BundleError, match="outside the bundle"):
        open_bundle(b)
    with pytest.raises(BundleError, match="outside the bundle"):
        open_bundle(b, verify=False)


# -- issue 29: nothing in a bundle that the manifest does not vouch for ---------------------------


def _list_file(root: Path, rel: str) -> None:
    """Add `rel` to the manifest with its true sha256 and size (a tamperer can do as much)."""
    f = root / rel
    entry = {"sha256": sha256_file(f), "size": f.stat().st_size}
    _edit_manifest(root, lambda m: m["files"].update({rel: entry}))


def _index(root: Path, shard: str) -> str:
    rel = "verifier/model.safetensors.index.json"
    weights = root / "verifier" / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(weights), "np") as f:
        names = list(f.keys())
    (root / rel).write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    _list_file(root, rel)
    return rel


def _tamper(b: Path, case: str, outside: Path) -> str:
    """Tamper with bundle `b` as `case` says; returns the file the refusal must name."""
    import shutil

    outside.mkdir()
    shutil.copy(b / "verifier" / "model.safetensors", outside / "model.safetensors")
    if case == "extra_weights":
        shutil.copy(b / "draft" / "mlx" / "model.safetensors", b / "verifier" / "x.safetensors")
        return "verifier/x.safetensors"
    if case == "index_parent":
        return _index(b, "../../" + outside.name + "/model.safetensors")
    if case == "index_absolute":
        return _index(b, str(outside / "model.safetensors"))
    if case == "unlisted_symlink":
        (b / "verifier" / "y.safetensors").symlink_to(outside / "model.safetensors")
        return "verifier/y.safetensors"
    if case == "unlisted_template":
        (b / "tokenizer" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        (b / "verifier" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        return "chat_template.jinja"
    if case == "no_files":
        _edit_manifest(b, lambda m: m.update(files={}))
        return "'files'"
    if case == "nul_name":
        entry = {"sha256": "0" * 64, "size": 1}
        _edit_manifest(b, lambda m: m["files"].update({"verifier/a\u0000b": entry}))
        return "files.verifier/a"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["extra_weights", "index_parent", "index_absolute", "unlisted_symlink", "unlisted_template",
     "no_files", "nul_name"],
)  # fmt: skip
def test_load_and_check_refuse_what_the_manifest_does_not_list(
    bundle_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """Each of these loaded (and changed the answers) before issue 29, and `--check` exited 0."""
    import ondevice

    b = _copy(bundle_dir, tmp_path / "b")
    named = _tamper(b, case, tmp_path / "elsewhere")
    with pytest.raises(BundleError, match=re.escape(named)):
        ondevice.load(b)
    capsys.readouterr()
    assert cli.main(["--check", str(b)]) == 1
    out = capsys.readouterr()
    assert named.strip("'") in out.out + out.err and "Traceback" not in out.err


def test_the_catalog_pair_is_converted_without_its_dropped_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ensure_bundle`: a pair's `draft_drop_layers` reach the converter, and a bundle made
    without them (or with others) is never the one reused."""
    import dataclasses
    import subprocess

    from ondevice.convert import pair as pairs
    from ondevice.sources import catalog, pull

    cat = catalog.load_catalog()
    shipped = cat.pair()
    calls: list[list[str]] = []

    def convert(cmd: list[str]) -> int:
        calls.append(cmd)
        out = Path(cmd[cmd.index("-o") + 1])
        out.mkdir(parents=True)
        (out / "manifest.json").write_text("{}")
        return 0

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    monkeypatch.setattr(pull, "pull", lambda name: tmp_path / name)
    monkeypatch.setattr(subprocess, "call", convert)
    names = []
    for drop in ((), (3, 17), (3, 17)):
        cat.pairs[shipped.name] = dataclasses.replace(shipped, draft_drop_layers=drop)
        monkeypatch.setattr(catalog, "load_catalog", lambda: cat)
        names.append(Path(pairs.ensure_bundle()).name)
    assert names[0] != names[1] == names[2]  # the second (3, 17) reuses the first's bundle
    assert len(calls) == 2 and "--draft-drop-layers" not in calls[0]
    assert calls[1][calls[1].index("--draft-drop-layers") + 1] == "3,17"
