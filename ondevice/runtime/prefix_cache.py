"""The prompt cache: both models' KV for recent token sequences, reused by the next generation.

A generation leaves its verifier's (and draft's) cache holding the prompt and the answer. Instead
of dropping it, `PrefixCache.store` keeps it as an entry keyed by those tokens; the next
`restore` finds the entry sharing the longest prefix with the new prompt, puts that prefix back
into the engines and trims the rest, so the decoder prefills only the new tokens (decoders'
`run(..., resume=True)`). Every engine's cache is written by position (MLX `KVCache`, the Core ML
draft's state, the reference executor's buffers), so the first n entries of a cache depend only
on the first n tokens and a prefix stays valid whatever came after it.

At least the prompt's last token is always left to feed: the decoders need the logits it gives.

Where the CPU kernel computes prompts with other instructions than decoding (runtime/kernel.py,
"Prompts apart"), a decoded row is not bitwise what a prompt pass writes, so an entry keeps only
the rows prompt passes wrote (`MLXEngine.reusable`: the prompt but its last token); the next
turn prefills the previous answer again, at the prompt's rate, and decodes exactly what an
uncached request would.

Entries live in an LRU bounded in bytes (`max_bytes`; 0 turns the cache off). An entry whose
tokens the new prompt extends is moved into the engines (no copy; the generation stores it back,
longer); one the prompt leaves early is copied up to the shared prefix and stays, so two
conversations do not take each other's history. Entries loaded from a file (`load_file`, made by
`save_file`) are pinned: always copied, never evicted.

Every call must come from the model's generation thread (MLX streams belong to their thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ondevice.errors import OndeviceError
from ondevice.models.cache import KVCache
from ondevice.rules.engine import Engine
from ondevice.runtime.engines import DraftWindow, MLXEngine, innermost

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB: a few long conversations of a 1.5B pair
FILE_FORMAT = "ondevice-prompt-cache"
FILE_VERSION = 2  # 2: a sha256 over the tokens, fingerprints and arrays is kept and checked


class PromptCacheError(OndeviceError):
    """A saved prompt cache that cannot be used with the loaded models."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


# -- one engine's saved prefix ---------------------------------------------------------------------


@dataclass
class Saved:
    """The KV of an engine's first `length` positions: an MLX `KVCache` (at offset `length`)
    or a package draft's `export_kv` arrays."""

    length: int
    kv: KVCache | dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        if isinstance(self.kv, KVCache):
            return self.kv.nbytes
        return sum(a.nbytes for a in self.kv.values())

    def fits(self, engine: Engine) -> bool:
        if isinstance(engine, DraftWindow):
            engine = innermost(engine)
        return isinstance(self.kv, KVCache) == isinstance(engine, MLXEngine)


def _prefix_engine(engine: Engine, n: int) -> Engine | None:
    """The engine whose cache holds the sequence's first n positions: the engine itself, or a
    draft window's engine while the window has not moved (None once it has: nothing to keep,
    the draft then prefills only its window's tokens)."""
    if isinstance(engine, DraftWindow):
        return innermost(engine) if engine.holds_prefix(n) else None
    return engine


def take(engine: Engine, n: int) -> Saved | None:
    """The engine's first n positions; the engine is left empty. An MLX cache is moved out."""
    if isinstance(engine, DraftWindow):
        inner = _prefix_engine(engine, n)
        saved = take(inner, n) if inner is not None else None
        engine.reset()
        return saved
    if n <= 0:
        engine.reset()
        return None
    if isinstance(engine, MLXEngine):
        cache = engine.cache
        engine.reset()
        cache.trim(cache.offset - n)
        mx.eval(cache.state)  # nothing lazy may outlive the generation that built it
        return Saved(n, cache)
    export = getattr(engine, "export_kv", None)
    saved = Saved(n, export(n)) if export is not None else None
    engine.reset()
    return saved


def _reusable(engine: Engine) -> int:
    """How many of the engine's first positions a later prompt may reuse (`MLXEngine.reusable`:
    not a decoded row where the kernel computes prompts apart); any other engine's all."""
    return getattr(innermost(engine), "reusable", engine.length)


def put(engine: Engine, saved: Saved, n: int, move: bool, tokens: Sequence[int]) -> None:
    """Start the engine from the first n positions of `saved`, which hold tokens[:n] (moved when
    `move`: then `saved` must not be used again)."""
    if isinstance(engine, DraftWindow):
        put(innermost(engine), saved, n, move, tokens)
        engine.adopt(tokens[:n])
        return
    if isinstance(saved.kv, KVCache):
        assert isinstance(engine, MLXEngine)
        if move:
            saved.kv.trim(saved.kv.offset - n)
            engine.adopt(saved.kv)
        else:
            engine.adopt(saved.kv.copy(n))
    else:
        engine.import_kv({k: v[:, :, :n] for k, v in saved.kv.items()})  # type: ignore[attr-defined]


# -- the LRU ---------------------------------------------------------------------------------------


@dataclass
class Entry:
    tokens: tuple[int, ...]
    verifier: Saved | None
    draft: Saved | None
    pinned: bool = False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.verifier, self.draft) if p is not None)


@dataclass
class Restored:
    """What `restore` put into the engines: the tokens each cache now holds."""

    verifier: int = 0
    draft: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise OndeviceError(
                f"prompt_cache_bytes must be an integer >= 0 (0: no cache), got {max_bytes!r}."
            )
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next_id = 0
        # running totals, so that stats() may be read from any thread while the generation
        # thread changes the entries
        self._bytes = 0
        self._pinned_bytes = 0
        self._count = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.cached_tokens = 0  # prompt tokens not prefilled thanks to the cache, in total

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or any(e.pinned for e in self._entries.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return self._count

    def stats(self) -> dict[str, int]:
        return {
            "entries": self._count,
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "cached_tokens": self.cached_tokens,
        }

    def clear(self) -> None:
        """Forget every entry, pinned ones included."""
        for key in list(self._entries):
            self._remove(key)

    def _insert(self, entry: Entry) -> None:
        self._entries[self._next_id] = entry
        self._next_id += 1
        self._count += 1
        self._bytes += entry.nbytes
        self._pinned_bytes += entry.nbytes if entry.pinned else 0

    def _remove(self, key: int) -> Entry:
        entry = self._entries.pop(key)
        self._count -= 1
        self._bytes -= entry.nbytes
        self._pinned_bytes -= entry.nbytes if entry.pinned else 0
        return entry

    # -- lookup ------------------------------------------------------------------------------------

    def restore(self, prompt: Sequence[int], verifier: Engine, draft: Engine | None) -> Restored:
        """Put the longest cached prefix of `prompt` (all but its last token at most) into the
        engines, which are emptied first. Returns how many tokens each then holds."""
        verifier.reset()
        if draft is not None:
            draft.reset()
        limit = len(prompt) - 1
        best: tuple[int, int] | None = None  # (verifier tokens, key)
        shared = {}
        for key, e in self._entries.items():  # later entries are more recent: they win ties
            if e.verifier is None or not e.verifier.fits(verifier):
                continue
            shared[key] = n = min(common_prefix(e.tokens, prompt), limit)
            nv = min(n, e.verifier.length)
            if nv > 0 and (best is None or nv >= best[0]):
                best = (nv, key)
        if best is None:
            self.misses += int(self.enabled)
            return Restored()
        nv, key = best
        e = self._entries[key]
        nd = 0
        if draft is not None and e.draft is not None and e.draft.fits(draft):
            nd = min(shared[key], e.draft.length)
        # the prompt extends the entry: move it (its tail would be stored again, longer)
        move = not e.pinned and shared[key] >= len(e.tokens)
        if move:
            self._remove(key)
        else:
            self._entries.move_to_end(key)
        put(verifier, e.verifier, nv, move, prompt)  # type: ignore[arg-type]
        if nd:
            try:
                put(draft, e.draft, nd, move, prompt)  # type: ignore[arg-type]
            except Exception:  # e.g. Core ML refusing a state write: the draft prefills instead
                draft.reset()  # type: ignore[union-attr]
                nd = 0
        self.hits += 1
        self.cached_tokens += nv
        return Restored(nv, nd)

    # -- keeping what a generation built -----------------------------------------------------------

    def store(
        self,
        tokens: Sequence[int],
        verifier: Engine,
        draft: Engine | None,
        verifier_valid: int,
        draft_valid: int = 0,
    ) -> None:
        """Keep the engines' caches as an entry: their first `*_valid` positions hold
        tokens[:*_valid]. The engines are left empty either way."""
        if not self.max_bytes:
            verifier.reset()
            if draft is not None:
                draft.reset()
            return
        nv = min(verifier_valid, verifier.length, len(tokens), _reusable(verifier))
        v = take(verifier, nv)
        d = None
        if draft is not None:
            d = take(draft, min(draft_valid, draft.length, len(tokens)))
        if v is None:
            return  # no verifier prefix, nothing worth keeping
        entry = Entry(tuple(int(t) for t in tokens[: max(nv, d.length if d else 0)]), v, d)
        self._add(entry)

    def _add(self, entry: Entry) -> None:
        # entries the new one covers (their tokens and parts are prefixes of its) go
        for key, e in list(self._entries.items()):
            if e.pinned or common_prefix(e.tokens, entry.tokens) < len(e.tokens):
                continue
            if _covers(entry.verifier, e.verifier) and _covers(entry.draft, e.draft):
                self._remove(key)
        if not entry.pinned and entry.nbytes > self.max_bytes:
            self.evictions += 1  # larger than the whole budget: not kept
            return
        self._insert(entry)
        # least recently used first; pinned entries (saved prompts) are outside the budget
        while self._bytes - self._pinned_bytes > self.max_bytes:
            key = next(k for k, e in self._entries.items() if not e.pinned)
            self._remove(key)
            self.evictions += 1

    # -- saved prompts -----------------------------------------------------------------------------

    def save_file(
        self,
        path: str | Path,
        tokens: Sequence[int],
        verifier: Engine,
        draft: Engine | None,
        fingerprints: dict[str, str],
    ) -> None:
        """Write the KV of `tokens`, which the engines' caches hold in full, to `path`
        (safetensors; written to a temporary name first, so a failure leaves no file)."""
        n = len(tokens)
        arrays: dict[str, mx.array] = {}
        for role, engine in (("verifier", verifier), ("draft", draft)):
            if engine is None:
                continue
            if engine.length >= n:
                engine = _prefix_engine(engine, n)
                if engine is None:  # a draft window that moved: the draft prefills itself
                    continue
            if engine.length < n:
                raise ValueError(f"the {role}'s cache holds {engine.length} of {n} tokens")
            if isinstance(engine, MLXEngine):
                for i, (k, v) in enumerate(engine.cache.prefix(n)):
                    arrays[f"{role}.{i}.keys"], arrays[f"{role}.{i}.values"] = k, v
            elif hasattr(engine, "export_kv"):
                for name, a in engine.export_kv(n).items():
                    arrays[f"{role}.{name}"] = mx.array(a)
        meta = {
            "format": FILE_FORMAT,
            "format_version": str(FILE_VERSION),
            "tokens": json.dumps([int(t) for t in tokens]),
            **fingerprints,
        }
        meta["sha256"] = _digest(arrays, meta)
        path = Path(path)
        if path.suffix != ".safetensors":
            path_tmp = path.with_name(f".{path.name}.tmp.safetensors")
        else:
            path_tmp = path.with_name(f".{path.stem}.tmp.safetensors")
        try:
            mx.save_safetensors(str(path_tmp), arrays, metadata=meta)
            # read back: MLX reports no write error (a full disk leaves a short file)
            back, back_meta = mx.load(str(path_tmp), format="safetensors", return_metadata=True)
            if back_meta.get("sha256") != _digest(back, back_meta):
                raise OSError("the file read back differs from what was written; is the disk full?")
            os.replace(path_tmp, path)
        except (OSError, RuntimeError, ValueError) as e:  # MLX raises RuntimeError for files
            raise PromptCacheError(
                f"{path}: cannot write the prompt cache ({e}). Check that the folder exists, is "
                "writable and has room for it."
            ) from None
        finally:
            with contextlib.suppress(OSError):  # none was made, or its folder is not one
                path_tmp.unlink(missing_ok=True)

    def load_file(
        self,
        path: str | Path,
        verifier: Engine,
        draft: Engine | None,
        fingerprints: dict[str, str],
    ) -> int:
        """Add the prompt saved at `path` as a pinned entry; returns its length in tokens.
        A file made for another verifier or tokenizer is refused; a draft part made for
        another draft is left out (the draft then prefills the prompt itself)."""
        path = Path(path)
        if not path.is_file():
            raise PromptCacheError(f"{path}: no such prompt cache file (make one with "
                                   "`ondevice cache-prompt`).")  # fmt: skip
        try:
            arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        except Exception as e:  # a truncated or foreign file
            raise PromptCacheError(f"{path}: not a readable prompt cache ({e}).") from None
        if meta.get("format") != FILE_FORMAT:
            raise PromptCacheError(f"{path}: not a prompt cache made by `ondevice cache-prompt`.")
        if meta.get("format_version") != str(FILE_VERSION):
            raise PromptCacheError(
                f"{path}: prompt cache format {meta.get('format_version')}, this version reads "
                f"{FILE_VERSION}; make it again with `ondevice cache-prompt`."
            )
        if meta.get("sha256") != _digest(arrays, meta):
            raise PromptCacheError(
                f"{path}: damaged (its contents do not match the sha256 it was saved with); "
                "make it again with `ondevice cache-prompt`."
            )
        for field, what in (("tokenizer", "tokenizer"), ("verifier", "verifier model")):
            if meta.get(field) != fingerprints[field]:
                raise PromptCacheError(
                    f"{path} was made for another {what} (its {field} fingerprint "
                    f"{str(meta.get(field))[:12]}, the loaded one's {fingerprints[field][:12]}); "
                    "make it again with `ondevice cache-prompt` and the same --model, --draft "
                    "and --dtype."
                )
        tokens = _tokens(meta.get("tokens"), verifier.vocab_size, path)
        v = _saved_from_file(arrays, "verifier", verifier, len(tokens), path)
        d = None
        # a file without a draft part: the draft's window had moved; it prefills itself
        has_draft = any(k.startswith("draft.") for k in arrays)
        if draft is not None and has_draft:
            if meta.get("draft") == fingerprints.get("draft"):
                d = _saved_from_file(arrays, "draft", innermost(draft), len(tokens), path)
            else:
                warnings.warn(
                    f"{path}: made for another draft (or draft backend); only the verifier's "
                    "part is used.",
                    stacklevel=2,
                )
        self._add(Entry(tokens, v, d, pinned=True))
        return len(tokens)


def _digest(arrays: dict[str, mx.array], meta: dict[str, str]) -> str:
    """sha256 over the metadata (but its own digest) and every array's name, dtype, shape and
    bytes: a flipped bit anywhere in a saved prompt is found before its KV is used."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"},
                                  sort_keys=True).encode())  # fmt: skip
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)}".encode())
        raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # numpy has no bfloat16
        h.update(np.ascontiguousarray(np.array(raw)).data)
    return h.hexdigest()


def _tokens(value: Any, vocab_size: int, path: Path) -> tuple[int, ...]:
    """The saved token ids, checked: a list of ids of the loaded vocabulary."""
    try:
        tokens = json.loads(value)
    except (TypeError, ValueError):
        tokens = None
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        or not all(0 <= t < vocab_size for t in tokens)
    ):
        raise PromptCacheError(
            f"{path}: its token list is not a list of this model's token ids; make it again "
            "with `ondevice cache-prompt`."
        )
    return tuple(tokens)


def _covers(new: Saved | None, old: Saved | None) -> bool:
    return old is None or (new is not None and new.length >= old.length)


def _saved_from_file(
    arrays: dict[str, mx.array], role: str, engine: Engine, n: int, path: Path
) -> Saved:
    try:
        if isinstance(engine, MLXEngine):
            layers = len(engine.cache)
            kv = [(arrays[f"{role}.{i}.keys"], arrays[f"{role}.{i}.values"]) for i in range(layers)]
            cfg = engine.model.config
            want = (1, cfg.num_key_value_heads, n, cfg.head_dim)
            if any(tuple(a.shape) != want for pair in kv for a in pair):
                raise KeyError("shape")
            return Saved(n, KVCache.holding(kv))
        parts = {name: np.array(arrays[f"{role}.{name}"]) for name in ("key_cache", "value_cache")}
        if any(a.ndim != 4 or a.shape[2] != n for a in parts.values()):
            raise KeyError("length")
        return Saved(n, parts)
    except KeyError:
        raise PromptCacheError(
            f"{path}: its {role} part does not match the loaded {role} ({engine.name}); make the "
            "file again with `ondevice cache-prompt` and the same models and --draft-backend."
        ) from None


# -- fingerprints ----------------------------------------------------------------------------------


def model_fingerprint(model: Any) -> str:
    """sha256 over every parameter's name, shape, dtype and a sample of its values (the first
    and last 16): tells checkpoints (and dtypes) apart without reading gigabytes."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256(type(model).__name__.encode())
    samples = []
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.reshape(-1)
        samples.append(mx.concatenate([flat[:16], flat[-16:]]))
    mx.eval(samples)
    for s in samples:
        h.update(np.array(s.astype(mx.float32) if s.dtype == mx.bfloat16 else s).tobytes())
    return h.hexdigest()


def package_fingerprint(path: str | Path) -> str:
    """sha256 over a `.mlpackage`'s files: small ones whole, large ones by size and ends."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(root)}:{size}".encode())
        with f.open("rb") as fh:
            if size <= 1 << 20:
                h.update(fh.read())
            else:
                h.update(fh.read(1 << 16))
                fh.seek(size - (1 << 16))
                h.update(fh.read())
    return h.hexdigest()
