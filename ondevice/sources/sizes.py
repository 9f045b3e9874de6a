"""Byte counts for people: the one formatter of sizes (binary: 1 KB = 1024 bytes)."""

from __future__ import annotations


def human_size(n: float) -> str:
    """'512 B', '2.9 KB', '93.8 MB', '3.0 GB' (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
