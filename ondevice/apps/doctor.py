"""`ondevice doctor`: what this machine offers ondevice, and what would make it faster.

Reports the platform, Python, MLX and its default device, Core ML, the BLAS library MLX's matrix
products actually go to (on Linux), and the cache with its models. The BLAS check matters: the
`mlx-cpu` wheel links a reference BLAS that is 5-30x slower than MKL or OpenBLAS; ondevice opens
one of those before MLX loads (`ondevice.runtime.blas`), and doctor says which one serves MLX.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from ondevice.runtime import blas
from ondevice.sources.sizes import human_size as human

_BLAS_SYMBOL = "cblas_sgemm"  # what libmlx calls for float32 matrix products


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine: MLX device, Core ML, BLAS, cache",
        description="Report platform, MLX, Core ML, the BLAS in use and the ondevice cache.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    mac = p.add_argument_group(
        "--mac-check",
        "convert the draft with each compression, probe Core ML compile and placement, time a "
        "draft step on the Neural Engine and on the GPU and verifier passes; write one JSON",
    )
    mac.add_argument("--mac-check", action="store_true", help="run the Mac check (minutes)")
    mac.add_argument("--model", help="verifier (default: the default pair's)")
    mac.add_argument("--draft", "--draft-model", help="draft model (default: the default pair's)")
    mac.add_argument("--compressions", help="comma-separated (default: all)")
    mac.add_argument("--out", default="ondevice-mac-check.json", help="default %(default)s")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "mac_check", False):
        from ondevice.apps import mac_check

        return mac_check.main(args)
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


# -- collecting --------------------------------------------------------------------------------


def collect() -> dict[str, Any]:
    warnings: list[str] = []
    report: dict[str, Any] = {
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "description": platform.platform(),
        },
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "ondevice": {"version": _version("ondevice")},
        "mlx": _mlx(warnings),
        "coreml": _coreml(warnings),
        "blas": _blas(warnings),
        "kernel": _kernel(),
        "cache": _cache(),
        "draft_drift": _draft_drift(warnings),
        "skip_sets": _skip_sets(),
        "profiles": _profiles(),
    }
    report["warnings"] = warnings
    return report


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _mlx(warnings: list[str]) -> dict[str, Any]:
    try:
        import mlx.core as mx
    except ImportError as e:
        from ondevice.runtime.mlx_check import mlx_missing

        warnings.append(mlx_missing(e))
        return {"available": False, "error": str(e)}
    return {
        "available": True,
        "version": mx.__version__,
        "default_device": str(mx.default_device().type).rsplit(".", 1)[-1],
        "metal": bool(mx.metal.is_available()),
    }


# coremltools' native modules: conversion needs the first two (without them saving fails with
# "BlobWriter not loaded"), Core ML prediction the third (built for macOS only).
CONVERSION_MODULES = ("libmilstoragepython", "libmodelpackage")
PREDICTION_MODULE = "libcoremlpython"


def _coreml(warnings: list[str]) -> dict[str, Any]:
    from ondevice.runtime.coreml_engines import coreml_status

    reason = coreml_status()
    native = {name: _native_module(name) for name in (*CONVERSION_MODULES, PREDICTION_MODULE)}
    missing = [n for n in CONVERSION_MODULES if native[n] != "ok"]
    if missing:
        from ondevice.runtime.coreml_engines import native_module_hint

        warnings.append(
            f"coremltools' {', '.join(missing)} cannot be loaded, so ondevice-convert will fail "
            f"('BlobWriter not loaded'): {native_module_hint()}"
        )
    if platform.system() == "Darwin" and native[PREDICTION_MODULE] != "ok":
        warnings.append(f"Core ML prediction is unavailable: {reason}")
    return {
        "prediction_available": reason is None,
        "reason": reason,
        "coremltools": _version("coremltools"),
        "native_modules": native,
        "last_fallback": _last_fallback(),
    }


def _native_module(name: str) -> str:
    """ "ok", "missing" or "broken (why)" for one of coremltools' native extension modules.

    Found by file and opened with dlopen, not imported: importing coremltools on Linux logs a
    warning per missing module, and conversion does not need the prediction module anyway.
    """
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("coremltools")
    if spec is None or not spec.submodule_search_locations:
        return "missing"
    for folder in spec.submodule_search_locations:
        for lib in sorted(Path(folder).glob(f"{name}*.so")):
            try:
                ctypes.CDLL(str(lib))
            except OSError as e:
                return f"broken ({e})"
            return "ok"
    return "missing"


def _last_fallback() -> dict[str, Any] | None:
    """The last time a draft fell back from Core ML, and why (written by the draft engine)."""
    from ondevice.runtime.coreml_engines import FALLBACK_RECORD
    from ondevice.sources.hub import cache_dir

    try:
        return json.loads((cache_dir() / FALLBACK_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _blas(warnings: list[str]) -> dict[str, Any]:
    if platform.system() == "Darwin":
        return {"kind": "accelerate", "library": "Accelerate.framework (MLX on Metal / CPU)"}
    if platform.system() != "Linux":
        return {"kind": "unknown", "library": None}
    try:
        import mlx.core  # noqa: F401  (loads libmlx and the BLAS it links)
    except ImportError:
        return {"kind": "unknown", "library": None}
    maps = _mapped_libraries()
    library = _blas_serving_mlx(maps)
    kind = _classify(library)
    info: dict[str, Any] = {
        "kind": kind,
        "library": library,
        "loaded": [p for p in maps if _is_blas_like(p)],
    }
    info["override"] = os.environ.get(blas.ENV) or None
    if kind == "reference":
        info["fix"] = blas_fix()
        warnings.append(
            "MLX runs matrix products on the reference BLAS bundled with mlx-cpu (5-30x slower "
            f"than MKL or OpenBLAS; speculation cannot pay there); {info['fix']}"
        )
    return info


def _kernel() -> dict[str, Any]:
    """Which kernel serves the verifier's linear products (`ondevice.runtime.kernel`)."""
    try:
        from ondevice.runtime import kernel
    except ImportError as e:
        return {"kernel": "mlx", "reason": f"MLX cannot be imported ({e})"}
    try:
        return kernel.status()
    except ValueError as e:  # a bad ONDEVICE_KERNEL
        return {"kernel": "mlx", "reason": str(e)}


def _kernel_line(k: dict[str, Any]) -> str:
    """What serves the verifier's (and an MLX draft's) linear products."""
    if k["kernel"] == "mlx":
        return f"mlx (MLX's own products: {k['reason']})"
    dots = {"bf16": "bf16 dot products", "int8": "int8 dot products"}
    how = "ONDEVICE_KERNEL=" + k["env"] if k.get("env") else "the default"
    line = f"oneDNN {k['kernel']} weights, {dots.get(k['kernel'], 'float32')}, serves the verifier"
    if k.get("decode"):
        line += f" (decoding on {k['decode']}, prompts on {k['prompts']})"
    draft = k.get("draft", k["kernel"])
    if draft != k["kernel"]:
        line += f"; {draft} weights, {dots.get(draft, 'float32')}, serve an MLX draft"
    few = f"; passes of a few tokens: {k['few_rows']}" if k.get("few_rows") else ""
    return f"{line} ({how}) ({k['library']}){few}"


def _mapped_libraries() -> list[str]:
    """Shared objects mapped into this process (in address order)."""
    seen: dict[str, None] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and ".so" in parts[-1]:
                    seen.setdefault(parts[-1], None)
    except OSError:
        pass
    return list(seen)


def _blas_serving_mlx(maps: list[str]) -> str | None:
    """The file whose `cblas_sgemm` libmlx's calls bind to.

    The dynamic linker searches the global scope (the executable and any LD_PRELOAD libraries)
    before a dlopen'ed library's own dependencies, so a global definition wins; otherwise the
    symbol comes from libmlx's own dependency chain.
    """
    import ctypes

    path = _symbol_file(ctypes.CDLL(None), _BLAS_SYMBOL)
    if path:
        return path
    libmlx = next((p for p in maps if Path(p).name.startswith("libmlx")), None)
    if libmlx:
        try:
            path = _symbol_file(ctypes.CDLL(libmlx), _BLAS_SYMBOL)
        except OSError:
            path = None
    if path:
        return path
    return next((p for p in maps if _is_blas_like(p)), None)  # best guess from the mappings


def _symbol_file(lib: Any, symbol: str) -> str | None:
    """The path of the shared object that defines `symbol` as seen from `lib` (dladdr)."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        addr = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p)
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return None
    info = DlInfo()
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return str(Path(info.dli_fname.decode()).resolve())


def _is_blas_like(path: str) -> bool:
    name = Path(path).name.lower()
    return any(k in name for k in ("blas", "lapack", "mkl", "blis"))


def _classify(library: str | None) -> str:
    if not library:
        return "unknown"
    name = library.lower()
    for kind in ("openblas", "mkl", "blis"):
        if kind in Path(name).name:
            return kind
    return "reference" if "libblas" in Path(name).name else "unknown"


def blas_fix() -> str:
    """What makes ondevice load a fast BLAS here (it does so by itself when one is installed)."""
    if os.environ.get(blas.ENV, "").strip() == "reference":
        return f"unset {blas.ENV} (it asks for the reference BLAS)"
    if platform.machine() == "x86_64":
        return (
            "install MKL, an ondevice dependency on Linux x86_64 "
            f"({sys.executable} -m pip install mkl); ondevice loads it by itself"
        )
    return (
        f"install OpenBLAS (sudo apt-get install {blas.OPENBLAS_PACKAGE}); ondevice loads it "
        "by itself"
    )


def _draft_drift(warnings: list[str]) -> list[dict[str, Any]]:
    """Drift alarms that generations (serve, the API) left up: a draft the verifier no longer
    agrees with as it did when the bundle was made (runtime/drift.py)."""
    from ondevice.runtime.drift import describe_alarm, recorded_alarms
    from ondevice.sources.hub import cache_dir

    alarms = recorded_alarms(cache_dir() / "drift")
    warnings += [line for a in alarms for line in describe_alarm(a)]
    return alarms


def _cache() -> dict[str, Any]:
    from ondevice.sources.hub import cache_dir

    root = cache_dir()
    models_root = root / "models"
    models, partial = [], []
    if models_root.is_dir():
        for d in sorted(models_root.iterdir()):
            if not d.is_dir():
                continue
            if d.name.startswith("."):
                partial.append(str(d))  # an interrupted pull's staging folder
                continue
            files = [f for f in d.rglob("*") if f.is_file()]
            models.append(
                {
                    "name": d.name,
                    "path": str(d),
                    "size_bytes": sum(f.stat().st_size for f in files),
                    "files": [str(f.relative_to(d)) for f in files],
                }
            )
    return {
        "dir": str(root),
        "exists": root.is_dir(),
        "size_bytes": _tree_size(root),
        "models": models,
        "incomplete": partial,
    }


def _tree_size(path: Path) -> int:
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _skip_sets() -> list[dict[str, Any]]:
    """The layer skip sets method "self" found for each model (proposers/layer_skip.py)."""
    from ondevice.runtime.pass_costs import cached_skip_sets

    return [{"file": str(p), "summary": s.describe(), **s.to_json()} for p, s in cached_skip_sets()]


def _profiles() -> list[dict[str, Any]]:
    """The pass-cost profiles cached on this machine, with what they were measured for."""
    from ondevice.runtime.pass_costs import cached_profiles

    profiles = cached_profiles()
    try:
        from ondevice.runtime import kernel
    except ImportError:  # no MLX (doctor says so): which kernel revision is current is unknown
        kernel = None  # type: ignore[assignment]
    out = []
    for p in profiles:
        # a profile of an older kernel revision is never looked up again (its key differs)
        older = kernel is not None and kernel.revision(p.kernel) not in (None, kernel.REVISION)
        out.append({"file": str(p.path), "summary": p.describe(), "unused": older, **p.to_json()})
    return out


# -- rendering ---------------------------------------------------------------------------------


def render(r: dict[str, Any]) -> str:
    p, py, mlx, cm, blas, cache = (
        r["platform"],
        r["python"],
        r["mlx"],
        r["coreml"],
        r["blas"],
        r["cache"],
    )
    if mlx["available"]:
        metal = "yes" if mlx["metal"] else "no"
        mlx_line = f"{mlx['version']}, default device {mlx['default_device']} (Metal: {metal})"
    else:
        mlx_line = f"not available ({mlx['error']})"
    coreml_line = (
        "prediction available (Neural Engine)"
        if cm["prediction_available"]
        else f"prediction unavailable ({cm['reason']}); drafts run on MLX or the reference executor"
    )
    tools = cm["coremltools"] or "not installed"
    native = ", ".join(f"{k} {v}" for k, v in cm["native_modules"].items())
    lines = [
        "ondevice doctor",
        f"  platform    {p['description']} ({p['machine']})",
        f"  python      {py['version']} ({py['executable']})",
        f"  ondevice    {r['ondevice']['version'] or 'not installed as a package'}",
        f"  mlx         {mlx_line}",
        f"  core ml     {coreml_line}",
        f"  coremltools {tools} (native: {native})",
        f"  blas        {blas['kind']}" + (f" ({blas['library']})" if blas.get("library") else ""),
        f"  kernel      {_kernel_line(r['kernel'])}",
        f"  cache       {cache['dir']}"
        + (f" ({human(cache['size_bytes'])})" if cache["exists"] else " (not created yet)"),
    ]
    if cache["models"]:
        width = max(len(m["name"]) for m in cache["models"])
        lines.append("  models")
        for m in cache["models"]:
            lines.append(f"    {m['name']:<{width}}  {human(m['size_bytes']):>9}  {m['path']}")
    else:
        lines.append("  models      none cached (fetch the default with: ondevice pull)")
    profiles = r.get("profiles", [])
    for prof in profiles:
        if not prof.get("unused"):
            lines.append(f"  pass costs  {prof['summary']} ({prof['device']})")
    unused = [Path(prof["file"]) for prof in profiles if prof.get("unused")]
    if unused:
        lines.append(
            f"  old costs   {len(unused)} pass-cost profile(s) measured by an older kernel, no "
            f"longer used (safe to delete from {unused[0].parent}: "
            + ", ".join(p.name for p in unused)
            + ")"
        )
    for s in r.get("skip_sets", []):
        lines.append(f"  self draft  {s['summary']} ({Path(s['file']).name})")
    if cm["last_fallback"]:
        fb = cm["last_fallback"]
        lines.append(
            f"  fallback    last Core ML failure: {fb.get('reason')} (used the {fb.get('fallback')} "
            "draft instead)"
        )
    for d in cache["incomplete"]:
        lines.append(f"  incomplete  {d} (an interrupted pull; safe to delete)")
    for w in r["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
