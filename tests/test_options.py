"""Command-line habits: mlx-lm's flag names everywhere, one spelling per option across commands,
one list of choices (apps/options.py) that the commands import, `--prompt -` from stdin."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import tiny

import ondevice
from ondevice.apps import options
from ondevice.apps.cli import build_parser, main

MLX_LM_FLAGS = ["--model", "M", "--draft-model", "D", "--num-draft-tokens", "3",
                "--max-tokens", "5", "--temp", "0.5", "--top-p", "0.9", "--top-k", "4",
                "--min-p", "0.1", "--seed", "1"]  # fmt: skip


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.choices and "generate" in a.choices)
    return action.choices


def test_choices_are_the_apis():
    from ondevice.api import METHODS as API_METHODS
    from ondevice.models.weights import DTYPES
    from ondevice.proposers.registry import METHODS as TREE_METHODS
    from ondevice.runtime.engines import DRAFT_BACKENDS

    assert set(options.METHODS) == set(API_METHODS) == set(TREE_METHODS)
    assert set(options.DRAFT_BACKENDS) == set(DRAFT_BACKENDS)
    assert set(options.DTYPES) == set(DTYPES)


def test_no_command_keeps_its_own_list_of_choices():
    root = Path(ondevice.__file__).parent
    files = [*(root / "apps").glob("*.py"), root / "convert" / "cli.py"]
    for f in files:
        if f.name == "options.py":
            continue
        text = f.read_text()
        for literal in ('"coreml", "reference"', '"float16", "bfloat16"', '"pld", "lookahead"'):
            assert literal not in text, f"{f.name} repeats a choices list; import apps.options"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_mlx_lm_flags_are_accepted(command):
    extra = ["--prompt", "x"] if command == "generate" else []
    args = _subparsers()[command].parse_args([*MLX_LM_FLAGS, *extra])
    assert (args.model, args.draft, args.num_draft_tokens, args.max_tokens) == ("M", "D", 3, 5)
    assert (args.temp, args.top_p, args.top_k, args.min_p, args.seed) == (0.5, 0.9, 4, 0.1, 1)
    s = options.sampling_options(args)
    assert s["temperature"] == 0.5 and s["min_p"] == 0.1


def test_one_spelling_per_option_across_commands():
    """An option that several commands take has the same flags in each."""
    seen: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, sub in _subparsers().items():
        for action in sub._actions:
            flags = tuple(sorted(o for o in action.option_strings if o.startswith("--")))
            if not flags or action.dest == "help":
                continue
            if action.dest in seen and action.dest not in ("model",):  # bench: --model = bundle
                other, other_flags = seen[action.dest]
                assert flags == other_flags, (
                    f"{action.dest}: {name} {flags} vs {other} {other_flags}"
                )
            seen.setdefault(action.dest, (name, flags))
    assert "--temperature" not in {f for _, fl in seen.values() for f in fl}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("opt")
    v = tiny.write_model(d / "v", layers=2, scale=1.5)
    return v, tiny.perturbed_copy(v, d / "d", noise=0.3)


def test_generate_with_mlx_lm_flags_and_prompt_from_stdin(pair, monkeypatch, capsys):
    v, d = pair
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat sat"))
    argv = ["generate", "--model", str(v), "--draft-model", str(d), "--draft-backend", "mlx",
            "--num-draft-tokens", "2", "--max-tokens", "12", "--temp", "0", "--prompt", "-",
            "--min-p", "0.05", "--repetition-penalty", "1.2", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref = ondevice.load(v).generate("the cat sat", max_tokens=12, repetition_penalty=1.2)
    assert out["tokens"] == ref.tokens and out["stats"]["drafted"] > 0


def test_empty_stdin_prompt_is_a_clear_error(pair, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    assert main(["generate", "--model", str(pair[0]), "--prompt", "-"]) == 1
    assert re.search(r"standard input was empty", capsys.readouterr().err)


def test_chat_template_options(pair, capsys, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}")
    argv = ["generate", "--model", str(pair[0]), "--prompt", "hi", "--max-tokens", "2",
            "--chat-template", str(template), "--chat-template-args", '{"suffix": "!"}',
            "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    tok = ondevice.load(pair[0]).tokenizer
    assert out["stats"]["prompt_tokens"] == len(tok.encode("hi!", add_special_tokens=False))
    with pytest.raises(SystemExit):  # not a JSON object
        build_parser().parse_args(["generate", "--model", "m", "--prompt", "x",
                                   "--chat-template-args", "[1]"])  # fmt: skip


def test_integers_reads_comma_separated_ids_and_names_the_flag_on_bad_input():
    from ondevice.apps.options import integers
    from ondevice.errors import OndeviceError

    assert integers("3,5", "--x") == [3, 5] and integers(" 1, 2 ,", "--x") == [1, 2]
    assert integers("", "--x") == []
    with pytest.raises(OndeviceError, match=r"--prompt-ids must be comma-separated integers"):
        integers("1,two", "--prompt-ids")


def test_every_sampling_field_reaches_every_front_end():
    """One list of sampling fields (`SamplingParams`): the API takes each by name, the server's
    requests carry each (or translate it, by name), every command's flags set each that a flag
    can, and the chat's settings are stream options."""
    import dataclasses
    import inspect

    from ondevice.api import Generator
    from ondevice.apps.chat_controller import Settings
    from ondevice.apps.openai_schema import (
        SAMPLING_TRANSLATED,
        ChatCompletionRequest,
        CompletionRequest,
    )
    from ondevice.rules.sampling import SAMPLING_FIELDS, SamplingParams

    assert SAMPLING_FIELDS == tuple(f.name for f in dataclasses.fields(SamplingParams))
    for request in (ChatCompletionRequest, CompletionRequest):
        missing = set(SAMPLING_FIELDS) - set(request.model_fields) - set(SAMPLING_TRANSLATED)
        assert not missing, (request.__name__, missing)
    generate = _subparsers()["generate"].parse_args(["--prompt", "x"])
    flags = set(options.sampling_options(generate))
    assert set(SAMPLING_FIELDS) - set(options.NO_SAMPLING_FLAG) <= flags
    stream = set(inspect.signature(Generator.stream).parameters) | set(SAMPLING_FIELDS)
    chat = {f.name for f in dataclasses.fields(Settings)} - {"extra"}
    assert chat <= stream, chat - stream


def test_sampling_params_take_keywords_only_after_temperature():
    from ondevice.rules.sampling import SamplingParams

    with pytest.raises(TypeError):
        SamplingParams(1.0, 0.9)  # type: ignore[misc]
    assert SamplingParams(1.0, top_p=0.9).top_p == 0.9
