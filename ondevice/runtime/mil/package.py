"""Reading a saved `.mlpackage`: its ML Program, and the draft description stored in its metadata.

`convert_draft` writes the description (functions, shapes, context, chunk, kv mode) as JSON
under `METADATA_KEY` in the package's user-defined metadata, with `FORMAT_VERSION`; the draft
engines read it back here without loading the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ondevice.errors import OndeviceError

METADATA_KEY = "ondevice.draft"  # user-defined metadata entry written by convert_draft
FORMAT_VERSION = 1


def _require_package(path: Path) -> None:
    if not (path / "Manifest.json").exists():
        raise OndeviceError(f"{path}: not a .mlpackage (no Manifest.json).")


def load_program(path: Path) -> tuple[Any, Any]:
    """(spec, MIL program with every function) of the package at `path`.

    coremltools' milproto loader works on Linux: no Core ML runtime is involved.
    """
    from coremltools.converters.mil.frontend.milproto import load as milproto
    from coremltools.models.utils import _try_get_weights_dir_path, load_spec

    _require_package(path)
    try:
        spec = load_spec(str(path))
        if spec.WhichOneof("Type") != "mlProgram":
            raise OndeviceError(
                f"{path}: not an ML Program; the reference executor runs only those."
            )
        weights_dir = _try_get_weights_dir_path(str(path)) or ""
        prog = milproto.load(spec, spec.specificationVersion, weights_dir)
    except OndeviceError:
        raise
    except Exception as e:
        raise OndeviceError(
            f"{path}: cannot load the ML Program ({type(e).__name__}: {e}); the package may be "
            "damaged; convert it again."
        ) from None
    return spec, prog


def read_description(path: str | Path) -> dict:
    """The description `convert_draft` stored in a package's metadata (reads only the spec)."""
    from coremltools.models.utils import load_spec

    path = Path(path)
    _require_package(path)
    try:
        spec = load_spec(str(path))
    except Exception as e:
        raise OndeviceError(f"{path}: cannot read the Core ML package ({e}).") from None
    raw = spec.description.metadata.userDefined.get(METADATA_KEY)
    if raw is None:
        raise OndeviceError(
            f"{path}: no {METADATA_KEY!r} metadata; this package was not written by "
            "ondevice-convert. Convert the draft again."
        )
    meta = json.loads(raw)
    if meta.get("format_version") != FORMAT_VERSION:
        raise OndeviceError(
            f"{path}: draft format version {meta.get('format_version')} is not supported "
            f"(this ondevice reads version {FORMAT_VERSION}); convert the draft again."
        )
    return meta
