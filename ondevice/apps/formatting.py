"""One-line summaries for people: a generation's statistics and the prompt cache's state, as
the command line, the terminal chat and the menu bar show them."""

from __future__ import annotations

from typing import Any

from ondevice.sources.sizes import human_size


def format_stats(stats: dict[str, Any] | None) -> str:
    """One line about an answer: tokens and speed, the prompt (and how much of it came from the
    prompt cache), and acceptance when a draft was used (with the draft's window when the
    prompt outgrew it), or why no draft was used. Live counters (no prompt yet) give the share
    of tokens that came from the draft instead."""
    if not stats:
        return "no answer yet"
    parts = [
        f"{stats.get('generation_tokens', 0)} tokens",
        f"{stats.get('tokens_per_second', 0.0):.1f} tok/s",
    ]
    if "prompt_tokens" in stats:
        prompt = f"prompt {stats['prompt_tokens']} tokens"
        if "prompt_seconds" in stats:
            prompt += f" in {stats['prompt_seconds']:.2f}s"
        if stats.get("cached_tokens"):
            prompt += f" ({stats['cached_tokens']} from the prompt cache)"
        parts.append(prompt)
    if stats.get("drafted"):
        parts.append(f"acceptance {stats.get('acceptance_rate', 0.0):.0%}")
        passes = f"{stats.get('mean_accepted_length', 0.0):.2f} tokens/pass"
        if stats.get("draft_backend"):
            passes += f" (draft: {stats['draft_backend']})"
        parts.append(passes)
        if stats.get("draft_window_moves"):
            parts.append(f"draft read the last {stats['draft_window']} tokens")
    elif stats.get("draft_skipped"):
        parts.append(f"no drafting: {stats['draft_skipped']}")
    elif "from_draft" in stats:
        parts.append(f"{stats['from_draft']:.0%} from draft")
    if stats.get("stopped"):
        parts.append("stopped")
    return ", ".join(parts)


def format_limits(limits: dict[str, int | None] | None) -> str:
    """One line about the loaded model's two limits (`ChatController.limits`): how long a
    conversation can be, and how much of it the draft reads."""
    if not limits:
        return "context: no model loaded"
    line = f"context {limits['context']} tokens"
    if limits.get("draft_window"):
        line += f", draft reads the last {limits['draft_window']}"
    return line


def format_prompt_cache(pc: dict[str, int] | None) -> str:
    """One line about the prompt cache: what it holds and how often it was used."""
    if not pc:
        return "prompt cache: no model loaded"
    if not pc["max_bytes"] and not pc["entries"]:
        return "prompt cache: off"
    return (
        f"prompt cache: {pc['entries']} entries, {human_size(pc['bytes'])} of "
        f"{human_size(pc['max_bytes'])}, {pc['hits']} hits, {pc['misses']} misses, "
        f"{pc['evictions']} evictions, {pc['cached_tokens']} tokens reused"
    )
