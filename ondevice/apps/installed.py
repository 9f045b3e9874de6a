"""The pair bundles installed in the cache, with their sizes on disk (the menu bar's model
picker)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: Path
    size_bytes: int


def installed_bundles(root: Path | None = None) -> list[InstalledModel]:
    """Pair bundles under `root` (default: the cache's `bundles` folder), with sizes on disk."""
    if root is None:
        from ondevice.models.hub import cache_dir

        root = cache_dir() / "bundles"
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and (path / "manifest.json").is_file():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            found.append(InstalledModel(path.name, path, size))
    return found
