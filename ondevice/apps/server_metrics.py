"""The server's /metrics: request, generation, queue and prompt-cache counters, rendered in
Prometheus' text format."""

from __future__ import annotations

from typing import Any


class Metrics:
    """Counters for /metrics, written by hand in Prometheus' text format (a dozen lines)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}  # by (path, status)
        # the paths counted by name (routes, and "(...)" classes); any other is "(unknown)", so
        # random URLs cannot grow the metrics without bound (None: every path by name)
        self.known_paths: set[str] | None = None
        self.generations = self.prompt_tokens = self.generated_tokens = 0
        self.drafted = self.accepted = 0  # draft tokens proposed and accepted
        self.last_tps = 0.0  # tokens/s of the last generation

    def count_request(self, path: str, status: int) -> None:
        if self.known_paths is not None and path not in self.known_paths:
            path = path if path.startswith("(") and path.endswith(")") else "(unknown)"
        self.requests[(path, status)] = self.requests.get((path, status), 0) + 1

    def count_generation(self, stats: dict[str, Any]) -> None:
        self.generations += 1
        self.prompt_tokens += int(stats.get("prompt_tokens", 0))
        self.generated_tokens += int(stats.get("generation_tokens", 0))
        self.drafted += int(stats.get("drafted", 0))
        self.accepted += int(stats.get("accepted", 0))
        self.last_tps = float(stats.get("tokens_per_second", 0.0))

    def render(
        self, queue_length: int, busy: bool, prompt_cache: dict[str, int] | None = None
    ) -> str:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        requests = [
            (f'{{path="{_label(p)}",status="{s}"}}', n)
            for (p, s), n in sorted(self.requests.items())
        ]
        metrics = [
            ("requests_total", "counter", "HTTP requests by path and status code.", requests),
            ("generations_total", "counter", "Finished generations.", self.generations),
            ("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
            ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
            ("draft_tokens_total", "counter", "Tokens proposed by the draft.", self.drafted),
            ("accepted_tokens_total", "counter", "Draft tokens accepted.", self.accepted),
            ("acceptance_rate", "gauge", "Accepted / drafted tokens since start.", rate),
            ("tokens_per_second", "gauge", "Speed of the last generation.", self.last_tps),
            ("queue_length", "gauge", "Requests waiting for the model.", queue_length),
            ("generation_active", "gauge", "1 while the model is generating.", int(busy)),
        ]
        pc = prompt_cache or {}
        metrics += [
            (f"prompt_cache_{name}", kind, help_, pc.get(key, 0))
            for name, key, kind, help_ in (
                ("hits_total", "hits", "counter", "Prompts that started from cached KV."),
                ("misses_total", "misses", "counter", "Prompts with no cached prefix."),
                ("cached_tokens_total", "cached_tokens", "counter",
                 "Prompt tokens taken from the cache instead of prefilled."),
                ("evictions_total", "evictions", "counter", "Entries dropped to stay in budget."),
                ("entries", "entries", "gauge", "Token sequences whose KV is kept."),
                ("bytes", "bytes", "gauge", "Memory held by the prompt cache."),
                ("max_bytes", "max_bytes", "gauge", "The prompt cache's budget (--prompt-cache-mb)."),
            )
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_, value in metrics:
            samples = value if isinstance(value, list) else [("", value)]
            lines += [f"# HELP ondevice_{name} {help_}", f"# TYPE ondevice_{name} {kind}"]
            # integers (counters, bytes) exactly; `g` would round them to 6 digits
            lines += [
                f"ondevice_{name}{labels} {v if isinstance(v, int) else format(v, 'g')}"
                for labels, v in samples
            ]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A label value in Prometheus' text format: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
