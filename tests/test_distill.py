"""`ondevice distill` on a tiny verifier: data, training, resume, export."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.stats import chi_square_p
from tiny import write_model

from ondevice.distill import distill, draft_vocab_size, parse_layers
from ondevice.distill.data import answers_only, chat_turn_tokens, magpie_batch
from ondevice.distill.teacher import load_teacher, topk_logprobs
from ondevice.errors import OndeviceError

SMALL = dict(
    tokens=400,
    gen_batch=8,
    max_tokens=48,
    seq_len=32,
    batch_size=4,
    eval_every=5,
    checkpoint_every=5,
    layers="0,3",
    learning_rate=3e-3,
    progress=False,
)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verifier")
    return write_model(path, layers=4, tie=True, scale=2.0)


@pytest.fixture(scope="module")
def trained(verifier, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run") / "draft"
    summary = distill(verifier, out, steps=20, vocab=80, **SMALL)
    return out, summary


def test_magpie_data_has_conversations_with_teacher_targets(verifier):
    teacher = load_teacher(verifier)
    prefix, suffix = chat_turn_tokens(teacher.tokenizer)
    shard = magpie_batch(teacher.model, teacher.tokenizer, batch=4, k=5, max_tokens=40, seed=3)
    assert len(shard.starts) > 0 and shard.n_targets > 0
    ends = np.append(shard.starts[1:], len(shard.tokens))
    for a, b in zip(shard.starts, ends):
        conv = shard.tokens[a:b].tolist()
        assert conv[: len(prefix)] == prefix
        # the user turn is closed and the assistant's turn opened by the template's tokens
        i = len(prefix)
        while conv[i : i + len(suffix)] != suffix:
            i += 1
        assert len(conv) > i + len(suffix)
        # only the answer is learnt: the first target is the one predicting the answer
        learn = np.flatnonzero(answers_only(shard, suffix).mask[a:b])
        assert learn[0] == i + len(suffix) - 1
    lp = shard.logp[shard.mask].astype(np.float32)
    assert (lp <= 1e-3).all() and (np.diff(lp, axis=1) <= 1e-3).all()  # sorted log-probs


def test_magpie_conversations_are_written_under_the_given_system_prompt(verifier):
    """A system prompt steers what the self-written user turns ask (the heads' coding share):
    every conversation opens with the template's rendering of it, not the default opening."""
    teacher = load_teacher(verifier)
    system = "You write code in Python."
    prefix, suffix = chat_turn_tokens(teacher.tokenizer, system)
    assert prefix != chat_turn_tokens(teacher.tokenizer)[0]
    assert system in teacher.tokenizer.decode(prefix)
    shard = magpie_batch(teacher.model, teacher.tokenizer, batch=3, k=5, max_tokens=160, seed=3,
                         system=system)  # fmt: skip
    assert len(shard.starts) > 0
    for a in shard.starts:
        assert shard.tokens[a : a + len(prefix)].tolist() == prefix


def test_the_written_answers_are_drawn_from_the_tempered_distribution():
    """`magpie_batch`'s draws (numpy: `_draw`) follow softmax(logits / T), and greedily the
    argmax; a draw that ignored the temperature is caught by the same test."""
    from ondevice.distill.data import _draw

    logits = np.log(np.array([0.05, 0.1, 0.15, 0.2, 0.5]))
    rng = np.random.default_rng(0)
    for T in (0.4, 1.0):
        counts = np.bincount([_draw(logits, T, rng) for _ in range(4000)], minlength=5)
        want = np.exp(logits / T) / np.exp(logits / T).sum()
        assert chi_square_p(counts, want) > 0.001
        assert chi_square_p(counts, np.exp(logits) if T != 1 else want[::-1]) < 1e-6
    assert _draw(logits, 0.0, rng) == 4


def test_top_k_log_probabilities_in_numpy():
    """The teacher's record of a position: its k likeliest ids, likeliest first, and their exact
    log-probabilities, whether the logits come as MLX or numpy, in one block or several."""
    from ondevice.distill import teacher

    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, teacher.ROWS_AT_ONCE // 2 + 1, 50)).astype(np.float32) * 4
    want = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for given in (logits, mx.array(logits)):
        ids, lp = topk_logprobs(given, 6)
        assert ids.shape == lp.shape == (3, teacher.ROWS_AT_ONCE // 2 + 1, 6)
        assert ids.dtype == np.int32 and lp.dtype == np.float32
        np.testing.assert_array_equal(ids, np.argsort(-logits, axis=-1, kind="stable")[..., :6])
        np.testing.assert_allclose(lp, np.take_along_axis(want, ids, -1), atol=1e-5)


def test_loss_decreases_and_agreement_improves(trained):
    _, summary = trained
    losses = summary["losses"]
    assert summary["step"] == 20
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert summary["held_out_loss"] < summary["held_out_loss_start"]


def test_output_loads_in_ondevice_and_mlx_lm(trained):
    import mlx_lm

    from ondevice.models import load_model

    out, _ = trained
    ours = load_model(out)
    theirs, _ = mlx_lm.load(str(out))
    x = mx.array([[3, 10, 11, 12, 13]])
    assert ours.config.num_hidden_layers == 2
    # ondevice honours draft_vocab_size (scores only the first 80 ids); mlx_lm scores all
    ours_logits = ours.model(x)
    assert ours_logits.shape[-1] == 80
    assert mx.allclose(ours_logits, theirs(x)[..., :80], atol=1e-3).item()
    assert draft_vocab_size(out) == 80
    assert json.loads((out / "distill.json").read_text())["layers"] == [0, 3]


def test_resume_continues_step_counter_and_optimizer(trained, verifier):
    out, first = trained
    work = out.with_name(out.name + ".work")
    with pytest.raises(OndeviceError, match="--resume"):
        distill(verifier, out, steps=20, vocab=80, **SMALL)  # would overwrite the checkpoint
    with pytest.raises(OndeviceError, match="vocab"):
        distill(verifier, out, steps=30, vocab=64, resume=True, **SMALL)
    summary = distill(verifier, out, steps=30, vocab=80, resume=True, **SMALL)
    assert summary["step"] == 30 and len(summary["losses"]) == 10
    # Resumed from the trained weights, not from the initial slice of the verifier.
    assert summary["losses"][0] < first["losses"][0] - 0.5
    progress = json.loads((work / "checkpoint" / "progress.json").read_text())
    assert progress["step"] == 30
    opt = mx.load(str(work / "checkpoint" / "optimizer.safetensors"))
    assert int(opt["step"].item()) == 30  # Adam's own counter went on from 20


def test_text_data_and_errors(verifier, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"text": "the quick brown fox jumps over the lazy dog. " * 3}] * 6
    rows.append({"turns": ["what is a fox?"]})
    data.write_text("\n".join(json.dumps(r) for r in rows))
    summary = distill(verifier, tmp_path / "draft", data_files=[str(data)], steps=3, **SMALL)
    assert summary["data"] == "files" and summary["step"] == 3
    assert draft_vocab_size(tmp_path / "draft") is None
    with pytest.raises(OndeviceError, match="no checkpoint"):
        distill(verifier, tmp_path / "other", resume=True, steps=3, **SMALL)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": 1}\n')
    with pytest.raises(OndeviceError, match="bad.jsonl:1"):
        distill(verifier, tmp_path / "d2", data_files=[str(bad)], steps=3, **SMALL)
    assert not (tmp_path / "d2").exists()
    with pytest.raises(OndeviceError, match="layers"):
        parse_layers("two", 4)
    with pytest.raises(OndeviceError, match="layer 9"):
        distill(verifier, tmp_path / "d3", steps=3, **{**SMALL, "layers": "0,9"})


def test_cli_registers_distill():
    from ondevice.apps.cli import build_parser

    args = build_parser().parse_args(
        ["distill", "--verifier", "v", "-o", "d", "--layers", "0,1,28,29", "--vocab", "16384"]
    )
    assert args.func.__module__ == "ondevice.apps.distill"
    assert args.vocab == 16384 and args.layers == "0,1,28,29"


def test_agreement_simulates_greedy_speculative_rounds():
    from ondevice.distill.evaluate import Agreement

    a = Agreement(np.array([1, 1, 0, 1, 1, 1, 1, 0], bool))
    # k=3: round 1 accepts 2 (+1 verifier token at position 2); round 2 accepts 3 at 3..5,
    # the verifier's token is position 6; round 3 drafts at 7, rejected (+ verifier's token).
    assert a.speculative(3) == (3, 7, 5)
    assert a.rate == 0.75


def test_draft_drives_mlx_lm_speculative_generation(trained, verifier):
    """The draft works as `mlx_lm.generate --draft-model` does: greedy output is the verifier's."""
    import importlib

    import mlx_lm

    gen = importlib.import_module("mlx_lm.generate")
    out, _ = trained
    model, tok = mlx_lm.load(str(verifier))
    draft, _ = mlx_lm.load(str(out))
    prompt = [3, 10, 11, 12]

    def tokens(**kw) -> list[int]:
        return [r.token for r in gen.stream_generate(model, tok, prompt, max_tokens=12, **kw)]

    plain = tokens()
    spec = tokens(draft_model=draft, num_draft_tokens=3)
    assert spec == plain


def test_teacher_keeps_the_biases_of_quantized_layers(tmp_path):
    """Qwen2's attention projections have biases; expanding its quantized layers to float32
    must keep them (the GGUF verifiers arrive quantized)."""
    from ondevice.distill.teacher import dequantized
    from ondevice.models import load_model

    v = write_model(tmp_path / "qwen2", arch="qwen2", layers=2, hidden_size=64)
    model = load_model(v, quantize=4).model
    weights = dequantized(model)
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert all(v.dtype == mx.float32 for v in weights.values())


def test_a_size_limit_takes_the_most_bits_that_fit():
    """`--max-mb` for drafts and heads alike: float16 where it fits, else the most bits whose
    packed values and group scales fit, else a clear error."""
    from ondevice.distill.export import fitting_bits

    n, fixed = 1 << 20, 1000
    assert fitting_bits(fixed, n, None, 64, "x") is None
    assert fitting_bits(fixed, n, fixed + 2 * n, 64, "x") is None
    assert fitting_bits(fixed, n, fixed + 2 * n - 1, 64, "x") == 8
    assert fitting_bits(fixed, n, fixed + n // 2 + n // 16, 64, "x") == 4
    with pytest.raises(OndeviceError, match="the heads.*--max-mb"):
        fitting_bits(fixed, n, fixed + n // 8, 64, "the heads")
