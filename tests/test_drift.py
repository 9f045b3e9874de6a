"""Draft staleness (issue 28, item 10): the bundle records the pair's acceptance per domain at
conversion; generations keep a rolling acceptance per domain; a sustained fall below the record
raises an alarm in the log, `acceptance_drift()`, /health, /metrics and `ondevice doctor`."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import httpx
import pytest
import tiny
from test_server import LiveServer

import ondevice
from ondevice.convert import cli
from ondevice.convert.acceptance import domain_texts
from ondevice.errors import BundleError, OndeviceError
from ondevice.runtime import drift
from ondevice.runtime.drift import DriftMonitor, Rate, read_baseline, threshold

BASE = {"code": Rate(70, 30), "chat": Rate(40, 60)}


def _stats(accepted: int, rejected: int) -> dict[str, int]:
    return {"accepted": accepted, "rejected_rounds": rejected}


def test_the_threshold_is_the_baseline_less_tolerance_and_three_standard_errors():
    a = 0.7
    expected = a - drift.TOLERANCE - 3 * math.sqrt(a * (1 - a) * (1 / 256 + 1 / 100))
    assert threshold(Rate(70, 30), 256) == pytest.approx(expected)
    assert threshold(Rate(100, 0), 256) == pytest.approx(1 - drift.TOLERANCE)  # no noise at 1


def test_a_sustained_fall_raises_the_alarm_and_a_recovery_clears_it(tmp_path, caplog):
    mon = DriftMonitor(dict(BASE), model="m", key="k", state_dir=tmp_path)
    record = tmp_path / "k.json"
    for _ in range(20):  # the pair as it was: quiet
        mon.observe("code", _stats(14, 6))
    assert not mon.status()["alarm"]
    mon.observe("code", _stats(0, 20))  # one bad request is not a sustained fall
    assert not mon.status()["alarm"]
    with caplog.at_level(logging.INFO, logger="ondevice"):
        for _ in range(12):
            mon.observe("code", _stats(6, 14))
    status = mon.status()
    code = status["domains"]["code"]
    assert status["alarm"] and code["alarm"] and "re-distill" in status["advice"]
    assert code["acceptance"] < code["threshold"] < code["baseline"] == 0.7
    assert code["trials"] >= drift.WINDOW
    assert any("fell to" in r.getMessage() and "re-convert" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)  # fmt: skip
    saved = json.loads(record.read_text())
    assert saved["model"] == "m" and set(saved["domains"]) == {"code"}
    assert 'ondevice_draft_drift_alarm{domain="code"} 1' in mon.prometheus()
    (line,) = drift.describe_alarm(saved)
    assert "'code'" in line and "re-distill" in line

    for _ in range(20):
        mon.observe("code", _stats(14, 6))
    assert not mon.status()["alarm"] and not record.exists()


def test_nothing_is_judged_before_the_window_fills_or_without_a_baseline():
    mon = DriftMonitor(dict(BASE))
    for _ in range(5):
        mon.observe("code", _stats(0, 20))  # 100 trials, all failures
    assert not mon.status()["alarm"]
    bare = DriftMonitor({})
    for _ in range(40):
        bare.observe("code", _stats(0, 20))
    assert not bare.status()["alarm"] and bare.status()["domains"]["code"]["baseline"] is None


def test_unnamed_and_unknown_domains_use_the_weakest_record_and_buckets_are_bounded():
    base = read_baseline({"acceptance": {"domains": {"code": {"accepted": 70, "rejected": 30},
                                                     "chat": {"accepted": 40, "rejected": 60}}}})  # fmt: skip
    assert base == BASE
    mon = DriftMonitor(base)
    assert mon.base("poetry") == mon.base(drift.DEFAULT_DOMAIN) == Rate(40, 60)
    assert mon.base("code") == Rate(70, 30)
    names = {mon.bucket(f"d{i}") for i in range(drift.MAX_DOMAINS + 5)}
    for n in names:
        mon.observe(n, _stats(1, 1))
    assert len(mon.status()["domains"]) <= drift.MAX_DOMAINS + 1
    assert mon.bucket(None) in (drift.DEFAULT_DOMAIN, "other")


def test_bad_records_and_names_are_refused_by_field():
    with pytest.raises(BundleError, match=r"acceptance\.domains\.code"):
        read_baseline({"acceptance": {"domains": {"code": {"accepted": -1, "rejected": 2}}}})
    with pytest.raises(BundleError, match=r"acceptance\.domains"):
        read_baseline({"acceptance": {"domains": []}})
    assert read_baseline({}) == {}
    with pytest.raises(OndeviceError, match="domain must be"):
        drift.check_domain("no spaces please")


# -- the whole path: conversion, a perturbed verifier, the server, doctor ------------------------

REPEATS = 5  # generations per domain: enough drafted positions to fill the window
MAX_TOKENS = 64
PROMPT_CHARS = 300


@pytest.mark.slow
def test_a_perturbed_verifier_raises_the_alarm_and_the_original_stays_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    verifier = tiny.write_endless_model(tmp_path / "v")
    draft = tiny.perturbed_copy(verifier, tmp_path / "d", noise=0.1)
    bundle = tmp_path / "pair.bundle"
    argv = ["--verifier", str(verifier), "--draft", str(draft), "-o", str(bundle),
            "--context", "512", "--draft-chunk", "8", "--probe-prompts", "0"]  # fmt: skip
    assert cli.main(argv) == 0
    recorded = json.loads((bundle / "manifest.json").read_text())["acceptance"]
    assert set(recorded["domains"]) == set(domain_texts())
    assert all(d["accepted"] + d["rejected"] > 0 for d in recorded["domains"].values())

    # the same prompts, cut to fit the tiny model's context (one character, one token)
    texts = {name: text[:PROMPT_CHARS] for name, text in domain_texts().items()}
    chats = {name: [{"role": "user", "content": text}] for name, text in texts.items()}
    original = ondevice.load(bundle, draft_backend="mlx")
    assert original.acceptance_drift()["baseline"]
    for _ in range(REPEATS):
        for name, messages in chats.items():
            original.generate(messages, max_tokens=MAX_TOKENS, domain=name)
    status = original.acceptance_drift()
    assert set(status["domains"]) == set(chats)
    assert all(d["trials"] >= drift.WINDOW for d in status["domains"].values())
    assert not status["alarm"], status

    # a fine-tuned (here: perturbed) verifier serving with the bundle's draft; perturbed far
    # enough that every domain falls below its line under either kernel (at noise 0.5, bf16
    # products left summarization, whose low recorded rate sets a low line, just above it)
    changed = tiny.perturbed_copy(verifier, tmp_path / "v2", noise=1.0, seed=7)
    gen = ondevice.load(changed, draft=bundle, draft_backend="mlx")
    with LiveServer(gen) as server:
        client = server.client()
        for _ in range(REPEATS):
            for name, messages in chats.items():
                client.chat.completions.create(
                    model="m", messages=messages,
                    max_tokens=MAX_TOKENS, temperature=0,
                    extra_headers={"X-Ondevice-Domain": name},
                )  # fmt: skip
        health = httpx.get(server.url + "/health").json()
        metrics = httpx.get(server.url + "/metrics").text
        bad = httpx.post(
            server.url + "/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 1},
            headers={"X-Ondevice-Domain": "two words"},
        )
    acceptance = health["draft_acceptance"]
    assert acceptance["alarm"] and "re-convert" in acceptance["advice"]
    assert all(d["alarm"] for d in acceptance["domains"].values()), [
        (n, d["acceptance"], d["threshold"], d["alarm"]) for n, d in acceptance["domains"].items()
    ]
    for name in chats:
        assert f'ondevice_draft_drift_alarm{{domain="{name}"}} 1' in metrics
    assert bad.status_code == 400 and "X-Ondevice-Domain" in bad.json()["error"]["message"]

    from ondevice.apps.doctor import collect, render

    report = collect()
    assert len(report["draft_drift"]) == 1
    assert "re-distill" in render(report)
