"""What the cache holds: pair bundles (the menu bar's model picker) and pulled models, with
their sizes on disk (`ondevice list`, `show`, `rm`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: Path
    size_bytes: int
    kind: str = "bundle"  # "bundle" (a converted pair), "gguf" (a pulled file) or "folder"


def installed_bundles(root: Path | None = None) -> list[InstalledModel]:
    """Pair bundles under `root` (default: the cache's `bundles` folder), with sizes on disk."""
    if root is None:
        from ondevice.sources.hub import cache_dir

        root = cache_dir() / "bundles"
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and (path / "manifest.json").is_file():
            found.append(InstalledModel(path.name, path, _size(path)))
    return found


def installed_models(cache: Path | None = None) -> list[InstalledModel]:
    """Every model in the cache: pulled models (`models/`, named as `ondevice pull` names
    them, hub ids with "/") and pair bundles (`bundles/`). Staging folders of interrupted
    pulls and conversions (hidden names) are left out."""
    if cache is None:
        from ondevice.sources.hub import cache_dir

        cache = cache_dir()
    found = []
    root = cache / "models"
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if not path.is_dir() or path.name.startswith("."):
                continue
            if (path / "manifest.json").is_file():
                kind = "bundle"
            else:
                kind = "gguf" if any(path.glob("*.gguf")) else "folder"
            found.append(InstalledModel(path.name.replace("--", "/"), path, _size(path), kind))
    return found + installed_bundles(cache / "bundles")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
