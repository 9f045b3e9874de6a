"""The import layering `docs/design.md` draws, one way only:

    apps -> api -> decoders -> proposers -> runtime -> rules -> models -> sources

and the converter beside the runtime (it may use the runtime's reference executor; the runtime
never imports the converter). `rules` (acceptance, sampling transform, noise, token trees,
grammar, the engine protocol, the token chooser) is pure: numpy over token ids and
probabilities, no model, no runtime. Read from the source, so a lazy import inside a function
counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ondevice"
# the layers from the bottom up: each may import only the ones below it
ORDER = ("sources", "models", "rules", "runtime", "proposers", "decoders", "api", "apps")
FORBIDDEN = {layer: ORDER[i + 1 :] + ("convert",) for i, layer in enumerate(ORDER[:-2])}
FORBIDDEN["rules"] += ("models",)
FORBIDDEN["convert"] = ("apps", "api")
# commands: the apps layer, wherever they live (`ondevice-convert` shares the option lists)
COMMANDS = {"convert/cli.py"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def files_of(package: str) -> list[Path]:
    if package == "api":
        return [ROOT / "api.py"]
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_upward(package):
    bad = []
    for path in files_of(package):
        if path.relative_to(ROOT).as_posix() in COMMANDS:
            continue
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "ondevice" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_every_package_has_a_layer():
    """A new folder under ondevice/ must be placed in the order above (or be a leaf like
    convert/, distill/, speedtest/)."""
    leaves = {"convert", "distill", "speedtest", "__pycache__"}
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - leaves
    assert folders <= set(ORDER), folders - set(ORDER)


def test_the_design_notes_name_every_decoder_proposer_and_method():
    """docs/design.md is where a newcomer finds every decoder, every proposer and every method:
    a new one must be named there."""
    from ondevice.proposers.registry import METHODS

    text = (ROOT.parent / "docs" / "design.md").read_text()
    files = [p.name for d in ("decoders", "proposers") for p in (ROOT / d).glob("[!_]*.py")]
    missing = [f for f in files if f"`{f}`" not in text]
    missing += [m for m in METHODS if f"`{m}`" not in text]
    assert not missing, missing
