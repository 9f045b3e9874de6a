"""Benchmark results: per-method/category aggregates, machine facts, the JSON file, the table."""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ALL = "all"


def per_prompt_speedups(records: Sequence[dict]) -> None:
    """Set each record's `speedup`: its decode rate over plain decoding's on the same prompt."""
    plain = {(r["category"], r["question_id"]): r for r in records if r["method"] == "plain"}
    for r in records:
        base = plain.get((r["category"], r["question_id"]))
        tps, ref = r.get("tokens_per_second"), base and base.get("tokens_per_second")
        r["speedup"] = tps / ref if tps and ref else None


def _summarize(rs: Sequence[dict]) -> dict[str, Any]:
    """Token-weighted aggregates: rates are total tokens over total time, not means of rates."""
    timed = [r for r in rs if r.get("tokens_per_second")]
    decode_tokens = sum(r["decode_tokens"] for r in timed)
    decode_s = sum(r["decode_s"] for r in timed)
    tokens = sum(r["generation_tokens"] for r in rs)
    total_s = sum(r["total_s"] for r in rs)
    drafted = sum(r.get("drafted") or 0 for r in rs)
    accepted = sum(r.get("accepted") or 0 for r in rs)
    rounds = sum(r.get("rounds") or 0 for r in rs)
    t_draft = [r["time_draft_s"] for r in rs if r.get("time_draft_s") is not None]
    t_verify = [r["time_verify_s"] for r in rs if r.get("time_verify_s") is not None]
    checked = [r for r in rs if r.get("matches_reference") is not None]
    out: dict[str, Any] = {
        "prompts": len(rs),
        "generation_tokens": tokens,
        "tokens_per_second": decode_tokens / decode_s if decode_s > 0 else None,
        "e2e_tokens_per_second": tokens / total_s if total_s > 0 else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + rounds) / rounds if drafted and rounds else None,
        "drafted": drafted,
        "accepted": accepted,
        "rounds": rounds,
        "time_draft_s": sum(t_draft) if t_draft else None,
        "time_verify_s": sum(t_verify) if t_verify else None,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rs),
        "working_memory_bytes": max(r["working_memory_bytes"] for r in rs),
        "memory_bytes": max(r["memory_bytes"] for r in rs),
        "checked": len(checked),
        "mismatches": sum(not r["matches_reference"] for r in checked),
    }
    if drafted and out["time_draft_s"] is not None and out["time_verify_s"]:
        both = out["time_draft_s"] + out["time_verify_s"]
        out["draft_time_share"] = out["time_draft_s"] / both if both > 0 else None
    return out


def aggregate(records: Sequence[dict], methods: Sequence[str]) -> dict[str, dict[str, dict]]:
    """method -> category (and "all") -> summary, with speedup over plain in the same slice."""
    cats = list(dict.fromkeys(r["category"] for r in records))
    agg: dict[str, dict[str, dict]] = {}
    for m in methods:
        agg[m] = {}
        for c in [*cats, ALL]:
            rs = [r for r in records if r["method"] == m and c in (ALL, r["category"])]
            if rs:
                agg[m][c] = _summarize(rs)
    for m in methods:
        for c, s in agg[m].items():
            base = agg.get("plain", {}).get(c, {}).get("tokens_per_second")
            s["speedup"] = (
                s["tokens_per_second"] / base if s["tokens_per_second"] and base else None
            )
    return agg


def _cpu_name() -> str:
    if sys.platform == "darwin":
        import subprocess

        try:
            return (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.strip()
                or platform.processor()
            )
        except OSError:
            return platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_info() -> dict[str, Any]:
    """Which BLAS this process has loaded: on Linux the mlx[cpu] wheel's reference BLAS is far
    slower than OpenBLAS, so numbers measured without the preload are not comparable."""
    preload = os.environ.get("LD_PRELOAD", "")
    loaded: list[str] = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            name = line.rsplit("/", 1)[-1]
            if any(k in name.lower() for k in ("blas", "mkl", "lapack")) and name not in loaded:
                loaded.append(name)
    except OSError:  # not Linux: macOS MLX uses Accelerate
        pass
    return {
        "openblas_preloaded": "openblas" in preload.lower(),
        "ld_preload": preload or None,
        "loaded_libraries": loaded,
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    import mlx.core as mx

    import ondevice

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "mlx_device": str(mx.default_device()),
        "blas": blas_info(),
        "versions": {
            "python": platform.python_version(),
            "ondevice": ondevice.__version__,
            "mlx": _version("mlx"),
            "mlx-lm": _version("mlx-lm"),
            "numpy": _version("numpy"),
            "coremltools": _version("coremltools"),
        },
    }


def mismatches(records: Sequence[dict]) -> list[dict[str, Any]]:
    return [
        {
            "method": r["method"],
            "reference": r["reference"],
            "category": r["category"],
            "question_id": r["question_id"],
            "first_mismatch": r["first_mismatch"],
        }
        for r in records
        if r.get("matches_reference") is False
    ]


def staging_file(path: Path) -> str:
    """A temporary file next to `path`, with the permissions a plain open() would give it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private
    return tmp


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Write atomically: a crash or full disk never leaves a truncated results file."""
    tmp = staging_file(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(results: dict[str, Any]) -> str:
    """A compact text table: one line per method overall, then speedup per category."""
    agg = results["aggregates"]
    methods = list(agg)
    lines = [
        f"{'method':<12} {'tok/s':>7} {'speedup':>7} {'accept':>6} {'len':>5} "
        f"{'draft%':>6} {'mem MB':>7} {'greedy':>8}"
    ]
    for m in methods:
        s = agg[m].get(ALL)
        if not s:
            continue
        greedy = (
            "-"
            if not s["checked"]
            else ("ok" if not s["mismatches"] else f"{s['mismatches']} DIFF")
        )
        share = s.get("draft_time_share")
        lines.append(
            f"{m:<12} {_fmt(s['tokens_per_second'], '7.1f'):>7} "
            f"{_fmt(s['speedup'], '.2f') + 'x':>7} {_fmt(s['acceptance_rate'], '6.2f'):>6} "
            f"{_fmt(s['mean_accepted_length'], '5.2f'):>5} "
            f"{_fmt(share * 100 if share is not None else None, '5.0f'):>6} "
            f"{s['memory_bytes'] / 2**20:7.0f} {greedy:>8}"
        )
    lines.append(
        "(tok/s: decode rate; speedup: over plain, same run; accept: accepted/drafted; len: "
        "tokens per verifier pass; draft%: draft share of draft+verify time; mem: weights used "
        "+ working memory)"
    )
    repeats = results.get("settings", {}).get("repeats", 1)
    if repeats > 1:
        lines.append(f"(each prompt's runs done {repeats} times; each run's median repeat counts)")
    cats = [c for c in agg.get("plain", {}) if c != ALL]
    shown = [m for m in methods if m != "plain"]
    if cats and shown:
        lines.append("")
        lines.append("speedup over plain (acceptance) by category")
        lines.append(f"{'category':<16}" + "".join(f"{m:>18}" for m in shown))
        for c in cats:
            row = f"{c:<16}"
            for m in shown:
                s = agg[m].get(c)
                cell = (
                    "-"
                    if not s
                    else (f"{_fmt(s['speedup'], '.2f')}x ({_fmt(s['acceptance_rate'], '.2f')})")
                )
                row += f"{cell:>18}"
            lines.append(row)
    left_out = {
        k: v for r in results.get("records", []) for k, v in (r.get("auto_left_out") or {}).items()
    }
    lines += [f"auto left out {name}: {why}" for name, why in sorted(left_out.items())]
    return "\n".join(lines)
