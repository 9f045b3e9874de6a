"""A catalog pair as a bundle in ondevice's cache: its models pulled and converted once.

`ondevice demo`, the commands run without `--model` and `ondevice.load(PAIR_NAME)` all load the
same bundle, made on first use and kept until the catalog's files for the pair change.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

DRAFT_CONTEXT = 2048  # the Core ML draft's fixed state size; chats longer than this use MLX


def _draft_digest(draft: Path) -> str:
    """A short digest of the draft's files: a bundle converted from another draft (an older
    package version) is never reused."""
    import hashlib

    from ondevice.sources.files import sha256_file

    h = hashlib.sha256()
    for f in sorted(draft.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return h.hexdigest()[:12]


def _bundle_key(cat: Any, pair: Any) -> str:
    """What the bundle is made of: the catalog's digests of both models (a shipped draft's own
    files), so a bundle converted from other files (an older release) is never reused."""
    import hashlib

    parts = [pair.name]
    for name in (pair.verifier, pair.draft_model):
        if name:
            entry = cat.model(name)
            parts.append(f"{name}={entry.sha256 if entry and entry.sha256 else '?'}")
    if pair.draft is not None:
        parts.append(f"draft={_draft_digest(pair.draft)}")
    if pair.draft_drop_layers:
        parts.append(f"drop={','.join(map(str, pair.draft_drop_layers))}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def ensure_bundle(pair_name: str | None = None) -> str:
    """The catalog pair as a bundle in the cache: pulled and converted on first use."""
    import json
    import shutil

    from ondevice.errors import OndeviceError
    from ondevice.models.bundle import is_bundle
    from ondevice.sources.catalog import load_catalog
    from ondevice.sources.hub import cache_dir
    from ondevice.sources.pull import pull

    cat = load_catalog()
    pair = cat.pair(pair_name)
    if pair.draft is not None and not (pair.draft / "config.json").exists():
        raise OndeviceError(f"the shipped draft is missing at {pair.draft}; reinstall ondevice.")
    root = cache_dir() / "bundles"
    bundle = root / f"{pair.name}-{_bundle_key(cat, pair)}"
    if is_bundle(bundle):
        return str(bundle)
    verifier = pull(pair.verifier)
    draft = pull(pair.draft_model) if pair.draft_model else pair.draft
    root.mkdir(parents=True, exist_ok=True)
    context = DRAFT_CONTEXT
    if pair.draft is not None:
        max_pos = json.loads((pair.draft / "config.json").read_text()).get(
            "max_position_embeddings"
        )
        context = min(DRAFT_CONTEXT, int(max_pos or DRAFT_CONTEXT))
    print(
        f"[ondevice] converting {pair.verifier} + {pair.draft_model or 'the shipped draft'} "
        f"into {bundle} (once)",
        file=sys.stderr,
    )
    # In a child process: whatever the conversion leaves resident (it frees each copy once
    # written, but allocators and coremltools keep some) goes with it before the demo loads
    # the bundle; in one process, before the conversion freed its copies, the peak was 16 GB.
    import subprocess

    drop = ",".join(map(str, pair.draft_drop_layers))
    code = subprocess.call(
        [sys.executable, "-m", "ondevice.convert.cli"]
        + ["--verifier", str(verifier), "--draft", str(draft), "-o", str(bundle)]
        + ["--context", str(context)]
        + (["--draft-drop-layers", drop] if drop else [])
    )
    if code:
        if code == 130:
            raise KeyboardInterrupt
        raise OndeviceError("converting the default pair failed (see the messages above).")
    # bundles of this pair made from other files (older versions) are stale now
    same_pair = re.compile(re.escape(pair.name) + r"(-[0-9a-f]{12})?")
    for old in root.iterdir():
        if old != bundle and same_pair.fullmatch(old.name) and is_bundle(old):
            shutil.rmtree(old, ignore_errors=True)
    return str(bundle)
