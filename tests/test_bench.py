"""`ondevice bench` on a tiny pair: the JSON fields, the chart, mlx-lm as a peer, the greedy
canary, and clear errors for bad prompt files and options."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tiny import perturbed_copy, write_model

from ondevice.apps.cli import main
from ondevice.errors import OndeviceError
from ondevice.runtime import kernel
from ondevice.speedtest import builtin_prompts_path, read_prompts
from ondevice.speedtest.peers import mlx_lm_rounds

PROMPTS = [
    {"question_id": 1, "category": "chat", "turns": ["hello there, how are you?", "and now?"]},
    {"question_id": 2, "category": "chat", "turns": ["tell me a story"]},
    {"question_id": 3, "category": "code", "turns": ["def add(a, b): return a + b"]},
    {"question_id": 4, "category": "code", "turns": ["print the numbers 1 to 10"]},
]
SUMMARY_FIELDS = (
    "tokens_per_second",
    "speedup",
    "acceptance_rate",
    "mean_accepted_length",
    "time_draft_s",
    "time_verify_s",
    "peak_memory_bytes",
    "memory_bytes",
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    v = write_model(root / "verifier", scale=3.0)
    return v, perturbed_copy(v, root / "draft", noise=0.05)


@pytest.fixture
def prompts(tmp_path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return f


def bench(pair, prompts, out: Path, *extra: str) -> int:
    v, d = pair
    argv = ["bench", "--verifier", str(v), "--draft", str(d), "--prompts", str(prompts)]
    return main([*argv, "--max-tokens", "16", "--out", str(out), "--quiet", *extra])


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_bench_writes_json_and_png(pair, prompts, tmp_path, capsys):
    out = tmp_path / "res" / "results.json"
    assert bench(pair, prompts, out) == 0
    printed = capsys.readouterr().out
    assert "chain" in printed and "speedup" in printed  # the table

    r = json.loads(out.read_text())
    assert r["settings"]["methods"] == ["plain", "chain"]
    assert r["prompts"]["count"] == 4 and r["prompts"]["categories"] == ["chat", "code"]
    assert {"platform", "cpu", "blas", "versions", "mlx_device"} <= set(r["machine"])
    assert "openblas_preloaded" in r["machine"]["blas"]
    assert r["machine"]["versions"]["mlx"]
    # the draft is a perturbed copy of the verifier: same parameter bytes, unless the CPU
    # kernel rounds the draft's layers to int8 (kernel.draft_choice)
    m = r["models"]
    assert m["verifier"]["param_bytes"] > 0
    if kernel.draft_choice() == kernel.choice():
        assert m["draft_to_verifier_memory"] == pytest.approx(1.0)
    else:
        assert 0.3 < m["draft_to_verifier_memory"] < 0.9

    for method in ("plain", "chain"):
        assert set(r["aggregates"][method]) == {"chat", "code", "all"}
    chain = r["aggregates"]["chain"]
    for cat in ("chat", "code", "all"):
        s = chain[cat]
        for key in SUMMARY_FIELDS:
            assert s[key] is not None and s[key] >= 0, (cat, key)
        assert 0 <= s["acceptance_rate"] <= 1
        assert s["mean_accepted_length"] == pytest.approx(
            (s["accepted"] + s["rounds"]) / s["rounds"]
        )
    assert r["aggregates"]["plain"]["all"]["speedup"] == pytest.approx(1.0)
    assert r["aggregates"]["plain"]["all"]["acceptance_rate"] is None

    recs = r["records"]
    assert [x["method"] for x in recs] == ["plain", "chain"] * 4  # interleaved per prompt
    for x in recs:
        assert x["generation_tokens"] == len(x["tokens"]) > 0
        assert x["tokens_per_second"] == pytest.approx(x["decode_tokens"] / x["decode_s"])
        assert x["speedup"] > 0
        # memory: the weights the method uses plus what the run allocated on top
        used = m["verifier"]["param_bytes"] + (m["draft"]["param_bytes"] if x["drafted"] else 0)
        assert x["memory_bytes"] == used + x["working_memory_bytes"]
        assert x["working_memory_bytes"] > 0
    # the decode rate starts after the first verifier pass: one token for plain decoding
    assert all(x["decode_tokens"] == x["generation_tokens"] - 1 for x in recs[::2])
    # greedy speculative decoding is lossless: the canary stays quiet
    assert r["greedy_outputs_match"] is True and r["mismatches"] == []
    assert all(x["matches_reference"] for x in recs if x["method"] == "chain")

    png = out.with_suffix(".png")
    w, h = png_size(png)
    assert w >= 800 and h >= 500 and png.stat().st_size > 20_000


def test_peers_mlx_lm(pair, prompts, tmp_path, monkeypatch):
    pytest.importorskip("mlx_lm")
    # mlx-lm computes with MLX's float32 products: ondevice's plain tokens equal its own only
    # where ondevice's are MLX's too, not the CPU kernel's bf16 ones (runtime/kernel.py)
    monkeypatch.setenv(kernel.ENV, "mlx")
    out = tmp_path / "r.json"
    plot = tmp_path / "chart.png"
    rc = bench(
        pair, prompts, out, "--peers", "mlx-lm", "--num-draft-tokens", "3", "--plot", str(plot)
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["settings"]["methods"] == ["plain", "chain", "mlx-lm", "mlx-lm-spec"]
    spec = [x for x in r["records"] if x["method"] == "mlx-lm-spec"]
    assert len(spec) == 4 and all(x["num_draft_tokens"] == 3 for x in spec)
    assert sum(x["drafted"] for x in spec) > 0
    agg = r["aggregates"]["mlx-lm-spec"]["all"]
    assert agg["acceptance_rate"] is not None and agg["mean_accepted_length"] >= 1
    # same weights, same prompts: mlx-lm's greedy tokens equal ondevice's
    for x in r["records"]:
        if x["method"].startswith("mlx-lm"):
            assert x["matches_reference"] is True, x
    assert r["summary"]["chain_over_mlx_lm_spec"] > 0
    assert png_size(plot)[0] >= 800


def test_mlx_lm_at_each_fixed_k_and_the_pipeline(pair, prompts, tmp_path, capsys):
    """--peer-draft-tokens runs mlx-lm's speculative decoding once per K (the best one named in
    the summary); "pipeline" is the chain with pipeline=True, lossless like every method. With
    the default products (the CPU kernel's where it serves) mlx-lm gets the very weights in its
    own layout; its plain tokens are checked against ondevice's only where both use MLX's."""
    pytest.importorskip("mlx_lm")
    out = tmp_path / "r.json"
    args = ("--peers", "mlx-lm", "--peer-draft-tokens", "1,4", "--methods", "chain,pipeline,auto")
    assert bench(pair, prompts, out, *args, "--no-plot") == 0
    r = json.loads(out.read_text())
    runs = ["plain", "chain", "pipeline", "auto", "mlx-lm", "mlx-lm-spec:1", "mlx-lm-spec:4"]
    assert r["settings"]["methods"] == runs
    peer_plain = [x for x in r["records"] if x["method"] == "mlx-lm"]
    served = kernel.choice() != "mlx"
    assert all((x["reference"] is None) is served for x in peer_plain)
    for k in (1, 4):
        recs = [x for x in r["records"] if x["method"] == f"mlx-lm-spec:{k}"]
        assert len(recs) == 4 and all(x["num_draft_tokens"] == k for x in recs)
        assert all(x["matches_reference"] is True and x["reference"] == "mlx-lm" for x in recs)
        # a round drafts at most K tokens
        assert all(x["drafted"] <= k * x["rounds"] for x in recs)
    chain = [x for x in r["records"] if x["method"] == "chain"]
    assert all(x["rounds_by_method"] is None for x in chain)  # not a tree decoder
    for x in (x for x in r["records"] if x["method"] == "auto"):  # which proposer, how often
        assert sum(x["rounds_by_method"].values()) == x["rounds"]
    pipe = [x for x in r["records"] if x["method"] == "pipeline"]
    assert pipe and all(x["matches_reference"] is True and x["drafted"] > 0 for x in pipe)
    s = r["summary"]
    tps = {m: r["aggregates"][m]["all"]["tokens_per_second"] for m in runs}
    assert s["mlx_lm_spec_best"] == max(("mlx-lm-spec:1", "mlx-lm-spec:4"), key=tps.get)
    best = tps[s["mlx_lm_spec_best"]]
    assert s["over_mlx_lm_spec_best"]["pipeline"] == pytest.approx(tps["pipeline"] / best)
    assert "mlx-lm-spec:1" not in s["over_mlx_lm_spec_best"]
    assert (
        f"against mlx-lm's best speculative run ({s['mlx_lm_spec_best']})"
        in capsys.readouterr().out
    )


def test_peer_draft_tokens_needs_the_peer(pair, prompts, tmp_path, capsys):
    assert bench(pair, prompts, tmp_path / "r.json", "--peer-draft-tokens", "3") == 1
    assert "--peer-draft-tokens needs --peers mlx-lm" in capsys.readouterr().err
    bad = ("--peers", "mlx-lm", "--peer-draft-tokens", "3,five")
    assert bench(pair, prompts, tmp_path / "r.json", *bad) == 1
    assert "--peer-draft-tokens must be comma-separated integers" in capsys.readouterr().err


def test_mismatch_is_flagged(pair, prompts, tmp_path, capsys, monkeypatch):
    from ondevice.speedtest.runner import Bench

    original = Bench._ondevice_steps

    def corrupt(self, method, ids, max_tokens, out):
        for i, (toks, flags) in enumerate(original(self, method, ids, max_tokens, out)):
            if method == "chain" and i == 2:
                toks = [(toks[0] + 1) % 96]
            yield toks, flags

    monkeypatch.setattr(Bench, "_ondevice_steps", corrupt)
    out = tmp_path / "r.json"
    assert bench(pair, prompts, out, "--no-plot") == 1  # the lossless contract broke
    assert "GREEDY MISMATCH" in capsys.readouterr().err
    r = json.loads(out.read_text())
    assert r["greedy_outputs_match"] is False
    assert len(r["mismatches"]) == 4
    assert {(b["method"], b["reference"], b["first_mismatch"]) for b in r["mismatches"]} == {
        ("chain", "plain", 2)
    }
    assert r["aggregates"]["chain"]["all"]["mismatches"] == 4


def test_mlx_lm_rounds():
    # K=3: [d d v] [v] [d d d v] [d] (cut by max_tokens)
    flags = [True, True, False, False, True, True, True, False, True]
    assert mlx_lm_rounds(flags, max_tokens=9, k=3) == (4, 3 + 3 + 3 + 1)
    assert mlx_lm_rounds([], max_tokens=9, k=3) == (0, 0)


def test_builtin_prompts():
    prompts, skipped = read_prompts(builtin_prompts_path())
    assert skipped == 0
    cats = {p.category for p in prompts}
    assert {"code", "chat", "summarization", "translation", "math"} <= cats
    long = [p for p in prompts if p.category in ("summarization", "rag")]
    assert long and all(len(p.text) > 1500 for p in long)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"question_id": 1, "category": "a", "turns": ["x"]}\n{"question_id": 2,\n',
            ":2: not valid JSON",
        ),
        ('{"question_id": 1, "turns": ["x"]}\n', ":1: needs a 'category'"),
        ('{"question_id": 1, "category": "a", "turns": "x"}\n', ":1: 'turns' must be"),
        ("[1, 2]\n", ":1: expected a JSON object"),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_prompts_file(tmp_path, capsys, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    out = tmp_path / "r.json"
    # prompts are checked before any model loads: the verifier path need not even exist
    argv = ["bench", "--verifier", str(tmp_path / "none"), "--prompts", str(f), "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and str(f) in err and "Traceback" not in err
    assert not out.exists()


def test_missing_prompts_file(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["bench", "--verifier", "x", "--prompts", str(missing)]) == 1
    assert f"{missing}: no such prompts file" in capsys.readouterr().err


def test_unknown_category(prompts, capsys):
    assert (
        main(["bench", "--verifier", "x", "--prompts", str(prompts), "--categories", "math"]) == 1
    )
    assert "unknown category math; the prompts file has: chat, code" in capsys.readouterr().err


def test_per_category_and_turn(prompts):
    from ondevice.speedtest import select

    ps, skipped = read_prompts(prompts, turn=2)
    assert [p.text for p in ps] == ["and now?"] and skipped == 3
    ps, _ = read_prompts(prompts)
    assert [p.question_id for p in select(ps, per_category=1)] == ["1", "3"]
    with pytest.raises(OndeviceError, match="--per-category"):
        select(ps, per_category=0)


def test_bad_method_and_missing_draft(pair, prompts, tmp_path, capsys):
    v, _ = pair
    out = tmp_path / "r.json"
    assert bench(pair, prompts, out, "--methods", "nosuch") == 1
    assert "nosuch" in capsys.readouterr().err
    argv = ["bench", "--verifier", str(v), "--prompts", str(prompts), "--out", str(out)]
    assert main(argv) == 1
    assert "'chain' needs a draft model" in capsys.readouterr().err
    assert not out.exists()


def test_repeats_alternate_the_order_and_keep_each_runs_median(
    pair, prompts, tmp_path, capsys, monkeypatch
):
    """`--repeats 3`: each prompt's runs go forward, backward, forward; a run's record is the
    repeat with the median decode time, every repeat's times beside it; a repeat that breaks
    the lossless contract fails the run even when another repeat is the median."""
    from ondevice.speedtest.runner import Bench

    calls: list[str] = []
    original_run = Bench.run_one

    def run_one(self, method, ids, max_tokens, k=3):
        calls.append(method)
        return original_run(self, method, ids, max_tokens, k)

    monkeypatch.setattr(Bench, "run_one", run_one)
    out = tmp_path / "r.json"
    argv = ("--methods", "chain,tree", "--repeats", "3", "--no-plot", "--no-warmup")
    assert bench(pair, prompts, out, *argv) == 0
    assert "median repeat" in capsys.readouterr().out
    forward = ["plain", "chain", "tree"]
    assert calls == (forward + forward[::-1] + forward) * 4
    r = json.loads(out.read_text())
    assert r["settings"]["repeats"] == 3
    recs = r["records"]
    assert [x["method"] for x in recs] == forward * 4  # one record per run and prompt
    for x in recs:
        times = x["repeats_decode_s"]
        assert len(times) == 3 and x["decode_s"] == sorted(times)[1]
        assert x["tokens_per_second"] == pytest.approx(x["decode_tokens"] / x["decode_s"])
    assert r["greedy_outputs_match"] is True

    # the tree's second repeat (of each prompt) draws a wrong token: flagged, exit 1
    calls.clear()
    original_steps = Bench._ondevice_steps

    def corrupt(self, method, ids, max_tokens, out):
        nth = calls.count("tree")
        for i, (toks, flags) in enumerate(original_steps(self, method, ids, max_tokens, out)):
            if method == "tree" and nth % 3 == 2 and i == 1:
                toks = [(toks[0] + 1) % 96, *toks[1:]]
            yield toks, flags

    monkeypatch.setattr(Bench, "_ondevice_steps", corrupt)
    assert bench(pair, prompts, out, *argv) == 1
    r = json.loads(out.read_text())
    assert {(b["method"], b["first_mismatch"]) for b in r["mismatches"]} == {("tree", 1)}
    assert len(r["mismatches"]) == 4


def test_repeats_must_be_positive(pair, prompts, tmp_path, capsys):
    assert bench(pair, prompts, tmp_path / "r.json", "--repeats", "0") == 1
    assert "--repeats must be 1 or more" in capsys.readouterr().err
