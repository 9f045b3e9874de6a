"""benchmarks/soak.py compares only greedy answers, and a short run over repeated requests
finds every answer equal to the first one to the same request (issue 29 follow-up: its text
completions were sent without a temperature, so at OpenAI's default of 1, and their sampled
answers were counted as corrupted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_soak_over_repeated_requests_finds_every_greedy_answer_equal():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--requests", "60",
           "--concurrency", "3", "--max-queue", "4", "--warmup", "5", "--prompts", "2",
           "--kinds", "chat", "chat_stream", "completion", "disconnect_stream"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    assert "unexpected: 0" in out, out
    compared = re.search(r"same request: (.*)", out)
    assert compared is not None, out
    counts = dict(re.findall(r"(\w+) (\d+)", compared.group(1)))
    assert int(counts.get("completion", 0)) > 0 and int(counts.get("chat", 0)) > 0, out
