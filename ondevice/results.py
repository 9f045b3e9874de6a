"""What a generation gives back: the streamed `Chunk`, the whole `GenerationResult`, and the
statistics dict its last chunk carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ondevice.decoders.base import Decoder
from ondevice.rules.sampling import TokenLogprob
from ondevice.runtime.memory import peak_footprint_bytes


@dataclass
class Chunk:
    """A piece of a streamed answer: usually one token and the text it completed."""

    text: str
    tokens: list[int]
    from_draft: bool
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # set on the last chunk
    logprobs: list[TokenLogprob] | None = None  # per token, when asked for (`logprobs=`)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: dict[str, Any]
    finish_reason: str


def generation_stats(
    dec: Decoder, n_prompt: int, n_gen: int, elapsed: float, draft_backend: str | None
) -> dict[str, Any]:
    """The statistics of a finished generation by decoder `dec` (speed, acceptance, time per
    phase, peak memory since the generation began)."""
    s = dec.stats
    gen_time = max(elapsed - dec.time_prefill, 1e-9)
    return {
        "prompt_tokens": n_prompt,
        "generation_tokens": n_gen,
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "rejected_rounds": s.rejected,
        "acceptance_rate": s.accepted / s.drafted if s.drafted else 0.0,
        "mean_accepted_length": (s.accepted + s.rounds) / s.rounds if s.rounds else 0.0,
        "tokens_per_second": n_gen / gen_time,
        "prompt_seconds": dec.time_prefill,
        "time_draft_s": dec.time_draft,
        "time_verify_s": dec.time_verify,
        "total_seconds": elapsed,
        "peak_memory_bytes": int(mx.get_peak_memory()),  # MLX's arrays only
        "process_peak_bytes": peak_footprint_bytes(),  # with the Core ML draft and the rest
        "draft_backend": draft_backend if s.drafted else None,
        **dec.extra_stats(),
        # why speculation was off, when it was for the whole generation
        **({} if s.drafted else {"draft_skipped": dec.skip_reason or "nothing was proposed"}),
    }
