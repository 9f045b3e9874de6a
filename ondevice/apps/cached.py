"""`ondevice list`, `ondevice show NAME`, `ondevice rm NAME`: the models and pair bundles in
the cache, as `ollama list / show / rm` do for theirs."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from ondevice.apps import options
from ondevice.apps.installed import InstalledModel, installed_models
from ondevice.errors import ModelNotFoundError, did_you_mean
from ondevice.sources.sizes import human_size


def register(sub: argparse._SubParsersAction) -> None:
    p = options.add_command(
        sub, "list", "list the models and pair bundles in the cache",
        "List the models (`ondevice pull`) and pair bundles (`ondevice-convert`, `ondevice "
        "demo`) in the ondevice cache, with their kind, size on disk and path.",
        aliases=["ls"],
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=run_list)

    p = options.add_command(
        sub, "show", "show a cached model or bundle",
        "Show a cached model or pair bundle: path, size, files; for a bundle its verifier, "
        "draft, context and the draft acceptance recorded per domain when it was made.",
    )  # fmt: skip
    p.add_argument("name", help="a name as `ondevice list` prints it")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=run_show)

    p = options.add_command(
        sub, "rm", "delete cached models or bundles",
        "Delete models or pair bundles from the cache (`ondevice pull` fetches a model again).",
    )  # fmt: skip
    p.add_argument("names", nargs="+", metavar="NAME", help="names as `ondevice list` prints them")
    p.set_defaults(func=run_rm)


def find(name: str) -> list[InstalledModel]:
    """The cached models and bundles called `name` (a hub id may be written owner--name);
    none: ModelNotFoundError naming the close ones."""
    everything = installed_models()
    wanted = name.replace("--", "/")
    found = [m for m in everything if m.name in (name, wanted)]
    if found:
        return found
    names = sorted({m.name for m in everything})
    listed = ", ".join(names) if names else "the cache is empty"
    raise ModelNotFoundError(
        f"no cached model or bundle is called {name!r}.{did_you_mean(name, names)} "
        f"(cached: {listed}; `ondevice list` shows them)"
    )


def run_list(args: argparse.Namespace) -> int:
    found = installed_models()
    if args.json:
        print(json.dumps([_row(m) for m in found], indent=1))
        return 0
    if not found:
        print("no models cached (fetch one with `ondevice pull NAME`)", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in found)
    print(f"{'NAME':<{width}}  KIND    {'SIZE':>9}  PATH")
    for m in found:
        print(f"{m.name:<{width}}  {m.kind:<6}  {human_size(m.size_bytes):>9}  {m.path}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    details = [_details(m) for m in find(args.name)]
    if args.json:
        print(json.dumps(details[0] if len(details) == 1 else details, indent=1))
        return 0
    for d in details:
        for key, value in d.items():
            if key == "size_bytes":
                continue  # `size` says it
            if key == "acceptance":
                print("acceptance   (greedy draft acceptance per domain when the bundle was made)")
                for domain, rate in value.items():
                    print(f"  {domain:<14} {rate:.2f}")
            elif key == "files":
                print(f"files        {len(value)}: " + ", ".join(value[:8])
                      + (", ..." if len(value) > 8 else ""))  # fmt: skip
            else:
                print(f"{key:<12} {value}")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    targets = [m for name in args.names for m in find(name)]  # all names checked first
    for m in targets:
        shutil.rmtree(m.path)
        print(f"deleted {m.kind} {m.name} ({human_size(m.size_bytes)}, {m.path})")
    return 0


def _row(m: InstalledModel) -> dict[str, Any]:
    return {"name": m.name, "kind": m.kind, "size_bytes": m.size_bytes, "path": str(m.path)}


def _details(m: InstalledModel) -> dict[str, Any]:
    """What `show` prints: the listing's row, the files, and what the catalog or the bundle's
    manifest says about it."""
    d: dict[str, Any] = {**_row(m), "size": human_size(m.size_bytes)}
    d["files"] = sorted(
        str(f.relative_to(m.path)) for f in m.path.rglob("*") if f.is_file() and f.name[0] != "."
    )
    if m.kind == "bundle":
        d.update(_bundle_details(m))
    else:
        from ondevice.sources.catalog import load_catalog

        entry = load_catalog().model(m.name)
        if entry is not None:
            d.update({k: v for k, v in (("title", entry.title), ("license", entry.license),
                                        ("note", entry.note)) if v})  # fmt: skip
    return d


def _bundle_details(m: InstalledModel) -> dict[str, Any]:
    from ondevice.errors import BundleError
    from ondevice.models.bundle import read_manifest
    from ondevice.runtime.drift import read_baseline

    try:
        manifest = read_manifest(m.path)
        baseline = read_baseline(manifest, m.path / "manifest.json")
    except BundleError as e:
        return {"problem": str(e)}
    out = {
        "verifier": manifest["verifier"].get("source"),
        "draft": manifest["draft"].get("source"),
        "context": manifest.get("context_length"),
        "options": manifest.get("options"),
    }
    if baseline:
        out["acceptance"] = {name: r.alpha for name, r in baseline.items() if r.alpha is not None}
    return out
