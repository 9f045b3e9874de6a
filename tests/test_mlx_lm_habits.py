"""Command lines and Python habits from mlx-lm work unchanged (issue 28, item 7):
`--system-prompt`, `-m` (mlx-lm's short --max-tokens), `--ignore-chat-template`,
`--chat-template-config`, `--verbose False`, `serve --log-level INFO`; a prompt string that is
already templated is not templated again; an unknown flag shows the command's own usage."""

from __future__ import annotations

import json

import pytest
import tiny

import ondevice
from ondevice.apps.cli import build_parser, main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("habits")
    v = tiny.write_model(d / "v", layers=2, scale=1.5)
    return v, tiny.perturbed_copy(v, d / "d", noise=0.3)


@pytest.fixture(scope="module")
def gen(pair):
    return ondevice.load(pair[0])


def test_mlx_lm_generate_command_line_runs_unchanged(pair, gen, capsys, tmp_path):
    v, d = pair
    system = tmp_path / "system.txt"
    system.write_text("be brief\n")
    argv = ["generate", "--model", str(v), "--draft-model", str(d), "--draft-backend", "mlx",
            "--system-prompt", str(system), "--prompt", "hello", "-m", "7", "--temp", "0.0",
            "--num-draft-tokens", "2", "--chat-template-config", '{"enable_thinking": false}',
            "--verbose", "False"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert out == gen.generate(messages, max_tokens=7).text + "\n"
    assert "tokens/s" not in err  # --verbose False: the answer only

    assert main([*argv[:-2], "--verbose"]) == 0  # bare --verbose, as with a flag
    assert "tok" in capsys.readouterr().err


def test_ignore_chat_template_sends_the_raw_prompt(pair, gen, capsys):
    argv = ["generate", "--model", str(pair[0]), "--prompt", "hello", "-m", "3",
            "--ignore-chat-template", "--json"]  # fmt: skip
    assert main(argv) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["prompt_tokens"] == len(gen.tokenizer.encode("hello"))


def test_system_prompt_of_chat_and_log_level_of_serve_parse():
    sub = next(a for a in build_parser()._actions if a.choices and "chat" in a.choices).choices
    assert sub["chat"].parse_args(["--system-prompt", "hi", "-m", "9"]).system_prompt == "hi"
    assert sub["chat"].parse_args(["--system", "hi"]).system_prompt == "hi"
    assert sub["serve"].parse_args(["--log-level", "INFO"]).log_level == "info"
    assert sub["serve"].parse_args(["--log-level", "DEBUG"]).log_level == "debug"


def test_an_unknown_flag_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: ondevice generate")
    assert "unrecognized arguments: --no-such-flag" in err


def test_a_templated_prompt_string_is_not_templated_again(gen):
    plain = gen.encode_prompt("hi there")
    rendered = gen.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert gen.encode_prompt(rendered) == plain
    assert gen.count_tokens(rendered) == len(plain)
    # with a system turn of its own: the role markers tell
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi there"}]
    rendered = gen.tokenizer.apply_chat_template(chat)
    assert gen.encode_prompt(rendered) == gen.encode_prompt(chat)
    assert gen.is_templated(rendered) and not gen.is_templated("hi there")
    # raw text still goes through the template
    assert len(gen.encode_prompt("hi there")) > len(gen.tokenizer.encode("hi there"))


def test_mlx_lm_server_command_line_parses():
    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices).choices
    args = sub["serve"].parse_args(
        ["--model", "M", "--draft-model", "D", "--num-draft-tokens", "3", "--host", "127.0.0.1",
         "--port", "8080", "--log-level", "INFO", "--use-default-chat-template",
         "--chat-template-args", '{"enable_thinking": false}', "--temp", "0.7", "--top-p", "0.9",
         "--top-k", "40", "--min-p", "0.0", "--max-tokens", "100"]
    )  # fmt: skip
    assert args.use_default_chat_template and args.log_level == "info"
    assert args.chat_template_args == {"enable_thinking": False}


def test_use_default_chat_template_for_a_model_without_one(tmp_path, capsys):
    model = tiny.write_model(tmp_path / "bare", layers=1)
    config = model / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "chat_template"}))  # fmt: skip
    bare = ondevice.load(model)
    assert not bare.tokenizer.chat_template
    argv = ["generate", "--model", str(model), "--prompt", "hello", "-m", "1", "--json"]
    assert main(argv) == 0
    raw = json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"]
    assert raw == len(bare.tokenizer.encode("hello"))
    assert main([*argv, "--use-default-chat-template"]) == 0
    templated = json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"]
    from ondevice.models.tokenizer import DEFAULT_CHAT_TEMPLATE

    bare.tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    assert templated == len(bare.encode_prompt("hello")) > raw
