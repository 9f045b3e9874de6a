"""The pair's acceptance at conversion: the baseline that later generations are compared with
(`ondevice.runtime.drift`) to tell when the verifier no longer agrees with its draft.

One greedy chain generation per domain of the built-in benchmark prompts (the first prompt of
each category), verifier and draft both in MLX as the bundle stores them, counting accepted
positions and rounds cut short: the trials of the estimator `drift` explains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

NUM_DRAFT_TOKENS = 4  # the estimate does not depend on it (see runtime/drift.py)


def domain_texts() -> dict[str, str]:
    """Category -> its first built-in benchmark prompt."""
    from ondevice.speedtest.prompts import builtin_prompts_path, read_prompts

    prompts, _ = read_prompts(builtin_prompts_path())
    firsts = {p.category: p.text for p in reversed(prompts)}  # first of each category wins
    return dict(sorted(firsts.items()))


def domain_prompts(tokenizer: Any) -> dict[str, list[int]]:
    """Category -> token ids of its first built-in benchmark prompt, through the chat template
    (as a user's message) when the tokenizer has one."""
    out = {}
    for category, text in domain_texts().items():
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            out[category] = tokenizer.encode(text, add_special_tokens=False)
        else:
            out[category] = tokenizer.encode(text)
    return out


def measure(
    verifier: Any,
    draft: Any,
    prompts: Mapping[str, Sequence[int]],
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The manifest's `acceptance` section: per domain, the accepted positions, the rounds cut
    short and the tokens of a greedy chain generation of `max_tokens` from its prompt (cut to
    fit both models' context). `verifier` and `draft` are MLX models."""
    from ondevice.decoders.factory import make_decoder
    from ondevice.proposers.resources import Speculation
    from ondevice.rules.sampling import SamplingParams
    from ondevice.runtime.engines import MLXEngine

    domains = {}
    for name, ids in prompts.items():
        v, d = MLXEngine(verifier), MLXEngine(draft)
        room = min(v.context_length, d.context_length) - max_tokens - NUM_DRAFT_TOKENS - 2
        ids = list(ids)[: max(room, 1)]
        spec = Speculation(num_draft_tokens=NUM_DRAFT_TOKENS, profile=False)
        dec = make_decoder(v, d, SamplingParams(temperature=0.0), spec, eos_token_ids=eos_token_ids)
        tokens = sum(len(r.tokens) for r in dec.run(ids, max_tokens))
        s = dec.stats
        domains[name] = {
            "accepted": s.accepted,
            "rejected": s.rejected,
            "drafted": s.drafted,
            "rounds": s.rounds,
            "tokens": tokens,
        }
    return {
        "method": "chain",
        "temperature": 0.0,
        "num_draft_tokens": NUM_DRAFT_TOKENS,
        "max_tokens": max_tokens,
        "estimator": "accepted / (accepted + rejected)",
        "domains": domains,
    }
