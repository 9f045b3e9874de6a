"""Resolve a model name to files on disk: a local folder, a GGUF file, a pair bundle, a cached
model, or (only when nothing local matches) a Hugging Face hub id."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ondevice.errors import ModelFormatError, ModelNotFoundError, OndeviceError, did_you_mean

if TYPE_CHECKING:
    from ondevice.sources.catalog import ModelEntry, Pair

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]


def cache_dir() -> Path:
    """Where ondevice keeps models and bundles: $ONDEVICE_HOME or the platform cache folder."""
    env = os.environ.get("ONDEVICE_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ondevice", appauthor=False))


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def resolve(name: str | os.PathLike) -> Path:
    """A local path for `name`: the path itself, a cached model of that name, or a hub download."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    s = str(name)
    cached = cache_dir() / "models" / s.replace("/", "--")
    if cached.exists():
        return _checked_size(s, _single_gguf(cached))
    if _catalog_entry(s) is not None:
        raise ModelNotFoundError(
            f"{s!r} is not downloaded yet (looked in {cached}). Fetch it with: ondevice pull {s}"
        )
    if (pair := catalog_pair(s)) is not None:
        draft = pair.draft_model or "the shipped draft"
        raise ModelNotFoundError(
            f"{s!r} names a pair ({pair.verifier} drafted by {draft}), not one model: "
            f"ondevice.load({s!r}) loads the pair (pulled and converted once, as `ondevice "
            f"demo --pair {s}` does); here, name one of its models."
        )
    if not looks_like_hub_id(s):
        raise ModelNotFoundError(
            f"{s!r}: no such file or folder, and not a Hugging Face hub id (owner/name)."
            f"{did_you_mean(s, known_names())} Pass a local model folder, a .gguf file or a "
            "bundle, or fetch one with `ondevice pull`."
        )
    try:
        return _download(s)
    except ModelNotFoundError as e:
        hint = did_you_mean(s, known_names())
        raise ModelNotFoundError(f"{e}{hint}" if hint else str(e)) from None


def known_names() -> list[str]:
    """Names a model argument may take besides paths: the catalog's models and pairs, and the
    models pulled into the cache (for "did you mean" hints)."""
    from ondevice.sources.catalog import load_catalog

    names: set[str] = set()
    try:
        cat = load_catalog()
        names.update(cat.models, cat.pairs)
    except OndeviceError:
        pass  # a broken catalog must not hide the ordinary "not found" message
    models = cache_dir() / "models"
    if models.is_dir():
        names.update(p.name.replace("--", "/") for p in models.iterdir() if p.name[0] != ".")
    return sorted(names)


def _catalog_entry(name: str) -> ModelEntry | None:
    """The catalog's entry for `name` (a model `ondevice pull` can fetch), if any."""
    from ondevice.sources.catalog import load_catalog

    try:
        return load_catalog().model(name)
    except OndeviceError:
        return None  # a broken catalog must not hide the ordinary "not found" message


def catalog_pair(name: str) -> Pair | None:
    """The catalog's pair of that name (a draft and its verifier, loaded as one bundle), if any."""
    from ondevice.sources.catalog import load_catalog

    try:
        return load_catalog().pairs.get(name)
    except OndeviceError:
        return None  # a broken catalog must not hide the ordinary "not found" message


def _checked_size(name: str, path: Path) -> Path:
    """`path`, the cached GGUF of `name`, unless its size differs from the catalog's: a cheap
    check on every load (`ondevice pull` checks the sha256)."""
    entry = _catalog_entry(name) if path.is_file() else None
    if entry and entry.size and (size := path.stat().st_size) != entry.size:
        raise ModelFormatError(
            f"{path}: the cached copy of {name} is damaged ({size:,} bytes, the catalog expects "
            f"{entry.size:,}). Fetch it again: ondevice pull {name}"
        )
    return path


def _single_gguf(path: Path) -> Path:
    """A cached model folder that only holds a GGUF file resolves to that file."""
    if (path / "config.json").exists() or (path / "manifest.json").exists():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else path


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        offline = (
            type(e).__name__
            in (
                "LocalEntryNotFoundError",
                "ConnectionError",
                "OfflineModeIsEnabled",
            )
            or "connect" in str(e).lower()
        )
        if offline:
            raise ModelNotFoundError(
                f"{repo_id!r} is not on this machine and the Hugging Face hub cannot be reached. "
                f"Copy the model folder here and pass its path, or run `ondevice pull {repo_id}` "
                "on a machine that is online (then copy the cache folder "
                f"{cache_dir()})."
            ) from None
        raise ModelNotFoundError(
            f"{repo_id!r}: could not be fetched from the Hugging Face hub ({e})."
        ) from None
