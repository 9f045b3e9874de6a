"""Writing a pulled model into the cache safely: everything goes into a hidden staging folder
next to the target, is hashed as it is written, fsynced, and renamed into place in one step, so
an interrupted or failed pull leaves nothing that `resolve()` could mistake for a model. Also the
errors of a pull, clear messages for a full or read-only disk, and the progress a pull shows.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ondevice.errors import ModelFormatError, OndeviceError
from ondevice.sources.catalog import ModelEntry
from ondevice.sources.sizes import human_size

CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
SPACE_MARGIN = 64 << 20  # free space kept beyond the model's size before a download starts
Progress = Callable[[int], None]


class ChecksumError(OndeviceError):
    """A fetched file (or one part of it) does not have the size or sha256 the catalog promises."""


class PullError(OndeviceError):
    """No source could provide the model, or the cache cannot be written."""


STAGING_KINDS = ("partial", "old", "damaged")


def staging_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-"


class Say:
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


def shorten(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Staging:
    """A hidden folder next to `target`; on success it replaces `target` in one rename, on any
    failure it is deleted and the cache is as it was. Hidden names never resolve as models."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self) -> Path:
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            prefix = staging_prefix(self.target, "partial")
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            os.chmod(self.path, 0o755)  # mkdtemp's 0700 would make the cached model private
        except OSError as e:
            raise disk_error(e, parent) or e from None
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(exc, OSError) and (err := disk_error(exc, self.target.parent)):
                raise err from None
            return
        old = None
        try:
            if self.target.exists():  # --force: move the old copy aside, swap, then delete it
                prefix = staging_prefix(self.target, "old")
                old = Path(tempfile.mkdtemp(prefix=prefix, dir=self.target.parent))
                os.replace(self.target, old / "model")
            os.replace(self.path, self.target)
        except OSError as e:
            if old is not None and (old / "model").exists() and not self.target.exists():
                os.replace(old / "model", self.target)  # put the previous copy back
            shutil.rmtree(self.path, ignore_errors=True)
            raise disk_error(e, self.target.parent) or e from None
        _fsync_dir(self.target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def disk_error(e: OSError, where: Path) -> PullError | None:
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
        return human_size(shutil.disk_usage(_existing(where)).free)
    except OSError:
        return "unknown"


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_space(where: Path, size: int) -> None:
    """Refuse a download the disk cannot hold before fetching anything."""
    try:
        free = shutil.disk_usage(_existing(where)).free
    except OSError:
        return  # unknown: the write itself will tell
    if free < size + SPACE_MARGIN:
        raise PullError(
            f"not enough space on the disk holding {where}: the model needs {human_size(size)}, "
            f"{human_size(free)} are free. Free some space, or set ONDEVICE_HOME to a folder on a "
            "disk with more room, and pull again."
        )


def _write_chunk(out: BinaryIO, chunk: bytes) -> None:
    out.write(chunk)


class Writer:
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
            raise disk_error(e, path.parent.parent) or e from None

    def copy(self, src: BinaryIO, origin: str, progress: Progress | None = None) -> tuple[int, str]:
        """Append `src`; returns its size and sha256."""
        h, n = hashlib.sha256(), 0
        for chunk in _chunks(src):
            self._check_head(chunk, origin)
            try:
                _write_chunk(self.out, chunk)
            except OSError as e:
                raise disk_error(e, self.path.parent.parent) or e from None
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
            raise disk_error(e, self.path.parent.parent) or e from None
        return self.size, self.hash.hexdigest()

    def close(self) -> None:
        try:
            self.out.close()
        except OSError:
            pass  # a failed flush was reported by finish(); the staging folder is removed


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def install_file(
    src: BinaryIO,
    size: int,
    filename: str,
    entry: ModelEntry,
    target: Path,
    say: Say,
    origin: str,
) -> None:
    """Copy `src` to target/filename through the staging folder, hashing as it goes."""
    check_space(target.parent, size)
    with Staging(target) as stage:
        out = Writer(stage / filename)
        try:
            with say.bar(size, filename) as bar:
                out.copy(src, origin, advance(bar, 0))
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


def advance(bar, base: int, cap: int | None = None) -> Progress:
    """A progress callback moving `bar` to base + done (never backwards, at most base + cap)."""

    def update(done: int) -> None:
        pos = base + (min(done, cap) if cap is not None else done)
        if pos > bar.n:
            bar.update(pos - bar.n)

    return update


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
