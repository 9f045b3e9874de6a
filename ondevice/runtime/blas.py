"""A fast BLAS for MLX on Linux, chosen once per process before MLX loads.

MLX's Linux wheel (`mlx[cpu]`) links a reference BLAS that multiplies matrices at 2-3 GFLOP/s:
verifying K tokens then costs K times one token and speculation can only lose. libmlx looks its
`cblas_*` symbols up in the process's global scope before its own dependencies, so a library
opened with RTLD_GLOBAL before `import mlx.core` serves every matrix product, as LD_PRELOAD
would, without restarting the process.

Measured on the 2-core Linux x86_64 machines here (docs/benchmarks.md, "BLAS"): Intel MKL from
the `mkl` wheel with its TBB threading layer beats Debian's OpenBLAS on the products a verifier
pass makes, so the Linux x86_64 install depends on `mkl` and it is tried first; Debian's
`libopenblas0-pthread` is the fallback (Linux arm64, or an install without the wheel).

`ONDEVICE_BLAS` overrides the choice: `mkl`, `openblas`, `reference` (leave MLX's own), or the
path of a shared library that exports the standard CBLAS names.
"""

from __future__ import annotations

import ctypes
import os
import sys
from importlib import metadata
from pathlib import Path

ENV = "ONDEVICE_BLAS"
KINDS = ("mkl", "openblas", "reference")
OPENBLAS_PACKAGE = "libopenblas0-pthread"  # Debian's
OPENBLAS_PATHS = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_enabled: str | None = None  # the library this process loaded, once enable() has run


def _wheel_file(dist: str, prefix: str) -> Path | None:
    """A shared library installed by the wheel `dist` (wheels put MKL and TBB in <prefix>/lib)."""
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith(prefix) and ".so" in f.name:
            path = Path(str(f.locate())).resolve()
            if path.exists():
                return path
    return None


def _load_mkl() -> str | None:
    mkl = _wheel_file("mkl", "libmkl_rt.so")
    tbb = _wheel_file("tbb", "libtbb.so.12")
    if mkl is None:
        return None
    if tbb is not None:
        # libmkl_tbb_thread needs libtbb.so.12 and has no search path of its own: loading it
        # first makes the name resolve. TBB's pool measured faster than MKL's OpenMP layer here.
        ctypes.CDLL(str(tbb), mode=ctypes.RTLD_GLOBAL)
        os.environ.setdefault("MKL_THREADING_LAYER", "TBB")
    else:
        os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    ctypes.CDLL(str(mkl), mode=ctypes.RTLD_GLOBAL)
    return str(mkl)


def find_openblas() -> str | None:
    """An installed OpenBLAS that exports the standard CBLAS names, or None."""
    arch = os.uname().machine
    return next(
        (p for p in (f.format(arch=arch) for f in OPENBLAS_PATHS) if os.path.exists(p)), None
    )


def _load_openblas() -> str | None:
    path = find_openblas()
    if path:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def enable() -> str | None:
    """Open the fastest available BLAS for MLX; returns its path, or None when MLX keeps its own
    (not Linux, `ONDEVICE_BLAS=reference`, nothing installed, or MLX already loaded)."""
    global _enabled
    if _enabled is not None or not sys.platform.startswith("linux"):
        return _enabled
    if "mlx.core" in sys.modules:
        return None  # too late: libmlx already bound its symbols
    choice = os.environ.get(ENV, "").strip()
    try:
        if choice == "reference":
            return None
        if choice == "mkl":
            _enabled = _load_mkl()
        elif choice == "openblas":
            _enabled = _load_openblas()
        elif choice:
            ctypes.CDLL(choice, mode=ctypes.RTLD_GLOBAL)
            _enabled = choice
        else:
            _enabled = _load_mkl() or _load_openblas()
    except OSError as e:
        # A broken BLAS must not stop the program: MLX's own still works, only slower.
        print(
            f"warning: could not load a fast BLAS ({e}); MLX uses its reference BLAS.",
            file=sys.stderr,
        )
        return None
    return _enabled
