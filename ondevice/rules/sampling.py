"""The sampling transform, applied alike to verifier and draft.

Speculative sampling is lossless for whatever distribution the verifier's logits are mapped to,
as long as the same map is applied to the draft before the acceptance rule. The map here is, in
order: logit bias, repetition / presence / frequency penalties, a grammar's mask (logits of
forbidden tokens become -inf), temperature, top-k, top-p, min-p. Temperature 0 means greedy:
the distribution is a point mass on the argmax of the transformed logits (lowest id on ties).

Penalties and grammars depend on the tokens before the position, so a `Transform` is bound to
one generation (`start(prompt)`) and is asked for a position's distribution together with the
tokens committed so far (`seq`) and the drafted tokens between them and the position (`path`).
Every decoder hands the draft and the verifier the same (seq, path) for the same position, so
both see the same context, drafted tokens included. Penalties follow vLLM's definitions: the
repetition penalty (HF/CTRL: positive logits divided by it, negative ones multiplied) counts
every token of the context, prompt included; presence and frequency penalties (OpenAI) count
the generated tokens only.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, Protocol

import numpy as np


class GrammarState(Protocol):
    """A grammar bound to one generation (see `rules/grammar.py`)."""

    def allowed(self, generated: Sequence[int]) -> np.ndarray | None:
        """Boolean mask (vocab,) of the tokens allowed after `generated` (the tokens after the
        prompt), or None when `generated` itself is not allowed (a context no rule reads)."""


class Grammar(Protocol):
    def start(self) -> GrammarState: ...


@dataclass(frozen=True)
class SamplingParams:
    """The sampling fields of one generation: the one list every front end derives from or is
    checked against (`SAMPLING_FIELDS`: the API's keyword arguments, the server's request
    fields, the CLI's flags, the chat's settings; tests/test_options.py checks them). All but
    `temperature` are keyword-only, so adding a field shifts nothing."""

    temperature: float = 0.0
    _: KW_ONLY
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> added to its logit; a dict is accepted and stored as sorted pairs
    logit_bias: Any = ()
    grammar: Grammar | None = field(default=None, compare=False)
    # report log-probabilities of the emitted tokens (raw verifier distribution): None = no,
    # 0 = the emitted token's only, n = also the n most likely tokens at that position
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not (self.repetition_penalty > 0 and np.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 disables it), "
                f"got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not np.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        try:
            clean = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(
                "logit_bias must map token ids (integers) to numbers, e.g. {'50256': -100}"
            ) from None
        for t, b in clean:
            if t < 0 or not np.isfinite(b):
                raise ValueError(f"logit_bias: token {t} with bias {b} (ids >= 0, finite bias)")
        object.__setattr__(self, "logit_bias", clean)
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SamplingParams:
        """Sampling parameters from user options (field name -> value, any subset), their types
        checked first: a string where a number belongs ("0.7") or a flag where a number
        belongs is refused with a ValueError naming the field, not coerced."""
        unknown = sorted(set(options) - set(SAMPLING_FIELDS))
        if unknown:
            raise ValueError(f"unknown sampling option {unknown[0]!r}")
        for f in fields(cls):
            check = _NUMBER_CHECKS.get(f.name) or _INT_OR_NONE.get(f.name)
            if f.name in options and check is not None:
                check(f.name, options[f.name])
        bias = options.get("logit_bias") or {}
        check_kind("logit_bias", bias, dict, "a dict of token id -> bias")
        for token, value in bias.items():
            check_int("logit_bias token id", token, 0)
            check_kind(f"logit_bias[{token}]", value, numbers.Real, "a number")
        values = dict(options)
        for name, kind in (("top_k", int), *((n, float) for n in _NUMBER_CHECKS if n != "top_k")):
            if values.get(name) is not None:
                values[name] = kind(values[name])
        values["logit_bias"] = bias
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def contextual(self) -> bool:
        """Whether the transform depends on the tokens before the position."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.grammar is not None
        )

    @property
    def processed(self) -> bool:
        """Whether logits are processed (bias, penalties, a grammar's mask) before temperature /
        top-k / top-p / min-p."""
        return self.contextual or bool(self.logit_bias)


# the fields of SamplingParams, in order (`_` is dataclasses' keyword-only marker, no field)
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def check_kind(name: str, value: Any, types: type | tuple[type, ...], what: str) -> None:
    """ValueError unless `value` is one of `types` (a bool only where bool is named)."""
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ValueError(f"{name} must be {what}, got {value!r}.")


def check_int(name: str, value: Any, low: int, none_ok: bool = False) -> None:
    """ValueError unless `value` is an int >= `low` (or None, if allowed)."""
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def _number(name: str, value: Any) -> None:
    check_kind(name, value, numbers.Real, "a number")  # numpy's scalars too; not str, not bool


_NUMBER_CHECKS = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"), _number),
    "top_k": lambda name, value: check_int(name, value, 0),
}  # fmt: skip
_INT_OR_NONE = {"logprobs": lambda name, value: check_int(name, value, 0, none_ok=True)}


def align(logits: np.ndarray, vocab: int) -> np.ndarray:
    """Logits over a vocabulary of `vocab` ids: a draft's truncated (FR-Spec) vocabulary padded
    with -inf, a padded one cut."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[..., :vocab]
    pad = np.full((*logits.shape[:-1], vocab - v), -np.inf, logits.dtype)
    return np.concatenate([logits, pad], -1)


def softmax(logits: np.ndarray) -> np.ndarray:
    """The temperature-1 distribution (float64) of logits (..., V)."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def check_vocab(params: SamplingParams, vocab: int) -> None:
    """ValueError when a token id of `params.logit_bias` is outside a vocabulary of `vocab`."""
    bad = [t for t, _ in params.logit_bias if t >= vocab]
    if bad:
        raise ValueError(
            f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        )


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Map (already processed) logits (..., V) to float64 probabilities (..., V): temperature,
    top-k, top-p, min-p. The context-free part of the transform."""
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        out = np.zeros_like(logits)
        np.put_along_axis(out, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return out
    z = logits / params.temperature
    V = z.shape[-1]
    if 0 < params.top_k < V:
        # keep the k largest (ties at the threshold are kept, as in most implementations)
        kth = np.partition(z, V - params.top_k, axis=-1)[..., V - params.top_k, None]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    if params.min_p > 0.0:
        # keep tokens at least min_p times as likely as the most likely one
        p = np.where(p >= params.min_p * p.max(-1, keepdims=True), p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    cum = np.cumsum(sorted_p, -1)
    # a token is kept if the mass before it is still below top_p
    keep_sorted = (cum - sorted_p) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    q = np.where(keep, p, 0.0)
    return q / q.sum(-1, keepdims=True)


class Transform:
    """`SamplingParams` bound to one generation: a position's distribution given its context.

    The context of a position is `seq` (the committed sequence, prompt first) followed by
    `path` (drafted tokens not yet committed). The result depends on the context only, never
    on who asks (draft or verifier) or in what order.
    """

    def __init__(self, params: SamplingParams, vocab: int):
        self.params = params
        self.vocab = vocab
        self._prompt_len = 0
        self._grammar: GrammarState | None = None
        self._bias: np.ndarray | None = None
        check_vocab(params, vocab)
        if params.logit_bias:
            self._bias = np.zeros(vocab)
            for t, b in params.logit_bias:
                self._bias[t] = b

    @property
    def active(self) -> bool:
        """Whether logits are processed before temperature (otherwise `logits` is identity)."""
        return self.params.processed

    def start(self, prompt: Sequence[int]) -> None:
        """A new generation after `prompt`."""
        self._prompt_len = len(prompt)
        self._grammar = self.params.grammar.start() if self.params.grammar is not None else None

    def logits(
        self, logits: np.ndarray, seq: Sequence[int], paths: Sequence[Sequence[int]] = ((),)
    ) -> np.ndarray:
        """Processed float64 logits: row i of `logits` (R, V) or the single row (V,) is the
        position after seq + paths[i]."""
        z = np.array(logits, dtype=np.float64)  # a copy: rows are changed in place
        if not self.active:
            return z
        single = z.ndim == 1
        rows = z[None] if single else z
        if len(paths) != len(rows):
            raise ValueError(f"{len(rows)} rows of logits but {len(paths)} contexts")
        if self._bias is not None:
            rows += self._bias
        p = self.params
        penalised = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        if penalised:
            seen = np.bincount(np.asarray(seq, np.int64), minlength=self.vocab)[: self.vocab]
            gen = np.bincount(np.asarray(seq[self._prompt_len :], np.int64), minlength=self.vocab)[
                : self.vocab
            ]
        for row, path in zip(rows, paths):
            if penalised:
                extra = np.bincount(np.asarray(path, np.int64), minlength=self.vocab)[: self.vocab]
                self._penalise(row, seen + extra, gen + extra)
            if self._grammar is not None:
                allowed = self._grammar.allowed([*seq[self._prompt_len :], *path])
                if allowed is None:  # a context that was never allowed: any valid row
                    row[:] = -np.inf
                    row[0] = 0.0
                else:
                    row[~allowed[: self.vocab]] = -np.inf
        return z

    def _penalise(self, row: np.ndarray, seen: np.ndarray, gen: np.ndarray) -> None:
        p = self.params
        if p.repetition_penalty != 1.0:
            hit = seen > 0
            r = row[hit]
            row[hit] = np.where(r > 0, r / p.repetition_penalty, r * p.repetition_penalty)
        if p.presence_penalty:
            row -= p.presence_penalty * (gen > 0)
        if p.frequency_penalty:
            row -= p.frequency_penalty * gen

    def probs(
        self, logits: np.ndarray, seq: Sequence[int], paths: Sequence[Sequence[int]] = ((),)
    ) -> np.ndarray:
        """The transformed distribution(s) (float64) at the position(s) after seq + paths[i]."""
        return probabilities(self.logits(logits, seq, paths), self.params)

    def argmax(
        self, logits: np.ndarray, seq: Sequence[int], paths: Sequence[Sequence[int]] = ((),)
    ) -> np.ndarray | int:
        """The greedy token(s): argmax of the processed logits."""
        if not self.active:
            return np.argmax(logits, -1)
        return np.argmax(self.logits(logits, seq, paths), -1)


def chain_paths(drafts: Sequence[int]) -> list[list[int]]:
    """Contexts of a chain's verifier rows: row i follows the first i drafts."""
    return [list(drafts[:i]) for i in range(len(drafts) + 1)]


@dataclass
class TokenLogprob:
    """Log-probability of an emitted token under the verifier's raw distribution (temperature
    1, no processing), and the most likely alternatives at that position."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """Row i of the verifier's logits (R, V) scores tokens[i] (zip: extra rows are ignored)."""
    out = []
    for row, tok in zip(np.asarray(logits, np.float64), tokens):
        z = row - row.max()
        lp = z - np.log(np.exp(z).sum())
        best: list[tuple[int, float]] = []
        if top:
            idx = np.argpartition(-lp, min(top, len(lp)) - 1)[:top]
            idx = idx[np.lexsort((idx, -lp[idx]))]
            best = [(int(i), float(lp[i])) for i in idx]
        out.append(TokenLogprob(int(tok), float(lp[tok]), best))
    return out


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector by inverse CDF (one uniform per draw)."""
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(p) - 1))
