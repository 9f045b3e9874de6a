"""The public face: `ondevice.load(...)` returns a `Generator` with generate / stream / astream."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import mlx.core as mx

from ondevice.errors import OndeviceError
from ondevice.models import LoadedModel, load_model
from ondevice.models.tokenizer import Tokenizer, check_pair
from ondevice.results import Chunk, GenerationResult
from ondevice.runtime.decoders import METHODS as METHODS
from ondevice.runtime.decoders import check_method, make_decoder
from ondevice.runtime.engines import DRAFT_BACKENDS, MLXEngine, make_draft_engine
from ondevice.runtime.placement import Placement, place_draft
from ondevice.runtime.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache, Restored
from ondevice.speculative.sampling import Grammar, SamplingParams, Transform
from ondevice.streaming import decode_chunks
from ondevice.worker import Worker

Prompt = str | Sequence[dict[str, str]] | Sequence[int]
# Draft backends on other hardware than the verifier, where overlapping the two pays; see
# docs/benchmarks.md for the CPU measurements that decide the rest.
PIPELINE_BY_DEFAULT = ("coreml",)


@dataclass
class _Pair:
    verifier: LoadedModel
    draft: LoadedModel | None = None
    mlpackage: Path | None = None
    draft_context: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _check_int(name: str, value: Any, low: int, none_ok: bool = False) -> None:
    """OndeviceError unless `value` is an int >= `low` (or None, if allowed)."""
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise OndeviceError(f"{name} must be an integer >= {low}, got {value!r}.")


def _check_type(name: str, value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types):
        raise OndeviceError(f"{name} must be {what}, got {value!r}.")


class Generator:
    """A loaded verifier (and optional draft) ready to generate."""

    def __init__(
        self, pair: _Pair, draft_backend: str = "auto", prompt_cache_bytes: int = DEFAULT_MAX_BYTES
    ):
        self._pair = pair
        self.tokenizer: Tokenizer = pair.verifier.tokenizer
        self.model_name = str(pair.extra.get("name") or pair.verifier.path.name)
        self.verifier = MLXEngine(pair.verifier.model)
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
                mlx = make_draft_engine(
                    "mlx", mlx_model=pair.draft.model, mlpackage=None,
                    context_length=pair.draft_context,
                )  # fmt: skip
                engines = {"coreml": self.draft, "mlx": mlx}
                self.draft, self.placement = place_draft(self.verifier, engines)
        self.draft_backend = self.draft.name if self.draft is not None else None
        self._lock = threading.Lock()  # one generation at a time per loaded model
        # The model's generation thread: every generation runs there, so the KV caches (whose
        # MLX arrays belong to the thread's stream) outlive a call and the prompt cache can
        # reuse them. Started on first use.
        self._worker: Worker | None = None
        self.prompt_cache = PrefixCache(prompt_cache_bytes)
        self._ll_tokenizer: Any = None  # llguidance's view of the vocabulary, for grammars
        self._fingerprints: dict[str, str] | None = None

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

    def count_tokens(self, prompt: Prompt, chat_template: bool = True, **chat: Any) -> int:
        return len(self.encode_prompt(prompt, chat_template, **chat))

    def grammar(
        self,
        *,
        json_schema: dict[str, Any] | bool | None = None,
        lark: str | None = None,
        regex: str | None = None,
    ) -> Grammar:
        """A grammar for `stream(grammar=...)`: JSON valid under `json_schema` (True: any JSON
        object), or text matching a Lark grammar or a regular expression. Both models'
        distributions are masked by it, so speculation stays exact for the constrained law."""
        from ondevice.speculative import grammar as g

        if sum(x is not None for x in (json_schema, lark, regex)) != 1:
            raise OndeviceError("give exactly one of json_schema, lark or regex.")
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
        return g.Grammar.regex(*args, regex, *rest)

    # -- generation -------------------------------------------------------------------------

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        num_draft_tokens: int | None = None,
        speculative: bool = True,
        stop: str | Sequence[str] | None = None,
        chat_template: bool = True,
        method: str = "chain",
        pipeline: bool | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_prompt: bool = True,
        _cancel: threading.Event | None = None,
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are decided; the last chunk carries finish_reason and stats.

        method: "chain" (a draft chain, the default), "tree" (a token tree verified in one
        pass), "pld" (prompt lookup, no draft needed), "lookahead" (no draft needed),
        "cascade" (the draft itself sped up by prompt lookup) or "auto".
        pipeline: overlap drafting with verification (chain only); None picks what is faster
        for the draft backend. Every choice gives the same tokens for the same seed.
        cache_prompt: start from the longest prefix of the prompt whose KV the prompt cache
        holds (`stats["cached_tokens"]`), and keep this generation's KV there; the tokens are
        the same either way.
        min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias and
        grammar (`speculative.grammar`) transform the distribution of the verifier and of the
        draft alike, so speculation stays exact for the transformed law. logprobs: report the
        verifier's log-probabilities of the emitted tokens (and of the `logprobs` most likely).
        tools, chat_template_kwargs: passed to the chat template (see `encode_prompt`).
        """
        try:
            params = SamplingParams(
                float(temperature), float(top_p), int(top_k), float(min_p),
                float(repetition_penalty), float(presence_penalty), float(frequency_penalty),
                logit_bias or (), grammar, logprobs,
            )  # fmt: skip
            Transform(params, self.verifier.vocab_size)  # token ids of logit_bias in range
        except (ValueError, TypeError) as e:  # float(None), int("x"), ...
            raise OndeviceError(f"invalid sampling option: {e}") from None
        _check_int("max_tokens", max_tokens, 0)
        _check_int("num_draft_tokens", num_draft_tokens, 0, none_ok=True)
        _check_int("seed", seed, 0, none_ok=True)
        for flag, value in (("speculative", speculative), ("chat_template", chat_template)):
            _check_type(flag, value, bool, "True or False")
        _check_type("pipeline", pipeline, (bool, type(None)), "True, False or None")
        if not (stop is None or isinstance(stop, str) or (
            isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop)
        )):  # fmt: skip
            raise OndeviceError(f"stop must be a string or a list of strings, got {stop!r}.")
        ids = self.encode_prompt(
            prompt, chat_template, tools=tools, template_kwargs=chat_template_kwargs
        )
        if not ids:
            raise OndeviceError("the prompt is empty (it encodes to no tokens); pass some text.")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not self._lock.acquire(blocking=False):
            raise OndeviceError("this model is already generating; wait for it to finish.")
        try:
            cancel = _cancel or threading.Event()

            def job() -> Iterator[Chunk]:
                dec = self._decoder(params, seed, num_draft_tokens, speculative, method, pipeline)
                draft = self.draft if speculative else None
                return self._cached_stream(dec, draft, ids, max_tokens, stops, cancel, cache_prompt)

            yield from self._thread().iterate(job, cancel)
        finally:
            self._lock.release()

    # -- the generation thread and the prompt cache -----------------------------------------

    def _thread(self) -> Worker:
        if self._worker is None:
            self._worker = Worker("ondevice-generate")
            weakref.finalize(self, self._worker.stop)
        return self._worker

    def _call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the model's thread (it may touch the caches); its result or exception."""
        return self._thread().call(fn)

    def _cached_stream(self, dec, draft, ids, max_tokens, stops, cancel, cache_prompt):
        """`_stream` from the prompt cache's longest prefix of `ids`; afterwards the caches are
        kept there (or dropped when the generation failed mid-round)."""
        t = time.perf_counter()
        if cache_prompt:
            restored = self.prompt_cache.restore(ids, self.verifier, draft)
        else:
            restored = Restored()
            self._reset_engines()
        t_restore = time.perf_counter() - t
        emitted: list[int] = []
        consistent = True  # the caches hold whole rounds (a closed stream stops between them)
        chunks = self._stream(dec, ids, max_tokens, stops, cancel)
        try:
            for chunk in chunks:
                emitted.extend(chunk.tokens)
                if chunk.stats is not None:
                    chunk.stats["cached_tokens"] = restored.verifier
                    chunk.stats["draft_cached_tokens"] = restored.draft
                    chunk.stats["prompt_seconds"] += t_restore
                    chunk.stats["total_seconds"] += t_restore
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

    def _reset_engines(self) -> None:
        self.verifier.reset()
        if self.draft is not None:
            self.draft.reset()

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
            if isinstance(self.draft, MLXEngine):
                fp["draft"] = "mlx:" + self._call(lambda: model_fingerprint(self.draft.model))
            elif self.draft is not None:
                fp["draft"] = "package:" + package_fingerprint(self.draft.path)
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
        if not self._lock.acquire(blocking=False):
            raise OndeviceError("this model is already generating; wait for it to finish.")

        def work() -> None:
            from ondevice.speculative.engine import prefill

            self.prompt_cache.restore(ids, self.verifier, self.draft)
            try:
                prefill(self.verifier, ids, resume=True)
                if self.draft is not None:
                    prefill(self.draft, ids, resume=True)
                self.prompt_cache.save_file(path, ids, self.verifier, self.draft, fingerprints)
                self.prompt_cache.store(ids, self.verifier, self.draft, len(ids), len(ids))
            finally:
                self._reset_engines()

        try:
            self._call(work)
        finally:
            self._lock.release()
        return len(ids)

    def load_prompt_cache(self, path: str | Path) -> int:
        """Start every later prompt that begins with the prompt saved at `path` (by
        `save_prompt_cache` or `ondevice cache-prompt`) from its KV. Returns its length."""
        fingerprints = self.fingerprints()
        return self._call(
            lambda: self.prompt_cache.load_file(path, self.verifier, self.draft, fingerprints)
        )

    def _decoder(self, params, seed, num_draft_tokens, speculative, method, pipeline):
        check_method(method)  # also when speculative=False, which decodes plainly
        if pipeline is None:
            pipeline = (
                self.placement.pipelined
                if self.placement is not None
                else self.draft_backend in PIPELINE_BY_DEFAULT
            )
        return make_decoder(
            method if speculative else "chain",
            self.verifier,
            self.draft if speculative else None,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            seed=seed,
            num_draft_tokens=num_draft_tokens,
            pipeline=pipeline,
        )

    def _stream(self, dec, ids, max_tokens, stops, cancel):
        detok = self.tokenizer.detokenizer()
        return decode_chunks(dec, ids, max_tokens, stops, cancel, detok, self.draft_backend)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
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
) -> Generator:
    """Load a verifier (folder, GGUF file, pair bundle, cached name or hub id) and an optional
    draft. A pair bundle brings its own draft (Core ML and MLX).

    dequantize: expand quantized weights to float32 on load. Default: only where MLX runs on
    the CPU (Linux), because there its quantized matmul costs grow with every token of a
    verification block while a float32 GEMM (OpenBLAS) verifies 8 tokens for little more than
    one (measured in docs/benchmarks.md). On Apple GPUs quantized weights stay quantized.

    prompt_cache: a file written by `ondevice cache-prompt` (`Generator.save_prompt_cache`):
    prompts that begin with its tokens start from its KV. prompt_cache_bytes: memory for the
    KV of recent prompts and answers, reused by later prompts that share a prefix (0: off).
    """
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
    from ondevice.models.hub import resolve

    if dequantize is None:
        dequantize = quantize is None and mx.default_device() == mx.cpu
    opts = {"dtype": dtype, "dequantize": dequantize}
    path = resolve(verifier)
    pair: _Pair
    from ondevice.models.bundle import is_bundle, open_bundle

    if is_bundle(path):
        b = open_bundle(path)
        v = load_model(b.verifier_dir, quantize=quantize, **opts)
        d = load_model(b.draft_mlx_dir, **opts) if b.draft_mlx_dir else None
        pair = _Pair(v, d, b.mlpackage, b.context_length, {"name": path.name})
    else:
        v = load_model(path, quantize=quantize, **opts)
        pair = _Pair(v)
    if draft is not None:
        pair.draft = load_model(draft, **opts)
        pair.mlpackage = None
    if pair.draft is not None:
        check_pair(pair.verifier.tokenizer, pair.draft.tokenizer, pair.draft.config.vocab_size)
    if dequantize:  # MLX on the CPU: its float32 linear products go to the CPU kernel
        from ondevice.runtime import kernel

        for loaded in (pair.verifier, pair.draft):
            if loaded is not None:
                kernel.serve(loaded.model)
    gen = Generator(pair, draft_backend, prompt_cache_bytes)
    if prompt_cache is not None:
        gen.load_prompt_cache(prompt_cache)
    return gen
