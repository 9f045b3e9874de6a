"""Pair bundles at run time: find the verifier, the draft and the tokenizer in a bundle folder.

A bundle (written by `ondevice-convert`) is a directory holding `manifest.json`, `verifier/`,
`draft/draft.mlpackage`, `draft/mlx/` and `tokenizer/`. The manifest records every file's sha256
and size, so a damaged download is caught by `open_bundle(path, verify=True)` (or
`ondevice-convert --check`) instead of surfacing later as garbage output.

This module only reads; writing lives in `ondevice.convert.bundle` (runtime code must not import
the converter).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ondevice.errors import BundleError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Format versions this reader understands. A newer converter bumps the version when the layout
# changes in a way older readers would misread.
SUPPORTED_FORMAT_VERSIONS = (1,)

_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class Bundle:
    """Paths inside an opened bundle, plus its parsed manifest."""

    path: Path
    manifest: dict[str, Any]
    verifier_dir: Path
    draft_mlx_dir: Path
    mlpackage: Path | None
    tokenizer_dir: Path

    @property
    def context_length(self) -> int:
        """The draft's fixed context (the Core ML state size), in tokens."""
        return int(self.manifest["context_length"])

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(i) for i in self.manifest["tokenizer"].get("eos_token_ids", [])]

    @property
    def draft_functions(self) -> dict[str, Any]:
        """Function name -> description (e.g. input length) of the Core ML draft."""
        return dict(self.manifest["draft"].get("functions") or {})


def is_bundle(path: str | Path) -> bool:
    """True if `path` is a directory with a manifest.json (a pair bundle, maybe a broken one)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / MANIFEST).is_file()


def sha256_file(path: Path, progress: Callable[[int], object] | None = None) -> str:
    """Hex sha256 of a file, read in blocks; `progress(n)` is told each block's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed manifest of the bundle at `path`, with its format version checked."""
    root = Path(path).expanduser()
    mf = root / MANIFEST
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory; a pair bundle is a folder with {MANIFEST}.")
    if not mf.is_file():
        raise BundleError(
            f"{mf}: missing. {root} is not a pair bundle (or an incomplete copy of one); "
            "create bundles with `ondevice-convert`."
        )
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mf}: not valid JSON ({e}); the bundle is corrupted.") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{mf}: expected a JSON object; the bundle is corrupted.")
    version = manifest.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise BundleError(
            f"{mf}: format_version {version!r} is not supported by this ondevice "
            f"(supported: {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}). "
            "Upgrade ondevice or convert the pair again with this version's `ondevice-convert`."
        )
    for key in ("files", "context_length", "tokenizer", "verifier", "draft"):
        if key not in manifest:
            raise BundleError(f"{mf}: lacks the field {key!r}; the bundle is corrupted.")
    return manifest


def verify_files(root: str | Path, manifest: dict[str, Any]) -> list[str]:
    """Problems with the bundle's files (missing, wrong size, wrong sha256); empty if intact."""
    root = Path(root)
    problems: list[str] = []
    for rel, entry in sorted(manifest["files"].items()):
        f = root / rel
        if not f.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = f.stat().st_size
        if size != entry.get("size"):
            problems.append(f"{rel}: size {size} bytes, manifest says {entry.get('size')}")
            continue
        if sha256_file(f) != entry.get("sha256"):
            problems.append(f"{rel}: sha256 differs from the manifest (file is corrupted)")
    return problems


def _subdir(root: Path, manifest: dict[str, Any], section: str, key: str, default: str) -> Path:
    rel = manifest[section].get(key, default)
    d = root / rel
    if not d.exists():
        raise BundleError(
            f"{d}: missing from the bundle ({section}.{key} in {MANIFEST}); the bundle is "
            "incomplete. Copy it again or re-run `ondevice-convert`."
        )
    return d


def open_bundle(path: str | Path, verify: bool = False) -> Bundle:
    """Open the bundle at `path`; with `verify`, check every file's size and sha256 first."""
    root = Path(path).expanduser().resolve()
    manifest = read_manifest(root)
    if verify:
        problems = verify_files(root, manifest)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise BundleError(
                f"{root}: {problems[0]}{more}. The bundle is damaged; copy it again or re-run "
                "`ondevice-convert` (`ondevice-convert --check` lists every problem)."
            )
    mlpackage = manifest["draft"].get("mlpackage")
    return Bundle(
        path=root,
        manifest=manifest,
        verifier_dir=_subdir(root, manifest, "verifier", "path", "verifier"),
        draft_mlx_dir=_subdir(root, manifest, "draft", "mlx", "draft/mlx"),
        mlpackage=_subdir(root, manifest, "draft", "mlpackage", "") if mlpackage else None,
        tokenizer_dir=_subdir(root, manifest, "tokenizer", "path", "tokenizer"),
    )
