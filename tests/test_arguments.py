"""Issue 16, finding 7: every bad argument to the Python API and the commands is one
OndeviceError (one `error:` line from the CLI), never a ValueError or TypeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny

import ondevice
from ondevice.errors import OndeviceError


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("args")
    verifier = tiny.write_model(root / "verifier")
    return verifier, tiny.perturbed_copy(verifier, root / "draft", noise=0.1)


@pytest.fixture(scope="module")
def gen(models) -> ondevice.Generator:
    return ondevice.load(models[0], draft=models[1], draft_backend="mlx")


BAD_GENERATE = [
    ("", {"chat_template": False}, "empty"),
    ("hi", {"num_draft_tokens": -3}, "num_draft_tokens"),
    ("hi", {"num_draft_tokens": "3"}, "num_draft_tokens"),
    ("hi", {"max_tokens": "3"}, "max_tokens"),
    ("hi", {"max_tokens": 2.5}, "max_tokens"),
    ("hi", {"max_tokens": True}, "max_tokens"),
    ("hi", {"temperature": None}, "temperature"),
    ("hi", {"top_p": "high"}, "top_p"),
    # issue 29: no silent coercion ("0.7" was 0.7, "no" was true)
    ("hi", {"temperature": "0.7"}, "temperature must be a number"),
    ("hi", {"min_p": True}, "min_p"),
    ("hi", {"top_k": "3"}, "top_k"),
    ("hi", {"logprobs": "2"}, "logprobs"),
    ("hi", {"cache_prompt": "no"}, "cache_prompt"),
    ("hi", {"logit_bias": {"1": 2.0}}, "logit_bias token id"),
    ("hi", {"logit_bias": {1: "2"}}, "logit_bias"),
    ("hi", {"logit_bias": [(1, 2.0)]}, "logit_bias"),
    ("hi", {"method": 5}, "method"),
    ("hi", {"tools": "f"}, "tools"),
    ("hi", {"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("hi", {"chat_template_kwargs": {"tokenize": True}}, "'tokenize' is reserved"),
    ("hi", {"chat_template_kwargs": {"messages": []}}, "'messages' is reserved"),
    ("hi", {"seed": "x", "temperature": 1.0}, "seed"),
    ("hi", {"seed": -1, "temperature": 1.0}, "seed"),
    ("hi", {"stop": 5}, "stop"),
    ("hi", {"stop": ["a", 1]}, "stop"),
    ("hi", {"speculative": "no"}, "speculative"),
    ("hi", {"chat_template": None}, "chat_template"),
    ("hi", {"pipeline": "yes"}, "pipeline"),
    (None, {}, "prompt"),
    (5, {}, "prompt"),
    (b"hi", {}, "prompt"),
    ("\ud800", {}, "surrogate"),
    ("h\udcffi", {"chat_template": False}, "not UTF-8"),
    ([{"role": 1, "content": "x"}], {}, "role"),
]


@pytest.mark.parametrize(("prompt", "kwargs", "match"), BAD_GENERATE)
def test_bad_generation_arguments(gen, prompt, kwargs, match):
    with pytest.raises(OndeviceError, match=match):
        gen.generate(prompt, max_tokens=kwargs.pop("max_tokens", 2), **kwargs)
    assert gen.generate("hi", max_tokens=2).stats["generation_tokens"] == 2  # still usable


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((None,), {}, "verifier"),
        ((5,), {}, "verifier"),
        (("",), {}, "verifier"),
        (("VERIFIER",), {"draft": 5}, "draft"),
        (("VERIFIER",), {"quantize": 3}, "quantize"),
        (("VERIFIER",), {"quantize": "4"}, "quantize"),
        (("VERIFIER",), {"quantize": True}, "quantize"),
        (("VERIFIER",), {"dequantize": "no"}, "dequantize"),
        (("VERIFIER",), {"dtype": 5}, "dtype"),
        (("VERIFIER",), {"draft_backend": None}, "draft backend"),
    ],
)
def test_bad_load_arguments(models, args, kwargs, match):
    args = tuple(models[0] if a == "VERIFIER" else a for a in args)
    with pytest.raises(OndeviceError, match=match):
        ondevice.load(*args, **kwargs)


def _run(*argv: bytes | str, script: str = "ondevice") -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / script
    return subprocess.run(
        [exe, *argv], capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


@pytest.mark.slow
def test_cli_bad_arguments_are_one_line(models):
    verifier, draft = (os.fsencode(m) for m in models)
    cases = [
        ([b"generate", b"--model", verifier, b"--prompt", b"h\xffi", b"--no-chat-template"], b"not UTF-8"),
        ([b"generate", b"--model", verifier, b"--prompt", b"", b"--no-chat-template"], b"empty"),
        ([b"generate", b"--model", verifier, b"--draft", draft, b"--draft-backend", b"mlx",
          b"--prompt", b"hi", b"--num-draft-tokens", b"-3"], b"num_draft_tokens"),
        ([b"generate", b"--model", b"/tmp/\xff-no-such-model", b"--prompt", b"hi"], b"no such file"),
    ]  # fmt: skip
    for argv, message in cases:
        proc = _run(*argv)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith(b"error: ") and message in proc.stderr, proc.stderr
        assert b"Traceback" not in proc.stderr
    proc = _run(b"--check", b"/tmp/\xff-no-bundle", script="ondevice-convert")
    assert proc.returncode == 1 and proc.stderr.startswith(b"error: "), proc.stderr
