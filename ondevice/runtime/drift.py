"""Draft staleness: the pair's acceptance now, per domain, against what it was when the bundle
was made.

When the verifier is fine-tuned or swapped, a draft distilled for the old one agrees with it
less: outputs stay exact (speculation is lossless) but the speed-up fades, silently. Two numbers
tell: what `ondevice-convert` measured on its probe prompts (the manifest's `acceptance`, per
Spec-Bench-style domain: code, chat, math, ...) and what generations measure now.

Estimator. A round drafts k tokens and the verifier keeps the longest agreeing prefix: each
drafted position is a trial that succeeds with probability alpha until the first failure. Over
rounds, alpha-hat = accepted / (accepted + rejected), where `rejected` counts rounds cut short,
is the maximum-likelihood estimate of alpha, and it does not depend on k: requests with any
`num_draft_tokens`, or the adaptive length, compare with a baseline measured at a fixed one.
The acceptance of sampled tokens depends on the temperature, so only greedy chain generations
(temperature 0, no grammar, penalties or logit bias) are compared with the greedy baseline.

Window and threshold. A domain's rate is the pooled alpha-hat over its last WINDOW trials (about
accepted + rejected drafted positions; whole generations are kept, the oldest dropped once the
rest still fill the window). It is judged only once the window is full, so one odd request
cannot raise the alarm: the drop must hold over several requests' worth of tokens. The alarm
is up while

    alpha_now < alpha_base - TOLERANCE - Z * sqrt(a (1 - a) (1 / n_now + 1 / n_base)),  a = alpha_base

the one-sided two-sample test of a fall at Z = 3 standard errors of the binomial noise of both
estimates (a false alarm about once in 700 full windows for a pair that did not change), plus
TOLERANCE for what the binomial model does not see: user prompts are not the probe prompts,
trials within a round are correlated, and the Core ML draft computes in float16 while the
baseline ran its MLX copy. With WINDOW = 256 and alpha = 0.7 the margin is about 0.25
against a domain's record of 64 tokens (about 60 trials): it catches a draft that has lost a
third of its agreement, which costs most of the speed-up, and stays quiet for noise; more
`--acceptance-tokens` at conversion narrow it.

A generation without a named domain goes to one "default" bucket. Its traffic may be any mix of
domains, whose acceptance differs widely (from about 0.75 for chat to 0.98 for RAG for the
default pair), so it, and a domain the baseline lacks, is compared with the weakest recorded
domain: a fall below what every domain achieved is a drift whatever the mix.

The alarm is logged (logger "ondevice") when it rises and when it clears, shown by
`Generator.acceptance_drift()`, the server's /health and /metrics, and kept in the cache's
`drift/` folder while it is up, where `ondevice doctor` finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ondevice.errors import BundleError, OndeviceError

WINDOW = 256  # trials (drafted positions decided) per domain before it is judged
Z = 3.0  # standard errors of binomial noise a fall must exceed
TOLERANCE = 0.05  # and this much more (prompt mix, correlation, float16 draft)
MAX_DOMAINS = 16  # buckets kept; more names share "other" (bounded /metrics labels)
DEFAULT_DOMAIN = "default"
DOMAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
ADVICE = (
    "the verifier agrees with its draft less than when the bundle was made (was it fine-tuned "
    "or swapped?): re-distill the draft for it (`ondevice distill`) or re-convert the pair "
    "(`ondevice-convert`) to get the speed back; outputs stay exact meanwhile"
)
log = logging.getLogger("ondevice")


@dataclass(frozen=True)
class Rate:
    """Trials of a pooled acceptance estimate: `accepted` successes, `rejected` failures."""

    accepted: int
    rejected: int

    @property
    def trials(self) -> int:
        return self.accepted + self.rejected

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.trials if self.trials else None


def check_domain(domain: Any) -> str | None:
    """A domain name as given (letters, digits, `_.-`, at most 32), or None; else an error."""
    if domain is None:
        return None
    if not isinstance(domain, str) or not DOMAIN_NAME.fullmatch(domain):
        raise OndeviceError(
            f"domain must be a name of 1-32 letters, digits, '_', '.' or '-' (such as 'code' "
            f"or 'chat'), got {domain!r}."
        )
    return domain


def read_baseline(manifest: dict[str, Any], where: str | Path = "manifest.json") -> dict[str, Rate]:
    """Domain -> Rate from a bundle manifest's `acceptance` section ({} when it has none: a
    bundle converted before it was recorded, or with --acceptance-tokens 0)."""
    section = manifest.get("acceptance")
    if section is None:
        return {}
    domains = section.get("domains") if isinstance(section, dict) else None
    if not isinstance(domains, dict):
        raise BundleError(f"{where}: field 'acceptance.domains' must be an object of domains.")
    out = {}
    for name, entry in domains.items():
        counts = [
            entry.get(k) if isinstance(entry, dict) else None for k in ("accepted", "rejected")
        ]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise BundleError(
                f"{where}: field 'acceptance.domains.{name}' must hold counts 'accepted' and "
                "'rejected'; the manifest is corrupted. Re-run `ondevice-convert`."
            )
        out[str(name)] = Rate(*counts)
    return out


def threshold(base: Rate, trials: int) -> float | None:
    """The acceptance under which a window of `trials` raises the alarm (None: no baseline)."""
    a = base.alpha
    if a is None:
        return None
    noise = math.sqrt(a * (1 - a) * (1 / max(trials, 1) + 1 / base.trials))
    return a - TOLERANCE - Z * noise


class _Bucket:
    def __init__(self) -> None:
        self.generations: deque[tuple[int, int]] = deque()
        self.accepted = self.rejected = 0
        self.alarm = False
        self.since: float | None = None

    def add(self, accepted: int, rejected: int, window: int) -> None:
        self.generations.append((accepted, rejected))
        self.accepted += accepted
        self.rejected += rejected
        while len(self.generations) > 1:
            a, r = self.generations[0]
            if self.accepted + self.rejected - a - r < window:
                break
            self.generations.popleft()
            self.accepted -= a
            self.rejected -= r


class DriftMonitor:
    """Rolling acceptance per domain, judged against a baseline (see the module docstring)."""

    def __init__(
        self,
        baseline: dict[str, Rate] | None = None,
        *,
        model: str = "",
        key: str = "",
        window: int = WINDOW,
        state_dir: Path | None = None,
    ) -> None:
        self.baseline = dict(baseline or {})
        self.model = model
        self.window = window
        self.state_dir = state_dir
        self.key = key
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        self._checked = False  # whether a full window has been judged (see `observe`)

    def bucket(self, domain: str | None) -> str:
        """The bucket a generation of `domain` counts in."""
        name = domain or DEFAULT_DOMAIN
        with self._lock:
            if name not in self._buckets and len(self._buckets) >= MAX_DOMAINS:
                name = "other"
            self._buckets.setdefault(name, _Bucket())
        return name

    def base(self, bucket: str) -> Rate | None:
        """The record `bucket` is compared with: its own, else the weakest domain's."""
        if bucket in self.baseline:
            return self.baseline[bucket]
        rated = [r for r in self.baseline.values() if r.alpha is not None]
        return min(rated, key=lambda r: r.alpha or 0.0) if rated else None

    def observe(self, bucket: str, stats: dict[str, Any]) -> None:
        """Count a finished greedy chain generation's rounds (its stats) in `bucket`."""
        accepted, rejected = int(stats.get("accepted", 0)), int(stats.get("rejected_rounds", 0))
        if accepted + rejected == 0:
            return
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket())
            b.add(accepted, rejected, self.window)
            changed = self._judge(bucket, b)
            # the first full quiet window clears a record an earlier run left up
            stale = not self._checked and b.accepted + b.rejected >= self.window and not b.alarm
            self._checked = self._checked or stale
        if changed:
            self._report(bucket, b)
        elif stale:
            self._save()

    def _judge(self, name: str, b: _Bucket) -> bool:
        base = self.base(name)
        trials = b.accepted + b.rejected
        line = threshold(base, trials) if base is not None else None
        alarm = line is not None and trials >= self.window and b.accepted / trials < line
        if alarm == b.alarm:
            return False
        b.alarm, b.since = alarm, (time.time() if alarm else None)
        return True

    def _report(self, name: str, b: _Bucket) -> None:
        d = self._domain(name, b)
        if b.alarm:
            log.warning(
                "%s: draft acceptance on %r fell to %.2f over the last %d drafted positions, "
                "below %.2f (it was %.2f): %s.",
                self.model, name, d["acceptance"], d["trials"], d["threshold"], d["baseline"],
                ADVICE,
            )  # fmt: skip
        else:
            log.info(
                "%s: draft acceptance on %r is back to %.2f.", self.model, name, d["acceptance"]
            )
        self._save()

    def _domain(self, name: str, b: _Bucket) -> dict[str, Any]:
        trials = b.accepted + b.rejected
        base = self.base(name)
        return {
            "acceptance": b.accepted / trials if trials else None,
            "trials": trials,
            "baseline": base.alpha if base else None,
            "threshold": threshold(base, max(trials, self.window)) if base else None,
            "alarm": b.alarm,
            "since": b.since,
        }

    def status(self) -> dict[str, Any]:
        """{"baseline": recorded?, "alarm": any domain alarming, "advice": what to do (or None),
        "window": trials judged, "domains": {name: acceptance, trials, baseline, threshold,
        alarm, since}}."""
        with self._lock:
            domains = {n: self._domain(n, b) for n, b in self._buckets.items()}
        alarm = any(d["alarm"] for d in domains.values())
        return {
            "baseline": bool(self.baseline),
            "alarm": alarm,
            "advice": ADVICE if alarm else None,
            "window": self.window,
            "domains": domains,
        }

    def prometheus(self) -> str:
        """Gauges per domain in Prometheus' text format (empty before the first generation)."""
        domains = self.status()["domains"]
        if not domains:
            return ""
        lines = []
        for metric, field, help_ in (
            ("draft_acceptance", "acceptance", "Rolling acceptance (alpha) of greedy drafts."),
            ("draft_acceptance_baseline", "baseline", "Acceptance when the bundle was made."),
            ("draft_acceptance_threshold", "threshold", "Acceptance under which it alarms."),
            ("draft_drift_alarm", "alarm", "1 while the draft's acceptance has fallen."),
        ):
            lines += [f"# HELP ondevice_{metric} {help_}", f"# TYPE ondevice_{metric} gauge"]
            for name, d in sorted(domains.items()):
                if d[field] is not None:
                    lines.append(f'ondevice_{metric}{{domain="{name}"}} {float(d[field]):g}')
        return "\n".join(lines) + "\n"

    # -- the record `ondevice doctor` reads --------------------------------------------------

    def _save(self) -> None:
        """Keep the alarming domains in `state_dir` while any is up; remove the file after."""
        if self.state_dir is None or not self.key:
            return
        status = self.status()
        path = self.state_dir / f"{self.key}.json"
        try:
            if not status["alarm"]:
                path.unlink(missing_ok=True)
                return
            self.state_dir.mkdir(parents=True, exist_ok=True)
            record = {
                "model": self.model,
                "pid": os.getpid(),
                "time": time.time(),
                "advice": ADVICE,
                "domains": {n: d for n, d in status["domains"].items() if d["alarm"]},
            }
            fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=".drift-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:  # the alarm is logged and served either way
            log.warning("could not record the draft drift alarm in %s: %s", self.state_dir, e)


def state_key(*parts: str) -> str:
    """A file name for a pair (its model files), stable across runs."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def describe_alarm(record: dict[str, Any]) -> list[str]:
    """One line per alarming domain of a `recorded_alarms` record (for `ondevice doctor`)."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.get("time") or 0))
    lines = []
    for name, d in sorted(record["domains"].items()):
        try:
            lines.append(
                f"{record.get('model')}: draft acceptance on {name!r} fell to "
                f"{d['acceptance']:.2f} over {d['trials']} drafted positions, below "
                f"{d['threshold']:.2f} (the bundle recorded {d['baseline']:.2f}; seen {when}): "
                f"{ADVICE}."
            )
        except (KeyError, TypeError, ValueError):
            lines.append(f"{record.get('model')}: a damaged drift record {record.get('path')}")
    return lines


def recorded_alarms(state_dir: Path) -> list[dict[str, Any]]:
    """The drift alarms generations left in `state_dir` (for `ondevice doctor`)."""
    if not state_dir.is_dir():
        return []
    found = []
    for path in sorted(state_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("domains"), dict):
            found.append({**record, "path": str(path)})
    return found
