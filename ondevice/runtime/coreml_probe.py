"""Proving a Core ML draft in a child process, once per (package, coremltools, macOS build).

Some Neural Engine compile failures kill the process on its first prediction (coremltools#2758:
SIGKILL after a load that reported success), and some hang; no in-process fallback can catch
either, so every launch would die the same way. So before the draft is loaded in-process, a child
process loads it (compile, load, state, a first prediction of each function: what
`CoreMLDraftEngine` does at start) under a timeout, and its verdict is cached under the ondevice
cache: a draft whose compile kills its process costs one probe, not every launch. A new
coremltools, a new macOS build or a changed package probes again; deleting the verdict file
(`ondevice doctor` names it) does too.

Only where Core ML really runs (macOS) is a child useful; elsewhere `verdict` returns None at
once and the in-process start decides.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Compiling a 0.5B draft for the Neural Engine the first time takes minutes on some Macs;
# ONDEVICE_COREML_PROBE_TIMEOUT (seconds) overrides.
TIMEOUT_S = 900.0
ISOLATE = sys.platform == "darwin"  # a child can prove Core ML only where it runs


def run_child(argv: list[str], timeout: float) -> tuple[str | None, str]:
    """Run `argv`: (None when it exits with 0, else why not, in a sentence: the signal that
    killed it, the timeout it ran past, or the last line it wrote to stderr; its stdout)."""
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:  # subprocess.run has killed and reaped the child
        return f"the Core ML probe did not finish within {timeout:g} s", ""
    if proc.returncode == 0:
        return None, proc.stdout
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        why = f"the Core ML probe process was killed by {name} (a Neural Engine compile crash?)"
        return why, proc.stdout
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {proc.returncode}"
    return last.removeprefix("ondevice: "), proc.stdout


def child_argv(package: Path) -> list[str]:
    return [sys.executable, "-m", "ondevice.runtime.coreml_probe", str(package)]


def macos_build() -> str:
    """The macOS version and build (e.g. '15.4 24E248'); '' off macOS."""
    import platform

    version = platform.mac_ver()[0]
    if not version:
        return ""
    try:
        build = subprocess.run(
            ["sw_vers", "-buildVersion"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        build = ""
    return f"{version} {build}".strip()


def verdict_path(package: Path) -> Path:
    import hashlib

    import coremltools

    from ondevice.runtime.coreml_engines import package_digest
    from ondevice.sources.hub import cache_dir

    key = f"{package_digest(package)}|{coremltools.__version__}|{macos_build()}"
    return cache_dir() / "coreml-probe" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def verdict(package: str | Path, timeout: float | None = None) -> str | None:
    """None when the draft at `package` starts in a child process (or where no child is
    needed: off macOS), else why not; probed once and cached."""
    if not ISOLATE:
        return None
    package = Path(package)
    path = verdict_path(package)
    try:
        return json.loads(path.read_text())["reason"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no verdict yet (or an unreadable one): probe
    if timeout is None:
        try:
            timeout = float(os.environ.get("ONDEVICE_COREML_PROBE_TIMEOUT", TIMEOUT_S))
        except ValueError:
            timeout = TIMEOUT_S  # a malformed override must not stop the load
    print(
        "ondevice: compiling the draft for the Neural Engine (first time only)...",
        file=sys.stderr,
        flush=True,
    )
    reason, out = run_child(child_argv(package), timeout)
    if reason is not None:
        reason += f" [verdict cached in {path}; delete it to probe again]"
    warnings = plan_warnings(out)
    for w in warnings:  # once, at the first load: the verdict is cached
        print(
            f"ondevice: warning: the Core ML draft's {w}; it may draft slower than the MLX draft "
            "(see `ondevice-convert --check`).",
            file=sys.stderr,
        )
    record = {
        "reason": reason,
        "plan_warnings": warnings,
        "package": str(package),
        "time": time.time(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: probe again next time
    return reason


def plan_warnings(stdout: str) -> list[str]:
    """The compute-plan warnings the child reported (its last stdout line, JSON)."""
    lines = stdout.strip().splitlines()
    try:
        return [str(w) for w in json.loads(lines[-1])["plan_warnings"]]
    except (IndexError, ValueError, KeyError, TypeError):
        return []


def main(argv: list[str]) -> int:
    """The child: start the Core ML draft engine at argv[0] (exit 0 when it starts), then
    report where Core ML plans each function's cost, as JSON on the last stdout line."""
    from ondevice.errors import OndeviceError
    from ondevice.runtime.coreml_engines import CoreMLDraftEngine

    try:
        CoreMLDraftEngine(argv[0])
    except OndeviceError as e:
        print(f"ondevice: {e}", file=sys.stderr)
        return 1
    try:
        from ondevice.runtime import coreml_plan

        warnings = coreml_plan.off_neural_engine(coreml_plan.compute_plan(argv[0]))
    except Exception:  # the plan is advice: a failure to make one must not fail the draft
        warnings = []
    print(json.dumps({"plan_warnings": warnings}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
