"""Where the draft runs (issue 18, item 5): the placement the cost model predicts fastest from
measured profiles, checked here with injected profiles (Core ML prediction needs a Mac)."""

from __future__ import annotations

import json

import pytest
import tiny

from ondevice.models import load_model
from ondevice.runtime.engines import MLXEngine
from ondevice.runtime.pass_costs import SIZES, CostProfile, device_name, engine_key, profile_path
from ondevice.runtime.placement import choose, place_draft, predicted_model


def flat(ms: float) -> CostProfile:
    """A GPU-like profile: a pass costs about the same whatever its size."""
    return CostProfile([1, 64], [ms / 1000, ms / 1000 * 1.05])


def test_a_faster_neural_engine_draft_is_chosen_and_drafts_ahead():
    p = choose(flat(20), {"coreml": flat(3), "mlx": flat(8)})
    assert p.backend == "coreml" and p.pipelined and p.k >= 2


def test_a_draft_step_as_slow_as_a_verifier_pass_stays_on_the_gpu():
    # a 0.5B draft on the Neural Engine against a 1.5B verifier on an Apple GPU (issue 19)
    p = choose(flat(20), {"coreml": flat(30), "mlx": flat(6)})
    assert p.backend == "mlx" and not p.pipelined  # the GPU draft cannot overlap the GPU


def test_behind_a_slower_verifier_drafting_ahead_on_the_neural_engine_pays():
    verify, ane, gpu = flat(60), flat(15), flat(12)
    # one after the other the GPU draft is faster (12 ms a step against 15) ...
    seq = {
        name: m.rate(m.best_k(False, 8), False)
        for name, m in (("coreml", predicted_model(verify, ane, 0.75, 8)),
                        ("mlx", predicted_model(verify, gpu, 0.75, 8)))
    }  # fmt: skip
    assert seq["mlx"] > seq["coreml"]
    # ... but the Neural Engine drafts while the verifier's 60 ms passes run
    p = choose(verify, {"coreml": ane, "mlx": gpu})
    assert p.backend == "coreml" and p.pipelined and p.tokens_per_second > seq["mlx"]


def test_no_backend_is_an_error():
    with pytest.raises(ValueError):
        choose(flat(20), {})


@pytest.fixture
def profiled(tmp_path, monkeypatch):
    """Three tiny engines whose cost profiles are already in the cache (as a Mac would have
    measured them), saying the opposite of what measuring here would: the 3-layer draft is
    cheap, the 1-layer one dear."""
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    v = MLXEngine(load_model(tiny.write_model(tmp_path / "v", seed=1)).model)
    big = MLXEngine(load_model(tiny.write_model(tmp_path / "d1", seed=2, layers=3)).model)
    small = MLXEngine(load_model(tiny.write_model(tmp_path / "d2", seed=3, layers=1)).model)
    for engine, ms in ((v, 20.0), (big, 6.0), (small, 30.0)):
        path = profile_path(device_name(), engine_key(engine))
        assert not path.exists()  # three different keys
        path.parent.mkdir(parents=True, exist_ok=True)
        secs = [ms / 1000 * (1 + 0.01 * n) for n in SIZES]
        path.write_text(json.dumps(CostProfile(list(SIZES), secs).to_json()))
    return v, big, small


def test_place_draft_follows_the_cached_profiles(profiled):
    v, big, small = profiled
    engine, placement = place_draft(v, {"coreml": small, "mlx": big})
    assert engine is big and placement.backend == "mlx" and not placement.pipelined
    engine, placement = place_draft(v, {"coreml": big, "mlx": small})
    assert engine is big and placement.backend == "coreml" and placement.pipelined
