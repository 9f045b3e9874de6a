"""Writing pair bundles: a staging directory renamed into place, and the manifest with checksums.

The layout and the reader live in `ondevice.models.bundle`; this module is the writing half.
A bundle is built in a hidden temporary directory next to the destination (same filesystem, so
the final `rename` is atomic) and only appears at its destination once it is complete: a failed
or interrupted conversion leaves nothing behind, and `--force` keeps the old bundle until the new
one is ready.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ondevice.errors import BundleError
from ondevice.models.bundle import (
    FORMAT_VERSION,
    MANIFEST,
    is_sampled,
    sample_sha256,
    sha256_file,
)


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


def check_destination(out: Path, force: bool) -> None:
    """Refuse to overwrite an existing path without `force`, and a parent that does not exist."""
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


@contextmanager
def staging_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty directory next to `out`; on success it becomes `out`, on any error (or
    Ctrl-C) it is deleted and `out` is untouched."""
    out = Path(out).absolute()
    check_destination(out, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; a bundle is a normal folder
        yield tmp
        _replace(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _replace(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        os.rename(tmp, out)  # fails (not overwrites) if `out` appeared meanwhile
        return
    check_destination(out, force)  # someone may have created it while we converted
    # Two renames: the old bundle moves aside, the new one takes its name; only then is the old
    # one deleted. If the second rename fails the old bundle is put back.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
