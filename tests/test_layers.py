"""The import layering the README states: apps -> api -> runtime -> speculative -> models, and the
converter beside the runtime (it may use the runtime's reference executor; the runtime never
imports the converter). Read from the source, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ondevice"
# package -> the ondevice packages it must never import
FORBIDDEN = {
    "models": ("speculative", "runtime", "convert", "apps", "api"),
    "speculative": ("runtime", "convert", "apps", "api"),
    "runtime": ("convert", "apps", "api"),
    "convert": ("apps", "api"),
}
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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_upward(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in COMMANDS:
            continue
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "ondevice" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)
