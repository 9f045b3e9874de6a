"""A program that ran MLX in threads exits cleanly (runtime/threads.py).

MLX frees a thread's compile cache in the native thread's exit handlers, after `join()` has
returned; when that happened during interpreter shutdown the process aborted (exit code 134).
Measured on this machine before the fix: 7 of 10 runs of the first script below aborted, and
the terminal chat aborted on /quit in 4 of 5 runs after a stopped answer.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tiny

RUNS = 6


def _run_each(script: str, runs: int = RUNS) -> None:
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert r.returncode == 0, f"exit code {r.returncode}\n{r.stderr[-2000:]}"
        assert "terminate called" not in r.stderr


def test_threads_that_ran_mlx_do_not_abort_the_exit():
    _run_each(
        textwrap.dedent(
            """
            import mlx.core as mx, mlx.nn as nn
            from ondevice.runtime import threads

            def work():
                mx.eval(nn.silu(mx.ones((4, 4))))  # nn.silu is mx.compile'd: a compile cache

            ts = [threads.start(work, "w") for _ in range(4)]
            for t in ts:
                t.join()
            """
        )
    )


@pytest.mark.slow
def test_chat_controllers_exit_cleanly_right_after_their_answers(tmp_path: Path):
    first = tiny.write_model(tmp_path / "first", seed=0)
    draft = tiny.perturbed_copy(first, tmp_path / "draft", noise=0.1)
    _run_each(
        textwrap.dedent(
            f"""
            from ondevice.apps.chat import ChatController, Settings

            ctrls = [ChatController(settings=Settings(max_tokens=8, temperature=0.0))
                     for _ in range(3)]
            for c in ctrls:
                assert c.load({str(first)!r}, draft={str(draft)!r}, draft_backend="mlx",
                              wait=True), c.error
            for c in ctrls:
                assert c.send("hello")
            for c in ctrls:
                c.wait()
                assert c.error is None and c.answer, c.error
            """
        ),
        runs=4,
    )
