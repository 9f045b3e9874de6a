"""Why MLX cannot be imported here, in one line, and what to install: the right hint per platform.

MLX ships wheels for arm64 macOS 14+ (Metal) and Linux (`mlx[cpu]`) only. An x86_64 Python on an
Apple Silicon Mac (Homebrew under /usr/local, an Intel conda, anything run under Rosetta) skips MLX
through the dependency's platform marker, so the first `import mlx` is where it shows.
"""

from __future__ import annotations

import platform
import subprocess
import sys


def under_rosetta() -> bool:
    """True for an x86_64 process translated by Rosetta on Apple Silicon."""
    if sys.platform != "darwin":
        return False
    try:
        out = subprocess.run(
            ["sysctl", "-n", "sysctl.proc_translated"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip() == "1"


def install_hint() -> str:
    """What to do so that MLX imports, for this platform."""
    if platform.system() == "Darwin":
        if platform.machine() != "arm64":
            where = "under Rosetta on Apple Silicon" if under_rosetta() else "on an Intel Mac"
            return (
                f"this Python is x86_64 ({where}) and MLX runs only in an arm64 Python on "
                "Apple Silicon: install an arm64 Python 3.10-3.13 (`/opt/homebrew/bin/brew "
                "install python@3.12` or `uv python install 3.12`) and reinstall ondevice with it"
            )
        return "install it: pip install 'mlx>=0.31.2' (macOS 14 or newer)"
    if platform.system() == "Linux":
        return "install it: pip install 'mlx[cpu]>=0.31.2'"
    return f"MLX has no build for {platform.system()}; use macOS on Apple Silicon or Linux"


def mlx_missing(error: BaseException | None = None) -> str:
    """The one line a command prints when MLX cannot be imported."""
    why = f" ({error})" if error is not None else ""
    return f"MLX cannot be imported{why}; {install_hint()}."
