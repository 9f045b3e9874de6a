"""benchmarks/placement_prediction.py (issue 26 item 5, issue 30 item 5): the Mac predictions are
arithmetic over the runtime's own cost functions, so their structure can be checked here: a
cheaper draft is never predicted slower at the same acceptance, Medusa heads that never hit cost
exactly their own pass, a self-draft that skips more layers is never slower at the same
acceptance, and the report prints every row."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "placement_prediction.py"
_spec = importlib.util.spec_from_file_location("placement_prediction", SCRIPT)
pp = sys.modules["placement_prediction"] = importlib.util.module_from_spec(_spec)  # dataclasses
_spec.loader.exec_module(pp)

MACS = [pp.Mac("M4", 120.0), pp.Mac("M4 Pro", 273.0), pp.Mac("M4 Pro 4-bit", 273.0, bits=4)]


def test_the_verifiers_bytes_are_the_architectures_parameters():
    verifier, verify = pp.Mac("x", 100.0, overhead_ms=0.0, efficiency=1.0).verifier()
    # Qwen2.5-Coder-1.5B: 1.54B parameters, tied head, 2 bytes each
    assert pp.pass_bytes(verifier) == pytest.approx(3.09e9, rel=0.01)
    assert float(verify(1)) == pytest.approx(3.09e9 / 100e9, rel=0.01)
    assert pp.pass_bytes(pp.lazy_model(pp.VERIFIER, 4)) < pp.pass_bytes(verifier) / 3


@pytest.mark.parametrize("mac", MACS, ids=lambda m: m.name)
def test_a_cheaper_draft_is_never_predicted_slower_at_the_same_acceptance(mac):
    _, verify = mac.verifier()
    full, cut, l22, l18, l12 = (mac.draft_profiles(d) for d in pp.DRAFTS)
    steps = [float(p["mlx"](1)) for p in (full, l22, l18, l12)]
    assert steps == sorted(steps, reverse=True)
    assert float(cut["coreml"](1)) < float(full["coreml"](1)) == pytest.approx(mac.ane_ms / 1000)
    for alpha in (0.3, 0.545, 0.76, 0.9):
        for backend in ("mlx", "coreml"):
            rate = {
                name: pp.best_per_backend(verify, drafts, alpha)[backend].tokens_per_second
                for name, drafts in (
                    ("full", full), ("cut", cut), ("22", l22), ("18", l18), ("12", l12)
                )
            }  # fmt: skip
            assert rate["cut"] >= rate["full"] - 1e-9, (alpha, backend, rate)
            assert rate["22"] >= rate["full"] - 1e-9, (alpha, backend, rate)
            assert rate["18"] >= rate["22"] - 1e-9, (alpha, backend, rate)
            assert rate["12"] >= rate["18"] - 1e-9, (alpha, backend, rate)


def test_medusa_heads_that_never_hit_cost_plain_decoding_their_own_pass():
    mac = pp.Mac("M4 Pro", 273.0)
    verifier, verify = mac.verifier()
    heads = pp.medusa_heads_seconds(mac, verifier)
    assert 0 < heads < 0.1 * float(verify(1))  # K small residual blocks and 32768 output rows
    n, per_pass, rate = pp.medusa_prediction(verify, heads, np.zeros(64))
    assert (n, per_pass) == (0, 1.0)
    assert rate == pytest.approx(1.0 / (float(verify(1)) + heads))
    # and heads that do hit verify a tree and beat plain decoding
    n, per_pass, rate = pp.medusa_prediction(
        verify, heads, pp.medusa_values(pp.MEDUSA_HEADS["Medusa-1, Vicuna-7B (Medusa repo)"])
    )
    assert n >= 2 and per_pass > 1.5 and rate > 1.0 / float(verify(1))


def test_sequential_heads_pay_a_gpu_pass_per_level_of_their_tree():
    mac = pp.Mac("M4 Pro", 273.0)
    verifier, verify = mac.verifier()
    medusa = pp.medusa_heads_seconds(mac, verifier)
    hydra = pp.medusa_heads_seconds(mac, verifier, kind="hydra")
    one_level = pp.medusa_heads_seconds(mac, verifier, 1, kind="hydra")
    assert hydra == pytest.approx(4 * one_level) and hydra > medusa
    assert hydra < 0.25 * float(verify(1))


def test_medusa_tree_values_are_products_of_per_head_rank_accuracies():
    values = pp.medusa_values([[0.5, 0.7], [0.4]])
    # depth 1: ranks 0.5, 0.2; depth 2: 0.5 * 0.4, 0.2 * 0.4
    assert values == pytest.approx([0.5, 0.2, 0.2, 0.08])
    assert len(pp.medusa_values([[0.6, 0.7, 0.8]] * 4)) == pp.MEDUSA_MAX_NODES


def test_a_self_draft_skipping_more_layers_is_cheaper_and_never_slower_at_the_same_acceptance():
    verifier, verify = pp.Mac("M4", 120.0).verifier()
    previous_fraction, previous_rate = 1.0, 0.0
    for skipped in range(1, len(pp.SKIP_ORDER) + 1):
        fraction, p = pp.self_prediction(verify, verifier, skipped, 0.8)
        assert fraction < previous_fraction
        assert p.tokens_per_second >= previous_rate - 1e-9
        previous_fraction, previous_rate = fraction, p.tokens_per_second
    with pytest.raises(ValueError):
        pp.self_prediction(verify, verifier, len(pp.SKIP_ORDER) + 1, 0.8)


def test_the_report_prints_every_draft_method_and_machine(capsys):
    assert pp.main(["--machines", "M4=120,M4 Pro=273"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 0.5B (today's) |") == 2 and out.count("SWIFT's setting") == 2
    assert all(d.name in out for d in pp.DRAFTS)
    assert all(name in out for name in (*pp.MEDUSA_HEADS, *pp.HYDRA_HEADS))
    rows = [line for line in out.splitlines() if line.startswith("| 0.5B")]
    assert len(rows) == 2 * len(pp.DRAFTS)
    assert all(row.count("**") == 4 for row in rows)  # `choose`'s pick at each of two alphas
    with pytest.raises(SystemExit, match="NAME=GB/s"):
        pp.main(["--machines", "M4 Pro"])
