"""Writing pair bundles: a staging directory renamed into place, and the manifest with checksums.

The layout and the reader live in `ondevice.models.bundle`; this module is the writing half.
A bundle is built in a hidden temporary directory next to the destination (same filesystem, so
the final `rename` is atomic) and only appears at its destination once it is complete: a failed
or interrupted conversion leaves nothing behind, and `--force` keeps the old bundle until the new
one is ready.

A conversion killed outright (kill -9, power loss) cannot clean up after itself, so every hidden
directory is named after the process that made it (`.OUT.partial-PID-*`, `.OUT.old-PID-*`) and
the next conversion to OUT finishes the job (`recover`): it deletes the staging directories of
dead processes and, if a `--force` replacement died with OUT moved aside, puts it back. The
replacement itself is one atomic exchange of the two directories where the OS offers it
(renameat2 on Linux, renamex_np on macOS), so OUT always names a complete bundle.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ondevice.errors import BundleError
from ondevice.models.bundle import FORMAT_VERSION, MANIFEST, is_sampled, sample_sha256
from ondevice.sources.files import process_alive, sha256_file


def file_entries(
    root: Path, progress: Callable[[int], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Relative path -> {sha256, size[, sample_sha256]} of every file under `root` except the
    manifest; large files also get the digest of the sample `open_bundle` checks on every load.

    Walks into `.mlpackage` directories too: their weight blobs are what a bad copy damages.
    `progress(n_bytes)` is called after each file (for a byte progress bar).
    """
    entries: dict[str, dict[str, Any]] = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        size = f.stat().st_size
        entries[rel] = {"sha256": sha256_file(f), "size": size}
        if is_sampled(size):
            entries[rel]["sample_sha256"] = sample_sha256(f, size)
        if progress:
            progress(size)
    return entries


def total_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    """Write `manifest.json`, stamping format version and creation time."""
    data = {
        "format_version": FORMAT_VERSION,
        "created_by": f"ondevice-convert {_version()}",
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **manifest,
    }
    path = root / MANIFEST
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ondevice")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _hidden(out: Path, kind: str) -> str:
    """Prefix of this process's hidden directories next to `out` ("partial" or "old")."""
    return f".{out.name}.{kind}-{os.getpid()}-"


def _orphans(out: Path, kind: str) -> list[Path]:
    """Hidden `kind` directories next to `out` whose process is gone (or unknown: older names)."""
    found = []
    for p in sorted(out.parent.glob(f".{out.name}.{kind}-*")):
        pid = p.name[len(f".{out.name}.{kind}-") :].split("-", 1)[0]
        if p.is_dir() and not (pid.isdigit() and process_alive(int(pid))):
            found.append(p)
    return found


def recover(out: Path) -> list[str]:
    """Finish what killed conversions to `out` left: restore a bundle an interrupted --force
    moved aside, delete staging directories. Returns what was done, one line each."""
    out = Path(out).absolute()
    done: list[str] = []
    if not out.parent.is_dir():
        return done
    for old in _orphans(out, "old"):
        if not out.exists():
            os.rename(old, out)
            done.append(f"restored {out} (an interrupted --force had moved it to {old.name})")
        else:
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name}, the bundle an interrupted --force replaced")
    for partial in _orphans(out, "partial"):
        shutil.rmtree(partial, ignore_errors=True)
        done.append(f"removed {partial.name}, left by an interrupted conversion")
    return done


def check_destination(out: Path, force: bool, needed_bytes: int = 0) -> None:
    """Refuse to overwrite an existing path without `force`, a parent that does not exist or
    cannot be written, and a disk with less than `needed_bytes` free."""
    if out.exists() and not force:
        raise BundleError(
            f"{out}: already exists. Choose another output path, or pass --force to replace it "
            "(the old bundle is kept until the new one is complete)."
        )
    if out.exists() and not out.is_dir():
        raise BundleError(
            f"{out}: exists and is not a directory; it cannot be replaced by a bundle."
        )
    if not out.parent.is_dir():
        raise BundleError(f"{out.parent}: no such directory; create it first.")
    try:  # the real test of writability (permissions, read-only mounts, ACLs)
        os.rmdir(tempfile.mkdtemp(prefix=_hidden(out, "probe"), dir=out.parent))
    except OSError as e:
        raise BundleError(
            f"{out.parent}: cannot write there ({e.strerror}); choose an output folder you can "
            "write to."
        ) from None
    free = shutil.disk_usage(out.parent).free
    if needed_bytes > free:
        raise BundleError(
            f"{out.parent}: {free / 1e9:.2f} GB free, and the bundle needs about "
            f"{needed_bytes / 1e9:.2f} GB. Free some space or choose another output folder."
        )


def write_error(e: OSError, out: Path) -> BundleError:
    """The message for an OSError while writing the bundle (the staging directory is gone)."""
    what = f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    hint = {
        errno.ENOSPC: "Free some disk space and convert again.",
        errno.EDQUOT: "Free some space within your disk quota and convert again.",
        errno.EROFS: "The folder is on a read-only disk; choose another output folder.",
        errno.EACCES: "Choose an output folder you can write to.",
    }.get(e.errno or 0, "Fix the cause and convert again.")
    return BundleError(f"writing the bundle {out} failed: {what}. Nothing was written. {hint}")


@contextmanager
def staging_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty directory next to `out`; on success it becomes `out`, on any error (or
    Ctrl-C) it is deleted and `out` is untouched. An OSError (a full disk, a folder that went
    read-only) becomes a BundleError that says so."""
    out = Path(out).absolute()
    recover(out)
    check_destination(out, force)
    tmp = Path(tempfile.mkdtemp(prefix=_hidden(out, "partial"), dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; a bundle is a normal folder
        yield tmp
        _replace(tmp, out, force)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e.filename, str) and e.filename.startswith(str(tmp)):
            e.filename = str(out) + e.filename[len(str(tmp)) :]  # the name the user knows
        raise write_error(e, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step; False where the OS or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
            rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), 0x2)  # RENAME_SWAP
        elif sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
            at_fdcwd, rename_exchange = -100, 2
            rc = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
        else:
            return False
    except OSError:  # no C library to call
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # this filesystem cannot: fall back to two renames
    raise OSError(err, os.strerror(err), str(b))


def _replace(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        os.rename(tmp, out)  # fails (not overwrites) if `out` appeared meanwhile
        return
    check_destination(out, force)  # someone may have created it while we converted
    if _exchange(tmp, out):  # `out` is the new bundle, `tmp` the old one: at every instant
        shutil.rmtree(tmp, ignore_errors=True)  # `out` is complete
        return
    # Two renames: the old bundle moves aside, the new one takes its name; only then is the old
    # one deleted. If the second rename fails the old bundle is put back; if the process dies
    # between them, `recover` puts it back at the next conversion.
    old = out.parent / (_hidden(out, "old") + tmp.name.rsplit("-", 1)[-1])
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
