"""Pair bundles at run time: find the verifier, the draft and the tokenizer in a bundle folder.

A bundle (written by `ondevice-convert`) is a directory holding `manifest.json`, `verifier/`,
`draft/draft.mlpackage`, `draft/mlx/` and `tokenizer/`. The manifest records every file's sha256
and size, and for large files the sha256 of a fixed sample of blocks. `open_bundle` checks, by
default, that every file is there with its size, small files by their full sha256 and large ones
by their sample (about 1 MiB read per file): a missing, truncated or swapped file, or damage in a
sampled block, stops the load with the file's name. `verify="full"` (and `ondevice-convert
--check`) hashes every byte. The manifest itself is validated: wrong types raise BundleError
naming the field, and every path in it must stay inside the bundle.

This module only reads; writing lives in `ondevice.convert.bundle` (runtime code must not import
the converter).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

from ondevice.errors import BundleError
from ondevice.sources.files import sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Format versions this reader understands. A newer converter bumps the version when the layout
# changes in a way older readers would misread.
SUPPORTED_FORMAT_VERSIONS = (1,)

_HASH_BLOCK = 1 << 20
# The quick check reads SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes, evenly spread, from a file
# larger than their total; smaller files are hashed whole.
SAMPLE_BLOCK = 64 * 1024
SAMPLE_BLOCKS = 16
Verify = Literal["none", "sample", "full"]


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


def sample_sha256(path: Path, size: int | None = None) -> str:
    """Hex sha256 of SAMPLE_BLOCKS blocks spread evenly over a file (first and last included)."""
    size = path.stat().st_size if size is None else size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(i * max(size - SAMPLE_BLOCK, 0) // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()


def is_sampled(size: int) -> bool:
    """Whether the quick check reads a sample of a file of `size` bytes (else the whole)."""
    return size > SAMPLE_BLOCK * SAMPLE_BLOCKS


def _bad(mf: Path, field: str, expected: str, value: Any) -> BundleError:
    return BundleError(
        f"{mf}: field {field!r} must be {expected}, not {json.dumps(value)[:60]}; the manifest is "
        "corrupted. Re-run `ondevice-convert` (or copy the bundle again)."
    )


def _relpath(mf: Path, field: str, value: Any) -> str:
    """A path inside the bundle: relative, without '..', in POSIX form."""
    if not isinstance(value, str) or not value.strip():
        raise _bad(mf, field, "a relative path (a non-empty string)", value)
    if any(ord(c) < 32 for c in value):  # a NUL cannot even be opened
        raise _bad(mf, field, "a path without control characters", value)
    pure = PurePosixPath(value)
    if pure.is_absolute() or PureWindowsPath(value).drive or ".." in pure.parts or "\\" in value:
        raise BundleError(
            f"{mf}: field {field!r} is {value!r}, a path outside the bundle; a bundle only "
            "refers to its own files. The manifest is corrupted or was tampered with."
        )
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(mf: Path, m: dict[str, Any]) -> None:
    """Types and paths of every field the reader uses, so a bad manifest fails here, by name."""
    if not _is_int(m["context_length"]) or m["context_length"] < 1:
        raise _bad(mf, "context_length", "a positive integer", m["context_length"])
    for section in ("tokenizer", "verifier", "draft"):
        if not isinstance(m[section], dict):
            raise _bad(mf, section, "an object", m[section])
    files = m["files"]
    if not isinstance(files, dict) or not files:
        raise _bad(mf, "files", "a non-empty object of path -> {sha256, size}", files)
    for rel, entry in files.items():
        _relpath(mf, f"files.{rel}", rel)
        if not isinstance(entry, dict):
            raise _bad(mf, f"files.{rel}", "an object with sha256 and size", entry)
        if not _is_int(entry.get("size")) or entry["size"] < 0:
            raise _bad(mf, f"files.{rel}.size", "a byte count", entry.get("size"))
        for key in ("sha256", "sample_sha256"):
            value = entry.get(key)
            if (value is not None or key == "sha256") and not _is_hex64(value):
                raise _bad(mf, f"files.{rel}.{key}", "64 hex digits", value)
    eos = m["tokenizer"].get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(_is_int(i) and i >= 0 for i in eos):
        raise _bad(mf, "tokenizer.eos_token_ids", "a list of token ids", eos)
    functions = m["draft"].get("functions")
    if functions is not None and not isinstance(functions, dict):
        raise _bad(mf, "draft.functions", "an object", functions)
    for section, key in _PATHS:
        if m[section].get(key) is not None:  # absent: the default layout
            _relpath(mf, f"{section}.{key}", m[section][key])


def _is_hex64(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


_PATHS = (("verifier", "path"), ("draft", "mlx"), ("draft", "mlpackage"), ("tokenizer", "path"))


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
    _validate(mf, manifest)
    return manifest


def _inside(root: Path, rel: str) -> Path | None:
    """`root / rel` if it resolves inside `root` (a symlink may point elsewhere), else None."""
    target = (root / rel).resolve()
    return target if target.is_relative_to(root.resolve()) else None


def verify_files(root: str | Path, manifest: dict[str, Any], mode: Verify = "full") -> list[str]:
    """Problems with the bundle's files (missing, wrong size, wrong sha256, outside the bundle,
    a shard index leading elsewhere, a file or link the manifest does not list); empty if
    intact. mode "sample": large files are checked by their sample digest only."""
    root = Path(root)
    problems = _listed_problems(root, manifest, mode)
    problems += _index_problems(root, manifest)
    problems += [
        f"{rel}: not listed in the manifest; a bundle holds only the files it lists (remove "
        "it, or convert the pair again)"
        for rel in unlisted_files(root, manifest)
    ]
    return problems


# Files that macOS' Finder writes into folders it shows; no loader reads them.
_IGNORED = (".DS_Store",)


def unlisted_files(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Files and links under `root` that the manifest does not list (links are not followed):
    loaders read folders whole (every *.safetensors, chat_template.jinja), so nothing may lie
    in a bundle unverified."""
    listed = set(manifest["files"]) | {MANIFEST}
    found = []
    for dirpath, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            full = Path(dirpath, name)
            rel = full.relative_to(root).as_posix()
            if name in _IGNORED or rel in listed:
                continue
            if full.is_symlink() or not full.is_dir():
                found.append(rel)
        dirs[:] = [d for d in dirs if not Path(dirpath, d).is_symlink()]
    return sorted(found)


def _index_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Each listed shard index (`*.safetensors.index.json`) must name listed files beside it."""
    problems = []
    for rel in sorted(manifest["files"]):
        if not rel.endswith(".safetensors.index.json") or _inside(root, rel) is None:
            continue
        try:
            weight_map = json.loads((root / rel).read_text(encoding="utf-8"))["weight_map"]
            shards = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{rel}: not a readable shard index ({type(e).__name__})")
            continue
        folder = PurePosixPath(rel).parent
        for shard in sorted(shards, key=str):
            if (
                not isinstance(shard, str)
                or "/" in shard
                or "\\" in shard
                or shard in ("", ".", "..")
            ):
                problems.append(
                    f"{rel}: names the shard {str(shard)[:80]!r}, which is not a file beside it "
                    "in the bundle; the index was tampered with"
                )
            elif (folder / shard).as_posix() not in manifest["files"]:
                problems.append(
                    f"{rel}: names the shard {shard!r}, which the manifest does not list"
                )
    return problems


def _listed_problems(root: Path, manifest: dict[str, Any], mode: Verify) -> list[str]:
    problems: list[str] = []
    for rel, entry in sorted(manifest["files"].items()):
        f = _inside(root, rel)
        if f is None:
            problems.append(f"{rel}: points outside the bundle (a symlink?); refusing to read it")
            continue
        if not f.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = f.stat().st_size
        if size != entry.get("size"):
            problems.append(f"{rel}: size {size} bytes, manifest says {entry.get('size')}")
            continue
        if mode == "sample" and is_sampled(size):
            want = entry.get("sample_sha256")
            if want is not None and sample_sha256(f, size) != want:
                problems.append(
                    f"{rel}: sampled sha256 differs from the manifest (file is corrupted)"
                )
        elif sha256_file(f) != entry.get("sha256"):
            problems.append(f"{rel}: sha256 differs from the manifest (file is corrupted)")
    return problems


def _subdir(root: Path, manifest: dict[str, Any], section: str, key: str, default: str) -> Path:
    rel = manifest[section].get(key, default)
    d = _inside(root, rel)
    if d is None:
        raise BundleError(
            f"{root / MANIFEST}: {section}.{key} ({rel!r}) leads outside the bundle (a symlink?); "
            "a bundle only refers to its own files."
        )
    if not d.exists():
        raise BundleError(
            f"{d}: missing from the bundle ({section}.{key} in {MANIFEST}); the bundle is "
            "incomplete. Copy it again or re-run `ondevice-convert`."
        )
    return d


def open_bundle(path: str | Path, verify: bool | Verify = "sample") -> Bundle:
    """Open the bundle at `path`, first checking its files: "sample" (the default) checks every
    size, small files' sha256 and large files' sampled digest; "full" (or True) every sha256;
    "none" (or False) nothing."""
    mode: Verify = "full" if verify is True else "none" if verify is False else verify
    if mode not in ("none", "sample", "full"):
        raise ValueError(f"verify={verify!r}: use 'none', 'sample' or 'full'")
    root = Path(path).expanduser().resolve()
    manifest = read_manifest(root)
    if mode != "none":
        problems = verify_files(root, manifest, mode)
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
