"""Runs the benchmark: for each prompt, plain decoding, then every method, then every peer,
back to back, so machine noise (other processes, thermal state) hits all of them alike.

Every run is timed the same way from outside, whatever produced the tokens:
`tokens_per_second` is the decode rate: the tokens after the first verifier pass over the time
from that pass to the last token, which leaves the prompt's prefill out;
`e2e_tokens_per_second` is all tokens over all the time, prefill included.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ondevice.errors import OndeviceError
from ondevice.proposers.registry import METHODS
from ondevice.runtime.memory import param_bytes
from ondevice.speedtest.peers import SPEC, MlxLmPeer, Steps, mlx_lm_rounds, spec_k
from ondevice.speedtest.prompts import BenchPrompt

# Runs besides the registry's methods: "plain" (plain decoding, the reference every run is
# compared with) and "pipeline" (the chain with drafting overlapped with verification,
# `pipeline=True`, so the two schedules can be compared on the same prompts; "chain" runs what
# the placement chose).
PLAIN, PIPELINE = "plain", "pipeline"
# runs that measure nothing without a draft model (prompt lookup, lookahead and auto work alone)
DRAFT_RUNS = (PIPELINE,) + tuple(
    m.name for m in METHODS.values() if m.needs_draft or m.plain_without_draft
)
WARMUP_TOKENS = 8


@dataclass
class BenchOptions:
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    methods: tuple[str, ...] = ("chain",)  # besides "plain", which always runs first
    num_draft_tokens: int | None = None  # None: the runtime chooses
    peers: tuple[str, ...] = ()
    peer_draft_tokens: tuple[int, ...] = ()  # mlx-lm's speculative decoding at each fixed K
    warmup: bool = True
    # Each prompt's runs done this many times, in alternating order (forward, then backward, so
    # a drift of the machine's speed over a prompt hits the runs alike); a run's record is the
    # repeat with the median decode time (on a shared machine one run's time moves by more than
    # the differences between methods: docs/benchmarks.md, "Issues 26 and 30, session 32").
    repeats: int = 1


def draft_mlx_model(gen: Any) -> Any | None:
    """The draft's MLX model, whichever engine runs it (a Core ML draft keeps its MLX twin)."""
    model = getattr(gen.draft, "model", None)
    if model is None and gen.loaded_draft is not None:
        model = gen.loaded_draft.model
    return model


def method_runs(gen: Any, options: BenchOptions) -> list[str]:
    """The ondevice runs per prompt, in order: "plain" first, then the requested methods."""
    runs = [PLAIN] + [m for m in dict.fromkeys(options.methods) if m != PLAIN]
    if gen.draft is None:
        needs = [m for m in runs if m in DRAFT_RUNS]
        if needs:
            raise OndeviceError(
                f"method {needs[0]!r} needs a draft model: pass --draft D, or --model with a "
                "pair bundle (which brings its own draft)."
            )
    return runs


class Bench:
    """Holds the loaded pair (and peers) and measures one prompt at a time."""

    def __init__(self, gen: Any, options: BenchOptions) -> None:
        self.gen = gen
        self.options = options
        self.runs = method_runs(gen, options)
        self.repeats = max(1, options.repeats)  # each prompt's runs, done this many times
        self.eos = frozenset(gen.tokenizer.eos_token_ids)
        self.verifier_bytes = param_bytes(gen.verifier.model)
        draft = draft_mlx_model(gen)
        self.draft_bytes = param_bytes(draft) if draft is not None else 0
        self.peer: MlxLmPeer | None = None
        for peer in options.peers:
            if peer != "mlx-lm":
                raise OndeviceError(f"unknown peer {peer!r}; the known peer is mlx-lm.")
            self.peer = MlxLmPeer(
                gen.verifier.model, draft_mlx_model(gen), options.peer_draft_tokens
            )
            self.runs += self.peer.methods

    # -- one run ------------------------------------------------------------------------------

    def _ondevice_steps(self, method: str, ids: list[int], max_tokens: int, out: dict) -> Steps:
        o = self.options
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens, temperature=o.temperature, seed=o.seed, chat_template=False
        )
        if method == PLAIN:
            kwargs["speculative"] = False
        else:
            kwargs["num_draft_tokens"] = o.num_draft_tokens
            if method == PIPELINE:
                kwargs["pipeline"] = True
            else:
                kwargs["method"] = method
        for chunk in self.gen.stream(ids, **kwargs):
            if chunk.stats is not None:
                out.update(chunk.stats)
                out["finish_reason"] = chunk.finish_reason
            if chunk.tokens:
                yield list(chunk.tokens), [chunk.from_draft] * len(chunk.tokens)

    def _peer_steps(self, method: str, ids: list[int], max_tokens: int, k: int, out: dict) -> Steps:
        assert self.peer is not None
        detok = self.gen.tokenizer.detokenizer()  # the same text work ondevice's stream does
        n = 0
        for toks, flags in self.peer.steps(
            method, ids, max_tokens, self.eos, self.options.temperature, self.options.seed, k
        ):
            detok.add(toks)
            n += len(toks)
            yield toks, flags
        detok.flush()
        out["finish_reason"] = "length" if n >= max_tokens else "stop"

    def run_one(self, method: str, ids: list[int], max_tokens: int, k: int = 3) -> dict[str, Any]:
        """Generate once with `method` and return its measurements (`k`: mlx-lm's K unless
        the method names its own, "mlx-lm-spec:K")."""
        k = spec_k(method) or k
        stats: dict[str, Any] = {}
        if method.startswith("mlx-lm"):
            steps = self._peer_steps(method, ids, max_tokens, k, stats)
        else:
            steps = self._ondevice_steps(method, ids, max_tokens, stats)
        # Free the previous run's KV caches first, or they would count in the baseline and hide
        # part of this run's working memory.
        self.gen.verifier.reset()
        if self.gen.draft is not None:
            self.gen.draft.reset()
        gc.collect()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tokens, flags, t_first, t0 = _consume(steps)
        t_end = time.perf_counter()
        peak = int(mx.get_peak_memory())
        n = len(tokens)
        # The first verifier pass delivers its tokens together (one, or a whole accepted draft):
        # decoding speed is what comes after it, so neither kind of method is credited tokens
        # that cost no measured time.
        n_first = flags.index(False) + 1 if False in flags else n
        decode_tokens = n - n_first
        decode_s = t_end - t_first if t_first is not None else 0.0
        rec: dict[str, Any] = {
            "method": method,
            "prompt_tokens": len(ids),
            "generation_tokens": n,
            "tokens": tokens,
            "ttft_s": (t_first - t0) if t_first is not None else None,
            "total_s": t_end - t0,
            "decode_tokens": decode_tokens,
            "decode_s": decode_s,
            "tokens_per_second": decode_tokens / decode_s
            if decode_tokens and decode_s > 0
            else None,
            "e2e_tokens_per_second": n / (t_end - t0) if n else None,
            "finish_reason": stats.get("finish_reason"),
            "text": self.gen.tokenizer.decode(tokens),
            "peak_memory_bytes": peak,
            "working_memory_bytes": max(0, peak - base),
        }
        if method.startswith("mlx-lm"):
            accepted = sum(flags)
            spec = method.startswith(SPEC)
            rounds, drafted = mlx_lm_rounds(flags, max_tokens, k) if spec else (n, 0)
            rec.update(
                rounds=rounds,
                drafted=drafted,
                accepted=accepted,
                num_draft_tokens=k if spec else None,
                time_draft_s=None,
                time_verify_s=None,
            )
        else:
            rec.update(
                rounds=stats.get("rounds", 0),
                drafted=stats.get("drafted", 0),
                accepted=stats.get("accepted", 0),
                num_draft_tokens=self.options.num_draft_tokens if method != PLAIN else None,
                time_draft_s=stats.get("time_draft_s"),
                time_verify_s=stats.get("time_verify_s"),
                draft_backend=stats.get("draft_backend"),
                rounds_by_method=stats.get("rounds_by_method"),  # auto's choices, per proposer
                auto_left_out=stats.get("auto_left_out"),  # auto's candidates left out, and why
            )
        self._derive(rec)
        return rec

    def _derive(self, rec: dict[str, Any]) -> None:
        """The run's memory, acceptance rate and mean accepted length, from its counts."""
        method = rec["method"]
        d, a, r = rec["drafted"], rec["accepted"], rec["rounds"]
        # What this method alone needs: the weights it uses plus its working memory. The MLX
        # peak itself counts every model loaded in the process (peers' copies included).
        # (prompt lookup and lookahead draft without a model; "auto" may pick either kind)
        uses_draft = method.startswith(SPEC) or (
            d > 0 and (method == PIPELINE or (method in METHODS and METHODS[method].uses_draft))
        )
        rec["memory_bytes"] = (
            self.verifier_bytes
            + (self.draft_bytes if uses_draft else 0)
            + rec["working_memory_bytes"]
        )
        rec["acceptance_rate"] = a / d if d else None
        rec["mean_accepted_length"] = (a + r) / r if d and r else None

    # -- one prompt: every run, interleaved ---------------------------------------------------

    def warm_up(self, ids: list[int]) -> None:
        """One short generation per run kind, so first-call costs (allocation, graph building,
        lazy loading) are not charged to the first measured prompt."""
        for method in self.runs:
            self.run_one(method, ids, WARMUP_TOKENS, self.options.num_draft_tokens or 3)

    def run_prompt(
        self, prompt: BenchPrompt, ids: list[int], tick: Callable[[str], None]
    ) -> list[dict]:
        """Every run on one prompt, `repeats` times; one record per run (its median repeat)."""
        done: list[dict[str, dict]] = []  # per repeat, its record of each run
        for rep in range(self.repeats):
            by_method: dict[str, dict] = {}
            for method in self.runs if rep % 2 == 0 else self.runs[::-1]:
                tick(method)
                chain = by_method.get("chain") or (done[0].get("chain") if done else None)
                k = self.options.num_draft_tokens or _mean_k(chain)
                rec = self.run_one(method, ids, self.options.max_tokens, k)
                by_method[method] = {
                    "question_id": prompt.question_id,
                    "category": prompt.category,
                    **rec,
                }
            same = self.peer is not None and self.peer.same_products
            _check_against_plain(
                list(by_method.values()), by_method, self.options.temperature, same
            )
            done.append(by_method)
        return [_median_repeat([r[m] for r in done]) for m in self.runs]


def _median_repeat(recs: Sequence[dict]) -> dict:
    """One run's record over its repeats: the repeat with the median decode time (the faster
    middle one of an even count), its every repeat's times beside it, and the lossless check
    failed if any repeat failed it. A repeat that drew other tokens (a seeded or greedy run
    must not) fails it too."""
    if len(recs) == 1:
        return recs[0]

    def seconds(r: dict) -> float:
        return r["decode_s"] if r["decode_tokens"] else r["total_s"]

    ordered = sorted(recs, key=seconds)
    rec = dict(ordered[(len(recs) - 1) // 2])
    rec["repeats_decode_s"] = [r["decode_s"] for r in recs]
    rec["repeats_total_s"] = [r["total_s"] for r in recs]
    for key in ("peak_memory_bytes", "working_memory_bytes", "memory_bytes"):
        rec[key] = max(r[key] for r in recs)
    differs = next((r for r in recs if r["tokens"] != recs[0]["tokens"]), None)
    failed = next((r for r in recs if r.get("matches_reference") is False), None)
    if failed is not None:
        rec["matches_reference"], rec["first_mismatch"] = False, failed["first_mismatch"]
        rec["reference"] = failed["reference"]
    elif differs is not None and rec.get("matches_reference") is not None:
        first = _first_difference(differs["tokens"], recs[0]["tokens"])
        rec["matches_reference"], rec["first_mismatch"] = False, first
    return rec


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Where two token lists first differ (the shorter one's length where one extends the
    other); None where they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _consume(steps: Iterable[tuple[list[int], list[bool]]]):
    tokens: list[int] = []
    flags: list[bool] = []
    t0 = time.perf_counter()
    t_first = None
    for toks, fl in steps:
        if toks and t_first is None:
            t_first = time.perf_counter()
        tokens.extend(toks)
        flags.extend(fl)
    return tokens, flags, t_first, t0


def _mean_k(chain: dict | None) -> int:
    """K for a peer that needs a fixed draft length: ondevice's mean drafted per round on the
    same prompt (its own choice), rounded; 3 when there is nothing to go by."""
    if chain and chain.get("rounds") and chain.get("drafted"):
        return max(1, round(chain["drafted"] / chain["rounds"]))
    return 3


def _check_against_plain(
    records: Sequence[dict], by_method: dict[str, dict], temp: float, peer_same: bool = False
) -> None:
    """Greedy outputs must be identical: every ondevice method to ondevice's plain decoding,
    mlx-lm's speculative to mlx-lm's plain, and mlx-lm's plain to ondevice's where both compute
    with MLX's own products (`peer_same`: the same weights, the same arithmetic; with the CPU
    kernel's bf16 products a near-tied token may differ, runtime/kernel.py)."""
    for rec in records:
        m = rec["method"]
        ref = (
            None
            if m == PLAIN or (m == "mlx-lm" and not peer_same)
            else "mlx-lm"
            if m.startswith(SPEC)
            else PLAIN
        )
        if ref is None or temp > 0 or ref not in by_method:
            rec["reference"], rec["matches_reference"], rec["first_mismatch"] = None, None, None
            continue
        first = _first_difference(rec["tokens"], by_method[ref]["tokens"])
        rec["reference"], rec["matches_reference"], rec["first_mismatch"] = (
            ref,
            first is None,
            first,
        )
