"""The public face: `ondevice.load(...)` returns a `Generator` with generate / stream / astream."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import mlx.core as mx

from ondevice.decoders.base import Decoder
from ondevice.decoders.factory import make_decoder
from ondevice.errors import CoreMLRuntimeError, CoreMLUnavailableError, OndeviceError
from ondevice.models import LoadedModel, load_model
from ondevice.models.tokenizer import RESERVED_TEMPLATE_ARGS, Tokenizer, check_pair
from ondevice.proposers import registry
from ondevice.proposers.registry import METHODS as METHODS
from ondevice.proposers.resources import Calibrations, Speculation
from ondevice.results import Chunk, GenerationResult
from ondevice.rules.sampling import (
    SAMPLING_FIELDS,
    Grammar,
    SamplingParams,
    check_int,
    check_kind,
    check_vocab,
)
from ondevice.runtime.coreml_engines import fall_back
from ondevice.runtime.drift import DriftMonitor, check_domain, read_baseline, state_key
from ondevice.runtime.engines import (
    DRAFT_BACKENDS,
    MLXEngine,
    draft_window,
    innermost,
    make_draft_engine,
)
from ondevice.runtime.memory import apply_metal_limits, param_bytes
from ondevice.runtime.pass_costs import remeasure_stale
from ondevice.runtime.placement import BESIDE_VERIFIER, Placement, place_draft
from ondevice.runtime.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache, Restored
from ondevice.runtime.worker import Worker
from ondevice.streaming import decode_chunks

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


@dataclass
class _Pair:
    verifier: LoadedModel
    draft: LoadedModel | None = None
    mlpackage: Path | None = None
    draft_context: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    heads: Path | None = None  # Medusa heads given to `load` (method "medusa")


def _check_int(name: str, value: Any, low: int, none_ok: bool = False) -> None:
    """OndeviceError unless `value` is an int >= `low` (or None, if allowed)."""
    try:
        check_int(name, value, low, none_ok)
    except ValueError as e:
        raise OndeviceError(str(e)) from None


def _check_type(name: str, value: Any, types: type | tuple[type, ...], what: str) -> None:
    try:
        check_kind(name, value, types, what)
    except ValueError as e:
        raise OndeviceError(str(e)) from None


def _check_options(options: dict[str, Any]) -> None:
    """OndeviceError naming the first of `Generator.stream`'s options (other than the sampling
    fields, which `SamplingParams.from_options` checks) of the wrong type: a number where a flag
    belongs is refused here, not coerced."""
    for flag in ("speculative", "chat_template", "cache_prompt"):
        _check_type(flag, options[flag], bool, "True or False")
    _check_type("pipeline", options["pipeline"], (bool, type(None)), "True, False or None")
    _check_type("method", options["method"], str, "a method name")
    _check_type("tools", options["tools"], (list, tuple, type(None)), "a list of tools or None")
    _check_type("chat_template_kwargs", options["chat_template_kwargs"], (dict, type(None)),
                "a dict or None")  # fmt: skip
    reserved = sorted(set(options["chat_template_kwargs"] or ()) & set(RESERVED_TEMPLATE_ARGS))
    if reserved:
        raise OndeviceError(
            f"chat_template_kwargs: {reserved[0]!r} is reserved (an argument of the chat "
            "template function itself); rename it."
        )
    _check_int("max_tokens", options["max_tokens"], 0)
    _check_int("num_draft_tokens", options["num_draft_tokens"], 0, none_ok=True)
    _check_int("seed", options["seed"], 0, none_ok=True)
    stop = options["stop"]
    if not (stop is None or isinstance(stop, str) or (
        isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop)
    )):  # fmt: skip
        raise OndeviceError(f"stop must be a string or a list of strings, got {stop!r}.")


class Generator:
    """A loaded verifier (and optional draft) ready to generate."""

    def __init__(
        self, pair: _Pair, draft_backend: str = "auto", prompt_cache_bytes: int = DEFAULT_MAX_BYTES
    ):
        self._pair = pair
        # The model's generation thread: every generation runs there, so the KV caches (whose
        # MLX arrays belong to the thread's stream) outlive a call and the prompt cache can
        # reuse them. Started on first use. Its job queue is also the line of callers: a
        # generation asked for while another runs waits its turn (first come, first served).
        # Pass costs are measured there too: on Linux the CPU kernel's products run on OpenMP,
        # whose every calling thread keeps a pool of its own, and a second pool makes them all
        # stop spinning between products (runtime/kernel.py, "Threads").
        self._worker: Worker | None = None
        # callers on several threads may ask for it at once: exactly one may start it
        self._worker_lock = threading.Lock()
        self.tokenizer: Tokenizer = pair.verifier.tokenizer
        self.model_name = str(pair.extra.get("name") or pair.verifier.path.name)
        self.verifier = MLXEngine(pair.verifier.model)
        # a profile live passes marked stale is measured here, where a wait is expected, never
        # in a generation (runtime/pass_costs.py); the draft's once it is chosen, below
        self._call(lambda: remeasure_stale(self.verifier))
        self.context_length = self.verifier.context_length
        self.draft = None
        # where `auto` put the draft when it could choose (Core ML and MLX both run: a Mac)
        self.placement: Placement | None = None
        if pair.draft is not None or pair.mlpackage is not None:
            self.draft = make_draft_engine(
                draft_backend,
                mlx_model=pair.draft.model if pair.draft else None,
                mlpackage=pair.mlpackage,
                context_length=pair.draft_context,
            )
            if draft_backend == "auto" and self.draft.name == "coreml" and pair.draft:
                mlx = MLXEngine(pair.draft.model, pair.draft_context)
                try:  # placement runs both functions too: a failure there falls back as well
                    self.draft, self.placement = place_draft(
                        self.verifier, {"coreml": self.draft, "mlx": mlx}
                    )
                except CoreMLUnavailableError as e:
                    fall_back(str(e), "bundle's MLX", pair.mlpackage)  # type: ignore[arg-type]
                    self.draft = mlx
                del mlx
                if self.draft.name == "coreml" and "reload_draft" in pair.extra:
                    pair.draft = None  # the losing MLX draft's memory goes back (8 GB Macs)
                    mx.clear_cache()
        self.draft_backend = self.draft.name if self.draft is not None else None
        if self.draft is not None:
            self._call(lambda: remeasure_stale(self.draft))  # type: ignore[arg-type]
        draft_mlx = self.draft.model if isinstance(self.draft, MLXEngine) else None
        apply_metal_limits(
            param_bytes(self.verifier.model) + (param_bytes(draft_mlx) if draft_mlx else 0)
        )
        if self.draft is not None:
            # past its own context the draft drafts from the newest tokens (a sliding window)
            self.draft = draft_window(self.draft, self.context_length)
        # the draft's window in tokens (None: no draft); prompts may be longer (context_length)
        self.draft_context = self.draft.window if self.draft is not None else None
        self.prompt_cache = PrefixCache(prompt_cache_bytes)
        # what proposers learn about this pair across its generations (new with a new draft)
        self.calibrations = Calibrations()
        self._ll_tokenizer: Any = None  # llguidance's view of the vocabulary, for grammars
        self._fingerprints: dict[str, str] | None = None
        self._marks: tuple[str | None, str, tuple[str, ...]] | None = None  # _template_marks
        # the pair's rolling acceptance against the one its bundle recorded (runtime/drift.py)
        from ondevice.sources.hub import cache_dir

        drafts = pair.mlpackage or (pair.draft.path if pair.draft else None)
        self.drift = DriftMonitor(
            pair.extra.get("baseline"),
            model=self.model_name,
            key=state_key(str(pair.verifier.path), str(drafts or "")),
            state_dir=cache_dir() / "drift",
        )

    @property
    def loaded_draft(self) -> LoadedModel | None:
        """The draft as loaded (its MLX model, config, tokenizer and path), or None: no draft,
        or a Core ML draft that won the placement and let its MLX twin go."""
        return self._pair.draft

    # -- prompts ----------------------------------------------------------------------------

    def encode_prompt(
        self,
        prompt: Prompt,
        chat_template: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a prompt. Chats go through the chat template, with `tools` (OpenAI
        function schemas) and `template_kwargs` (e.g. enable_thinking=False) passed to it."""
        chat = {"tools": tools, **(template_kwargs or {})}
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (str, Sequence)):
            raise OndeviceError(
                "prompt must be a string, a list of {'role','content'} messages, or a list of "
                f"token ids; got {type(prompt).__name__}."
            )
        tok = self.tokenizer
        if isinstance(prompt, str):
            if chat_template and tok.chat_template:
                if self.is_templated(prompt):  # rendered already: templating again doubles it
                    return tok.encode(prompt, add_special_tokens=False)
                text = tok.apply_chat_template([{"role": "user", "content": prompt}], **chat)
                return tok.encode(text, add_special_tokens=False)
            return tok.encode(prompt)
        prompt = list(prompt)
        if not prompt:
            raise OndeviceError("the prompt is empty.")
        if all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise OndeviceError(f"message {i} needs string 'role' and 'content' fields.")
            text = tok.apply_chat_template(prompt, **chat)
            return tok.encode(text, add_special_tokens=False)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.verifier.vocab_size]
            if bad:
                raise OndeviceError(
                    f"token id {bad[0]} is outside the vocabulary (0..{self.verifier.vocab_size - 1})."
                )
            return prompt
        raise OndeviceError(
            "prompt must be a string, a list of {'role','content'} messages, or a list of token ids."
        )

    def is_templated(self, text: str) -> bool:
        """Whether a prompt string was already rendered by a chat template (mlx-lm's users pass
        `tokenizer.apply_chat_template(...)`'s text): it begins as the template renders a user
        message, or holds a special token the template writes around messages (such as
        `<|im_start|>`). Such a string is encoded as it is, not wrapped in the template again."""
        prefix, markers = self._template_marks()
        return (bool(prefix.strip()) and text.startswith(prefix)) or any(m in text for m in markers)

    def _template_marks(self) -> tuple[str, tuple[str, ...]]:
        """The chat template's text before a user message's content, and the special tokens it
        writes; cached per template (--chat-template may replace it)."""
        tok = self.tokenizer
        cached = self._marks
        if cached is not None and cached[0] == tok.chat_template:
            return cached[1], cached[2]
        sentinel = "\u2063ondevice\u2063"
        try:
            rendered = tok.apply_chat_template([{"role": "user", "content": sentinel}])
        except OndeviceError:  # a template that needs a system turn, ... : no prefix to match
            rendered = ""
        prefix = rendered.split(sentinel)[0] if sentinel in rendered else ""
        specials = tok._tok.get_added_tokens_decoder().values()
        markers = tuple(
            t.content for t in specials if t.special and t.content and t.content in rendered
        )
        self._marks = (tok.chat_template, prefix, markers)
        return prefix, markers

    def count_tokens(self, prompt: Prompt, chat_template: bool = True, **chat: Any) -> int:
        return len(self.encode_prompt(prompt, chat_template, **chat))

    def grammar(
        self,
        *,
        json_schema: dict[str, Any] | bool | None = None,
        lark: str | None = None,
        regex: str | None = None,
        gbnf: str | None = None,
    ) -> Grammar:
        """A grammar for `stream(grammar=...)`: JSON valid under `json_schema` (True: any JSON
        object), or text matching a Lark grammar, a GBNF grammar (llama.cpp's) or a regular
        expression. Both models' distributions are masked by it, so speculation stays exact for
        the constrained law. A grammar that no token of the vocabulary can begin is refused
        here; one that reaches such a state later ends its generation with a GrammarError."""
        from ondevice.rules import grammar as g

        if sum(x is not None for x in (json_schema, lark, regex, gbnf)) != 1:
            raise OndeviceError("give exactly one of json_schema, lark, gbnf or regex.")
        if self._ll_tokenizer is None:  # about half a second for a large vocabulary
            self._ll_tokenizer = g.ll_tokenizer(
                self.tokenizer._tok, self.verifier.vocab_size, self.tokenizer.eos_token_ids
            )
        args = (self._ll_tokenizer,)
        rest = (self.verifier.vocab_size, self.tokenizer.eos_token_ids)
        if json_schema is not None:
            schema = {"type": "object"} if json_schema is True else json_schema
            return g.Grammar.json_schema(*args, schema, *rest)
        if lark is not None:
            return g.Grammar.lark(*args, lark, *rest)
        if gbnf is not None:
            return g.Grammar.gbnf(*args, gbnf, *rest)
        return g.Grammar.regex(*args, regex, *rest)

    # -- generation -------------------------------------------------------------------------

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        speculative: bool = True,
        method: str = "chain",
        num_draft_tokens: int | None = None,
        pipeline: bool | None = None,
        chat_template: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_prompt: bool = True,
        domain: str | None = None,
        hide_tokens: Collection[int] = (),
        _cancel: threading.Event | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are decided; the last chunk carries finish_reason and stats.

        prompt: text, chat messages ([{"role", "content"}, ...]) or token ids.
        max_tokens: at most this many new tokens. seed: the sampling seed (None: random; the
        same seed and settings give the same tokens). stop: a string or strings that end the
        answer (not included).
        **sampling: the fields of `SamplingParams` (`SAMPLING_FIELDS`): temperature, top_p,
        top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias
        (token id -> bias), grammar (from `Generator.grammar`), logprobs (report the verifier's
        log-probabilities of the emitted tokens, and of the `logprobs` most likely). Every one
        transforms the distribution of the verifier and of the draft alike, so speculation
        stays exact for the transformed law; unknown names are refused.
        speculative: False runs the verifier alone. method: a name in `METHODS` (the registry
        `proposers/registry.py` says what each is and what a fixed num_draft_tokens means).
        pipeline: overlap drafting with verification (chain only); None picks what is faster
        for the draft backend. With the same seed and settings the tokens are the same,
        pipelined or not; another method or num_draft_tokens may use the random draws
        differently (the same distribution, other samples); at temperature 0 every choice gives
        the verifier's greedy tokens.
        chat_template: apply the model's chat template to text and messages; tools,
        chat_template_kwargs: passed to it (see `encode_prompt`).
        cache_prompt: start from the longest prefix of the prompt whose KV the prompt cache
        holds (`stats["cached_tokens"]`), and keep this generation's KV there; the tokens are
        the same either way.
        domain: the kind of request ("code", "chat", "math", ...) whose draft acceptance this
        generation counts towards (see `acceptance_drift`); None counts it in one default bucket.
        hide_tokens: token ids whose text never appears in the chunks (special tokens, see
        `Tokenizer.special_ids`); a stop string equal to one's text still ends the answer.
        Generations asked for from several threads (or while one is being read) wait their
        turn, first come first served, and each gives the tokens it would give alone.
        """
        _check_options(locals())
        params = self._sampling(sampling)
        domain = check_domain(domain)
        registry.method(method)  # checked also when speculative=False, which decodes plainly
        ids = self.encode_prompt(
            prompt, chat_template, tools=tools, template_kwargs=chat_template_kwargs
        )
        if not ids:
            raise OndeviceError("the prompt is empty (it encodes to no tokens); pass some text.")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        hidden = frozenset(int(t) for t in hide_tokens)
        cancel = _cancel or threading.Event()

        # greedy chain drafts are what the bundle's acceptance baseline measured
        plain = params.greedy and not params.processed
        comparable = speculative and self.draft is not None and method == "chain" and plain
        bucket = self.drift.bucket(domain) if comparable else None

        def run() -> Iterator[Chunk]:  # the decoder is made anew after a Core ML failure
            dec = self._decoder(params, seed, method, num_draft_tokens, pipeline, speculative)
            draft = self.draft if speculative else None
            return self._cached_stream(
                dec, draft, ids, max_tokens, stops, cancel, cache_prompt, bucket, hidden
            )

        # Queued on the model's thread behind the generations asked for earlier (by any
        # thread); the job never waits for its consumer, so a caller that starts a second
        # generation while reading the first one cannot deadlock.
        yield from self._thread().iterate(lambda: self._falling_back(run), cancel)

    def _falling_back(self, run: Callable[[], Iterator[Chunk]]) -> Iterator[Chunk]:
        """The chunks of `run()`; when Core ML fails mid-use this model moves to the MLX draft,
        and a request that has sent nothing yet starts again on it."""
        for retry in (False, True):
            started = False
            try:
                for chunk in run():
                    started = True
                    yield chunk
                return
            except CoreMLRuntimeError as e:
                self._leave_core_ml(str(e))
                if started or retry:
                    raise

    def _sampling(self, sampling: dict[str, Any]) -> SamplingParams:
        """The sampling parameters of `stream`'s sampling keywords, checked."""
        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise OndeviceError(
                f"unknown option {unknown[0]!r}; the sampling options are "
                f"{', '.join(SAMPLING_FIELDS)}."
            )
        try:
            params = SamplingParams.from_options(sampling)
            check_vocab(params, self.verifier.vocab_size)
        except (ValueError, TypeError) as e:
            raise OndeviceError(f"invalid sampling option: {e}") from None
        return params

    def _decoder(
        self,
        params: SamplingParams,
        seed: int | None,
        name: str,
        num_draft_tokens: int | None,
        pipeline: bool | None,
        speculative: bool,
    ) -> Decoder:
        """The decoder of one generation (the pipelining default follows the draft backend,
        which a Core ML failure changes)."""
        spec = self._speculation(name, num_draft_tokens, pipeline, speculative)
        draft = self.draft if speculative else None
        dec = make_decoder(
            self.verifier, draft, params, spec, eos_token_ids=self.tokenizer.eos_token_ids,
            seed=seed, heads=self._pair.heads, calibrations=self.calibrations,
        )  # fmt: skip
        if not speculative:
            dec.skip_reason = "speculative=False"
        return dec

    # -- the generation thread and the prompt cache -----------------------------------------

    def _thread(self) -> Worker:
        with self._worker_lock:
            if self._worker is None:
                self._worker = Worker("ondevice-generate")
                weakref.finalize(self, self._worker.stop)
            return self._worker

    def close(self) -> None:
        """End the model's generation thread, waiting for it (a later call starts a new one)."""
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the model's thread (it may touch the caches); its result or exception."""
        return self._thread().call(fn)

    def _cached_stream(
        self, dec, draft, ids, max_tokens, stops, cancel, cache_prompt, bucket, hidden
    ):
        """`_stream` from the prompt cache's longest prefix of `ids`; afterwards the caches are
        kept there (or dropped when the generation failed mid-round)."""
        t = time.perf_counter()
        if cache_prompt:
            restored = self.prompt_cache.restore(ids, self.verifier, draft)
        else:
            restored = Restored()
            self._reset_engines()
        t_restore = time.perf_counter() - t
        moves = draft.moves if draft is not None else 0
        emitted: list[int] = []
        consistent = True  # the caches hold whole rounds (a closed stream stops between them)
        chunks = self._stream(dec, ids, max_tokens, stops, cancel, hidden)
        try:
            for chunk in chunks:
                emitted.extend(chunk.tokens)
                if chunk.stats is not None:
                    chunk.stats["cached_tokens"] = restored.verifier
                    chunk.stats["draft_cached_tokens"] = restored.draft
                    if draft is not None:  # the draft's window, and how often it moved
                        chunk.stats["draft_window"] = draft.window
                        chunk.stats["draft_window_moves"] = draft.moves - moves
                    chunk.stats["prompt_seconds"] += t_restore
                    chunk.stats["total_seconds"] += t_restore
                    if bucket is not None:
                        self.drift.observe(bucket, chunk.stats)
                yield chunk
        except GeneratorExit:
            raise
        except BaseException:
            consistent = False
            raise
        finally:
            chunks.close()  # stops the decoder between rounds
            if cache_prompt and consistent:
                seq = [*ids, *emitted]
                self.prompt_cache.store(
                    seq, self.verifier, draft, len(seq), dec.draft_prefix_length()
                )
            self._reset_engines()

    def _leave_core_ml(self, reason: str) -> None:
        """Move the draft off Core ML for good (on the model's thread): to the bundle's MLX
        draft, else to the reference executor of the same package; one line says why."""
        if self.draft is None or self.draft.name != "coreml":
            return
        pair = self._pair
        if pair.draft is None and "reload_draft" in pair.extra:
            pair.draft = pair.extra["reload_draft"]()
        to = "bundle's MLX" if pair.draft is not None else "reference"
        fall_back(reason, to, pair.mlpackage)  # type: ignore[arg-type]
        engine = make_draft_engine(
            "mlx" if pair.draft is not None else "reference",
            mlx_model=pair.draft.model if pair.draft is not None else None,
            mlpackage=pair.mlpackage,
            context_length=pair.draft_context,
        )
        self.draft = draft_window(engine, self.context_length)
        self.draft_backend = self.draft.name
        self.placement = None
        self._fingerprints = None
        self.calibrations = Calibrations()

    def _reset_engines(self) -> None:
        self.verifier.reset()
        if self.draft is not None:
            self.draft.reset()

    def acceptance_drift(self) -> dict[str, Any]:
        """The draft's rolling acceptance per domain against the one its bundle recorded when
        it was made, and whether it has fallen (see `ondevice.runtime.drift`): {"baseline",
        "alarm", "advice", "window", "domains": {name: acceptance, trials, baseline, threshold,
        alarm, since}}."""
        return self.drift.status()

    def prompt_cache_stats(self) -> dict[str, int]:
        """entries, bytes, max_bytes, hits, misses, evictions and cached_tokens (in total)."""
        return self.prompt_cache.stats()

    def clear_prompt_cache(self) -> None:
        self._call(self.prompt_cache.clear)

    def fingerprints(self) -> dict[str, str]:
        """What a saved prompt cache must match: tokenizer, verifier and draft."""
        if self._fingerprints is None:
            from ondevice.runtime.prefix_cache import model_fingerprint, package_fingerprint

            fp = {
                "tokenizer": self.tokenizer.fingerprint(),
                "verifier": self._call(lambda: model_fingerprint(self.verifier.model)),
                "draft": "",
            }
            draft = innermost(self.draft) if self.draft is not None else None
            if isinstance(draft, MLXEngine):
                fp["draft"] = "mlx:" + self._call(lambda: model_fingerprint(draft.model))
            elif draft is not None:
                fp["draft"] = "package:" + package_fingerprint(draft.path)
            self._fingerprints = fp
        return self._fingerprints

    def save_prompt_cache(
        self, path: str | Path, prompt: Prompt, chat_template: bool = True
    ) -> int:
        """Prefill `prompt` and write both models' KV of it to `path` (safetensors), for
        `load(..., prompt_cache=path)`. Returns the number of tokens saved."""
        ids = self.encode_prompt(prompt, chat_template)
        fingerprints = self.fingerprints()
        if len(ids) >= self.context_length:
            from ondevice.errors import ContextLengthError

            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.context_length}."
            )

        def work() -> None:
            from ondevice.rules.engine import prefill

            self.prompt_cache.restore(ids, self.verifier, self.draft)
            try:
                prefill(self.verifier, ids, resume=True)
                if self.draft is not None:
                    prefill(self.draft, ids, resume=True)
                self.prompt_cache.save_file(path, ids, self.verifier, self.draft, fingerprints)
                self.prompt_cache.store(ids, self.verifier, self.draft, len(ids), len(ids))
            finally:
                self._reset_engines()

        self._call(work)  # after the generations already queued
        return len(ids)

    def load_prompt_cache(self, path: str | Path) -> int:
        """Start every later prompt that begins with the prompt saved at `path` (by
        `save_prompt_cache` or `ondevice cache-prompt`) from its KV. Returns its length."""
        fingerprints = self.fingerprints()
        return self._call(
            lambda: self.prompt_cache.load_file(path, self.verifier, self.draft, fingerprints)
        )

    def _speculation(
        self, name: str, num_draft_tokens: int | None, pipeline: bool | None, speculative: bool
    ) -> Speculation:
        """The speculation settings of one generation."""
        if pipeline is None:  # pipelined where the draft runs beside the verifier
            pipeline = (
                self.placement.pipelined
                if self.placement is not None
                else self.draft_backend in BESIDE_VERIFIER
            )
        return Speculation(
            method=name if speculative else "chain",
            num_draft_tokens=num_draft_tokens,
            pipeline=pipeline,
        )

    def _stream(self, dec, ids, max_tokens, stops, cancel, hidden=frozenset()):
        detok = self.tokenizer.detokenizer(hidden)
        # a hidden token whose text is a stop string still stops (Continue's FIM stop list)
        stop_ids = {t for t in hidden if self.tokenizer.id_to_token(t) in stops}
        return decode_chunks(
            dec, ids, max_tokens, stops, cancel, detok, self.draft_backend, stop_ids
        )

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """The whole answer at once: `stream(prompt, **kwargs)` collected into a
        GenerationResult (text, token ids, stats, finish_reason); the options are `stream`'s."""
        text, tokens = [], []
        last: Chunk | None = None
        for chunk in self.stream(prompt, **kwargs):
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            last = chunk
        assert last is not None and last.stats is not None
        return GenerationResult("".join(text), tokens, last.stats, last.finish_reason or "length")

    async def astream(self, prompt: Prompt, **kwargs: Any) -> AsyncIterator[Chunk]:
        """Like `stream`, run in a worker thread; never blocks the event loop. Closing the
        iterator (or cancelling its task) stops the generation after the current round."""
        cancel = threading.Event()
        # One long-lived thread per model: a new thread per call would leave MLX's per-thread
        # streams (native threads) behind on every request, and the caches could not be kept.
        chunks = self._thread().aiterate(
            lambda: self.stream(prompt, _cancel=cancel, **kwargs), cancel
        )
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk


def _bundle_draft(pair: _Pair, b: Any, opts: dict[str, Any]) -> None:
    """The draft of bundle `b` (its MLX copy and Core ML package) and its acceptance baseline."""
    from ondevice.models.bundle import MANIFEST

    pair.draft = load_model(b.draft_mlx_dir, **opts) if b.draft_mlx_dir else None
    pair.mlpackage, pair.draft_context = b.mlpackage, b.context_length
    pair.extra["baseline"] = read_baseline(b.manifest, b.path / MANIFEST)
    if pair.draft is not None:  # the Generator frees the MLX draft when Core ML wins
        pair.extra["reload_draft"] = lambda: load_model(b.draft_mlx_dir, **opts)
    else:
        pair.extra.pop("reload_draft", None)


def _check_load_arguments(
    verifier: Any, draft: Any, draft_backend: Any, dtype: Any, quantize: Any, dequantize: Any
) -> None:
    """OndeviceError naming the first of `load`'s arguments that is wrong."""
    for name, value in (("verifier", verifier), ("draft", draft)):
        if value is None and name == "draft":
            continue
        if not isinstance(value, (str, PathLike)) or not str(value).strip():
            raise OndeviceError(
                f"{name} must be a model folder, .gguf file, bundle or model name; got {value!r}."
            )
    if quantize is not None and (isinstance(quantize, bool) or quantize not in (4, 8)):
        raise OndeviceError(f"quantize={quantize!r}: use 4 or 8 (bits), or None.")
    _check_type("dequantize", dequantize, (bool, type(None)), "True, False or None")
    if draft_backend not in DRAFT_BACKENDS:
        raise OndeviceError(
            f"unknown draft backend {draft_backend!r}; choose one of {', '.join(DRAFT_BACKENDS)}."
        )
    if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
        raise OndeviceError(f"unknown dtype {dtype!r}; choose float32, float16 or bfloat16.")


def _load_pair(path: Path, draft: str | Path | None, quantize: int | None, opts: dict) -> _Pair:
    """The verifier at `path` and its draft: a bundle's own, or `draft` (a model or a bundle's)."""
    from ondevice.models.bundle import is_bundle, open_bundle
    from ondevice.models.gguf_tokenizer import repair_bundle_tokenizers
    from ondevice.sources.hub import resolve

    pair: _Pair
    if is_bundle(path):
        b = open_bundle(path)
        v = load_model(b.verifier_dir, quantize=quantize, **opts)
        repair_bundle_tokenizers(b.manifest, [v.tokenizer], str(path))  # prompts' tokenizer
        pair = _Pair(v, extra={"name": path.name})
        _bundle_draft(pair, b, opts)
    else:
        v = load_model(path, quantize=quantize, **opts)
        pair = _Pair(v)
    if draft is not None:
        draft_path = resolve(draft)
        if is_bundle(draft_path):  # a bundle's draft, with the acceptance it recorded
            _bundle_draft(pair, open_bundle(draft_path), opts)
        else:
            pair.draft = load_model(draft_path, **opts)
            pair.mlpackage = None
            for key in ("reload_draft", "baseline"):
                pair.extra.pop(key, None)
    if pair.draft is not None:
        check_pair(pair.verifier.tokenizer, pair.draft.tokenizer, pair.draft.config.vocab_size)
    return pair


def load(
    verifier: str | Path,
    draft: str | Path | None = None,
    *,
    draft_backend: str = "auto",
    dtype: str | None = None,
    quantize: int | None = None,
    dequantize: bool | None = None,
    prompt_cache: str | Path | None = None,
    prompt_cache_bytes: int = DEFAULT_MAX_BYTES,
    heads: str | Path | None = None,
) -> Generator:
    """Load a verifier (folder, GGUF file, pair bundle, cached name or hub id) and an optional
    draft, or a catalog pair by its name (`qwen2.5-coder-1.5b`: its bundle, pulled and
    converted on first use as `ondevice demo` makes it). A pair bundle brings its own draft
    (Core ML and MLX); `draft` may also be a bundle, whose draft then serves this verifier (a
    fine-tuned one, say) and whose recorded acceptance tells when the two agree less
    (`Generator.acceptance_drift`).

    draft_backend: where the draft runs: "auto" (Core ML where it runs, placed by measured
    costs; else MLX), "coreml", "reference" (the package through the numpy executor) or "mlx".
    dtype: "float32", "float16" or "bfloat16" for the weights (None: as stored).
    quantize: 4 or 8 bits for the verifier's weights (None: as stored).

    dequantize: expand quantized weights on load. Default: only where MLX runs on the CPU
    (Linux), because there its quantized matmul costs grow with every token of a verification
    block. The expanded products then go to the CPU kernel where oneDNN loads (bf16 weights,
    flat passes, batch-invariant; runtime/kernel.py, `ONDEVICE_KERNEL`), else to MLX's float32
    BLAS (measured in docs/benchmarks.md). On Apple GPUs quantized weights stay quantized.

    prompt_cache: a file written by `ondevice cache-prompt` (`Generator.save_prompt_cache`):
    prompts that begin with its tokens start from its KV. prompt_cache_bytes: memory for the
    KV of recent prompts and answers, reused by later prompts that share a prefix (0: off).
    heads: a folder of heads for this verifier (`ondevice distill --heads hydra` or `medusa`),
    read by method "medusa" (None: it looks in the cache, then among the heads shipped with
    ondevice); checked against the verifier now.
    """
    _check_load_arguments(verifier, draft, draft_backend, dtype, quantize, dequantize)
    from ondevice.sources.hub import catalog_pair, resolve

    if draft is None and not Path(verifier).expanduser().exists() and catalog_pair(str(verifier)):
        from ondevice.convert.pair import ensure_bundle

        verifier = ensure_bundle(str(verifier))  # a catalog pair: its bundle, made once

    if dequantize is None:
        dequantize = quantize is None and mx.default_device() == mx.cpu
    opts = {"dtype": dtype, "dequantize": dequantize}
    if dequantize:  # the CPU kernel's weights are read in its dtype (runtime/kernel.py)
        from ondevice.runtime import kernel

        opts["product_dtype"] = kernel.weight_dtype()
    pair = _load_pair(resolve(verifier), draft, quantize, opts)
    if dequantize:  # MLX on the CPU: its float32 linear products go to the CPU kernel
        from ondevice.runtime import kernel

        kernel.serve_pair(pair.verifier.model, pair.draft.model if pair.draft else None)
    if heads is not None:
        from ondevice.proposers.medusa import check_heads

        pair.heads = check_heads(heads, pair.verifier.model)
    gen = Generator(pair, draft_backend, prompt_cache_bytes)
    if prompt_cache is not None:
        gen.load_prompt_cache(prompt_cache)
    return gen
